"""Run the audit: for every head depth K and defence, attack the uplink (layer K's output, what the
cloud receives) and the downlink (layer L-M's output, what it sends back), with a fixed attacker
(public weights, probes trained on undefended activations) and an adaptive one (which reruns the
defence on its own copy, `adaptive.py`), and measure the defence's cost; then trace real decoding
for the output leakage (`output.py`) and the metadata (`metadata.py`). Returns a JSON-ready dict;
`report.py` writes it out."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from splitlm.audit.adaptive import Attacker, adaptive_attacker, public_attacker
from splitlm.audit.attacks import (
    LinearProbe,
    merge_candidates,
    rank_lens,
    rank_nn,
    recovery,
    train_mlp_probe,
    whitebox,
)
from splitlm.audit.config import ATTACKS, AuditConfig
from splitlm.audit.data import AuditCorpus, build_corpus, load_for_audit  # noqa: F401 (re-exported)
from splitlm.audit.decoding_audit import trace_audit
from splitlm.audit.defences import Defence
from splitlm.audit.harden import HardenConfig, harden_head, relative_distance
from splitlm.audit.views import SplitView, batched, quality
from splitlm.model.llama import Transformer
from splitlm.progress import bar

log = logging.getLogger(__name__)

__all__ = ["ATTACKS", "AuditConfig", "load_for_audit", "run_audit"]


def shift_next(ranked: torch.Tensor, frequent: torch.Tensor) -> torch.Tensor:
    """ranked [B, S, k] predictions of the *next* token -> guesses for each position's own token."""
    out = torch.empty_like(ranked)
    out[:, 1:] = ranked[:, :-1]
    out[:, 0] = frequent[: ranked.shape[-1]]
    return out


def depth_cost(model: Transformer, view: SplitView, ids: torch.Tensor, tail: int) -> dict[str, float]:
    """What keeping K layers local costs the edge per step (one new token)."""
    cfg = model.cfg
    layer_params = sum(p.numel() for p in model.stack.layers[0].parameters())
    elem = next(model.parameters()).element_size()
    shared = sum(p.numel() for p in model.embed_tokens.parameters()) + sum(p.numel() for p in model.norm.parameters())
    if model.lm_head is not None:
        shared += model.lm_head.weight.numel()
    t0 = time.perf_counter()
    batched(view.up, ids)
    seconds = time.perf_counter() - t0
    return {
        "head": view.k,
        "head_params": view.k * layer_params,
        "edge_weights_mb": (shared + (view.k + tail) * layer_params) * elem / 2**20,
        "head_macs_per_token": view.k * layer_params,
        "head_kv_bytes_per_token": view.k * 2 * cfg.num_kv_heads * cfg.head_dim * elem,
        "head_ms_per_token": 1000 * seconds / ids.numel(),
    }


def train_probes(
    h_train: torch.Tensor, y: torch.Tensor, emb: torch.Tensor, config: AuditConfig, mlp: bool = True
) -> dict:
    """The linear and (with `mlp`) MLP probes on activations h_train [N, D] of the tokens y [N]."""
    probes = {"probe-linear": LinearProbe(h_train, y, emb)}
    if mlp:
        n_mlp = min(len(y), config.mlp_probe_tokens)  # the MLP's training costs far more than the ridge's
        probes["probe-mlp"] = train_mlp_probe(
            h_train[:n_mlp], y[:n_mlp], emb, epochs=config.probe_epochs, seed=config.seed
        )
    return probes


