"""Checkpoints and GGUFs are untrusted files: the cases an independent probe found (issue 35) fail fast
with one line, metadata arrays cost what they weigh, partial outputs never outlive their writer, and
the CLI prints file strings escaped and never a traceback. The mutation fuzzer for checkpoint folders
is tests/convert/test_checkpoint_fuzz.py."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from tiny_arch import write_arch_model
from tiny_model import write_tiny_model

from localllm.convert.convert_hf import convert_hf, read_checkpoint
from localllm.convert.export_hf import export_hf
from localllm.convert.spm_proto import SpmModel, read_spm, write_spm
from localllm.errors import LocalLLMError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
UNSAFE = ("\x1b", "\x07", "\x9b", "\u202e")


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("hf")
    return export_hf(write_arch_model(work / "q.gguf", "qwen2", "F32", n_layers=1), work / "qwen2")


def _copy(hf: Path, to: Path) -> Path:
    to.mkdir()
    for f in hf.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def _edit_json(path: Path, edit) -> None:  # noqa: ANN001
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _refused_fast(folder: Path, match: str, seconds: float = 2.0) -> None:
    start = time.perf_counter()
    with pytest.raises(LocalLLMError, match=match) as err:
        read_checkpoint(folder, "Q8_0")
    assert time.perf_counter() - start < seconds and "\n" not in str(err.value)


# ---------------------------------------------------------------- the probe's cases


@pytest.mark.parametrize("value", [3e9, 3_000_000_000, -5, "4096", True])
def test_vocab_size_out_of_range_fails_fast(hf: Path, tmp_path: Path, value: object) -> None:
    """3e9 made a list of 3e9 padding tokens: memory past 4.4 GB, then a MemoryError."""
    folder = _copy(hf, tmp_path / "c")
    _edit_json(folder / "config.json", lambda c: c.update(vocab_size=value))
    _refused_fast(folder, "vocab_size is .*; an integer from 1 to 4,194,304 expected")


def test_vocab_size_beyond_the_embedding_fails_fast(hf: Path, tmp_path: Path) -> None:
    folder = _copy(hf, tmp_path / "c")
    _edit_json(folder / "config.json", lambda c: c.update(vocab_size=4_000_000))
    _refused_fast(folder, "vocab_size 4,000,000 is more than the embedding's 269 rows")


@pytest.mark.parametrize("token_id", [4_000_000_000, 269, -1, "7", None])
def test_added_token_id_out_of_range_fails_fast(hf: Path, tmp_path: Path, token_id: object) -> None:
    folder = _copy(hf, tmp_path / "c")
    added = {"id": token_id, "content": "<x>", "special": True}
    _edit_json(folder / "tokenizer.json", lambda t: t["added_tokens"].append(added))
    _refused_fast(folder, r"token '<x>' has id .*; ids go from 0 to 268 \(the embedding's rows\)")


def test_a_1_mb_tokenizer_model_fails_fast(hf: Path, tmp_path: Path) -> None:
    """A field key followed by 1 MB of varint continuation bytes took 68 s (each byte widened a
    Python int by 7 bits: quadratic); a varint is now at most 10 bytes."""
    folder = _copy(hf, tmp_path / "c")
    (folder / "tokenizer.model").write_bytes(b"\x0a" + b"\xff" * (1 << 20))
    _refused_fast(folder, "tokenizer.model is damaged: a number at byte 1 runs past 64 bits", 0.5)


def test_tokenizer_model_parsing_is_linear() -> None:
    """A valid 0.4 MB and 1.6 MB tokenizer.model parse in time proportional to their size."""
    times = []
    for n in (20_000, 80_000):
        pieces = [f"piece{i}" for i in range(n)]
        blob = write_spm(SpmModel(pieces, [0.0] * n, [1] * n))
        start = time.perf_counter()
        assert read_spm(blob).pieces == pieces
        times.append(time.perf_counter() - start)
    assert len(blob) > 1 << 20 and times[1] < 10 * times[0] + 0.5, times


def test_spm_piece_types_and_text_are_checked() -> None:
    with pytest.raises(LocalLLMError, match="piece 1 has type 9"):
        read_spm(write_spm(SpmModel(["a", "b"], [0.0, 0.0], [1, 9])))
    blob = write_spm(SpmModel(["a\xff"], [0.0], [1])).replace("a\xff".encode(), b"a\xff\xfe")
    with pytest.raises(LocalLLMError, match="piece 0 is not UTF-8"):
        read_spm(blob)


@pytest.mark.parametrize(
    ("index", "match"),
    [
        ({"weight_map": {"w": "../qwen2/model.safetensors"}}, "weight_map must map tensor names to shard"),
        ({"weight_map": {"w": "/etc/passwd"}}, "weight_map must map tensor names to shard"),
        ({"weight_map": {"w": "a\x00b"}}, "names shards that are missing: 'a\\\\x00b'"),
        ({"weight_map": {"w": "a" * 5000}}, "names shards that are missing: 'aaa"),
        ([1, 2], "weight_map must map tensor names to shard"),
    ],
)
def test_shard_names_stay_in_the_folder(hf: Path, tmp_path: Path, index: object, match: str) -> None:
    folder = _copy(hf, tmp_path / "c")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused_fast(folder, match)


def test_lone_surrogates_and_nan_are_refused(hf: Path, tmp_path: Path) -> None:
    folder = _copy(hf, tmp_path / "c")
    _edit_json(folder / "tokenizer_config.json", lambda c: c.update(chat_template="\ud800"))
    _refused_fast(folder, r"holds a lone surrogate")
    _edit_json(folder / "tokenizer_config.json", lambda c: c.update(chat_template="ok \ud83d\ude00"))
    read_checkpoint(folder, "Q8_0")  # a pair is one character: fine
    _edit_json(folder / "config.json", lambda c: c.update(rope_theta=float("nan")))
    _refused_fast(folder, "NaN is not a JSON number")


# ---------------------------------------------------------------- metadata arrays


def _bool_array_gguf(path: Path, n: int) -> Path:
    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + text("general.architecture") + struct.pack("<I", 8)
    head += text("llama") + text("llama.flags") + struct.pack("<IIQ", 9, 7, n)
    path.write_bytes(head + (np.arange(n, dtype=np.int64) % 3 == 0).astype(np.uint8).tobytes())
    return path


def test_a_bool_array_costs_a_byte_an_element(tmp_path: Path) -> None:
    """A 10M-element bool array was a Python list: ~9 bytes an element (8-byte pointers to the two
    bools, plus the list's growth); now a numpy bool array, 1 byte an element."""
    import psutil

    from localllm.loading.file import GGUFFile

    n = 10_000_000
    path = _bool_array_gguf(tmp_path / "flags.gguf", n)
    rss = psutil.Process().memory_info().rss
    tracemalloc.start()
    try:
        gf = GGUFFile.open(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    grown = psutil.Process().memory_info().rss - rss
    flags = gf.metadata["llama.flags"]
    print(f"bool array: {peak / n:.2f} B/element allocated at peak, RSS grew {grown / n:.2f} B/element")
    assert flags.dtype == np.bool_ and len(flags) == n and flags[:4].tolist() == [True, False, False, True]
    assert peak < 2 * n and grown < 2 * n


def test_short_bool_arrays_stay_lists(tmp_path: Path) -> None:
    from localllm.loading.file import GGUFFile

    gf = GGUFFile.open(_bool_array_gguf(tmp_path / "flags.gguf", 6))
    assert gf.metadata["llama.flags"] == [True, False, False, True, False, False]


# ---------------------------------------------------------------- partial outputs and signals

WRITER = r"""
import sys, time
from pathlib import Path
kind, src, out = sys.argv[1:4]
def slow(*args):
    Path(out + ".started").touch()
    time.sleep(60)
if kind == "convert":
    import localllm.convert.convert_hf as m
    m.prepare = lambda *a: slow()
    m.convert_hf(src, out, "Q8_0")
else:
    from localllm.quant.quantize_gguf import quantize_file
    quantize_file(src, out, "Q8_0", progress=slow)
"""


def _default_signals() -> None:
    # A suite started under nohup or in the background (`cmd &`) passes SIGHUP/SIGINT on ignored, and
    # an ignored signal rightly stays ignored: give the writer the dispositions a terminal gives it.
    for sig in (signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def _start_writer(kind: str, src: Path, out: Path) -> subprocess.Popen:
    command = [sys.executable, "-c", WRITER, kind, str(src), str(out)]
    proc = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    started = Path(f"{out}.started")
    deadline = time.monotonic() + 60
    while not started.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the writer did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return proc


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_arch_model(tmp_path_factory.mktemp("f32") / "m.gguf", "qwen2", "F32", n_layers=2)


@pytest.mark.parametrize("kind", ["convert", "quantize"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_removes_the_partial_output(
    kind: str, sig: int, hf: Path, f32_gguf: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.gguf"
    proc = _start_writer(kind, hf if kind == "convert" else f32_gguf, out)
    assert list(tmp_path.glob(".o.gguf.*.part"))  # being written
    proc.send_signal(sig)
    status = proc.wait(30)
    assert status == 128 + sig if sig != signal.SIGINT else status != 0  # SIGINT: KeyboardInterrupt
    assert not list(tmp_path.glob(".o.gguf.*")) and not out.exists()


def test_after_a_sigkill_the_next_run_removes_the_leftover(hf: Path, tmp_path: Path, capfd) -> None:  # noqa: ANN001
    out = tmp_path / "o.gguf"
    proc = _start_writer("convert", hf, out)
    proc.kill()
    proc.wait(30)
    (left,) = tmp_path.glob(".o.gguf.*.part")  # SIGKILL cannot be caught
    other = _start_writer("convert", hf, tmp_path / "p.gguf")  # another file's writer, still alive
    try:
        busy = _start_writer("convert", hf, tmp_path / "o2.gguf")
        busy.kill()
        busy.wait(30)
        convert_hf(hf, out, "Q8_0")
        assert not left.exists() and out.is_file()
        assert f"removed {left.name}" in capfd.readouterr().err
        assert list(tmp_path.glob(".p.gguf.*.part")) and list(tmp_path.glob(".o2.gguf.*.part"))
    finally:
        other.kill()
        other.wait(30)


def test_a_live_writers_partial_output_is_left_alone(hf: Path, tmp_path: Path) -> None:
    from localllm.partial_file import remove_stale

    out = tmp_path / "o.gguf"
    proc = _start_writer("convert", hf, out)
    try:
        assert remove_stale(out) == [] and list(tmp_path.glob(".o.gguf.*.part"))
    finally:
        proc.kill()
        proc.wait(30)


# ---------------------------------------------------------------- the CLI: one line, escaped


def _malformed_folders(hf: Path, work: Path) -> dict[str, Path]:
    cases = {}
    edits = {
        "vocab": ("config.json", lambda c: c.update(vocab_size=3e9)),
        "arch": ("config.json", lambda c: c.update(architectures=["\x1b]0;pwned\x07\u202eEvil"])),
        "token": ("tokenizer.json", lambda t: t["added_tokens"].append({"id": 4e9, "content": "\x1b[2J"})),
    }
    for name, (file, edit) in edits.items():
        cases[name] = _copy(hf, work / name)
        _edit_json(cases[name] / file, edit)
    cases["spm"] = _copy(hf, work / "spm")
    (cases["spm"] / "tokenizer.model").write_bytes(b"\x0a" + b"\xff" * (1 << 20))
    cases["header"] = _copy(hf, work / "header")
    weights = cases["header"] / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 1 << 40) + weights.read_bytes()[8:])
    return cases


def test_cli_prints_one_escaped_line_and_no_traceback(hf: Path, tmp_path: Path) -> None:
    cases = {
        name: [str(p), "hi", "--quantize", "int8"] for name, p in _malformed_folders(hf, tmp_path).items()
    }
    hostile = {"general.architecture": "ev\x1b[2J\u202eil", "general.name": "\x1b]0;pwned\x07"}
    cases["gguf"] = [str(write_tiny_model(tmp_path / "e.gguf", extra_metadata=hostile)), "hi"]
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path / "home")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "localllm", "run", *args, "-n", "1"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in cases.items()
    }
    errors = {}
    for name, proc in procs.items():
        out, errors[name] = proc.communicate(timeout=120)
        lines = errors[name].splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (name, lines)
        assert "Traceback" not in errors[name] + out and not any(c in errors[name] for c in UNSAFE), name
    assert "architecture \\x1b]0;pwned\\x07\\u202eEvil is not one" in errors["arch"]
    assert "the 'ev\\x1b[2J\\u202eil' architecture" in errors["gguf"]


def test_rm_on_a_read_only_cache_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.cli.manage import remove_model
    from localllm.registry import load_registry

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    write_tiny_model(home / "models" / "t.gguf")

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(LocalLLMError, match=r"cannot remove model t.gguf: .*t.gguf: Permission denied"):
        remove_model("t.gguf", load_registry(), home)
