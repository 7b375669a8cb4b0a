"""Load a model and its tokenizer for the audit."""

from __future__ import annotations

from splitlm import SplitLMError


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
