"""Mutation fuzzing of Hugging Face checkpoint folders: every damaged folder converts or ends in one
clean line (a LocalLLMError), never another exception, a hang or a huge allocation.

Two small valid folders are the seeds: a qwen2 one (config.json, model.safetensors, a BPE
tokenizer.json, tokenizer_config.json) and a llama one sharded through model.safetensors.index.json
with a SentencePiece tokenizer.model. Each case writes a seed folder and applies one to three
mutations: JSON values replaced by hostile ones (3e9, -1, 2**64, NaN, strings with terminal escapes,
lone surrogates, wrong types, deep nesting) at a random place in config.json, tokenizer.json,
tokenizer_config.json or the index, keys deleted or added; the safetensors header's JSON mutated the
same way or its length prefix rewritten; tokenizer.model's protobuf rewritten (piece types, long
varints) or its bytes flipped; any file truncated, emptied, byte-flipped, grown, deleted or made a
folder. The case then converts (read_checkpoint + write), and when that succeeds the GGUF is opened,
validated and tokenizes a sentence, as `localllm run DIR --quantize int8` would. A case fails on any
exception other than a one-line LocalLLMError, on taking over 5 s, or on allocating (tracemalloc
peak) more than 64 MiB + 20x the folder's size.

The cases run in a child process (this file as a script) so a hang or a crash names its case; case k
of seed s alone: `python tests/convert/test_checkpoint_fuzz.py --seed s --first k --cases 1 --verbose`.
Budget: LOCALLLM_CKPT_FUZZ_CASES (default 800) cases, 30-40 s on the shared 2-core machine (about
45 ms a case: most are refused in a few ms, a conversion and tokenizer load take ~30 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import tracemalloc
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CASES = int(os.environ.get("LOCALLLM_CKPT_FUZZ_CASES", "800"))
CASE_SECONDS = 5.0
MEMORY_SLACK = 64 << 20
TARGETS = ("Q8_0", "F16", "Q4_1")
JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")
# keys worth adding where they are missing: what convert and gguf's SpecialVocab read
KEYS = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rope_theta", "rms_norm_eps", "rope_scaling", "sliding_window",
    "tie_word_embeddings", "architectures", "model_type", "_name_or_path", "added_tokens", "model",
    "pre_tokenizer", "post_processor", "chat_template", "bos_token", "eos_token", "add_bos_token",
    "weight_map", "merges", "vocab", "id", "content", "special", "type", "factor", "rope_type",
    "low_freq_factor", "high_freq_factor", "final_logit_softcapping", "dtype", "shape", "data_offsets",
]  # fmt: skip


# ---------------------------------------------------------------- the seed folders


def seed_folders(work: Path) -> list[dict[str, bytes]]:
    """The two seeds as {file name: bytes}."""
    from tiny_arch import write_arch_model
    from tiny_spm import tiny_metadata

    from localllm.convert.export_hf import export_hf
    from localllm.convert.vocab import write_tokenizer_files

    qwen = export_hf(write_arch_model(work / "q.gguf", "qwen2", "F32", n_layers=1), work / "qwen2")
    llama = export_hf(
        write_arch_model(work / "l.gguf", "llama", "F32", n_layers=2), work / "llama", shard_bytes=60_000
    )
    rows = json.loads((llama / "config.json").read_text())["vocab_size"]
    meta = tiny_metadata()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        meta[key] = meta[key][:rows]
    (llama / "tokenizer.json").unlink()
    write_tokenizer_files(meta, llama)
    return [{p.name: p.read_bytes() for p in folder.iterdir()} for folder in (qwen, llama)]


# ---------------------------------------------------------------- mutations


def hostile(rng: random.Random, old: Any = None) -> Any:
    """A JSON value a malformed or hostile folder might hold in place of `old`."""
    numbers = [0, 1, -1, 2, 3, 7, 3e9, int(3e9), int(4e9), 2**31, 2**32 + 1, 2**63, 2**64 + 5, -(2**63)]
    numbers += [0.5, 1e-300, 1e308, float("nan"), float("inf"), 3.0, 64.0, 10**30]
    if isinstance(old, int) and not isinstance(old, bool):
        numbers += [old + 1, old - 1, old * 2, old // 2, old * 1000, -old, float(old) + 0.5]
    texts = [
        "",
        "x",
        "\x1b[2J\x1b]0;pwned\x07\u202eevil",
        "\ud800",
        "<|im_start|>",
        "a" * 100_000,
        "../x",
        "a\x00b",
    ]
    shapes = [None, True, False, [], {}, [1, 2], {"a": 1}, [[[[[]]]]], [old] * 3, {"type": "BPE"}]
    deep: Any = []
    for _ in range(rng.choice([50, 5000])):
        deep = [deep]
    pool = rng.choice([numbers, numbers, texts, shapes, [deep]])
    return rng.choice(pool)


def pick_path(rng: random.Random, root: Any) -> list[Any]:
    """A random place in a JSON tree: descend into a random child until a coin says stop."""
    path: list[Any] = []
    node = root
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    return path


def mutate_tree(rng: random.Random, root: Any) -> tuple[Any, str]:
    path = pick_path(rng, root) if rng.random() > 0.05 else []
    if not path:
        return hostile(rng, root), "root replaced"
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    key, roll = path[-1], rng.random()
    if roll < 0.6:
        parent[key] = hostile(rng, parent[key])
        return root, f"{path[:4]} replaced"
    if roll < 0.75:
        del parent[key]
        return root, f"{path[:4]} deleted"
    if roll < 0.9 and isinstance(parent, dict):
        new = rng.choice(KEYS)
        parent[new] = hostile(rng, parent.get(new))
        return root, f"{path[:3]}+{new} added"
    if isinstance(parent, list):
        parent.extend([parent[key]] * rng.choice([1, 3]))
    else:
        parent[key] = [parent[key], parent[key]]
    return root, f"{path[:4]} doubled"


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8")  # NaN and lone surrogates written as Python writes them


def mutate_json(rng: random.Random, files: dict[str, bytes]) -> str:
    name = rng.choice([n for n in JSON_FILES if isinstance(files.get(n), bytes)])
    try:
        tree = json.loads(files[name])
    except ValueError:  # already damaged by an earlier mutation
        return mutate_bytes(rng, files, name)
    tree, what = mutate_tree(rng, tree)
    try:
        files[name] = dumps(tree)
    except (ValueError, RecursionError):
        return f"{name}: unwritable"
    return f"{name}: {what}"


def mutate_safetensors_header(rng: random.Random, files: dict[str, bytes]) -> str:
    name = rng.choice([n for n, d in files.items() if n.endswith(".safetensors") and len(d or b"") >= 8])
    data = files[name]
    (n,) = struct.unpack_from("<Q", data)
    body = data[8 + n :]
    if rng.random() < 0.25:
        new = rng.choice([0, 1, n - 1, n + 1, n + 8, len(data), 2**40, 2**64 - 1])
        files[name] = struct.pack("<Q", new) + data[8:]
        return f"{name}: header length {n}->{new}"
    try:
        header, what = mutate_tree(rng, json.loads(data[8 : 8 + n]))
        text = dumps(header)
    except (ValueError, RecursionError):
        return f"{name}: header unwritable"
    text += b" " * (-len(text) % 8)
    files[name] = struct.pack("<Q", len(text)) + text + body
    return f"{name} header: {what}"


def mutate_spm(rng: random.Random, files: dict[str, bytes]) -> str:
    from localllm.convert.spm_proto import _encode_varint, read_spm, write_spm
    from localllm.errors import LocalLLMError

    try:
        model = read_spm(files["tokenizer.model"])
    except LocalLLMError:
        return mutate_bytes(rng, files, "tokenizer.model")
    roll, i = rng.random(), rng.randrange(len(model.pieces))
    if roll < 0.3:
        model.types[i] = rng.choice([0, 7, 255, 2**40])
        what = f"piece {i} type {model.types[i]}"
    elif roll < 0.5:
        model.pieces[i] = rng.choice(["", "\x1b[2J", "a" * 5000, model.pieces[0]])
        what = f"piece {i} text"
    elif roll < 0.7:
        model.pieces = model.pieces[: rng.randrange(len(model.pieces))]
        model.scores, model.types = model.scores[: len(model.pieces)], model.types[: len(model.pieces)]
        what = f"{len(model.pieces)} pieces"
    else:
        run = b"\xff" * rng.choice([9, 10, 11, 100, 100_000]) + b"\x01"
        blob = write_spm(model)
        at = rng.randrange(len(blob))
        files["tokenizer.model"] = (
            blob[:at] + _encode_varint(rng.choice([0x0A, 0x08, 0x12])) + run + blob[at:]
        )
        return f"tokenizer.model: long varint at {at}"
    files["tokenizer.model"] = write_spm(model)
    return f"tokenizer.model: {what}"


def mutate_bytes(rng: random.Random, files: dict[str, bytes], name: str) -> str:
    data = bytearray(files[name])
    roll = rng.random()
    if roll < 0.3 and data:
        cut = rng.randrange(len(data))
        del data[cut:]
        what = f"truncated at {cut}"
    elif roll < 0.6 and data:
        for _ in range(rng.choice([1, 4, 32])):
            data[rng.randrange(len(data))] = rng.randrange(256)
        what = "bytes flipped"
    elif roll < 0.8:
        at = rng.randrange(len(data) + 1)
        data[at:at] = rng.choice([rng.randbytes(16), b"\x00" * 64, b"{" * 10_000, b'"\\ud800"'])
        what = f"bytes inserted at {at}"
    else:
        data = bytearray()
        what = "emptied"
    files[name] = bytes(data)
    return f"{name}: {what}"


def mutate_files(rng: random.Random, files: dict[str, bytes]) -> str:
    name = rng.choice(sorted(files))
    roll = rng.random()
    if roll < 0.5:
        del files[name]
        return f"{name}: deleted"
    if roll < 0.75:
        files[name] = None  # type: ignore[assignment]  # written as a folder
        return f"{name}: a folder"
    extra = rng.choice(["extra.safetensors", "tokenizer.model", "merges.txt", "chat_template.json"])
    files[extra] = rng.choice([b"", b"\x00" * 100, files.get(name) or b"x", b'{"chat_template": 5}'])
    return f"{extra}: added"


def mutate(rng: random.Random, seed: dict[str, bytes]) -> tuple[dict[str, bytes], str]:
    files = dict(seed)
    done = []
    for _ in range(1 + (rng.random() < 0.3) + (rng.random() < 0.1)):
        present = {n for n, d in files.items() if isinstance(d, bytes)}
        roll = rng.random()
        if roll < 0.45 and present & set(JSON_FILES):
            done.append(mutate_json(rng, files))
        elif roll < 0.6 and any(n.endswith(".safetensors") and len(files[n]) >= 8 for n in present):
            done.append(mutate_safetensors_header(rng, files))
        elif roll < 0.72 and "tokenizer.model" in present:
            done.append(mutate_spm(rng, files))
        elif roll < 0.9 and present:
            done.append(mutate_bytes(rng, files, rng.choice(sorted(present))))
        elif files:
            done.append(mutate_files(rng, files))
    return files, "; ".join(done)


def write_folder(folder: Path, files: dict[str, bytes | None]) -> int:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, data in files.items():
        if data is None:
            (folder / name).mkdir()
        else:
            (folder / name).write_bytes(data)
    return sum(len(d) for d in files.values() if d is not None)


# ---------------------------------------------------------------- one case


class CaseTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so no `except Exception` in the code under test eats it."""