def tail_ranks(view: SplitView, down: torch.Tensor, tail, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The edge's next-token argmax [B, S] and the cloud's top-k [B, S, k] through `tail`."""
    edge, cloud = [], []
    with torch.no_grad():
        for i in range(0, down.shape[0], 16):
            edge.append(view.logits(down[i : i + 16]).argmax(-1))
            cloud.append(view.logits(down[i : i + 16], tail).topk(k, dim=-1).indices)
    return torch.cat(edge), torch.cat(cloud)


@dataclass
class Target:
    """What the attacks aim at: the held-out token ids [Ne, S], the corpus's commonest tokens (the
    guesses of last resort), and how many held-out sequences the white-box search takes."""

    ids: torch.Tensor
    frequent: torch.Tensor
    n_wb: int


def attack_uplink(
    config: AuditConfig,
    view: SplitView,
    attacker: Attacker,
    probes: dict,
    up: torch.Tensor,
    target: Target,
    known: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Ranked guesses [B, S, k] per uplink attack; `known`: other attacks' guesses the white-box
    search tries too (the adaptive attacker keeps the fixed one's)."""
    model, ncand, shape, n_wb = view.model, config.candidates, (*target.ids.shape, -1), target.n_wb
    flat = up.flatten(0, 1)
    ranks = {}
    if "nn" in config.attacks:
        ranks["nn"] = rank_nn(flat, model.embed_tokens.weight, ncand).view(shape)
    if "lens" in config.attacks:
        ranks["lens"] = rank_lens(flat, model, ncand).view(shape)
    for name, probe in probes.items():
        ranks[name] = probe.rank(flat, ncand).view(shape)
    if "whitebox" in config.attacks:
        pool = list(ranks.values()) + [r for name, r in (known or {}).items() if name != "whitebox"]
        cands = merge_candidates([r[:n_wb].flatten(0, 1) for r in pool], target.frequent, ncand, n_wb * config.seq_len)
        ranks["whitebox"] = whitebox(
            attacker.search, view.embed, up[:n_wb], cands.view(n_wb, config.seq_len, -1), score=attacker.score
        )
    return ranks


@dataclass
class Defended:
    """One defence at one head depth K: what the cloud receives and returns, and what it costs."""

    view: SplitView  # the edge's view (a private head and tail under harden)
    up: torch.Tensor  # [Ne, S, D] the uplink, defence applied
    down: torch.Tensor  # [Ne, S, D] the downlink
    quality: dict  # agreement, perplexity, uplink distance, bytes (+ the harden run's figures)
    harden: HardenConfig  # what an adaptive attacker reruns to copy the defence

    @property
    def row_quality(self) -> dict:
        return {"agreement": self.quality["agreement"], "ppl": self.quality["ppl"]}


