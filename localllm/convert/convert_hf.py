"""`localllm convert`: a Hugging Face checkpoint directory -> a GGUF that llama.cpp and localllm load.

What llama.cpp's convert_hf_to_gguf does for these families, and no more: tensor names mapped (names.py),
the llama family's q/k rows permuted from Hugging Face's rotate-half layout to GGUF's interleaved pairs,
Gemma's norms stored as 1 + w, Gemma's embedding rows beyond the vocabulary dropped, the vocabulary and
special tokens from the tokenizer files (vocab.py).  Tensors are stored as `--type` chooses, with the
same per-tensor rules as `localllm quantize` (norms and 1-D tensors F32; mixes as llama.cpp picks);
a tensor the checkpoint stores as MXFP4 stays MXFP4, its blocks moved bit for bit (as llama.cpp's
gpt-oss conversion keeps them), unless `--type` is F32 or F16 (then its exact values).
The file is written under a temporary name and renamed at the end (localllm.partial_file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localllm.convert.check import check_tensors, quoted
from localllm.convert.checkpoint import (
    MXFP4,
    TensorRef,
    ggml_mxfp4,
    list_tensors,
    load_tensor,
    read_config,
    tensor_files,
)
from localllm.convert.hparams import gguf_hparams, llama3_rope_factors
from localllm.convert.names import ARCHITECTURES, gguf_name, norm_shift, permute_qk
from localllm.convert.vocab import Vocab, add_vocab, load_vocab, special_vocab
from localllm.errors import LocalLLMError
from localllm.partial_file import partial_output


@dataclass(slots=True)
class Item:
    ref: TensorRef | None  # None for a tensor made here (rope_freqs.weight)
    name: str  # GGUF name
    shape: tuple[int, ...]
    target: str = "F32"
    data: np.ndarray | None = None


def architecture(config: dict[str, Any]) -> str:
    names = config.get("architectures") or [config.get("model_type") or "?"]
    arch = ARCHITECTURES.get(names[0])
    if arch is None:
        known = ", ".join(ARCHITECTURES)
        name = names[0] if len(names[0]) <= 80 else quoted(names[0])
        raise LocalLLMError(f"architecture {name} is not one localllm convert can map ({known})")
    return arch


def plan(arch: str, config: dict[str, Any], refs: list[TensorRef], n_vocab: int, target: str) -> list[Item]:
    from localllm.quant.quantize_gguf import choose_type, layer_positions

    items = []
    for ref in refs:
        name = gguf_name(arch, ref.name)
        if name is None or (name == "output.weight" and config.get("tie_word_embeddings")):
            continue
        shape = ref.shape
        if name in ("token_embd.weight", "output.weight"):
            if shape[0] < n_vocab:
                raise LocalLLMError(f"{ref.name} has {shape[0]} rows for a vocabulary of {n_vocab} tokens")
            shape = (n_vocab, *shape[1:])  # Gemma pads its embedding past the vocabulary: dropped
        items.append(Item(ref, name, shape))
    if (factors := llama3_rope_factors(config)) is not None:
        items.append(Item(None, "rope_freqs.weight", factors.shape, data=factors))
    names = [i.name for i in items]
    if "token_embd.weight" not in names:
        raise LocalLLMError("the checkpoint has no model.embed_tokens.weight")
    tied, layers = "output.weight" not in names, layer_positions(names)
    for item in items:
        item.target = choose_type(item.name, item.shape, target, tied, layers.get(item.name))
        if _is_mxfp4(item) and target not in ("F32", "F16"):
            item.target = MXFP4
    return items


def _is_mxfp4(item: Item) -> bool:
    return item.ref is not None and item.ref.dtype == MXFP4


def prepare(arch: str, config: dict[str, Any], item: Item, raw: bool = False) -> np.ndarray:
    """A tensor as GGUF stores it (before type conversion), float32; `raw`: an MXFP4 tensor's ggml
    blocks, rows in the same order."""
    if item.data is not None:
        return item.data
    data = (ggml_mxfp4(item.ref) if raw else load_tensor(item.ref))[: item.shape[0]]
    if arch == "llama" and item.name.split(".")[-2] in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"]
        if item.name.split(".")[-2] == "attn_k":
            heads = config.get("num_key_value_heads") or heads
        data = permute_qk(data, heads)
    return data + np.float32(norm_shift(arch, item.name)) if norm_shift(arch, item.name) else data


@dataclass(slots=True)
class Checkpoint:
    """A Hugging Face directory read and checked, ready to be written as a GGUF."""

    hf_dir: Path
    arch: str
    config: dict[str, Any]
    hparams: dict[str, Any]
    vocab: Vocab
    special: Any  # gguf's SpecialVocab
    items: list[Item]
    target: str


def read_checkpoint(hf_dir: str | Path, target: str = "F16") -> Checkpoint:
    """Everything convert reads from `hf_dir`, checked (localllm.convert.check) before anything is
    written: a malformed directory is one LocalLLMError here, not a half-written file."""
    from localllm.quant.quantize_gguf import check_target

    hf_dir, target = Path(hf_dir), check_target(target)
    config = read_config(hf_dir)
    arch = architecture(config)
    hp = gguf_hparams(arch, config)
    refs = list_tensors(tensor_files(hf_dir))
    rows = check_tensors(arch, config, refs)  # bounds vocab_size and every token id
    vocab = load_vocab(hf_dir, config.get("vocab_size"), rows)
    items = plan(arch, config, refs, len(vocab.tokens), target)
    return Checkpoint(hf_dir, arch, config, hp, vocab, special_vocab(hf_dir, vocab), items, target)


def convert_hf(
    hf_dir: str | Path, out: str | Path, target: str = "F16", force: bool = False
) -> tuple[str, list[Item]]:
    """Convert `hf_dir` to the GGUF `out`; returns the architecture and the tensors written."""
    from localllm.quant.quantize_gguf import check_target

    out = Path(out)
    if out.exists() and not force:
        check_target(target)  # a bad --type is named first
        raise LocalLLMError(f"{out} exists; pass --force to overwrite it")
    checkpoint = read_checkpoint(hf_dir, target)
    write_checkpoint(checkpoint, out)
    return checkpoint.arch, checkpoint.items


def write_checkpoint(ck: Checkpoint, out: Path) -> None:
    """Write the GGUF under a temporary name (localllm.partial_file), then rename it to `out`."""
    with partial_output(out) as tmp:
        try:
            _write(tmp, ck)
        except UnicodeEncodeError as e:  # JSON can spell a lone surrogate ("\ud800"); UTF-8 cannot
            bad = quoted(e.object[max(0, e.start - 20) : e.end + 20])
            raise LocalLLMError(
                f"{ck.hf_dir}'s text is not valid Unicode: a lone surrogate in {bad}"
            ) from None
        os.replace(tmp, out)


def _write(path: Path, ck: Checkpoint) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    from localllm.quant.quantize_gguf import FILE_TYPES, QUANTIZATION_VERSION, Plan, convert_tensor
    from localllm.quant.types import QUANT_BY_NAME

    writer = GGUFWriter(path, ck.arch)
    writer.add_name(str(ck.config.get("_name_or_path") or ck.hf_dir.resolve().name))
    writer.add_file_type(FILE_TYPES[ck.target])
    writer.add_quantization_version(QUANTIZATION_VERSION)
    for key, value in ck.hparams.items():
        _add(writer, f"{ck.arch}.{key}", value)
    add_vocab(writer, ck.vocab, ck.special)
    for it in ck.items:
        rows = int(np.prod(it.shape[:-1], dtype=np.int64))
        nbytes = rows * QUANT_BY_NAME[it.target].row_bytes(it.shape[-1])
        raw = GGMLQuantizationType[it.target]
        writer.add_tensor_info(it.name, it.shape, np.dtype(np.float32), nbytes, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for it in ck.items:
        if it.target == MXFP4 and _is_mxfp4(it) and not norm_shift(ck.arch, it.name):
            writer.write_tensor_data(prepare(ck.arch, ck.config, it, raw=True))
            continue
        plan = Plan(it.name, it.shape, "F32", it.target)
        writer.write_tensor_data(
            convert_tensor(prepare(ck.arch, ck.config, it), GGMLQuantizationType.F32, plan)
        )
    writer.close()


def _add(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, int(value))
