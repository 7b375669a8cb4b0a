"""`splitlm harden`: a private head whose activations move away from the public model's.

The edge's head layers [0, K) are fine-tuned (the edge keeps the new weights private; the cloud
keeps running the public middle layers) with

    loss = KL(p_public || p_private) + weight * mean(relu(margin - |z_private - z_public| / |z_public|))

p: the full model's next-token distribution; h: layer K's output per token, z = (h - mean) / std
per dimension (statistics of the public activations, so that the few huge "massive activation"
dimensions, which are the same for every token, do not count). The first term keeps what the
model says; the second pushes every uplink activation at least `margin` away from what the
public weights produce for the same text, in the directions that tell tokens apart, which is
what white-box attacks match against.

With `tail` the edge's tail layers [L-M, L) are fine-tuned too (a private tail), and a third term,
`output_weight * mean(p_cloud(y))`, pushes down the probability that the *public* tail, run by the
cloud on the downlink, gives the reference model's next token y: the private head moves the
downlink where the public tail reads it wrong, and the private tail learns to read it right.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitlm.audit.views import SplitView
from splitlm.model.llama import LayerStack
from splitlm.progress import track


@dataclass
class HardenConfig:
    steps: int = 20
    batch: int = 4
    lr: float = 1e-3
    margin: float = 0.5
    weight: float = 1.0
    seed: int = 0
    tail: bool = False  # also train a private tail (against the cloud running the public one)
    output_weight: float = 1.0


@dataclass
class HardenResult:
    head: LayerStack
    tail: LayerStack | None
    steps: int
    seconds: float
    final_kl: float
    final_distance: float  # mean standardised relative distance to the public activation
    final_cloud_p: float = 0.0  # with a private tail: the public tail's mean probability of the reference token


def relative_distance(h: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (h - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)  # [B, T]


def standardised_distance(h: torch.Tensor, ref: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return ((h - ref) / std).norm(dim=-1) / ((ref - mean) / std).norm(dim=-1).clamp_min(1e-6)  # [B, T]


def harden_head(view: SplitView, train: torch.Tensor, config: HardenConfig) -> HardenResult:
    """Train a private copy of view's public head (and with `config.tail` of its tail) on sequences
    `train` [N, S]."""
    t0 = time.perf_counter()
    with torch.no_grad():
        sample = view.public_head(view.embed(train[:64]), torch.arange(train.shape[1])).flatten(0, 1)  # [n, D]
        mean, std = sample.mean(0), sample.std(0).clamp_min(1e-6)
    private = copy.deepcopy(view.public_head)
    tail = copy.deepcopy(view.public_tail) if config.tail else None
    trained = list(private.parameters()) + (list(tail.parameters()) if tail is not None else [])
    for p in view.model.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.Adam(trained, lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed)
    positions = torch.arange(train.shape[1])
    kl = dist = cloud_p = torch.tensor(0.0)
    for _ in track(range(config.steps), "harden", unit="step"):
        ids = train[torch.randint(0, train.shape[0], (config.batch,), generator=gen)]  # [b, S]
        x = view.embed(ids)
        with torch.no_grad():
            h_pub = view.public_head(x, positions)
            logp_pub = F.log_softmax(view.logits(view.down(h_pub), view.public_tail).float(), dim=-1)  # [b, S, V]
        h = private(x, positions)
        down = view.down(h)
        logp = F.log_softmax(view.logits(down, tail or view.public_tail).float(), dim=-1)
        kl = F.kl_div(logp, logp_pub, log_target=True, reduction="none").sum(-1).mean()
        dist = standardised_distance(h, h_pub, mean, std)
        loss = kl + config.weight * F.relu(config.margin - dist).mean()
        if tail is not None:
            p_cloud = F.softmax(view.logits(down, view.public_tail).float(), dim=-1)
            cloud_p = p_cloud.gather(-1, logp_pub.argmax(-1, keepdim=True)).mean()
            loss = loss + config.output_weight * cloud_p
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in trained:
        p.requires_grad_(False)
    private.eval()
    if tail is not None:
        tail.eval()
    return HardenResult(
        private,
        tail,
        config.steps,
        time.perf_counter() - t0,
        float(kl.detach()),
        float(dist.detach().mean()),
        float(cloud_p.detach()),
    )


def head_state(head: LayerStack) -> dict[str, torch.Tensor]:
    """The private head's (or tail's) weights under their global names (`model.layers.{i}.*`)."""
    return {
        f"model.layers.{head.start + int(k.split('.')[1])}.{k.split('.', 2)[2]}": v.detach().contiguous()
        for k, v in head.state_dict().items()
        if k.startswith("layers.")
    }


def harden_split(
    spec: str,
    head: int,
    tail: int,
    out,
    docs: list[str],
    config: HardenConfig,
    seq_len: int = 32,
    max_train_tokens: int = 32768,
) -> dict:
    """Split `spec` like `splitlm split` and replace the edge's head layers by a hardened private head.
    Returns the hardening's measured cost (agreement, perplexity, how far the uplink moved)."""
    from pathlib import Path

    from splitlm.audit.data import build_corpus, load_for_audit
    from splitlm.audit.views import batched, quality
    from splitlm.model.shards import check_split, split_model
    from splitlm.model.weights import read_shard_state, write_state

    model, encode, _ = load_for_audit(spec)
    check_split(model.cfg.num_layers, head, tail)
    corpus = build_corpus(docs, encode, model.cfg.vocab_size, seq_len, max_train_tokens, seed=config.seed)
    view = SplitView(model, head, tail)
    ref = batched(lambda x: view.logits(view.down(view.up(x))).argmax(-1), corpus.held_out)
    result = harden_head(view, corpus.train, config)
    hard = SplitView(model, head, tail, private_head=result.head, private_tail=result.tail)
    up = batched(hard.up, corpus.held_out)
    before = quality(view, batched(view.down, batched(view.up, corpus.held_out)), corpus.held_out, ref)
    after = quality(hard, batched(hard.down, up), corpus.held_out, ref)
    out = split_model(spec, head, tail, out, "fp32")
    edge_dir = Path(out) / "edge"
    state = read_shard_state(edge_dir)
    state.update(head_state(result.head))
    if result.tail is not None:
        state.update(head_state(result.tail))
    write_state(edge_dir, state)
    return {
        "head": head,
        "tail": tail,
        "steps": result.steps,
        "seconds": round(result.seconds, 1),
        "agreement": after["agreement"],
        "ppl": after["ppl"],
        "ppl_public": before["ppl"],
        "uplink_distance": float(relative_distance(up, batched(view.up, corpus.held_out)).mean()),
        "private_tail": result.tail is not None,
        "held_out_tokens": corpus.held_out.numel(),
    }