class AuditRun:
    """One audit's shared state (the corpus, the held-out ids under attack, the rows so far) and its
    steps: per head depth K the public attacker and its probes, then per defence the defended split,
    the attacks on its uplink and downlink (fixed and adaptive attackers), and the report's rows."""

    def __init__(self, model: Transformer, encode: Callable[[str], list[int]], docs: list[str], config: AuditConfig):
        cfg = model.cfg
        self.model, self.config = model, config
        self.corpus = build_corpus(
            docs,
            encode,
            cfg.vocab_size,
            config.seq_len,
            config.max_train_tokens,
            config.max_eval_tokens,
            seed=config.seed,
        )
        self.ids = self.corpus.held_out  # [Ne, S]
        log.info(
            f"[audit] corpus: {self.corpus.train.numel()} training tokens ({self.corpus.train_docs} documents), "
            f"{self.ids.numel()} held-out tokens ({self.corpus.held_out_docs} documents)"
        )
        self.frequent = self.corpus.frequent(max(config.candidates, 5))
        self.edge_text, self.attacker_text = self.corpus.train[0::2], self.corpus.train[1::2]  # who hardens on what
        self.rows: list[dict] = []
        freq_ranked = self.frequent[:5].expand(*self.ids.shape, 5)
        for k in config.heads:
            self.rows.append(
                {
                    "head": k,
                    "link": "up",
                    "attack": "freq",
                    "defence": "none",
                    "attacker": "fixed",
                    **recovery(freq_ranked, self.ids),
                    "tokens": self.ids.numel(),
                }
            )
        full = SplitView(model, config.heads[0], config.tail)
        self.ref_argmax = batched(lambda x: full.logits(full.down(full.up(x))).argmax(-1), self.ids)  # [Ne, S]
        self.quality_rows: list[dict] = []
        self.depth_rows: list[dict] = []
        self.linear_probes: dict[int, LinearProbe] = {}
        self.n_wb = max(1, min(self.ids.shape[0], config.whitebox_tokens // config.seq_len))
        self.n_dwb = max(1, min(self.ids.shape[0], config.down_whitebox_tokens // config.seq_len))
        self.undefended_down = None  # the downlink white-box result without a defence (the same for every K)

    def add(
        self,
        k: int,
        defence: Defence,
        d: Defended,
        link: str,
        attack: str,
        ranked: torch.Tensor,
        truth: torch.Tensor,
        who: str,
    ) -> None:
        self.rows.append(
            {
                "head": k,
                "link": link,
                "attack": attack,
                "defence": defence.name,
                "attacker": who,
                **recovery(ranked, truth),
                "tokens": truth.numel(),
                **d.row_quality,
            }
        )

    def probes(self, attacker: Attacker, view: SplitView, mlp: bool = True) -> dict:
        """The probes `attacker` trains on its own view of the public text (none without the probe attack)."""
        if "probe" not in self.config.attacks:
            return {}
        train = self.corpus.train
        return train_probes(
            attacker.uplink(view, train).flatten(0, 1),
            train.flatten(),
            self.model.embed_tokens.weight,
            self.config,
            mlp=mlp,
        )

    def audit_depth(self, k: int, stages) -> None:
        """Every defence at head depth K, against the public attacker (and the adaptive ones)."""
        view = SplitView(self.model, k, self.config.tail)
        self.depth_rows.append(depth_cost(self.model, view, self.ids, self.config.tail))
        fixed = public_attacker(view)
        t0 = time.perf_counter()
        fixed_probes = self.probes(fixed, view)
        if fixed_probes:
            self.linear_probes[k] = fixed_probes["probe-linear"]
            log.info(f"[audit] K={k}: probes trained in {time.perf_counter() - t0:.0f} s")
        stages.update()
        for defence in self.config.defences:
            t0 = time.perf_counter()
            stages.set_postfix_str(f"K={k} {defence.name}")
            d = self.defend(view, k, defence)
            attackers = [("fixed", fixed, fixed_probes), *self.adaptive(view, k, defence, d, t0)]
            self.quality_rows.append({"head": k, "defence": defence.name, **d.quality})
            self.attack_links(view, k, defence, d, attackers)
            self.attack_downlink(view, k, defence, d)
            self.log_defence(k, defence, d, t0)
            stages.update()

    def defend(self, view: SplitView, k: int, defence: Defence) -> Defended:
        """The split under `defence` at depth K (harden trains the private head and tail first)."""
        config, ids = self.config, self.ids
        dview, extra, hc = view, {}, config.harden
        if defence.kind == "harden":
            hc = replace(config.harden, steps=int(defence.value) or config.harden.steps, seed=config.seed)
            result = harden_head(view, self.edge_text, hc)
            dview = SplitView(self.model, k, config.tail, private_head=result.head, private_tail=result.tail)
            extra = {
                "harden_steps": result.steps,
                "harden_s": round(result.seconds, 1),
                "private_tail": result.tail is not None,
            }
        up = defence.apply(batched(dview.up, ids), seed=config.seed + k)  # [Ne, S, D]
        down = batched(dview.down, up)  # [Ne, S, D]
        qual = {
            **quality(dview, down, ids, self.ref_argmax),
            "uplink_distance": float(relative_distance(up, batched(view.up, ids)).mean()),
            "wire_bytes_per_token": defence.wire_bytes_per_token(self.model.cfg.hidden_size),
            **extra,
        }
        return Defended(dview, up, down, qual, hc)

    def adaptive(
        self, view: SplitView, k: int, defence: Defence, d: Defended, t0: float
    ) -> list[tuple[str, Attacker, dict]]:
        """The adaptive attacker of a defence (none without one, or with --no-adaptive)."""
        config = self.config
        if not config.adaptive or defence.kind == "none":
            return []
        adv = adaptive_attacker(view, defence, self.attacker_text, d.harden, seed=config.seed + 1000 + k)
        adv_probes = self.probes(adv, view, mlp=config.adaptive_mlp)
        d.quality["adaptive_setup_s"] = round(time.perf_counter() - t0, 1)
        return [("adaptive", adv, adv_probes)]

    def attack_links(
        self, view: SplitView, k: int, defence: Defence, d: Defended, attackers: list[tuple[str, Attacker, dict]]
    ) -> None:
        """Each attacker on the uplink (every attack) and on the tail's output (what the cloud reads)."""
        fixed_ranks = None
        for who, attacker, probes in attackers:
            target = Target(self.ids, self.frequent, self.n_wb)
            ranks = attack_uplink(self.config, view, attacker, probes, d.up, target, fixed_ranks)
            fixed_ranks = fixed_ranks or ranks
            for name, ranked in ranks.items():
                self.add(k, defence, d, "up", name, ranked, self.ids[: ranked.shape[0]], who)
            edge_argmax, cloud = tail_ranks(d.view, d.down, attacker.tail)
            self.add(k, defence, d, "down", "tail-output", cloud, edge_argmax, who)

    def attack_downlink(self, view: SplitView, k: int, defence: Defence, d: Defended) -> None:
        """The public attacker on the downlink: nearest embedding, logit lens, and (undefended) white-box."""
        config, ids = self.config, self.ids
        flat_down, shape = d.down.flatten(0, 1), (*ids.shape, -1)
        down_ranks = {}
        if "nn" in config.attacks:
            down_ranks["down-nn"] = rank_nn(flat_down, self.model.embed_tokens.weight, config.candidates).view(shape)
        if "lens" in config.attacks:
            lens_down = rank_lens(flat_down, self.model, config.candidates).view(shape)
            down_ranks["down-lens"] = lens_down
            down_ranks["down-lens-next"] = shift_next(lens_down, self.frequent)
        for name, ranked in down_ranks.items():
            self.add(k, defence, d, "down", name, ranked, ids, "fixed")
        if "whitebox" in config.attacks and defence.kind == "none":
            if self.undefended_down is None:  # layers [0, L-M) whatever K is: searched once
                n = self.n_dwb
                cands = merge_candidates(
                    [r[:n].flatten(0, 1) for r in down_ranks.values()],
                    self.frequent,
                    config.candidates,
                    n * config.seq_len,
                )
                self.undefended_down = whitebox(
                    view.down_prefix, view.embed, d.down[:n], cands.view(n, config.seq_len, -1)
                )
            self.add(k, defence, d, "down", "down-whitebox", self.undefended_down, ids[: self.n_dwb], "fixed")

    def log_defence(self, k: int, defence: Defence, d: Defended, t0: float) -> None:
        summary = ", ".join(
            f"{r['attack']}{'*' if r['attacker'] == 'adaptive' else ''} {r['top1']:.2f}"
            for r in self.rows
            if r["head"] == k
            and r["defence"] == defence.name
            and r["attack"] in ("probe-linear", "whitebox", "tail-output")
        )
        log.info(
            f"[audit] K={k} {defence.name}: agreement {d.quality['agreement']:.3f}, ppl {d.quality['ppl']:.2f}; "
            f"top-1 {summary} (* adaptive; {time.perf_counter() - t0:.0f} s)"
        )

    def document(self, load_start: list[float]) -> dict:
        cfg, config = self.model.cfg, self.config
        return {
            "config": {**asdict(config), "defences": [d.name for d in config.defences]},
            "model": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
            "corpus": corpus_summary(self.corpus),
            "rows": self.rows,
            "quality": self.quality_rows,
            "depth": self.depth_rows,
            "load_average_start": load_start,
        }


def run_audit(model: Transformer, encode: Callable[[str], list[int]], docs: list[str], config: AuditConfig) -> dict:
    """The audit of `model` on `docs` (a JSON-ready document; `report.py` writes it out)."""
    t_start = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    config.check(model.cfg.num_layers)
    model.eval()
    run = AuditRun(model, encode, docs, config)
    tracing = config.output_prompts > 0
    stages = bar(
        len(config.heads) * (1 + len(config.defences)) + (2 if tracing else 0), "audit", unit="stage"
    )  # probes + each defence (+ tracing, its attacks)
    for k in config.heads:
        run.audit_depth(k, stages)
    doc = run.document(load_start)
    if tracing:
        doc.update(trace_audit(model, encode, config, run.linear_probes, stages))
    stages.close()
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    doc["threads"] = torch.get_num_threads()
    doc["load_average_end"] = [round(x, 2) for x in os.getloadavg()]  # other jobs on the machine slow the run
    return doc


def corpus_summary(corpus: AuditCorpus) -> dict:
    return {
        "train_tokens": corpus.train.numel(),
        "held_out_tokens": corpus.held_out.numel(),
        "train_docs": corpus.train_docs,
        "held_out_docs": corpus.held_out_docs,
        "seq_len": corpus.train.shape[1],
    }
