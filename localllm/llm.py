"""The Python API: `LLM(model).generate(prompts, params)`, driving the same LLMEngine as the CLI."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from localllm.config import EngineConfig
from localllm.engine.output import RequestOutput
from localllm.sampling_params import SamplingParams


def resolve_model_path(model: str, home: Path | None = None, progress: bool = True) -> Path:
    """A .gguf path as is; a registry name or URL is pulled into the cache on first use."""
    return resolve_with_defaults(model, home, progress)[0]


def resolve_with_defaults(
    model: str | None,
    home: Path | None = None,
    progress: bool = True,
    quantize: str | None = None,
    group_size: int = 32,
) -> tuple[Path, dict[str, Any]]:
    """The model file (pulled on first use; None = the registry's default model) and its models.toml
    defaults ({} for a plain path or URL).  A Hugging Face directory, or a float GGUF with `quantize`
    ("int8", "int4"), is converted once into a cached GGUF (convert/on_load.py)."""
    from localllm.convert.on_load import is_hf_dir, prepare_model
    from localllm.registry import default_home, default_user_registry, load_registry, resolve_model

    if model is not None and (quantize or is_hf_dir(model)):
        return prepare_model(model, home or default_home(), quantize, group_size), {}

    registry = load_registry(default_user_registry())
    resolved = resolve_model(
        model or registry.default_model, home or default_home(), registry, progress=progress
    )
    return resolved.path, resolved.entry.defaults.as_dict() if resolved.entry is not None else {}


def default_numba_cache() -> None:
    """Numba's compiled-kernel cache goes in a writable place of ours unless the user chose one
    (NUMBA_CACHE_DIR), keyed by a hash of all kernel sources: importing the kernels sets it up
    (localllm/kernels/__init__.py), before Numba reads its configuration."""
    import localllm.kernels  # noqa: F401


# A SamplingParams is used as given; a mapping (or None) sets only some values, and the rest come from
# the model's defaults (models.toml, then the GGUF), then the built-ins, as in the CLI and the server.
Params = SamplingParams | Mapping[str, Any] | None


class LLM:
    """Load a model once and generate from it.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> out = llm.generate(["The capital of France is"], {"temperature": 0, "max_tokens": 8})
    >>> out[0].text

    `chat_template` (a name like "chatml", Jinja text or a file) overrides the model's template.
    `model` may be a Hugging Face directory; `quantize` ("int8" or "int4", blocks of `group_size` 32)
    quantizes it, or a float GGUF, on load (once: the result is cached under LOCALLLM_HOME/converted).
    Other keywords are EngineConfig fields, e.g. speculative decoding: `prompt_lookup=True`, or
    `draft_model="qwen2.5-coder-0.5b-instruct"` (a path or registry name), with `draft_max=8` and
    `draft_vocab=32768` (the draft's output layer scores the first ids and the special ones; 0: all).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        chat_template: str | None = None,
        quantize: str | None = None,
        group_size: int = 32,
        **engine_options: Any,
    ):
        from localllm.engine.engine import LLMEngine
        from localllm.registry import default_home
        from localllm.tokenizer.chat_template import chat_template_source

        home = default_home()
        default_numba_cache()
        path, defaults = resolve_with_defaults(str(model), home, quantize=quantize, group_size=group_size)
        source = chat_template_source(chat_template, defaults.get("chat_template"))  # a bad file: fail now
        if engine_options.get("draft_model"):  # speculative decoding's draft: a path or a registry name
            draft = resolve_model_path(str(engine_options["draft_model"]), home)
            engine_options["draft_model"] = str(draft)
        engine_options.setdefault("index_dir", home / "index")
        engine_options.setdefault("sampling_defaults", defaults)
        self.engine = LLMEngine(EngineConfig(model=str(path), **engine_options))
        self.tokenizer = self.engine.tokenizer
        self.name = path.name
        self._template_source = source

    def sampling_params(self, **given: Any) -> SamplingParams:
        """`given` completed by the model's defaults, then the built-ins: what `generate` uses for a dict."""
        return self.engine.sampling_params(given)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: Params | list[SamplingParams] = None,
        **constraint: Any,
    ) -> list[RequestOutput]:
        """Completions of `prompts`. `json_schema=` (a dict or JSON text), `grammar=` (GBNF or Lark) or
        `regex=` constrains every output to it."""
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.engine.generate(list(prompts), constrained(params, **constraint))

    def embed(
        self,
        inputs: str | list[str] | list[int] | list[list[int]],
        pooling: str | None = None,
        normalize: bool = True,
    ) -> Any:
        """An (n, dim) float32 array: each input's final hidden states pooled (`pooling`: mean, cls or
        last; default: what the model's metadata says, else last) and L2-normalised, all inputs in
        batched forward passes of the same engine."""
        from localllm.engine.embedding import embed_token_ids

        return embed_token_ids(self.engine, embedding_inputs(self.engine, inputs), pooling, normalize)

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: Params = None,
        reasoning_budget: int | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **constraint: Any,
    ) -> RequestOutput:
        """One assistant reply to `messages`, through the chat template (`json_schema=`, `grammar=` or
        `regex=` constrain it, as in `generate`). A thinking model's reasoning comes back apart, in
        `.reasoning` (at most `reasoning_budget` tokens of it); `chat_template_kwargs` reach the
        template (e.g. {"enable_thinking": False}); an assistant message's `reasoning_content` is given
        to it too, and the template decides whether to show it."""
        from localllm.reasoning import with_reasoning

        given = constrained(params, **constraint)
        resolved = given if isinstance(given, SamplingParams) else self.engine.sampling_params(given)
        resolved = with_reasoning(resolved, self.chat_template, self.tokenizer, reasoning_budget)
        ids = self.apply_chat_template(messages, **(chat_template_kwargs or {}))
        return self.engine.generate([ids], resolved)[0]

    @functools.cached_property
    def chat_template(self) -> Any:
        """The ChatTemplate `chat` renders with (resolve_chat_template's rule); raises if there is none."""
        from localllm.tokenizer.chat_template import require_chat_template

        return require_chat_template(self.engine.gguf.metadata, self.name, configured=self._template_source)

    def apply_chat_template(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        from localllm.tokenizer.chat_template import apply_chat_template

        return apply_chat_template(self.tokenizer, self.chat_template, messages, True, **template_kwargs)


def constrained(
    params: Params | list[SamplingParams],
    json_schema: Any = None,
    grammar: str | None = None,
    regex: str | None = None,
) -> Params | list[SamplingParams]:
    """`params` with the constraint the keywords ask for attached (unchanged when none is given)."""
    import dataclasses

    from localllm.structured.spec import structured_from

    spec = structured_from(json_schema, grammar, regex)
    if spec is None:
        return params
    if isinstance(params, list):
        return [dataclasses.replace(p, structured=spec) for p in params]
    if isinstance(params, SamplingParams):
        return dataclasses.replace(params, structured=spec)
    return {**(params or {}), "structured": spec}


def embedding_inputs(engine: Any, inputs: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Texts or token-id lists as token-id lists (a flat list of ints is one input)."""
    items: list[Any] = [inputs] if isinstance(inputs, str) else list(inputs)
    if items and all(isinstance(t, int) for t in items):
        items = [items]
    return [
        engine.tokenize_prompt(item) if isinstance(item, str) else engine.check_token_ids(item)
        for item in items
    ]
