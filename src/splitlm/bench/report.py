"""What a benchmark run reports: its Markdown tables and PNG plots (matplotlib); `results.py` writes them."""

from __future__ import annotations

from pathlib import Path

PARTS = (
    ("network_s_per_step", "network"),
    ("cloud_s_per_step", "cloud compute"),
    ("edge_s_per_step", "edge compute"),
    ("serialize_s_per_step", "serialisation"),
    ("other_s_per_step", "other"),
)
COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#bab0ac", "#76b7b2", "#edc948", "#b07aa1")


def _tau(row: dict) -> str:
    """Tokens per round trip; for local modes tokens per forward pass, marked "/fwd" (1.00 = no speculation)."""
    if row.get("tokens_per_round_trip") is not None:
        return f"{row['tokens_per_round_trip']:.2f}"
    if row.get("tokens_per_step") is not None:
        return f"{row['tokens_per_step']:.2f}/fwd"
    return "–"


def _f(value, fmt: str = ".1f", scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, fmt)


def _pct(value) -> str:
    return "–" if value is None else f"{value * 100:.1f} %"


def _div(a, b):
    return a / b if a is not None and b else None


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def _setup(doc: dict) -> str:
    c, env = doc["config"], doc["environment"]
    m, s = env["model"], env["split"]
    link = "RTT " + ", ".join(f"{r:g}" for r in c["rtts_ms"]) + " ms"
    if c["jitter_ms"]:
        link += f", jitter ±{c['jitter_ms']:g} ms"
    link += ", bandwidth " + ("unlimited" if c["mbps"] is None else f"{c['mbps']:g} Mbit/s")
    if s.get("topology") == "split-head":
        split = (
            f"split-head: edge layers [0,{s['head']}) + LM-head columns [0,{s['d_end']}), cloud layers"
            f" [{s['head']},{m['layers']}) + final norm + LM-head columns [{s['d_end']},{m['hidden_size']})"
        )
    else:
        split = (
            f"tail-local: edge layers [0,{s['head']}) + [{s['cloud_layers'][1]},{m['layers']}),"
            f" cloud [{s['cloud_layers'][0]},{s['cloud_layers'][1]})"
        )
    vocab = f"; vocabulary subset {s['vocab']}" if s.get("vocab") else ""
    return (
        f"- model: {m['name']} ({m['layers']} layers, hidden {m['hidden_size']}, vocabulary {m.get('vocab_size', '?')},"
        f" {m['weights_dtype']} weights); split {split}{vocab}; wire {c['wire_dtype']}\n"
        f"- network: emulated WAN (user-space TCP proxy on loopback), {link}\n"
        f"- {len(doc['prompts'])} prompts ({c['prompts']}), up to {c['max_new_tokens']} new tokens, greedy\n"
        f"- machine: {env['cpu'] or 'unknown CPU'}, {env['cpu_count']} cores; torch {env['torch']},"
        f" transformers {env['transformers']}; edge (and local-hf) and cloud each pinned to 1 torch thread,"
        f" cloud in its own process\n"
        f"- run: {doc['created']}, {doc['duration_s']:.0f} s; load average (1 min) at start"
        f" {env.get('load_avg_at_start', ['?'])[0]}, at end {env.get('load_avg_at_end', ['?'])[0]}"
        " (other work on the machine slows every mode; compare modes within a run)" + _provenance(doc)
    )


def _provenance(doc: dict) -> str:
    """The run's provenance (`result_files.provenance`) as one more line of the set-up, if it has one."""
    prov = doc.get("provenance")
    if not prov:
        return ""
    code = prov["code"]
    commit = (
        f"commit {(code['commit'] or '?')[:12]}{' (dirty)' if code['dirty'] else ''}"
        if code["commit"]
        else f"splitlm {code['version']} (no checkout)"
    )
    heads = ", ".join(f"{Path(h['path']).name} sha256 {(h['sha256'] or '?')[:12]}" for h in prov["draft_heads"])
    return (
        f"\n- provenance: {commit}; draft head {heads or 'none'}; torch threads {prov['torch_threads']};"
        f" command `{prov['command_line']}`"
    )