def _alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout


def run_case(folder: Path, out: Path, target: str) -> str:
    """'converted', 'loaded' or 'refused'; raises whatever the code under test raised otherwise."""
    from localllm.convert.convert_hf import read_checkpoint, write_checkpoint
    from localllm.errors import LocalLLMError
    from localllm.loading.file import GGUFFile
    from localllm.tokenizer import load_tokenizer

    try:
        write_checkpoint(read_checkpoint(folder, target), out)
    except LocalLLMError as e:
        if "\n" in str(e) or "\r" in str(e):
            raise AssertionError(f"a LocalLLMError of several lines: {str(e)[:300]!r}") from None
        return "refused"
    try:
        gf = GGUFFile.open(out)
        load_tokenizer(gf.metadata).encode("Hello, world! <|im_start|> 123", add_special=True)
    except LocalLLMError as e:
        assert "\n" not in str(e), str(e)[:300]
        return "converted"
    return "loaded"


def worker(seed: int, first: int, cases: int, verbose: bool) -> dict[str, Any]:
    import warnings

    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.CRITICAL)  # gguf's SpecialVocab warns about odd tokenizer files
    work = Path(tempfile.mkdtemp(prefix="ckpt-fuzz-"))
    seeds = seed_folders(work)
    signal.signal(signal.SIGALRM, _alarm)
    counts: dict[str, int] = {}
    failures = []
    slowest = 0.0
    for k in range(first, first + cases):
        rng = random.Random(f"{seed}-{k}")
        files, what = mutate(rng, seeds[k % len(seeds)])
        folder = work / "case"
        size = write_folder(folder, files)
        out = work / "out.gguf"
        out.unlink(missing_ok=True)
        tracemalloc.start()
        start = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, 4 * CASE_SECONDS)
        try:
            result = run_case(folder, out, TARGETS[k % len(TARGETS)])
        except CaseTimeout:
            result = "error: no result after 4x the time bound (a hang?)"
        except BaseException as e:  # noqa: BLE001  (what the fuzzer is here to find)
            tail = "".join(traceback.format_exception(e)[-3:])
            result = f"error: {type(e).__name__}: {str(e)[:300]} | {tail[-600:]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            seconds = time.perf_counter() - start
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        slowest = max(slowest, seconds)
        problems = [result] if result.startswith("error") else []
        if seconds > CASE_SECONDS:
            problems.append(f"took {seconds:.1f} s")
        if peak > MEMORY_SLACK + 20 * size:
            problems.append(f"allocated {peak / 2**20:.0f} MiB for a {size / 2**20:.1f} MiB folder")
        counts[result.split(":")[0]] = counts.get(result.split(":")[0], 0) + 1
        if problems:
            failures.append({"case": k, "mutation": what, "problems": problems})
        if verbose:
            print(f"case {k}: {what} -> {result} ({seconds:.2f} s, {peak / 2**20:.1f} MiB)", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return {"counts": counts, "failures": failures, "slowest_s": round(slowest, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    print(json.dumps(worker(args.seed, args.first, args.cases, args.verbose)))


def run_worker(cases: int, seed: int) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__)), "--seed", str(seed), "--cases", str(cases)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=60 + cases * CASE_SECONDS, cwd=HERE
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_fuzz_checkpoint_folders() -> None:
    summary = run_worker(CASES, seed=1)
    print(summary["counts"], f"slowest {summary['slowest_s']} s")
    assert not summary["failures"], json.dumps(summary["failures"][:10], indent=1)
    assert summary["counts"].get("refused", 0) > CASES // 4  # the mutations do reach the checks
    assert summary["counts"].get("loaded", 0) > CASES // 50  # and some still make a working model


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent / "support"))
    main()
