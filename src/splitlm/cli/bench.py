"""The benchmark commands (`bench`, `loadtest`, `wan`); their code lives in `splitlm.bench`."""

from __future__ import annotations


def add_bench_parsers(sub) -> None:
    """The parsers of `bench`, `loadtest` and (with its dependencies) `wan`."""
    p = sub.add_parser("bench", help="benchmark split decoding behind an emulated WAN")
    from splitlm.bench.suite import add_bench_arguments, bench_main

    add_bench_arguments(p)
    p.set_defaults(func=bench_main)

    p = sub.add_parser("loadtest", help="many edges against one cloud behind an emulated WAN: batched vs --max-batch 1")
    from splitlm.bench.loadtest import add_loadtest_arguments, loadtest_main

    add_loadtest_arguments(p)
    p.set_defaults(func=loadtest_main)

    try:
        from splitlm.bench.wan import add_wan_arguments, wan_main
    except ImportError:
        pass
    else:
        p = sub.add_parser("wan", help="emulate a wide-area link: a delaying TCP proxy")
        add_wan_arguments(p)
        p.set_defaults(func=wan_main)
