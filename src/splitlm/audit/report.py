"""Write an audit: DIR/audit.json (every row), DIR/report.md (tables) and DIR/audit.png (plot)."""

from __future__ import annotations

import json
from pathlib import Path

from splitlm.result_files import suffixed, write_result

UP_ORDER = ["freq", "nn", "lens", "probe-linear", "probe-mlp", "whitebox"]
DOWN_ORDER = ["down-nn", "down-lens", "down-lens-next", "down-whitebox"]


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def fixed(rows: list[dict], **match) -> dict | None:
    """The fixed attacker's row (reports written before adaptive attackers have no `attacker`)."""
    return find(rows, **match, attacker="fixed") or find([r for r in rows if "attacker" not in r], **match)


def recovery_table(doc: dict, attacks: list[str], defence: str = "none") -> list[str]:
    heads = doc["config"]["heads"]
    lines = [
        "| attack | " + " | ".join(f"K={k} top-1 / top-5 / seq" for k in heads) + " |",
        "|---|" + "---|" * len(heads),
    ]
    for attack in attacks:
        cells = []
        for k in heads:
            r = fixed(doc["rows"], head=k, attack=attack, defence=defence)
            cells.append("–" if r is None else f"{pct(r['top1'])} / {pct(r['top5'])} / {pct(r['exact_seq'])}")
        if any(c != "–" for c in cells):
            lines.append(f"| {attack} | " + " | ".join(cells) + " |")
    return lines


