"""splitlm: privacy-aware split inference for LLMs over wide-area networks."""

__version__ = "0.1.0"


class SplitLMError(Exception):
    """An error with a message meant for the user (the CLI prints it without a traceback)."""
