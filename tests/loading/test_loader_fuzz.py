"""Mutation fuzzing of the GGUF loader: every damaged file ends in one clean line or a correct run.

A seeded, structure-aware mutator (field layout from the `gguf` package's reader of the intact file)
rewrites header fields, counts, string lengths, value types, hyperparameters, tensor dimensions, types
and offsets, re-factors shapes with the same byte size, flips bytes, inserts, deletes and truncates.
Each mutated file is opened and, when it validates, loaded and run for one token. A case fails on any
exception other than a one-line LocalLLMError (ModelFormatError for bad files), a case over 5 s, the
parse allocating more than 2x the file size (+64 KiB of fixed cost), or a run allocating more than
twice what the intact model needs.

The cases run in a child process (this file run as a script), so a crash (SIGSEGV, abort from heap
corruption) fails the test with the case that caused it instead of killing pytest. Case k of seed s is
reproducible alone:
`python tests/loading/test_loader_fuzz.py --base FILE --seed s --first k --cases 1 --verbose`.

Budget: LOCALLLM_FUZZ_CASES (default 10,000) cases of the tiny model through the numpy backend, 1/50
of them through numba, and 1/40 (SmolLM2) or 1/400 (gemma3, qwen2) of real headers in the slow tests.
Measured on the shared 2-core machine: 10,000 numpy cases in 48-71 s; 200 numba cases in 9 s (about
100 s when the kernels compile cold); 250 SmolLM2 headers in 14-17 s. A longer run on demand:
LOCALLLM_FUZZ_CASES=100000 python -m pytest -q tests/loading/test_loader_fuzz.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
CASES = int(os.environ.get("LOCALLLM_FUZZ_CASES", "10000"))
CASE_SECONDS = 5.0
PARSE_SLACK = 64 * 1024  # fixed cost of an open (objects, exception) that even a 10-byte file pays
STRING, ARRAY = 8, 9
TENSOR_KINDS = ("length", "text", "ndims", "dims", "ttype", "toffset")
GGML_TYPES = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 24, 28, 29, 30, 31, 34, 39, 40, 41]


# ---------------------------------------------------------------- the intact file's field layout


@dataclass(frozen=True, slots=True)
class Slot:
    offset: int
    dtype: str  # numpy dtype of the field as stored
    count: int  # elements (text slots: bytes)
    label: str  # key or tensor name, for reports


def field_layout(path: Path) -> tuple[dict[str, list[Slot]], int]:
    """Slots by kind (header, length, text, vtype, count, value, hyper, ndims, dims, ttype, toffset)
    and where the tensor data starts."""
    import gguf

    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    kinds: dict[str, list[Slot]] = {}

    def add(kind: str, part: np.ndarray, label: str) -> None:
        slot = Slot(int(part.ctypes.data - base), part.dtype.str, int(part.size), label)
        kinds.setdefault(kind, []).append(slot)

    for name, field in reader.fields.items():
        for kind, part in _kv_parts(name, field, reader.fields["general.architecture"].contents()):
            add(kind, part, name)
    for tensor in reader.tensors:
        for kind, part in zip(TENSOR_KINDS, tensor.field.parts, strict=True):
            add(kind, part, tensor.name)
    data_start = min(int(t.data_offset) for t in reader.tensors)
    return kinds, data_start


def _kv_parts(name: str, field: Any, arch: str) -> list[tuple[str, np.ndarray]]:
    parts = field.parts
    if name.startswith("GGUF."):
        return [("header", parts[0])]
    out = [("length", parts[0]), ("text", parts[1]), ("vtype", parts[2])]
    if field.types[0] == STRING:
        return out + [("length", parts[3]), ("text", parts[4])]
    if field.types[0] != ARRAY:
        return out + [("hyper" if name.startswith(f"{arch}.") else "value", parts[3])]
    out += [("vtype", parts[3]), ("count", parts[4])]
    items = parts[5:]
    if field.types[1] == STRING:
        kinds = ["length", "text"] * (len(items) // 2)
        return out + list(zip(kinds, items, strict=True))
    return out + [("value", p) for p in items]


# ---------------------------------------------------------------- mutations


def interesting_int(rng: random.Random, old: int, bits: int) -> int:
    choices = [0, 1, 2, 3, 5, old + 1, old - 1, old * 2, old // 2, old * 3, 2**bits - 1, 2 ** (bits - 1)]
    choices += [2 ** (bits - 1) - 1, 2**31, 2**32, 2**40, 2**63, rng.randrange(2**bits), rng.randrange(1025)]
    choices += [old ^ (1 << rng.randrange(bits))]
    return rng.choice(choices) % 2**bits


def interesting_float(rng: random.Random, old: float) -> float:
    return rng.choice(
        [0.0, -1.0, -old, old * 2, old / 2, float("nan"), float("inf"), -float("inf"), 1e-45, 3e38]
    )


def set_slot(data: bytearray, slot: Slot, rng: random.Random) -> str:
    """Overwrite one element of a numeric slot with an interesting value."""
    dtype = np.dtype(slot.dtype)
    at = slot.offset + rng.randrange(slot.count) * dtype.itemsize
    old = np.frombuffer(data, dtype, 1, at)[0]
    if dtype.kind == "f":
        new = np.array([interesting_float(rng, float(old))], dtype)
    else:
        bits = dtype.itemsize * 8
        new = np.array([interesting_int(rng, int(old), bits)], np.uint64).astype(dtype.str.replace("i", "u"))
    data[at : at + dtype.itemsize] = new.tobytes()
    return f"{slot.label}@{at}:{old}->{new[0]}"


def reshape_tensor(data: bytearray, kinds: dict[str, list[Slot]], rng: random.Random) -> str:
    """The same bytes under another shape (e.g. 576x576 read as 288x1152), the issue's first crash."""
    slot = rng.choice([s for s in kinds["dims"] if s.count == 2])
    ne0, ne1 = np.frombuffer(data, "<u8", 2, slot.offset).tolist()
    k = rng.choice([2, 4, 8, 3])
    new = rng.choice([(ne1, ne0), (ne0 * k, ne1 // k), (ne0 // k, ne1 * k), (ne0 * ne1, 1)])
    data[slot.offset : slot.offset + 16] = np.array(new, "<u8").tobytes()
    return f"reshape {slot.label} {(ne0, ne1)}->{new}"


def mutate(
    base: bytes, kinds: dict[str, list[Slot]], data_start: int, rng: random.Random
) -> tuple[bytes, str, bool]:
    """The mutated bytes, what was done, and whether the file was cut short."""
    data = bytearray(base)
    done = []
    ops = MUTATIONS if data_start < len(base) else MUTATIONS[:-1]  # a header-only base has no data
    for _ in range(1 + (rng.random() < 0.3) + (rng.random() < 0.1)):
        done.append(rng.choice(ops)(data, kinds, data_start, rng))
    tail = rng.random()
    if tail < 0.05:
        cut = rng.choice([rng.randrange(data_start), rng.randrange(len(data))])
        del data[cut:]
        return bytes(data), "; ".join([*done, f"truncate@{cut}"]), True
    elif tail < 0.10:
        at = rng.randrange(data_start)
        if rng.random() < 0.5:
            data[at:at] = rng.randbytes(rng.randint(1, 16))
            done.append(f"insert@{at}")
        else:
            del data[at : at + rng.randint(1, 16)]
            done.append(f"delete@{at}")
    return bytes(data), "; ".join(done), False


def _field_op(*kinds_wanted: str):
    def op(data: bytearray, kinds: dict[str, list[Slot]], data_start: int, rng: random.Random) -> str:
        kind = rng.choice([k for k in kinds_wanted if k in kinds])
        return f"{kind} " + set_slot(data, rng.choice(kinds[kind]), rng)

    return op


def _flip_header(data: bytearray, kinds: dict[str, list[Slot]], data_start: int, rng: random.Random) -> str:
    at = rng.randrange(data_start)
    data[at] = rng.randrange(256)
    return f"byte@{at}"


def _flip_data(data: bytearray, kinds: dict[str, list[Slot]], data_start: int, rng: random.Random) -> str:
    at = rng.randrange(data_start, len(data))
    data[at] = rng.randrange(256)
    return f"data byte@{at}"


def _reshape(data: bytearray, kinds: dict[str, list[Slot]], data_start: int, rng: random.Random) -> str:
    return reshape_tensor(data, kinds, rng)


MUTATIONS = [
    _field_op("header"),
    _field_op("length", "count"),
    _field_op("vtype"),
    _field_op("hyper"),
    _field_op("hyper"),
    _field_op("value"),
    _field_op("ndims"),
    _field_op("dims"),
    _field_op("ttype"),
    _field_op("toffset"),
    _reshape,
    _flip_header,
    _flip_data,  # last: left out for a header-only base
]


# ---------------------------------------------------------------- one case


class CaseTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout(f"over {CASE_SECONDS} s")


class Meter:
    """What a phase allocated at its peak: traced Python and numpy allocations (precise, slows
    allocation-heavy code ~10x), or the process's resident high-water mark (Linux; cheap, coarse)."""

    def __init__(self, kind: str):
        self.kind, self.base = kind, 0
        if kind == "tracemalloc":
            tracemalloc.start()

    def start(self) -> None:
        if self.kind == "tracemalloc":
            tracemalloc.reset_peak()
            self.base = tracemalloc.get_traced_memory()[0]
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.base = _proc_status("VmRSS")

    def peak(self) -> int:
        if self.kind == "tracemalloc":
            return tracemalloc.get_traced_memory()[1] - self.base
        return _proc_status("VmHWM") - self.base


def _proc_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_case(path: Path, backend: str, mode: str, meter: Meter) -> tuple[str, int, int]:
    """'rejected: <class>' or 'ran'; with the bytes the parse and the run allocated at their peaks."""
    from localllm.errors import LocalLLMError

    peaks, phase, outcome = [0, 0], 0, "ran"  # phase 0 opens (parse, validate), 1 loads or runs
    try:
        meter.start()
        gf = _open(path)
        if mode != "open":
            peaks[0], phase = meter.peak(), 1
            meter.start()
            RUNNERS[mode](path, backend)
        del gf
    except LocalLLMError as e:
        message = str(e)
        if not message or "\n" in message or "\x1b" in message:
            raise AssertionError(f"not a clean one-line error: {message!r}") from e
        outcome = f"rejected: {type(e).__name__}"
    peaks[phase] = meter.peak()
    return outcome, peaks[0], peaks[1]


def _open(path: Path) -> Any:
    from localllm.loading.file import GGUFFile

    return GGUFFile.open(path)


def _run_one_token(path: Path, backend: str) -> None:
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.sampling_params import SamplingParams

    config = EngineConfig(model=str(path), backend=backend, ctx_size=64, num_kv_blocks=4, max_num_seqs=1)
    engine = LLMEngine(config)
    out = engine.generate(["the cat"], SamplingParams(max_tokens=1, temperature=0))
    assert len(out) == 1 and out[0].finish_reason in ("length", "stop"), out  # stop: it sampled EOS


def _load_model(path: Path, backend: str) -> None:
    """Validation and weight loading without a forward step (a real model's step is too slow here)."""
    from localllm.backends import make_backend
    from localllm.models import load_model

    load_model(_open(path), make_backend(backend, 1))


RUNNERS = {"load": _load_model, "run": _run_one_token}


def check_case(path: Path, backend: str, mode: str, meter: Meter, run_budget: int) -> str:
    size = path.stat().st_size
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        outcome, parse_peak, run_peak = run_case(path, backend, mode, meter)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    elapsed = time.perf_counter() - start
    assert elapsed < CASE_SECONDS, f"took {elapsed:.1f} s"
    assert parse_peak <= 2 * size + PARSE_SLACK, f"parse allocated {parse_peak:,} B for a {size:,} B file"
    assert run_peak <= run_budget, f"run allocated {run_peak:,} B (budget {run_budget:,})"
    return outcome


# ---------------------------------------------------------------- the worker


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run cases [first, first + cases) of one seed; progress lines let the parent name a crash."""
    if args.backend == "numba":
        from localllm.llm import default_numba_cache

        default_numba_cache()
    base_path = Path(args.base)
    kinds, data_start = field_layout(base_path)
    base = _read_base(base_path, data_start, args.header_only)
    pad_to = base_path.stat().st_size - len(base) if args.header_only else 0
    signal.signal(signal.SIGALRM, _alarm)
    warnings.simplefilter("ignore", RuntimeWarning)  # NaN and inf from mutated weights are expected
    import gguf.constants  # noqa: F401 - imported on the first unknown tensor type; not the case's cost

    import localllm.model_info  # noqa: F401 - imported by the first error message

    meter = Meter(args.memory)
    _open(base_path)  # first-use imports and caches
    work = Path(tempfile.mkdtemp(prefix="gguf-fuzz-"))
    path = work / "case.gguf"
    run_budget = _run_budget(base_path, args, meter) if args.mode != "open" else 0
    counts: dict[str, int] = {}
    failures: list[str] = []
    progress = open(args.progress, "w") if args.progress else None
    for k in range(args.first, args.first + args.cases):
        rng = random.Random(f"{args.seed}:{k}")
        data, desc, truncated = mutate(base, kinds, data_start, rng)
        _write(path, data, 0 if truncated else pad_to)
        if progress:
            progress.write(f"case {k}: {desc}\n")
            progress.flush()
        try:
            outcome = check_case(path, args.backend, args.mode, meter, run_budget)
        except Exception as e:  # noqa: BLE001 - every other outcome is the failure being hunted
            outcome = "FAILED"
            failures.append(f"case {k} ({desc}): {type(e).__name__}: {str(e)[:300]}")
        if args.verbose:
            print(f"case {k}: {desc} -> {outcome}", file=sys.stderr)
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"counts": counts, "failures": failures[:20], "n_failures": len(failures)}


def _read_base(path: Path, data_start: int, header_only: bool) -> bytes:
    with open(path, "rb") as f:
        return f.read(data_start) if header_only else f.read()


def _write(path: Path, data: bytes, pad: int) -> None:
    """The case file; a header-only base gets the real file's data section back as a sparse hole."""
    with open(path, "wb") as f:
        f.write(data)
        if pad:
            f.truncate(len(data) + pad)


def _run_budget(base_path: Path, args: argparse.Namespace, meter: Meter) -> int:
    """Twice what a run of the intact model allocates, plus twice the file."""
    RUNNERS[args.mode](base_path, args.backend)  # imports and compiles what every run needs
    meter.start()
    RUNNERS[args.mode](base_path, args.backend)
    return 2 * meter.peak() + 2 * base_path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the intact GGUF to mutate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument(
        "--mode", choices=["open", "load", "run"], default="run", help="how far each case goes"
    )
    parser.add_argument("--header-only", action="store_true", help="mutate only the header (big files)")
    parser.add_argument("--memory", choices=["tracemalloc", "rss"], default="tracemalloc")
    parser.add_argument("--progress", default="")
    parser.add_argument("--verbose", action="store_true")
    print(json.dumps(worker(parser.parse_args())))


# ---------------------------------------------------------------- the tests


def run_worker(tmp_path: Path, base: Path, cases: int, *extra: str, timeout: float = 900) -> dict[str, Any]:
    progress = tmp_path / "progress.txt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--base", str(base), "--cases", str(cases)]
    cmd += ["--progress", str(progress), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, cases), cwd=HERE)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        lines = progress.read_text().splitlines() if progress.exists() else []
        last = lines[-1] if lines else "before the first case"
        pytest.fail(f"fuzz worker died (rc {proc.returncode}) at {last}\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["seconds"] = round(elapsed, 1)
    print(f"\n{cases} cases in {elapsed:.1f} s: {summary['counts']}")
    return summary


def _assert_clean(summary: dict[str, Any]) -> None:
    assert summary["n_failures"] == 0, "\n".join(summary["failures"])


def test_fuzz_tiny_model_numpy(tiny_model_path: Path, tmp_path: Path) -> None:
    summary = run_worker(tmp_path, tiny_model_path, CASES, "--seed", "1")
    _assert_clean(summary)
    assert summary["counts"].get("ran", 0) > CASES // 50  # the mutator also makes files that still run


def test_fuzz_tiny_q4_0_numba(tmp_path: Path) -> None:
    """A smaller sample through the Numba kernels, where a shape that slipped through would write out
    of bounds (new type combinations compile new kernels, so a case costs ~0.1-1 s)."""
    from tiny_model import write_tiny_model

    base = write_tiny_model(tmp_path / "tiny-q4_0.gguf", quant="Q4_0", seed=3)
    _assert_clean(run_worker(tmp_path, base, max(CASES // 50, 50), "--seed", "2", "--backend", "numba"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "share"), [("smollm2_path", 40), ("gemma3_path", 400), ("qwen25c_path", 400)]
)
def test_fuzz_real_model_header(
    model: str, share: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A real model's header (1.8-6.5 MB: vocabulary, hyperparameters, tensor table) mutated, its
    weights a sparse hole: open, validate, load. Gemma's and Qwen's 150k-262k vocabularies make a case
    ~0.5 s, so they get fewer cases."""
    path = request.getfixturevalue(model)
    cases = max(CASES // share, 25)
    summary = run_worker(
        tmp_path, path, cases, "--seed", "3", "--header-only", "--mode", "load", "--memory", "rss"
    )
    _assert_clean(summary)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent / "support"))
    main()
