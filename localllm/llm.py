"""The Python API: `LLM(model).generate(prompts, params)`, driving the same LLMEngine as the CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from localllm.config import EngineConfig
from localllm.engine.output import RequestOutput
from localllm.sampling_params import SamplingParams


def resolve_model_path(model: str, home: Path | None = None, progress: bool = True) -> Path:
    """A .gguf path as is; a registry name or URL is pulled into the cache on first use."""
    from localllm.registry import default_home, default_user_registry, load_registry, resolve_model

    home = home or default_home()
    return resolve_model(model, home, load_registry(default_user_registry()), progress=progress).path


def default_numba_cache(home: Path) -> None:
    """Numba's compiled-kernel cache goes in a writable place of ours unless the user chose one.

    Numba only notices a change in a cached function's own file, not in the helpers it inlines from
    other files, so the directory is keyed by a hash of all kernel sources: an upgrade never runs
    stale machine code.
    """
    import hashlib
    from importlib.util import find_spec

    spec = find_spec("localllm.kernels")
    digest = hashlib.sha256()
    for source in sorted(Path(spec.origin).parent.glob("*.py")) if spec and spec.origin else []:
        digest.update(source.read_bytes())
    os.environ.setdefault("NUMBA_CACHE_DIR", str(home / "numba_cache" / digest.hexdigest()[:16]))


class LLM:
    """Load a model once and generate from it.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].text
    """

    def __init__(self, model: str | os.PathLike, **engine_options: Any):
        from localllm.engine.engine import LLMEngine
        from localllm.registry import default_home

        home = default_home()
        default_numba_cache(home)
        path = resolve_model_path(str(model), home)
        engine_options.setdefault("index_dir", home / "index")
        self.engine = LLMEngine(EngineConfig(model=str(path), **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.engine.generate(list(prompts), params)

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> RequestOutput:
        """One assistant reply to `messages`, through the model's chat template."""
        return self.engine.generate([self.apply_chat_template(messages)], params)[0]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        from localllm.errors import LocalLLMError
        from localllm.tokenizer.chat_template import ChatTemplate, apply_chat_template

        template = ChatTemplate.from_metadata(self.engine.gguf.metadata)
        if template is None:
            raise LocalLLMError("this model has no chat template; use a raw prompt instead")
        return apply_chat_template(self.tokenizer, template, messages)
