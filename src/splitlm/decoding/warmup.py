"""A warm-up corpus for retrieval drafting: the model's own answers to generic requests.

Small models answer in a recognisable house style (how a code block opens, how a list is laid
out, which phrases start an answer). `splitlm warmup` runs the full model locally over a fixed
list of generic instructions — programming tasks in several languages, structured-data requests,
short creative pieces, everyday questions — and over snippets of Python's standard library to
continue, and stores the greedy answers. The `auto` drafter's n-gram model learns from them next
to `pydoc_data.topics`. Nothing here comes from a user; a user's own text never enters the file.

File format: gzip'd JSON lines, one {"prompt": ..., "text": ...} object per answer. With `states`, a
second file beside it (`captured_path`: `warmup-states.pt` next to `warmup.jsonl.gz`) keeps, per prompt, the
answer's token ids and the final-normed hidden state that chose each of them, taken from the generation itself
(a hook on the model's final norm), so that `splitlm train-head` needs no second pass of the full model: on a
1.5 B model on 2 cores that pass costs as much as generating.
"""

from __future__ import annotations

import gzip
import json
import pickle
import random
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from splitlm import SplitLMError
from splitlm.decoding.warmup_requests import instructions
from splitlm.progress import bar

WARMUP_FILE = "warmup.jsonl.gz"
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data" / "warmup"


