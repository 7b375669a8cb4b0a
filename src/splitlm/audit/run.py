"""Run the audit: for every head depth K and defence, attack the uplink (layer K's output, what the
cloud receives) and the downlink (layer L-M's output, what it sends back), and measure the
defence's cost. Returns a JSON-ready dict; `report.py` writes it out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from splitlm import SplitLMError
from splitlm.audit.attacks import (
    LinearProbe,
    merge_candidates,
    rank_lens,
    rank_nn,
    recovery,
    train_mlp_probe,
    whitebox,
)
from splitlm.audit.data import AuditCorpus, build_corpus, load_for_audit  # noqa: F401 (re-exported)
from splitlm.audit.defences import Defence, parse_defence
from splitlm.audit.harden import HardenConfig, harden_head, relative_distance
from splitlm.audit.views import SplitView, batched, quality
from splitlm.model.llama import Transformer
from splitlm.progress import bar

logger = logging.getLogger(__name__)

ATTACKS = ("nn", "lens", "probe", "whitebox")


@dataclass
class AuditConfig:
    heads: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    tail: int = 2
    attacks: list[str] = field(default_factory=lambda: list(ATTACKS))
    defences: list[Defence] = field(default_factory=lambda: [parse_defence("none")])
    seq_len: int = 32
    max_train_tokens: int = 32768
    max_eval_tokens: int = 1024
    whitebox_tokens: int = 256  # held-out tokens the (expensive) white-box search attacks
    down_whitebox_tokens: int = 128
    candidates: int = 64  # tokens the white-box search tries per position
    probe_epochs: int = 2
    mlp_probe_tokens: int = 8192
    harden: HardenConfig = field(default_factory=HardenConfig)
    seed: int = 0

    def check(self, num_layers: int) -> None:
        for k in self.heads:
            if k < 1 or k + self.tail >= num_layers:
                raise SplitLMError(f"--head {k} with --tail {self.tail} leaves no layer for the cloud "
                                   f"(the model has {num_layers})")
        unknown = set(self.attacks) - set(ATTACKS)
        if unknown or not self.attacks:
            raise SplitLMError(f"unknown attack(s) {', '.join(sorted(unknown)) or '(none given)'}; "
                               f"choose from {', '.join(ATTACKS)}")
        if self.candidates < 5:
            raise SplitLMError("--candidates must be at least 5")


def log(msg: str) -> None:
    """A status line (logging: shown unless --quiet)."""
    logger.info("[audit] %s", msg)


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


def run_audit(model: Transformer, encode: Callable[[str], list[int]], docs: list[str], config: AuditConfig) -> dict:
    t_start = time.perf_counter()
    cfg = model.cfg
    config.check(cfg.num_layers)
    model.eval()
    corpus = build_corpus(docs, encode, cfg.vocab_size, config.seq_len, config.max_train_tokens,
                          config.max_eval_tokens, seed=config.seed)
    ids = corpus.held_out  # [Ne, S]
    log(f"corpus: {corpus.train.numel()} training tokens ({corpus.train_docs} documents), "
        f"{ids.numel()} held-out tokens ({corpus.held_out_docs} documents)")
    frequent = corpus.frequent(max(config.candidates, 5))
    rows: list[dict] = []
    freq_ranked = frequent[:5].expand(*ids.shape, 5)
    for k in config.heads:
        rows.append({"head": k, "link": "up", "attack": "freq", "defence": "none", **recovery(freq_ranked, ids),
                     "tokens": ids.numel()})
    full = SplitView(model, config.heads[0], config.tail)
    ref_argmax = batched(lambda x: full.logits(full.down(full.up(x))).argmax(-1), ids)  # [Ne, S]
    quality_rows, depth_rows = [], []
    n_wb = max(1, min(ids.shape[0], config.whitebox_tokens // config.seq_len))
    n_dwb = max(1, min(ids.shape[0], config.down_whitebox_tokens // config.seq_len))
    ncand = config.candidates
    undefended_down = None  # the downlink white-box result without a defence (the same for every K)
    stages = bar(len(config.heads) * (1 + len(config.defences)), "audit", unit="stage")  # probes + each defence
    for k in config.heads:
        view = SplitView(model, k, config.tail)
        depth_rows.append(depth_cost(model, view, ids, config.tail))
        probes = {}
        if "probe" in config.attacks:
            t0 = time.perf_counter()
            h_train = batched(view.up, corpus.train).flatten(0, 1)  # [N, D]
            y, emb = corpus.train.flatten(), model.embed_tokens.weight
            probes["probe-linear"] = LinearProbe(h_train, y, emb)
            n_mlp = min(len(y), config.mlp_probe_tokens)  # the MLP's training costs far more than the ridge's
            probes["probe-mlp"] = train_mlp_probe(h_train[:n_mlp], y[:n_mlp], emb, epochs=config.probe_epochs,
                                                  seed=config.seed)
            del h_train
            log(f"K={k}: probes trained in {time.perf_counter() - t0:.0f} s")
        stages.update()
        for defence in config.defences:
            t0 = time.perf_counter()
            dview, extra = view, {}
            if defence.kind == "harden":
                hc = HardenConfig(**{**asdict(config.harden), "steps": int(defence.value) or config.harden.steps})
                result = harden_head(view, corpus.train, hc)
                dview = SplitView(model, k, config.tail, private_head=result.head)
                extra = {"harden_steps": result.steps, "harden_s": round(result.seconds, 1)}
            up = defence.apply(batched(dview.up, ids), seed=config.seed + k)  # [Ne, S, D]
            down = batched(dview.down, up)  # [Ne, S, D]
            public_up = batched(view.up, ids)
            qual = {**quality(dview, down, ids, ref_argmax),
                    "uplink_distance": float(relative_distance(up, public_up).mean()),
                    "wire_bytes_per_token": defence.wire_bytes_per_token(cfg.hidden_size), **extra}
            quality_rows.append({"head": k, "defence": defence.name, **qual})
            row_q = {"agreement": qual["agreement"], "ppl": qual["ppl"]}

            def add(link: str, attack: str, ranked: torch.Tensor, truth: torch.Tensor,
                    k=k, defence=defence, row_q=row_q) -> None:
                rows.append({"head": k, "link": link, "attack": attack, "defence": defence.name,
                             **recovery(ranked, truth), "tokens": truth.numel(), **row_q})

            flat_up, flat_down = up.flatten(0, 1), down.flatten(0, 1)
            shape = (*ids.shape, -1)
            up_ranks, down_ranks = {}, {}
            if "nn" in config.attacks:
                up_ranks["nn"] = rank_nn(flat_up, model.embed_tokens.weight, ncand).view(shape)
                down_ranks["down-nn"] = rank_nn(flat_down, model.embed_tokens.weight, ncand).view(shape)
            if "lens" in config.attacks:
                up_ranks["lens"] = rank_lens(flat_up, model, ncand).view(shape)
                lens_down = rank_lens(flat_down, model, ncand).view(shape)
                down_ranks["down-lens"] = lens_down
                down_ranks["down-lens-next"] = shift_next(lens_down, frequent)
            for name, probe in probes.items():
                up_ranks[name] = probe.rank(flat_up, ncand).view(shape)
            for name, ranked in {**up_ranks, **down_ranks}.items():
                add("down" if name.startswith("down-") else "up", name, ranked, ids)
            if "whitebox" in config.attacks:
                cands = merge_candidates([r[:n_wb].flatten(0, 1) for r in up_ranks.values()], frequent, ncand,
                                         n_wb * config.seq_len)
                ranked = whitebox(view.public_head, view.embed, up[:n_wb], cands.view(n_wb, config.seq_len, -1))
                add("up", "whitebox", ranked, ids[:n_wb])
                if defence.kind == "none":
                    if undefended_down is None:  # layers [0, L-M) whatever K is: searched once
                        cands = merge_candidates([r[:n_dwb].flatten(0, 1) for r in down_ranks.values()], frequent,
                                                 ncand, n_dwb * config.seq_len)
                        undefended_down = whitebox(view.down_prefix, view.embed, down[:n_dwb],
                                                   cands.view(n_dwb, config.seq_len, -1))
                    add("down", "down-whitebox", undefended_down, ids[:n_dwb])
            summary = ", ".join(f"{r['attack']} {r['top1']:.2f}" for r in rows
                                if r["head"] == k and r["defence"] == defence.name and r["attack"] != "freq")
            log(f"K={k} {defence.name}: agreement {qual['agreement']:.3f}, ppl {qual['ppl']:.2f}; top-1 {summary} "
                f"({time.perf_counter() - t0:.0f} s)")
            stages.update()
    stages.close()
    return {
        "config": {**asdict(config), "defences": [d.name for d in config.defences]},
        "model": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
        "corpus": corpus_summary(corpus),
        "rows": rows,
        "quality": quality_rows,
        "depth": depth_rows,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "threads": torch.get_num_threads(),
    }


def corpus_summary(corpus: AuditCorpus) -> dict:
    return {"train_tokens": corpus.train.numel(), "held_out_tokens": corpus.held_out.numel(),
            "train_docs": corpus.train_docs, "held_out_docs": corpus.held_out_docs,
            "seq_len": corpus.train.shape[1]}
