"""Models split by llama.cpp's gguf-split, opened as one.

A split model (`NAME-00001-of-0000N.gguf` ... `NAME-0000N-of-0000N.gguf`: `split.no`, `split.count`
and `split.tensors.count` in each, all other metadata in the first) opens from any of its files:
each shard is parsed, cached and validated as a file of its own, then the set is checked (every shard
present, numbered as named, the tensor count the first promises, no tensor twice) and its tensors
merged, each remembering its shard.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from localllm.errors import ModelFormatError
from localllm.loading.cache import load_index
from localllm.loading.index import GGUFIndex, TensorInfo
from localllm.loading.parser import check_header

# llama.cpp's split file names (llama_split_path: "%s-%05d-of-%05d.gguf", shards numbered from 1)
SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf", re.I)
MAX_SHARDS = 0xFFFF  # split.count is a u16


def split_paths(path: Path, metadata: dict[str, Any]) -> list[Path]:
    """All files of the model `path` belongs to: [path] unless its metadata says it is a shard of a
    split model, whose files are then named as llama.cpp's gguf-split names them."""
    count = metadata.get("split.count", 0)
    if not _is_count(count) or count > MAX_SHARDS:
        raise ModelFormatError(f"{path.name}: 'split.count' is {count!r}; expected 0 to {MAX_SHARDS:,}")
    if count <= 1:
        return [path]
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None or int(match["count"]) != count:
        raise ModelFormatError(
            f"{path.name} is one of {count} files of a split model, but its name does not end in "
            f"-NNNNN-of-{count:05d}.gguf, so the other files cannot be found (keep gguf-split's names)"
        )
    return _shard_paths(path, match)


def split_names(path: str | os.PathLike) -> list[Path]:
    """The files of the split model `path` names by its file name alone (for `rm` and `list`);
    [path] when the name is not a shard's."""
    path = Path(path)
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None or not 1 < int(match["count"]) <= MAX_SHARDS:
        return [path]
    return _shard_paths(path, match)


def _shard_paths(path: Path, match: re.Match[str]) -> list[Path]:
    prefix, count = match["prefix"], match["count"]
    return [path.with_name(f"{prefix}-{i:05d}-of-{count}.gguf") for i in range(1, int(count) + 1)]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def open_shard(path: Path, paths: list[Path], index_dir: Path | None) -> GGUFIndex:
    if not path.is_file():
        raise ModelFormatError(
            f"{path.name} is missing: the split model {paths[0].name} needs all {len(paths)} of its files"
        )
    check_header(path)
    return load_index(path, index_dir)


def check_split(paths: list[Path], indexes: list[GGUFIndex]) -> None:
    """Every shard is numbered as its name says, and together they hold the tensors the first promises."""
    for i, (path, index) in enumerate(zip(paths, indexes, strict=True)):
        no, count = index.metadata.get("split.no"), index.metadata.get("split.count")
        if no != i or count != len(paths):
            said = f"shard {no + 1} of {count}" if _is_count(no) and _is_count(count) else "no shard number"
            raise ModelFormatError(
                f"{path.name} holds {said} (split.no / split.count), not shard {i + 1} of {len(paths)} "
                "as its name says: the files are from different splits"
            )
    promised = indexes[0].metadata.get("split.tensors.count")
    held = sum(len(index.tensors) for index in indexes)
    if promised is not None and promised != held:
        raise ModelFormatError(
            f"{paths[0].name}: the split model promises {promised!r} tensors (split.tensors.count) but "
            f"its {len(paths)} files hold {held}"
        )
    seen: dict[str, int] = {}
    for i, index in enumerate(indexes):
        for name in index.tensors:
            if name in seen:
                where = f"{paths[seen[name]].name} and {paths[i].name}"
                raise ModelFormatError(f"tensor '{name}' is in both {where}")
            seen[name] = i


def merged_tensors(indexes: list[GGUFIndex]) -> dict[str, TensorInfo]:
    if len(indexes) == 1:
        return indexes[0].tensors
    return {
        name: replace(info, shard=i)
        for i, index in enumerate(indexes)
        for name, info in index.tensors.items()
    }
