"""Model management commands: `pull`, `list`, `rm`.

The table that `list` prints has fixed columns (name, file, size, downloaded) plus whatever
`describe(path)` returns for each downloaded file, so richer GGUF facts (architecture, parameter
count, quantization) only need a better `describe`, not changes to the table code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from localllm.cli.app import app
from localllm.download import fetch_lock, human_size, part_path, remove_leftovers, report_leftovers
from localllm.errors import LocalLLMError, ModelNotFoundError
from localllm.printable import printable
from localllm.registry import (
    Registry,
    cached_file,
    default_home,
    default_user_registry,
    index_dir,
    load_registry,
    model_path,
    models_dir,
    resolve_model,
    unknown_model_message,
)

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

Describe = Callable[[Path], Mapping[str, str]]
# A llama.cpp quant tag in a file name, e.g. "Q4_1", "q4_k_m", "IQ2_XS", "F16".
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.I)


@dataclass(frozen=True)
class ModelRow:
    name: str
    file: str
    size: int | None  # bytes on disk when downloaded, else the size the registry expects
    status: str  # "yes", "no", "partial", "local" (a user's own file) or "missing"
    path: Path | None  # the file when it is present
    default: bool = False


def describe(path: Path) -> dict[str, str]:
    """Extra `list` columns for one downloaded file: architecture, parameters, quant type, context.

    Reads the GGUF's metadata and tensor table through the cached index (a full parse happens only
    the first time a file is seen). A file that cannot be read still gets the quant tag in its name.
    """
    from localllm.loading.file import GGUFFile
    from localllm.model_info import format_params, summarize

    match = _QUANT.search(path.name)
    quant = match.group(1).upper() if match else ""
    try:
        info = summarize(GGUFFile.open(path, index_dir(default_home())))
    except Exception:  # a damaged or foreign file must not break the listing
        return {"arch": "", "params": "", "quant": quant, "context": ""}
    return {
        "arch": info.architecture,
        "params": format_params(info.parameters),
        "quant": info.quant or quant,
        "context": f"{info.context_length:,}" if info.context_length else "",
    }


@app.command()
def pull(
    name: Annotated[
        str | None,
        typer.Argument(metavar="NAME|URL", help="Registry name or http(s) URL; default model if omitted."),
    ] = None,
    verify: Annotated[
        bool, typer.Option("--verify", help="Re-check the sha256 of a file already downloaded.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """Download a model into the cache (only once) and print its path.

    Example: localllm pull smollm2-135m-instruct
    """
    home, registry = default_home(), load_registry(default_user_registry())
    report_leftovers(remove_leftovers(models_dir(home)), progress=not quiet)  # even if NAME is here
    resolved = resolve_model(
        name or registry.default_model, home, registry, progress=not quiet, verify=verify
    )
    print(resolved.path)


@app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List the registry's models and the .gguf files in the cache.

    On a terminal a table as wide as the terminal; piped, tab-separated lines with a header (--json for
    JSON).

    Example: localllm list
    """
    import sys

    from localllm.cli.tables import print_records

    home, registry = default_home(), load_registry(default_user_registry())
    rows = model_rows(registry, home)
    if as_json or not sys.stdout.isatty():
        print_records(model_records(rows, describe), "json" if as_json else "tsv")
        return
    from rich.console import Console  # here, not at the top: every command pays for the CLI's imports

    Console().print(model_table(rows, describe))


@app.command()
def rm(name: Annotated[str, typer.Argument(help="Registry name, or a file name in the cache.")]) -> None:
    """Delete a downloaded model and what was derived from it (index, packed weights) from the cache.

    Example: localllm rm smollm2-135m-instruct
    """
    home, registry = default_home(), load_registry(default_user_registry())
    for path, size in remove_model(name, registry, home):
        print(f"removed {path} ({human_size(size)})")


# ---------------------------------------------------------------- logic behind the commands


def model_rows(registry: Registry, home: Path) -> list[ModelRow]:
    """One row per registry entry, then one per .gguf in the cache that no entry accounts for (one for
    all the files of a split model, under its first)."""
    from localllm.loading.splits import split_names

    rows = [_entry_row(registry, name, home) for name in registry.entries]
    known = {row.file for row in rows}
    cache = models_dir(home)
    extra = sorted(cache.glob("*.gguf")) if cache.is_dir() else []
    for path in extra:
        shards = split_names(path)
        if path.name in known or not path.is_file() or (shards[0] != path and shards[0].is_file()):
            continue
        present = [p for p in shards if p.is_file()]
        status = "yes" if len(present) == len(shards) else "partial"
        rows.append(ModelRow(path.name, path.name, sum(p.stat().st_size for p in present), status, path))
    return rows