def defence_table(doc: dict) -> list[str]:
    lines = [
        "| K | defence | agreement | perplexity | uplink moved (rel. L2) | uplink bytes/token | probe-linear | "
        "probe-mlp | **whitebox** | cloud reads the output |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for q in doc["quality"]:
        k, d = q["head"], q["defence"]
        cells = []
        for a in ("probe-linear", "probe-mlp", "whitebox", "tail-output"):
            f = pct((fixed(doc["rows"], head=k, defence=d, attack=a) or {}).get("top1"))
            ad = find(doc["rows"], head=k, defence=d, attack=a, attacker="adaptive")
            cell = f if ad is None else f"{f} / {pct(ad['top1'])}"
            cells.append(f"**{cell}**" if a == "whitebox" else cell)
        extra = f" ({q['harden_steps']} steps, {q['harden_s']:.0f} s)" if "harden_steps" in q else ""
        lines.append(
            f"| {k} | {d}{extra} | {pct(q['agreement'])} | {q['ppl']:.2f} | {q['uplink_distance']:.2f} | "
            f"{q['wire_bytes_per_token']:.0f} | " + " | ".join(cells) + " |"
        )
    return lines


def output_tables(doc: dict) -> list[str]:
    out = doc["output"]
    tails = sorted({r["tail"] for r in out if "tail" in r})
    heads = sorted({r["head"] for r in out if "head" in r})
    lines = ["| what the cloud reads | " + " | ".join(f"M={m}" for m in tails) + " |", "|---|" + "---|" * len(tails)]

    def cells(kind, key="top1", **match):
        return " | ".join(pct((find(out, kind=kind, tail=m, **match) or {}).get(key)) for m in tails)

    n_rows = (find(out, kind="row-outputs") or {}).get("tokens", 0)
    lines.append(f"| the edge's next-token choice, every verified row ({n_rows} rows) | {cells('row-outputs')} |")
    for k in heads:
        n = (find(out, kind="generated", head=k) or {}).get("tokens", 0)
        lines.append(
            f"| generated tokens ({n}; last step checked with the public head at K={k}) | "
            f"{cells('generated', head=k)} |"
        )
        lines.append(f"| whole generations exact (K={k}) | {cells('generated', 'exact_seq', head=k)} |")
    d = find(out, kind="drafts", via="parent-output") or {}
    lines.append(
        f"| drafted tokens from the parent row's output ({d.get('tokens', 0)} drafts) | "
        f"{cells('drafts', via='parent-output')} |"
    )
    lines.append(
        f"| rejected drafts from the parent row's output ({d.get('rejected', 0)}) | "
        f"{cells('drafts', 'rejected_top1', via='parent-output')} |"
    )
    lines += [
        "",
        "| drafted tokens from the uplink (linear probe) | " + " | ".join(f"K={k}" for k in heads) + " |",
        "|---|" + "---|" * len(heads),
    ]
    for key, label in (("top1", "all drafts"), ("rejected_top1", "rejected drafts")):
        lines.append(
            f"| {label} | "
            + " | ".join(pct((find(out, kind="drafts", via="uplink-probe", head=k) or {}).get(key)) for k in heads)
            + " |"
        )
    return lines


def metadata_lines(doc: dict) -> list[str]:
    m = doc["metadata"]
    labels = m["labels"]
    feats = ["prompt_tokens", "steps", "mean_rows", "max_rows", "mean_accepted", "accept_rate"]
    lines = [
        f"{m['generations']} generations ({' and '.join(labels)} prompts in equal numbers, "
        f"{doc['config']['output_tokens']} tokens each at most, speculative mode `{doc['config']['spec']}`).",
        "",
        "| what the cloud infers from shapes alone | measured |",
        "|---|---|",
        f"| exact count of generated tokens, from the keep lists it was sent (lower bound) | "
        f"{pct(m['count_exact_known'])} % of generations (mean error {m['count_mean_abs_error_known']:.1f} tokens) |",
    ]
    if "count_exact_estimated" in m:
        lines.append(
            f"| exact count, also checking the last step's drafts with the public head | "
            f"{pct(m['count_exact_estimated'])} % |"
        )
    if "count_exact_estimated_capped" in m:
        lines.append(
            f"| the same, cut at the length limit ({doc['config']['output_tokens']} tokens) when the cloud "
            f"knows it | {pct(m['count_exact_estimated_capped'])} % |"
        )
    lines += [
        f"| code vs prose, nearest centroid, leave-one-out, from tree shapes and keep lists | "
        f"{pct(m['classify_shape'])} % (chance 50 %) |",
        f"| the same with fixed tree shapes (keep lists and step count only) | {pct(m['classify_keep_only'])} % |",
        f"| the same from the prompt's length alone | {pct(m['classify_prompt_length'])} % |",
        f"| padding every step to the largest tree ({m['max_rows_per_step']} rows; mean "
        f"{m['mean_rows_per_step']:.2f}) | +{100 * m['fixed_shape_row_overhead']:.0f} % rows (uplink bytes, "
        "cloud compute) |",
        "",
        "| label | " + " | ".join(feats) + " |",
        "|---|" + "---|" * len(feats),
    ]
    for lab in labels:
        lines.append(f"| {lab} | " + " | ".join(f"{m['per_label'][lab][f]:.2f}" for f in feats) + " |")
    return lines


def depth_table(doc: dict) -> list[str]:
    lines = [
        "| K | head params | edge weights (MB) | head MACs / token | head KV bytes / token | head ms / token |",
        "|---|---|---|---|---|---|",
    ]
    for d in doc["depth"]:
        lines.append(
            f"| {d['head']} | {d['head_params'] / 1e6:.1f} M | {d['edge_weights_mb']:.0f} | "
            f"{d['head_macs_per_token'] / 1e6:.1f} M | {d['head_kv_bytes_per_token']} | "
            f"{d['head_ms_per_token']:.2f} |"
        )
    return lines


def defence_label(name: str) -> str:
    kind, _, value = name.partition(":")
    if kind == "noise":
        return f"noise {value} × RMS on the uplink"
    if kind == "quant":
        return f"{value}-bit uplink"
    if kind == "harden":
        return "hardened private head + tail" + (f" ({value} steps)" if value else "")
    return name


def summary_table(doc: dict) -> list[str]:
    """The short table the README quotes: top-1 % per K."""
    heads, rows = doc["config"]["heads"], doc["rows"]

    def cell(k, attack, defence="none", who="fixed"):
        r = (
            fixed(rows, head=k, attack=attack, defence=defence)
            if who == "fixed"
            else find(rows, head=k, attack=attack, defence=defence, attacker=who)
        )
        return pct(None if r is None else r["top1"])

    lines = [
        "| top-1 token recovery, % | " + " | ".join(f"K = {k}" for k in heads) + " |",
        "|---|" + "---|" * len(heads),
    ]
    for label, attack in (
        ("most frequent token (the floor)", "freq"),
        ("linear probe on the uplink", "probe-linear"),
        ("**white-box search on the uplink**", "whitebox"),
    ):
        lines.append(
            f"| {label} | "
            + " | ".join(cell(k, attack) if attack != "whitebox" else f"**{cell(k, attack)}**" for k in heads)
            + " |"
        )
    for d in doc["config"]["defences"]:
        if d == "none":
            continue
        cells = []
        for k in heads:
            q = find(doc["quality"], head=k, defence=d) or {}
            cells.append(
                f"{cell(k, 'whitebox', d)} / {cell(k, 'whitebox', d, 'adaptive')} (agreement {pct(q.get('agreement'))})"
            )
        lines.append(f"| {defence_label(d)}: white-box, fixed / adaptive attacker | " + " | ".join(cells) + " |")
    if "harden" in "".join(doc["config"]["defences"]):
        d = next(x for x in doc["config"]["defences"] if x.startswith("harden"))
        lines.append(
            f"| {defence_label(d)}: the cloud's tail reads the edge's next token, fixed / adaptive | "
            + " | ".join(f"{cell(k, 'tail-output', d)} / {cell(k, 'tail-output', d, 'adaptive')}" for k in heads)
            + " |"
        )
    out = doc.get("output")
    if out:
        m = doc["config"]["tail"]
        lines.append(
            f"| generated tokens read from the downlink (public tail, M = {m}) | "
            + " | ".join(pct((find(out, kind="generated", head=k, tail=m) or {}).get("top1")) for k in heads)
            + " |"
        )
        lines.append(
            "| drafted tokens read from the uplink: all / rejected | "
            + " | ".join(
                f"{pct(r.get('top1'))} / {pct(r.get('rejected_top1'))}"
                for r in (find(out, kind="drafts", via="uplink-probe", head=k) or {} for k in heads)
            )
            + " |"
        )
    return lines


def render_markdown(doc: dict, plot_name: str | None) -> str:
    c, cfg = doc["corpus"], doc["config"]
    lines = [
        "# Privacy audit",
        "",
        f"Model: {doc.get('model_name', '?')} ({doc['model']['num_layers']} layers, D={doc['model']['hidden_size']}, "
        f"vocab {doc['model']['vocab_size']}); tail M={cfg['tail']}. Corpus: {c['train_tokens']} public "
        f"training tokens "
        f"({c['train_docs']} documents), {c['held_out_tokens']} held-out tokens ({c['held_out_docs']} other "
        f"documents), "
        f"sequences of {c['seq_len']} tokens. White-box search: {cfg['whitebox_tokens']} held-out tokens on the "
        f"uplink, "
        f"{cfg['down_whitebox_tokens']} on the downlink, {cfg['candidates']} candidate tokens per position. "
        f"Wall time {doc['wall_s']:.0f} s on {doc['threads']} torch threads"
        + (
            f" (load average {doc['load_average_start'][0]:.1f} at the start, {doc['load_average_end'][0]:.1f} at "
            "the end: other jobs shared the CPU)."
            if "load_average_start" in doc
            else "."
        ),
        "",
        "Numbers are token recovery in % of held-out tokens: top-1 / top-5 / exact sequence "
        f"(all {c['seq_len']} tokens right).",
        "",
        "## Summary (the README's table)",
        "",
        *summary_table(doc),
        "",
        "## Uplink: what the cloud receives (layer K's output)",
        "",
        *recovery_table(doc, UP_ORDER),
        "",
        "## Downlink: what the cloud sends back (layer L-M's output, tail-local)",
        "",
        *recovery_table(doc, DOWN_ORDER),
        "",
        "## Defences and their cost: fixed / adaptive attacker",
        "",
        "Agreement: teacher-forced next-token argmax equal to the undefended model's, on the held-out text. "
        "Attack columns: top-1 % for the fixed attacker (public weights, probes trained on undefended activations) "
        "/ the adaptive one (reruns the defence on its own copy with its own seed and text; its white-box search "
        "models the defence). `cloud reads the output`: the cloud runs the public tail (adaptive, for harden: its "
        "own hardened tail) on the downlink; % of positions where its top-1 is the edge's next-token choice.",
        "",
        *defence_table(doc),
        "",
        "## Cost of more local layers (the edge, per token)",
        "",
        *depth_table(doc),
        "",
        *(
            [
                "## Output leakage: the cloud finishes the forward pass",
                "",
                "The cloud mirrors the edge's tail KV cache from the positions, masks and keep lists, and runs "
                "the public "
                "tail layers [L-M, L), norm and LM head on its own downlink, on real speculative decoding of the "
                "metadata prompts (greedy, no defence).",
                "",
                *output_tables(doc),
                "",
                "## Metadata: what the shape of the traffic tells",
                "",
                *metadata_lines(doc),
                "",
            ]
            if "output" in doc
            else []
        ),
        "## How to read it",
        "",
        "- `freq`: always guess the most frequent training tokens (the floor).",
        "- `nn`: nearest embedding row by cosine; `lens`: final norm + LM head on the activation.",
        "- `probe-linear`: ridge regression into embedding space + nearest embedding (ranks all tokens); "
        "`probe-mlp`: MLP classifier over the tokens of the training text only.",
        "- `whitebox`: with the public weights, tries candidate tokens after the prefix it has recovered so far and "
        "keeps the one whose activation is nearest (L2). Candidates are restricted: the union of the other attacks' "
        f"top lists plus frequent tokens, {cfg['candidates']} per position; a token outside them cannot be found, "
        "so these figures are a lower bound on a white-box attacker with more compute.",
        "- `down-*`: the same on the downlink; `down-lens-next` reads the model's next-token prediction at position "
        "t-1 as a guess for token t.",
        "- adaptive: `noise` scored by the Gaussian likelihood under the candidate's own noise scale, `quant` by the "
        "distance after quantising the candidate; `harden`: the attacker hardens its own copy of the head and tail "
        "(same procedure, its own text and seed), trains its probes on that copy and searches through it and the "
        "public head. It also tries the fixed attacks' guesses.",
    ]
    if plot_name:
        lines += ["", f"![audit]({plot_name})"]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = doc["config"]["heads"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for attack in UP_ORDER + DOWN_ORDER:
        ys = [(fixed(doc["rows"], head=k, attack=attack, defence="none") or {}).get("top1") for k in heads]
        if any(y is not None for y in ys):
            style = "--" if attack.startswith("down-") else "-"
            axes[0].plot(
                heads, [100 * y if y is not None else float("nan") for y in ys], style, marker="o", label=attack
            )
    axes[0].set(
        title="Token recovery, no defence", xlabel="local head layers K", ylabel="top-1 recovery %", ylim=(0, 102)
    )
    axes[0].legend(fontsize=7)
    defences = doc["config"]["defences"]
    for d in defences:
        ys = [(fixed(doc["rows"], head=k, attack="whitebox", defence=d) or {}).get("top1") for k in heads]
        ag = [(find(doc["quality"], head=k, defence=d) or {}).get("agreement") for k in heads]
        seen = [a for a in ag if a is not None]
        label = f"{d} (agreement {100 * min(seen):.0f}–{100 * max(seen):.0f} %)"
        line = axes[1].plot(heads, [100 * y if y is not None else float("nan") for y in ys], marker="o", label=label)
        ya = [
            (find(doc["rows"], head=k, attack="whitebox", defence=d, attacker="adaptive") or {}).get("top1")
            for k in heads
        ]
        if any(y is not None for y in ya):
            axes[1].plot(
                heads,
                [100 * y if y is not None else float("nan") for y in ya],
                ":",
                marker="x",
                color=line[0].get_color(),
                label=f"{d}, adaptive",
            )
    axes[1].set(
        title="White-box recovery under defences",
        xlabel="local head layers K",
        ylabel="top-1 recovery %",
        ylim=(0, 102),
    )
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(heads)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_audit(doc: dict, out: str | Path, plots: bool = True) -> list[Path]:
    """Write DIR/audit.json, DIR/audit.png (with `plots`) and DIR/report.md; returns their paths."""

    def draw(base: Path) -> list[Path]:
        plot(doc, suffixed(base, ".png"))
        return [suffixed(base, ".png")]

    written = write_result(
        out,
        "audit",
        doc,
        markdown_name="report.md",
        plots=draw if plots else None,
        markdown=lambda pngs: render_markdown(doc, pngs[0].name if pngs else None),
    )
    return written.paths


if __name__ == "__main__":  # re-render a report from its audit.json: python -m splitlm.audit.report DIR
    import sys

    target = Path(sys.argv[1])
    write_audit(json.loads((target / "audit.json").read_text()), target, plots=(target / "audit.png").exists())
