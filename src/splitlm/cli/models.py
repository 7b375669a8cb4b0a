"""Commands that make and convert shards: `split` and `export-onnx` (the all-in-one `demo`: `demo.py`)."""

from __future__ import annotations

import json

from splitlm.cli.options import need_edge_shard, non_negative_int, positive_int


def cmd_split(args) -> int:
    from splitlm.model.shards import split_model

    tail = args.tail if args.tail is not None else (0 if args.topology == "split-head" else 2)
    out = split_model(
        args.model, args.head, tail, args.out, args.dtype, args.topology, args.d_end, max_file_mb=args.max_file_mb
    )
    print(f"wrote {out / 'edge'} and {out / 'cloud'}")
    return 0


def cmd_export_onnx(args) -> int:
    import time

    from splitlm.edge.adapters import apply_edge_adapter
    from splitlm.model.onnx_export import export_edge_onnx, graph_file
    from splitlm.model.shards import load_edge

    need_edge_shard(args)
    start = time.perf_counter()
    model = load_edge(args.edge, "cpu", __import__("torch").float32)
    adapter = apply_edge_adapter(model, args.edge_adapter) if args.edge_adapter else None
    manifest = export_edge_onnx(model, args.edge, int8=args.int8, adapter=adapter.digest if adapter else "")
    files = {f"{seg}.{p}": graph_file(args.edge, seg, p) for p in manifest.precisions for seg in ("head", "tail")}
    print(
        json.dumps(
            {
                "edge": args.edge,
                "precisions": manifest.precisions,
                "adapter": adapter.path if adapter else None,
                "files_mb": {k: round(f.stat().st_size / 2**20, 1) for k, f in files.items()},
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    )
    return 0


def add_split(sub) -> None:
    """The `split` command's parser."""
    p = sub.add_parser("split", help="split a model into an edge shard and a cloud shard")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=positive_int, default=2, help="layers [0, K) stay on the edge (default 2)")
    p.add_argument(
        "--tail",
        type=non_negative_int,
        default=None,
        help="layers [L-M, L) stay on the edge (default 2; split-head: 0)",
    )
    p.add_argument(
        "--topology",
        default="tail-local",
        choices=["tail-local", "split-head"],
        help="tail-local (default): the edge keeps the last layers and the LM head; split-head: the cloud "
        "runs every layer from K on and part of the LM head, the edge completes the logits",
    )
    p.add_argument(
        "--d-end",
        type=positive_int,
        default=None,
        metavar="D",
        help="split-head: the LM head's columns [0, D) stay on the edge (default: half the hidden size)",
    )
    p.add_argument("--out", required=True, help="output directory (gets edge/ and cloud/)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "fp16", "bf16"],
        help="dtype the shards store (default auto: the checkpoint's own; the built-in models are fp32)",
    )
    p.add_argument(
        "--max-file-mb",
        type=positive_int,
        default=512,
        metavar="MB",
        help="largest weight file of each shard, in MiB (default 512; a larger tensor gets a file of its "
        "own); the split reads and writes one tensor at a time",
    )
    p.set_defaults(func=cmd_split)


def add_export_onnx(sub) -> None:
    """The `export-onnx` command's parser."""
    p = sub.add_parser("export-onnx", help="export the edge's layers as ONNX graphs for --device onnx (and onnx:int8)")
    p.add_argument("--edge", required=True, help="the edge shard directory; the graphs are written to its onnx/")
    p.add_argument(
        "--int8",
        action="store_true",
        help="also write int8 graphs (ONNX Runtime's dynamic quantisation) for --device onnx:int8",
    )
    p.add_argument(
        "--edge-adapter",
        metavar="PATH",
        default=None,
        help="merge this peft LoRA adapter into the exported weights (see --edge-adapter of generate)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.set_defaults(func=cmd_export_onnx)