def _entry_row(registry: Registry, name: str, home: Path) -> ModelRow:
    entry = registry.entries[name]
    path = model_path(entry, home)
    default = name == registry.default_model
    if path.is_file() and (entry.is_local or entry.size in (None, path.stat().st_size)):
        status = "local" if entry.is_local else "yes"
        return ModelRow(name, path.name, path.stat().st_size, status, path, default)
    status = "missing" if entry.is_local else "partial" if part_path(path).exists() else "no"
    return ModelRow(name, entry.file_name, entry.size, status, None, default)


def model_records(rows: list[ModelRow], describe: Describe | None = None) -> list[dict[str, object]]:
    """The rows as plain records (for TSV and JSON): sizes in bytes, the default model flagged."""
    records = []
    for row in rows:
        extra = describe(row.path) if describe and row.path else {}
        record = {"name": row.name, "file": row.file, "size": human_size(row.size), "bytes": row.size}
        records.append(record | {"downloaded": row.status, "default": row.default, **extra})
    return records


def model_table(rows: list[ModelRow], describe: Describe | None = None) -> Table:
    """A Rich table of `rows`; columns after DOWNLOADED come from `describe` on present files."""
    from rich.table import Table

    extra = [describe(row.path) if describe and row.path else {} for row in rows]
    extra_columns = list(dict.fromkeys(key for info in extra for key in info))
    table = Table(
        box=None, header_style="bold", caption="* default model" if any(r.default for r in rows) else None
    )
    for column in ("NAME", "FILE", "SIZE", "DOWNLOADED", *(c.upper() for c in extra_columns)):
        table.add_column(column, overflow="fold", justify="right" if column == "SIZE" else "left")
    for row, info in zip(rows, extra, strict=True):
        name = f"{row.name} *" if row.default else row.name
        cells = [_text(info.get(c, "")) for c in extra_columns]
        table.add_row(_text(name), _text(row.file), human_size(row.size), row.status, *cells)
    return table


def _text(value: str) -> Text:
    """A cell from a file's name or metadata: escapes shown, brackets not read as Rich markup."""
    from rich.text import Text

    return Text(printable(value))


def remove_model(name: str, registry: Registry, home: Path) -> list[tuple[Path, int]]:
    """Delete a model's cached file, any leftover .part and the caches derived from the file; also
    what killed downloads left behind; all files of a split model. Returns (path, bytes) for each file
    or folder removed."""
    path = _cached_path(name, registry, home)
    if not path.parent.is_dir():
        raise LocalLLMError(f"model {name} is not downloaded, so there is nothing to remove.")
    try:
        return _remove(name, path, home)
    except OSError as e:  # a read-only or foreign-owned cache: say which file, no traceback
        where = f": {e.filename}" if e.filename else ""
        raise LocalLLMError(f"cannot remove model {name}{where}: {e.strerror or e}") from None


def _remove(name: str, path: Path, home: Path) -> list[tuple[Path, int]]:
    from localllm.loading.splits import split_names

    leftovers = remove_leftovers(path.parent)
    with fetch_lock(path, wait=False) as idle:
        if idle is False:  # its .part is being written: deleting it would only break that download
            raise LocalLLMError(f"another localllm process is downloading {path.name}; remove it afterwards.")
        candidates = [*split_names(path), part_path(path), *derived_caches(path, home)]
        removed = [(p, p.stat().st_size) for p in candidates if p.is_file()]
        if not removed:
            raise LocalLLMError(f"model {name} is not downloaded, so there is nothing to remove.")
        for p, _ in removed:
            p.unlink()
    return removed + leftovers


def _cached_path(name: str, registry: Registry, home: Path) -> Path:
    """Where the model `name` (a registry name, or a file name in the cache) is or would be cached."""
    entry = registry.find(name)
    if entry is not None and entry.is_local:
        raise LocalLLMError(
            f"model {entry.name} is your own file {model_path(entry, home)}; localllm leaves it alone."
        )
    if entry is not None:
        return model_path(entry, home)
    path = cached_file(name, models_dir(home))
    if path is None:
        raise ModelNotFoundError(unknown_model_message(name, registry))
    return path


def derived_caches(path: Path, home: Path) -> list[Path]:
    """The cache files made from the model file `path`: its parsed GGUF index and its packed weights
    (for a split model, each file's index and the weights packed from all of them)."""
    from localllm.backends.weight_cache import cache_files  # imports numba: only when removing
    from localllm.loading.cache import index_cache_path
    from localllm.loading.splits import split_names

    shards = split_names(path)
    found = cache_files(shards[0], index_dir(home))
    # the index cache's name depends on the file's size and mtime
    found += [index_cache_path(p, index_dir(home)) for p in shards if p.is_file()]
    return found