def markdown_report(doc: dict) -> str:
    res = doc["results"]
    overall = [r for r in res if r["category"] == "all"]
    out = [f"# splitlm bench, {doc['created'][:16].replace('T', ' ')}", "", _setup(doc), "", "## Overall", ""]
    out.append(
        _table(
            [
                "mode",
                "RTT ms",
                "tok/RT",
                "tok/s",
                "TTFT ms",
                "step ms",
                "net",
                "cloud",
                "edge",
                "ser",
                "other",
                "B up/tok",
                "B down/tok",
                "agreement",
                "exact",
                "efficiency",
                "× seq",
            ],
            [
                [
                    r["mode"],
                    f"{r['rtt_ms']:g}",
                    _tau(r),
                    _f(r["tok_s"]),
                    _f(r["ttft_s"], ".0f", 1e3),
                    _f(r["step_s"], ".1f", 1e3),
                    *(_f(r[k], ".1f", 1e3) for k, _ in PARTS),
                    _f(r["bytes_up_per_token"], ".0f"),
                    _f(r["bytes_down_per_token"], ".0f"),
                    _pct(r["agreement"]),
                    _pct(r["exact_match"]),
                    _pct(r["efficiency"]),
                    _f(r["tok_s_vs_split_seq"], ".2f"),
                ]
                for r in overall
            ],
        )
    )
    out += [
        "",
        "tok/RT: decoding tokens per cloud round trip (prefill excluded). step: ms per decoding step, split"
        " into network / cloud compute / edge compute / serialisation / other (Python, websockets). B/tok: bytes"
        " on the wire per decoding token. agreement: teacher-forced next-token agreement with the full"
        " transformers model; exact: prompts whose greedy ids equal the full model's (local-hf *is* that"
        " reference: its 100 % checks determinism). efficiency: tok/s ÷ (tok/RT / (RTT + compute per step)). × seq:"
        " tok/s ÷ split-seq's tok/s at the same RTT in this run.",
        "",
        "## Per category",
        "",
    ]
    out.append(
        _table(
            ["mode", "RTT ms", "category", "prompts", "tok/RT", "tok/s", "× seq", "TTFT ms", "agreement", "exact"],
            [
                [
                    r["mode"],
                    f"{r['rtt_ms']:g}",
                    r["category"],
                    str(r["prompts"]),
                    _tau(r),
                    _f(r["tok_s"]),
                    _f(r["tok_s_vs_split_seq"], ".2f"),
                    _f(r["ttft_s"], ".0f", 1e3),
                    _pct(r["agreement"]),
                    _pct(r["exact_match"]),
                ]
                for r in res
                if r["category"] != "all"
            ],
        )
    )
    piped = [r for r in overall if r.get("pipelined_fraction")]
    if piped:
        out += [
            "",
            "## Pipelining",
            "",
            _table(
                ["mode", "RTT ms", "tok/s", "× seq", "round trips", "pipelined", "discarded of those", "bet missed"],
                [
                    [
                        r["mode"],
                        f"{r['rtt_ms']:g}",
                        _f(r["tok_s"]),
                        _f(r["tok_s_vs_split_seq"], ".2f"),
                        str(r["round_trips"]),
                        _pct(r["pipelined_fraction"]),
                        _pct(r["discarded_fraction"]),
                        _pct(r.get("missed_fraction")),
                    ]
                    for r in piped
                ],
            ),
            "",
            "pipelined: decoding round trips sent while the step before was still in flight (a bet that the"
            " step before accepts its likeliest path); discarded: of those, the ones whose reply was dropped;"
            " bet missed: dropped because the step before accepted another path (the others held the bet but"
            " guessed none of the candidates for the next token). Round trips and steps count dropped ones too;"
            " the step breakdown's network column is the time the edge waited for replies.",
        ]
    downlink = [r for r in overall if r.get("topology")]
    if downlink:
        out += [
            "",
            "## Downlink",
            "",
            _table(
                [
                    "mode",
                    "RTT ms",
                    "topology",
                    "vocab",
                    "ids allowed",
                    "B down/tok (measured)",
                    "full logits B/tok (computed)",
                    "measured ÷ full logits",
                ],
                [
                    [
                        r["mode"],
                        f"{r['rtt_ms']:g}",
                        r["topology"] + (f" d={r['d_end']}" if r.get("d_end") else ""),
                        r["vocab"],
                        str(r["vocab_size"]),
                        _f(r["bytes_down_per_token"], ".0f"),
                        str(r["full_logits_bytes_per_token"]),
                        _pct(_div(r["bytes_down_per_token"], r["full_logits_bytes_per_token"])),
                    ]
                    for r in downlink
                ],
            ),
            "",
            "Measured: bytes the edge received per decoding token (frames, metadata, AES-GCM tags included;"
            " tail-local: one hidden vector per token in the pass; split-head: h[:d] and partial logits over the"
            " allowed ids for each row the edge asks for). Computed: what a cloud returning the full logits of one"
            " token would send (V values of the wire codec, no framing), the seed paper's baseline.",
        ]
    if doc["memory"]:
        out += [
            "",
            "## Memory",
            "",
            _table(
                ["mode", "peak RSS MiB", "runtime baseline MiB", "added by the mode MiB", "weights MiB"],
                [
                    [
                        mode,
                        _f(m.get("peak_rss_mb")),
                        _f(m.get("baseline_rss_mb")),
                        _f(m.get("added_mb")),
                        _f(m.get("weights_mb")),
                    ]
                    if "error" not in m
                    else [mode, f"error: {m['error']}", "", "", ""]
                    for mode, m in doc["memory"].items()
                ],
            ),
            "",
            "Each mode alone in a fresh process (1 torch thread) decoding the longest prompt: peak RSS of that"
            " process (VmHWM). Baseline = RSS after importing torch, transformers and splitlm, before loading"
            " a model. For split modes this is the edge's memory; the cloud's is not included.",
        ]
    if doc.get("codecs"):
        from splitlm.bench.codecs import codec_table

        out += [
            "",
            "## Wire codecs",
            "",
            *codec_table(doc["codecs"]),
            "",
            "Per codec, straight to the cloud: decoding bytes per token (sequential, one token per round trip),"
            " teacher-forced next-token agreement with the full transformers model's greedy continuation,"
            " free-running greedy agreement up to the first differing token, and prompts whose greedy ids are"
            " identical. int8 and fp8 (e4m3) carry one fp32 scale per row.",
        ]
    if doc["step_model"]:
        pred_rtts = (20, 50, 100, 200, 500)
        out += [
            "",
            "## Step-time model: t_step = α·RTT + β",
            "",
            _table(
                [
                    "mode",
                    "α",
                    "β ms",
                    "LOO mean err",
                    "LOO max err",
                    "tok/step",
                    *(f"tok/s @{r} ms" for r in pred_rtts),
                ],
                [
                    [
                        mode,
                        f"{f['alpha']:.3f}",
                        f"{f['beta_s'] * 1e3:.1f}",
                        _pct(f["loo_mean_rel_error"]),
                        _pct(f["loo_max_rel_error"]),
                        f"{f['tokens_per_step']:.2f}",
                        *(_f(next(p["tok_s"] for p in f["predictions"] if p["rtt_ms"] == r)) for r in pred_rtts),
                    ]
                    for mode, f in doc["step_model"].items()
                ],
            ),
            "",
            "Least squares over the sweep's per-RTT step times; LOO: leave one RTT out, fit the rest, predict it"
            " (relative error of the step time). Predicted tok/s = tok/step ÷ t_step(RTT).",
        ]
    from splitlm.bench.structured import markdown as structured_markdown

    return "\n".join(out) + "\n" + spec_bench_section(doc) + structured_markdown(doc.get("structured") or {})


