"""`splitlm train-adapter`: fit a LoRA adapter on the user's own text, on this machine, for the
modules the edge holds.

The full model (the one the edge shard was split from) is loaded with `transformers`, `peft`
adds LoRA to the edge's layers only (`layers_to_transform` = the head and tail layers), and a few
steps of AdamW on the text's next-token loss fit it (a small CPU job: the 135M default model takes
a second or two per step). The result is a `peft` adapter directory for the full model, which
`--edge-adapter` applies on the edge; the cloud's layers are frozen and untouched, so the cloud
shard serves the adapted edge unchanged.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from splitlm import SplitLMError
from splitlm.model.loading import file_sha256, resolve_model, safetensors_files
from splitlm.model.shards import Manifest

log = logging.getLogger(__name__)

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def edge_layers(manifest: Manifest) -> list[int]:
    """The layer indices the edge holds: [0, K) and [L-M, L)."""
    return list(range(manifest.head)) + list(range(manifest.num_layers - manifest.tail, manifest.num_layers))


def text_windows(ids: list[int], seq_len: int) -> list[list[int]]:
    """Consecutive windows of seq_len + 1 tokens (inputs and their next tokens), the last one shorter."""
    step = seq_len
    windows = [ids[a : a + seq_len + 1] for a in range(0, max(1, len(ids) - 1), step)]
    return [w for w in windows if len(w) >= 2]


@dataclass(frozen=True)
class AdapterTraining:
    """How the adapter is fitted: LoRA of rank `rank` (scaled by `alpha`) on `targets`, `steps` steps of
    AdamW at `lr` on windows of `seq_len` tokens; `progress`: a progress bar (default: on a terminal)."""

    rank: int = 8
    alpha: float = 16.0
    steps: int = 40
    lr: float = 1e-3
    seq_len: int = 128
    targets: tuple[str, ...] = DEFAULT_TARGETS
    seed: int = 0
    progress: bool | None = None


def train_adapter(
    model: str, edge_dir: str | Path, text: str, out: str | Path, training: AdapterTraining | None = None
) -> dict:
    """Fit LoRA on `text` for the edge's layers of `model` (`training`: how); save the adapter to `out`.
    Returns a report (tokens, steps, loss before and after, seconds)."""
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = training or AdapterTraining()
    rank, alpha, steps, lr, seq_len, targets, seed, progress = (
        t.rank,
        t.alpha,
        t.steps,
        t.lr,
        t.seq_len,
        t.targets,
        t.seed,
        t.progress,
    )
    if rank < 1 or steps < 1 or seq_len < 2 or not lr > 0:
        raise SplitLMError("--rank and --steps must be at least 1, --seq-len at least 2, --lr positive")
    manifest = Manifest.read(Path(edge_dir), "edge")
    if manifest.topology != "tail-local":
        raise SplitLMError("train-adapter supports the tail-local topology")
    model_dir = resolve_model(model)
    if file_sha256(safetensors_files(model_dir))[:32] != manifest.model_hash:
        raise SplitLMError(f"{edge_dir} was split from another model than {model}")
    tokenizer = AutoTokenizer.from_pretrained(edge_dir)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    windows = text_windows(ids, seq_len)
    if not windows:
        raise SplitLMError("the training text has fewer than 2 tokens")
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(targets),
        layers_to_transform=edge_layers(manifest),
    )
    lora = get_peft_model(base, config)
    params = [p for p in lora.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)

    def loss_of(window: list[int]) -> torch.Tensor:
        x = torch.tensor([window])  # [1, T + 1]
        return torch.nn.functional.cross_entropy(lora(input_ids=x[:, :-1]).logits[0], x[0, 1:])  # next-token loss

    @torch.no_grad()
    def mean_loss() -> float:
        lora.eval()
        losses = [loss_of(w).item() for w in windows[:8]]
        lora.train()
        return sum(losses) / len(losses)

    start = time.perf_counter()
    before = mean_loss()
    lora.train()
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(range(steps), desc="train-adapter", unit="step", file=sys.stderr, disable=not show)
    for step in bar:
        loss = loss_of(windows[step % len(windows)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    after = mean_loss()
    out = Path(out)
    lora.save_pretrained(out)
    report = {
        "adapter": str(out),
        "tokens": len(ids),
        "windows": len(windows),
        "steps": steps,
        "rank": rank,
        "layers": edge_layers(manifest),
        "targets": list(targets),
        "trainable_params": sum(p.numel() for p in params),
        "loss_before": round(before, 4),
        "loss_after": round(after, 4),
        "perplexity_after": round(math.exp(min(after, 50)), 2),
        "seconds": round(time.perf_counter() - start, 1),
    }
    log.info("train-adapter: %s", report)
    return report
