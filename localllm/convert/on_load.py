"""Quantize on load: `LLM(HF_DIR, quantize="int4")` / `localllm run HF_DIR --quantize int8`.

A Hugging Face directory (or, with a quantize choice, an F32/F16/BF16 GGUF) becomes a GGUF in
LOCALLLM_HOME/converted/ once, named by the source's path, sizes and times and the chosen type, then
loads like any other model file and runs on the same kernels: int8 is Q8_0 (32 weights per block, one
f16 scale: symmetric), int4 is Q4_1 (32 weights per block, an f16 scale and an f16 minimum: the affine
int4 of mlx and AWQ), with llama.cpp's rule of a Q6_K output projection.  No --quantize converts to F16.
The kernels' blocks hold 32 weights, so a group size other than 32 is refused.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from localllm.errors import LocalLLMError

TARGETS = {"int8": "Q8_0", "int4": "Q4_1"}
GROUP_SIZE = 32  # the only group size the kernels' blocks have


def is_hf_dir(model: str | Path | None) -> bool:
    return model is not None and Path(model).is_dir() and (Path(model) / "config.json").is_file()


def target_type(quantize: str | None, group_size: int = GROUP_SIZE) -> str:
    if quantize is None:
        return "F16"
    if quantize.lower() not in TARGETS:
        raise LocalLLMError(f"--quantize must be int8 or int4, not {quantize!r}")
    if group_size != GROUP_SIZE:
        raise LocalLLMError(
            f"--group-size {group_size} cannot run on localllm's kernels: their int8/int4 blocks hold "
            f"{GROUP_SIZE} weights each (use --group-size {GROUP_SIZE})"
        )
    return TARGETS[quantize.lower()]


def cache_path(source: Path, target: str, home: Path) -> Path:
    """Keyed by the source's resolved path and every file's size and modification time: an edited
    checkpoint is converted again."""
    source = source.resolve()
    digest = hashlib.sha256(str(source).encode())
    for f in sorted(source.iterdir()) if source.is_dir() else [source]:
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    name = source.name.removesuffix(".gguf")
    return home / "converted" / f"{name}-{digest.hexdigest()[:12]}-{target}.gguf"


def prepare_model(model: str, home: Path, quantize: str | None = None, group_size: int = GROUP_SIZE) -> Path:
    """The GGUF to load for `model` (an HF directory, or a float GGUF with `quantize`), made on first use."""
    target = target_type(quantize, group_size)
    source = Path(model)
    if not is_hf_dir(source) and not (source.is_file() and quantize):
        raise LocalLLMError(f"{model}: --quantize takes a Hugging Face directory or an F16/F32/BF16 GGUF")
    out = cache_path(source, target, home)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if is_hf_dir(source):
        from localllm.convert.convert_hf import read_checkpoint, write_checkpoint

        checkpoint = read_checkpoint(source, target)  # a malformed one is refused before a word is said
        _announce(source, target, out)
        write_checkpoint(checkpoint, out)
    else:
        _announce(source, target, out)
        from localllm.quant.quantize_gguf import quantize_file

        quantize_file(source, out, target)
    return out


def _announce(source: Path, target: str, out: Path) -> None:
    print(f"converting {source.name} to {target} (once; cached as {out})", file=sys.stderr, flush=True)
