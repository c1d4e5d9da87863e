"""A tiny random llama model written as a real GGUF file, with a byte-level BPE vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "e n", "a n"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    tokens = list(SPECIALS) + [bytes_to_unicode()[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, MERGES


def write_vocabulary(
    writer,
    vocab: tuple[list[str], list[int], list[str]],
    unk: bool = False,
    chat_template: str = CHATML,
    eos_id: int = 2,
) -> None:
    """The byte-level BPE vocabulary, its special ids and the ChatML template, as every tiny writer
    stores them (same calls, same order: the fixtures' bytes, pinned by sha256, depend on it)."""
    tokens, types, merges = vocab
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos_id)
    if unk:
        writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)


class RandomTensors:
    """Random weights into a GGUFWriter: matrices (quantized to `quant` unless F32) and vectors near 1,
    in the order asked (test files are reproducible from their seed)."""

    def __init__(self, writer, rng: np.random.Generator, quant: str):
        import gguf

        self.w, self.rng, self.quant = writer, rng, quant
        self.qtype = getattr(gguf.GGMLQuantizationType, quant)

    def matrix(self, name: str, rows: int, cols: int, scale: float = 0.5) -> None:
        from gguf.quants import quantize

        data = (self.rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)
        if self.quant == "F32":
            self.w.add_tensor(name, data)
        else:
            self.w.add_tensor(name, quantize(data, self.qtype), raw_dtype=self.qtype)

    def vector(self, name: str, n: int, spread: float = 0.1) -> None:
        self.w.add_tensor(name, (1.0 + spread * self.rng.standard_normal(n)).astype(np.float32))


def write_tiny_model(
    path: Path,
    quant: str = "Q8_0",
    seed: int = 0,
    n_layers: int = 2,
    extra_metadata: dict | None = None,
    vocab: tuple[list[str], list[int], list[str]] | None = None,
    chat_template: str = CHATML,
    eos_id: int = 2,
) -> Path:
    """extra_metadata: more string keys, e.g. {"general.name": ...} (keys not written above);
    `vocab`, `chat_template`, `eos_id`: another vocabulary (tiny_think.py adds reasoning markers)."""
    import gguf

    rng = np.random.default_rng(seed)
    dim, ffn, heads, kv_heads = 64, 128, 4, 2
    head_dim = dim // heads
    tokens, types, merges = vocab or vocabulary()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    write_vocabulary(w, (tokens, types, merges), True, chat_template, eos_id)
    for key, value in (extra_metadata or {}).items():
        w.add_string(key, value)
    t = RandomTensors(w, rng, quant)
    matrix, vector = t.matrix, t.vector

    matrix("token_embd.weight", len(tokens), dim)
    vector("output_norm.weight", dim)
    for il in range(n_layers):
        p = f"blk.{il}"
        vector(f"{p}.attn_norm.weight", dim)
        vector(f"{p}.ffn_norm.weight", dim)
        matrix(f"{p}.attn_q.weight", dim, dim)
        matrix(f"{p}.attn_k.weight", kv_heads * head_dim, dim)
        matrix(f"{p}.attn_v.weight", kv_heads * head_dim, dim)
        matrix(f"{p}.attn_output.weight", dim, dim)
        matrix(f"{p}.ffn_gate.weight", ffn, dim)
        matrix(f"{p}.ffn_up.weight", ffn, dim)
        matrix(f"{p}.ffn_down.weight", dim, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