def spec_bench_section(doc: dict) -> str:
    """A Spec-Bench run's table by category, next to the published figures (`bench.specbench`)."""
    if not doc.get("spec_bench"):
        return ""
    from splitlm.bench.specbench import markdown

    return "\n" + markdown(doc["spec_bench"])


def write_plots(doc: dict, base: Path) -> list[Path]:
    """Write `<base>-overview.png` (and `<base>-sweep.png` for a sweep); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [_overview(doc, base.with_name(base.name + "-overview.png"), plt)]
    if doc["step_model"]:
        paths.append(_sweep(doc, base.with_name(base.name + "-sweep.png"), plt))
    return paths


def _overview(doc: dict, path: Path, plt) -> Path:
    res = doc["results"]
    rtts = sorted({r["rtt_ms"] for r in res})
    rtt = min(rtts, key=lambda r: abs(r - 80))  # the category panel shows one RTT: the one nearest 80 ms
    modes = list(dict.fromkeys(r["mode"] for r in res))
    cats = list(dict.fromkeys(r["category"] for r in res if r["category"] != "all")) + ["all"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.2, 1]})
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        vals = [
            next((r["tok_s"] or 0 for r in res if r["mode"] == mode and r["rtt_ms"] == rtt and r["category"] == c), 0)
            for c in cats
        ]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(cats))]
        bars = ax1.bar(xs, vals, width, label=mode, color=COLORS[i % len(COLORS)])
        ax1.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    ax1.set_xticks(range(len(cats)), cats)
    ax1.set_ylabel("decode tokens / s")
    ax1.set_title(f"Throughput by prompt category (RTT {rtt:g} ms)")
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)

    overall = [r for r in res if r["category"] == "all"]
    labels = [f"{r['mode']}\n{r['rtt_ms']:g} ms" if doc["config"]["sweep"] else r["mode"] for r in overall]
    left = [0.0] * len(overall)
    for (key, name), color in zip(PARTS, COLORS[:4] + ("#bab0ac",), strict=True):
        vals = [max(0.0, (r[key] or 0) * 1e3) for r in overall]
        ax2.barh(range(len(overall)), vals, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for j, total in enumerate(left):
        ax2.text(total, j, f" {total:.1f}", va="center", fontsize=8)
    ax2.set_yticks(range(len(overall)), labels, fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xlim(0, max(left, default=1) * 1.12)
    ax2.set_xlabel("ms per decoding step")
    ax2.set_title("Where a decoding step's time goes")
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=5, frameon=False)
    ax2.grid(axis="x", alpha=0.3)
    fig.suptitle(_title(doc), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _sweep(doc: dict, path: Path, plt) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    rtt_max = max(max(f["rtts_ms"]) for f in doc["step_model"].values())
    grid = [rtt_max * 1.1 * i / 100 for i in range(101)]
    for i, (mode, f) in enumerate(doc["step_model"].items()):
        color = COLORS[i % len(COLORS)]
        loo = f["loo_mean_rel_error"]
        label = f"{mode}: α={f['alpha']:.2f}, β={f['beta_s'] * 1e3:.1f} ms" + (
            "" if loo is None else f", LOO {loo * 100:.1f} %"
        )
        ax1.plot(f["rtts_ms"], [s * 1e3 for s in f["steps_s"]], "o", color=color)
        ax1.plot(grid, [(f["alpha"] * r / 1e3 + f["beta_s"]) * 1e3 for r in grid], "-", color=color, label=label)
        ax2.plot(f["rtts_ms"], f["measured_tok_s"], "o", color=color, label=f"{mode} measured")
        tau = f["tokens_per_step"]
        ax2.plot(
            grid,
            [tau / max(1e-9, f["alpha"] * r / 1e3 + f["beta_s"]) for r in grid],
            "--",
            color=color,
            label=f"{mode} predicted",
        )
    ax1.set_xlabel("emulated RTT (ms)")
    ax1.set_ylabel("ms per decoding step")
    ax1.set_title("Step time: measured (dots) and fit t = α·RTT + β")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.set_xlabel("emulated RTT (ms)")
    ax2.set_ylabel("decode tokens / s")
    ax2.set_ylim(bottom=0)
    ax2.set_title("Throughput: measured vs predicted")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(_title(doc), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _title(doc: dict) -> str:
    env, c = doc["environment"], doc["config"]
    return (
        f"{env['model']['name']}, {env['split'].get('topology') or 'tail-local'} split k={env['split']['head']}"
        f" m={env['split']['tail']}, wire {c['wire_dtype']},"
        f" {len(doc['prompts'])} prompts x ≤{c['max_new_tokens']} tokens, 1 thread edge + 1 thread cloud,"
        f" {env['cpu_count']}-core {env['cpu'] or 'CPU'}"
    )
