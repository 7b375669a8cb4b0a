"""The audit's corpus: documents split into public training text and held-out text by document,
tokenized and cut into fixed-length sequences."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from splitlm import SplitLMError


@dataclass
class AuditCorpus:
    train: torch.Tensor  # [N_train, S] token ids (public text the attacker may learn from)
    held_out: torch.Tensor  # [N_eval, S] token ids (the "private" text under attack)
    counts: torch.Tensor  # [V] token frequencies in the training text
    train_docs: int
    held_out_docs: int

    def frequent(self, n: int) -> torch.Tensor:
        return self.counts.topk(n).indices  # [n] most frequent training tokens first


def default_documents() -> list[str]:
    from splitlm.decoding.corpus import default_corpus_documents

    return default_corpus_documents()


def read_documents(paths: list[str | Path]) -> list[str]:
    """One document per file; a lone file is cut into documents at blank-line-separated blocks."""
    docs = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise SplitLMError(f"corpus file not found: {path}")
        try:
            docs.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise SplitLMError(f"corpus file {path} is not UTF-8 text") from None
    if len(docs) == 1:
        blocks = [b for b in docs[0].split("\n\n") if b.strip()]
        per_doc = max(1, len(blocks) // 20)
        docs = ["\n\n".join(blocks[i : i + per_doc]) for i in range(0, len(blocks), per_doc)]
    return [d for d in docs if d.strip()]


def split_documents(docs: list[str], held_out_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    if len(docs) < 2:
        raise SplitLMError("the audit corpus needs at least two documents (one to learn from, one held out)")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_held = min(len(docs) - 1, max(1, round(held_out_fraction * len(docs))))
    held = sorted(order[:n_held])
    train = sorted(order[n_held:])
    return [docs[i] for i in train], [docs[i] for i in held]


def to_sequences(docs_ids: list[list[int]], seq_len: int, max_tokens: int, seed: int) -> torch.Tensor:
    """Cut each document into seq_len chunks (never across documents); a seeded sample of them."""
    chunks = [ids[i : i + seq_len] for ids in docs_ids for i in range(0, len(ids) - seq_len + 1, seq_len)]
    random.Random(seed).shuffle(chunks)
    chunks = chunks[: max(1, max_tokens // seq_len)]
    if not chunks:
        raise SplitLMError(f"corpus too small: no document has {seq_len} tokens")
    return torch.tensor(chunks, dtype=torch.long)


def build_corpus(
    docs: list[str],
    encode: Callable[[str], list[int]],
    vocab_size: int,
    seq_len: int = 32,
    max_train_tokens: int = 32768,
    max_eval_tokens: int = 2048,
    held_out_fraction: float = 0.1,
    seed: int = 0,
) -> AuditCorpus:
    train_docs, held_docs = split_documents(docs, held_out_fraction, seed)
    train_ids = [encode(d) for d in train_docs]
    held_ids = [encode(d) for d in held_docs]
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in train_ids:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return AuditCorpus(
        train=to_sequences(train_ids, seq_len, max_train_tokens, seed),
        held_out=to_sequences(held_ids, seq_len, max_eval_tokens, seed + 1),
        counts=counts,
        train_docs=len(train_docs),
        held_out_docs=len(held_docs),
    )


def load_for_audit(spec: str):
    """(model, encode, model_dir) for a model spec; the tokenizer comes from the model directory."""
    from transformers import AutoTokenizer

    from splitlm.model.loading import load_model

    model, model_dir = load_model(spec)
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure means the audit cannot read text
        raise SplitLMError(f"{model_dir}: cannot load its tokenizer ({e})") from e
    return model, (lambda text: tok.encode(text, add_special_tokens=False)), model_dir
