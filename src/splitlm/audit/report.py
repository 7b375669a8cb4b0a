"""Write an audit: DIR/audit.json (every row), DIR/report.md (tables) and DIR/audit.png (plot)."""

from __future__ import annotations

import json
from pathlib import Path

UP_ORDER = ["freq", "nn", "lens", "probe-linear", "probe-mlp", "whitebox"]
DOWN_ORDER = ["down-nn", "down-lens", "down-lens-next", "down-whitebox"]


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def recovery_table(doc: dict, attacks: list[str], defence: str = "none") -> list[str]:
    heads = doc["config"]["heads"]
    lines = ["| attack | " + " | ".join(f"K={k} top-1 / top-5 / seq" for k in heads) + " |",
             "|---|" + "---|" * len(heads)]
    for attack in attacks:
        cells = []
        for k in heads:
            r = find(doc["rows"], head=k, attack=attack, defence=defence)
            cells.append("–" if r is None else f"{pct(r['top1'])} / {pct(r['top5'])} / {pct(r['exact_seq'])}")
        if any(c != "–" for c in cells):
            lines.append(f"| {attack} | " + " | ".join(cells) + " |")
    return lines


def defence_table(doc: dict) -> list[str]:
    lines = ["| K | defence | agreement | perplexity | uplink moved (rel. L2) | uplink bytes/token | nn | lens | "
             "probe-linear | probe-mlp | **whitebox** | down-lens-next |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for q in doc["quality"]:
        k, d = q["head"], q["defence"]
        tops = [pct((find(doc["rows"], head=k, defence=d, attack=a) or {}).get("top1"))
                for a in ("nn", "lens", "probe-linear", "probe-mlp", "whitebox", "down-lens-next")]
        tops[4] = f"**{tops[4]}**"
        extra = f" ({q['harden_steps']} steps, {q['harden_s']:.0f} s)" if "harden_steps" in q else ""
        lines.append(f"| {k} | {d}{extra} | {pct(q['agreement'])} | {q['ppl']:.2f} | {q['uplink_distance']:.2f} | "
                     f"{q['wire_bytes_per_token']:.0f} | " + " | ".join(tops) + " |")
    return lines


def depth_table(doc: dict) -> list[str]:
    lines = ["| K | head params | edge weights (MB) | head MACs / token | head KV bytes / token | head ms / token |",
             "|---|---|---|---|---|---|"]
    for d in doc["depth"]:
        lines.append(f"| {d['head']} | {d['head_params'] / 1e6:.1f} M | {d['edge_weights_mb']:.0f} | "
                     f"{d['head_macs_per_token'] / 1e6:.1f} M | {d['head_kv_bytes_per_token']} | "
                     f"{d['head_ms_per_token']:.2f} |")
    return lines


def render_markdown(doc: dict, plot_name: str | None) -> str:
    c, cfg = doc["corpus"], doc["config"]
    lines = [
        "# Privacy audit",
        "",
        f"Model: {doc.get('model_name', '?')} ({doc['model']['num_layers']} layers, D={doc['model']['hidden_size']}, "
        f"vocab {doc['model']['vocab_size']}); tail M={cfg['tail']}. Corpus: {c['train_tokens']} public training tokens "
        f"({c['train_docs']} documents), {c['held_out_tokens']} held-out tokens ({c['held_out_docs']} other documents), "
        f"sequences of {c['seq_len']} tokens. White-box search: {cfg['whitebox_tokens']} held-out tokens on the uplink, "
        f"{cfg['down_whitebox_tokens']} on the downlink, {cfg['candidates']} candidate tokens per position. "
        f"Wall time {doc['wall_s']:.0f} s on {doc['threads']} torch threads.",
        "",
        "Numbers are token recovery in % of held-out tokens: top-1 / top-5 / exact sequence "
        f"(all {c['seq_len']} tokens right).",
        "",
        "## Uplink: what the cloud receives (layer K's output)",
        "",
        *recovery_table(doc, UP_ORDER),
        "",
        "## Downlink: what the cloud sends back (layer L-M's output, tail-local)",
        "",
        *recovery_table(doc, DOWN_ORDER),
        "",
        "## Defences and their cost",
        "",
        "Agreement: teacher-forced next-token argmax equal to the undefended model's, on the held-out text. "
        "Attack columns: top-1 %. The white-box attacker uses the public weights (it does not know a hardened head).",
        "",
        *defence_table(doc),
        "",
        "## Cost of more local layers (the edge, per token)",
        "",
        *depth_table(doc),
        "",
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
        ys = [(find(doc["rows"], head=k, attack=attack, defence="none") or {}).get("top1") for k in heads]
        if any(y is not None for y in ys):
            style = "--" if attack.startswith("down-") else "-"
            axes[0].plot(heads, [100 * y if y is not None else float("nan") for y in ys], style, marker="o", label=attack)
    axes[0].set(title="Token recovery, no defence", xlabel="local head layers K", ylabel="top-1 recovery %",
                ylim=(0, 102))
    axes[0].legend(fontsize=7)
    defences = doc["config"]["defences"]
    for d in defences:
        ys = [(find(doc["rows"], head=k, attack="whitebox", defence=d) or {}).get("top1") for k in heads]
        ag = [(find(doc["quality"], head=k, defence=d) or {}).get("agreement") for k in heads]
        label = f"{d} (agreement {100 * min(a for a in ag if a is not None):.0f}–{100 * max(a for a in ag if a is not None):.0f} %)"
        axes[1].plot(heads, [100 * y if y is not None else float("nan") for y in ys], marker="o", label=label)
    axes[1].set(title="White-box recovery under defences", xlabel="local head layers K", ylabel="top-1 recovery %",
                ylim=(0, 102))
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(heads)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_audit(doc: dict, out: str | Path, plots: bool = True) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "audit.json"]
    written[0].write_text(json.dumps(doc, indent=1))
    plot_name = None
    if plots:
        plot(doc, out / "audit.png")
        plot_name = "audit.png"
        written.append(out / plot_name)
    (out / "report.md").write_text(render_markdown(doc, plot_name))
    written.append(out / "report.md")
    return written