def stdlib_snippets(rng: random.Random, count: int = 160, lines: int = 15, pattern: str = "*.py") -> list[str]:
    """Up to `count` runs of `lines` lines from the standard library's own modules (top-level ones, or
    those `pattern` selects), to be continued."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f
        for f in root.glob(pattern)
        if not {"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(f.relative_to(root).parts)
    )
    out = []
    for f in rng.sample(files, min(count, len(files))):
        text = f.read_text(errors="ignore").splitlines()
        if len(text) < 40:
            continue
        start = rng.randrange(0, len(text) - 30)
        out.append("\n".join(text[start : start + lines]) + "\n")
    return out


def warmup_prompts(tokenizer, answer_tokens: int = 128, continue_tokens: int = 96) -> list[tuple[str, int]]:
    """(prompt text, new tokens) pairs: chat-formatted instructions and stdlib snippets, shuffled."""
    chat = getattr(tokenizer, "chat_template", None) is not None
    prompts = []
    for q in instructions():
        text = (
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            if chat
            else q + "\n"
        )
        prompts.append((text, answer_tokens))
    rng = random.Random(1)
    prompts += [(s, continue_tokens) for s in stdlib_snippets(rng)]
    prompts += [(s, continue_tokens) for s in stdlib_snippets(random.Random(2), 200, pattern="*/*.py")]
    prompts += [(s, continue_tokens) for s in stdlib_snippets(random.Random(3), 200, pattern="*/*/*.py")]
    prompts += [(s, continue_tokens) for s in stdlib_snippets(random.Random(4), 200, pattern="*/*.py")]
    rng.shuffle(prompts)
    return prompts


def build_warmup(
    model_spec: str,
    out: str | Path,
    limit: int | None = None,
    batch: int = 16,
    progress: Callable[[str], None] = lambda _: None,
    states: bool = False,
) -> dict:
    """Generate the warm-up answers with the full model (transformers, greedy) into `out`. If `out`
    exists, the prompts it already answers are kept and only the others are generated (an
    interrupted run resumes; a file made with a shorter list grows). With `states`, the answers' final
    hidden states are kept too (`captured_path(out)`, read by `read_captured`)."""
    from transformers import AutoTokenizer

    from splitlm.model.loading import load_hf, resolve_model

    start = time.perf_counter()
    model_dir = resolve_model(model_spec)
    progress(f"loading {model_dir.name} (the full model, transformers)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:  # left padding is masked out: any token will do
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    model = load_hf(str(model_dir))
    prompts = warmup_prompts(tokenizer)[:limit]
    out = Path(out)
    kept = read_warmup_records(out) if out.exists() else []
    answered = {r["prompt"] for r in kept}
    prompts = [p for p in prompts if p[0] not in answered]
    # by length, so that a batch pads its prompts little (a 1.5 B model's prompt pass costs as much as its answer)
    prompts.sort(key=lambda p: len(tokenizer(p[0], add_special_tokens=False).input_ids))
    if kept:
        progress(f"{out}: {len(kept)} answers kept, {len(prompts)} prompts to go")
    else:
        progress(f"{len(prompts)} prompts to answer, {batch} at a time, into {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    recorder = NormOutputs(model) if states else None
    captured = read_captured(captured_path(out)) if states and out.exists() else {}
    captured = {r["prompt"]: captured[r["prompt"]] for r in kept if r["prompt"] in captured}
    tokens = 0
    with gzip.open(tmp, "wt", encoding="utf-8") as f, bar(len(prompts), "warmup", unit="prompt") as shown:
        for r in kept:
            f.write(json.dumps(r) + "\n")
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            enc = tokenizer([p for p, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            if recorder is not None:
                recorder.calls.clear()
            with torch.inference_mode():
                gen = model.generate(
                    **enc, max_new_tokens=max(n for _, n in chunk), do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
            for r, ((prompt, n), row) in enumerate(zip(chunk, gen[:, enc.input_ids.shape[1] :].tolist(), strict=True)):
                ended = row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
                ended = ended[:n]  # the answer, and its end token where one came within n
                answer = ended[:-1] if ended and ended[-1] == tokenizer.eos_token_id else ended
                tokens += len(answer)
                text = tokenizer.decode(answer, skip_special_tokens=True)
                f.write(json.dumps({"prompt": prompt, "text": text}) + "\n")
                if recorder is not None and ended:
                    captured[prompt] = CapturedAnswer(torch.tensor(ended), recorder.answer_states(r, len(ended)))
            shown.update(len(chunk))  # tqdm's ETA: the remaining prompts at the measured rate
            shown.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s")
    if recorder is not None:
        recorder.remove()
        save_captured(captured, captured_path(out))
    tmp.replace(out)
    return {
        "out": str(out),
        "prompts": len(prompts),
        "kept": len(kept),
        "tokens": tokens,
        "seconds": round(time.perf_counter() - start, 1),
    }


@dataclass(frozen=True)
class CapturedAnswer:
    """One answer as generated: its token ids [N] (an end token included) and, for each, the final-normed
    hidden state [N, D] (bf16) that chose it (the first from the prompt's last position)."""

    ids: torch.Tensor
    states: torch.Tensor


class NormOutputs:
    """Records every output of the model's final norm during `generate` (the prompt's pass [B, T, D], then
    one [B, 1, D] per new token); `answer_states` picks one row's states for its new tokens."""

    def __init__(self, model):
        norm = getattr(getattr(model, "model", None), "norm", None)
        if norm is None:
            raise SplitLMError(f"{type(model).__name__} has no final norm at model.norm: cannot keep its states")
        self.calls: list = []
        self.handle = norm.register_forward_hook(lambda _m, _a, out: self.calls.append(out.detach()))

    def answer_states(self, row: int, n: int) -> torch.Tensor:
        """The states that chose row `row`'s first `n` new tokens: [n, D] bf16."""
        first = self.calls[0][row, -1:]  # left padding: the prompt ends at the last column
        later = [c[row, -1:] for c in self.calls[1:n]]
        return torch.cat([first, *later]).to(torch.bfloat16)

    def remove(self) -> None:
        self.handle.remove()


def captured_path(warmup_path: str | Path) -> Path:
    """Where a warm-up file's captured states live: `NAME-states.pt` beside `NAME.jsonl.gz`."""
    path = Path(warmup_path)
    return path.with_name(path.name.removesuffix(".gz").removesuffix(".jsonl") + "-states.pt")


def save_captured(captured: dict[str, CapturedAnswer], path: Path) -> None:
    """Write the captured answers (by prompt) atomically."""
    tmp = path.with_name(path.name + ".part")
    torch.save({p: {"ids": a.ids, "states": a.states} for p, a in captured.items()}, tmp)
    tmp.replace(path)


def read_captured(path: str | Path) -> dict[str, CapturedAnswer]:
    """The captured answers by prompt ({} when the file is missing)."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        raw = torch.load(path, weights_only=True)
        out = {p: CapturedAnswer(a["ids"], a["states"]) for p, a in raw.items()}
    except (OSError, RuntimeError, KeyError, TypeError, AttributeError, pickle.UnpicklingError) as e:
        raise SplitLMError(f"{path}: not a file of captured warm-up states ({e})") from e
    for p, a in out.items():
        if a.ids.dim() != 1 or a.states.dim() != 2 or len(a.ids) != len(a.states):
            raise SplitLMError(f"{path}: the answer to {p[:40]!r} has {len(a.ids)} ids but {len(a.states)} states")
    return out


def read_warmup_records(path: str | Path) -> list[dict]:
    """The {"prompt", "text"} records of a warm-up file."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        for r in records:
            if not isinstance(r["prompt"], str) or not isinstance(r["text"], str):
                raise TypeError("prompt and text must be strings")
        return records
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise SplitLMError(f"{path}: not a warm-up file ({e})") from e


def read_warmup(path: str | Path) -> list[str]:
    """The answers of a warm-up file."""
    return [r["text"] for r in read_warmup_records(path)]


def find_warmup(edge_dir: str | Path, model_hash: str | None) -> Path | None:
    """The edge shard's own warm-up file, else the bundled one for this model, else None."""
    own = Path(edge_dir) / WARMUP_FILE
    if own.is_file():
        return own
    if model_hash:
        bundled = BUNDLED_DIR / f"{model_hash}.jsonl.gz"
        if bundled.is_file():
            return bundled
    return None
