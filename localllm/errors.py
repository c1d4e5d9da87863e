"""User-facing errors: each carries one sentence the CLI prints and the server maps to OpenAI's shape."""

from __future__ import annotations


class LocalLLMError(Exception):
    """Base for errors caused by user input or the environment (never a bug in localllm)."""

    code = "invalid_request_error"


class ModelNotFoundError(LocalLLMError):
    code = "model_not_found"


class ModelFormatError(LocalLLMError):
    """A model file that is truncated, corrupt, or uses something we do not support."""


class DownloadError(LocalLLMError):
    pass


class ChecksumError(DownloadError):
    pass


class ContextLengthExceededError(LocalLLMError):
    code = "context_length_exceeded"


class KVCacheFullError(LocalLLMError):
    """Not enough free KV cache blocks for work outside the scheduler (scoring, embeddings) right now."""

    code = "kv_cache_full"


class ConfigError(LocalLLMError):
    pass


class InvalidRequestError(LocalLLMError):
    """A request the model cannot take as given (e.g. a token id outside its vocabulary)."""
