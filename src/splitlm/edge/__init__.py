"""The user's side: tokenizer, embedding, head and tail layers, LM head, decoding."""

from splitlm.edge.runtime import Edge, EdgeConfig, GenerationRequest, GenerationResult, GenerationStats

__all__ = ["Edge", "EdgeConfig", "GenerationRequest", "GenerationResult", "GenerationStats"]
