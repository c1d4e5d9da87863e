"""Tokenizer files <-> a GGUF vocabulary, as llama.cpp's convert_hf_to_gguf reads them (no tokenizers or
transformers package): tokenizer.model (SentencePiece) when there is one, else tokenizer.json's BPE.

Token types follow llama.cpp: an added token is CONTROL when marked special or when it looks special
(`<|...|>`), else USER_DEFINED; ids below config.json's vocab_size that the tokenizer lacks become
UNUSED `[PAD{i}]` tokens.  The BPE pre-tokenizer name (tokenizer.ggml.pre) is recognised from
tokenizer.json's pre_tokenizer (llama.cpp hashes a test string's tokens instead; we cannot run the
Hugging Face tokenizer), for the pre-tokenizers of the families we convert.  Special token ids,
add_bos/add_eos, merges and the chat template come from gguf's SpecialVocab (llama.cpp's own reader).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.convert.check import MAX_BYTES, MAX_VOCAB, MIB, quoted, read_json
from localllm.convert.spm_proto import SpmModel, read_spm, write_spm
from localllm.errors import LocalLLMError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
_BYTES_REGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


# tokenizer.ggml.pre -> the pre_tokenizer of the Hugging Face tokenizer.json it stands for
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "qwen2": {
        "type": "Sequence",
        "pretokenizers": [_split(_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL), _BYTES],
    },
    "llama-bpe": {
        "type": "Sequence",
        "pretokenizers": [_split(_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL), _BYTES],
    },
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTES_REGEX],
    },
    "gpt-2": _BYTES_REGEX,
}


def _signature(pre: dict[str, Any] | None) -> tuple:
    """What decides the splitting: each step's kind and pattern (offsets/prefix flags aside)."""
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else [pre] if pre else []
    out: list[tuple] = []
    for s in steps if isinstance(steps, list) else [steps]:
        if not isinstance(s, dict):
            out.append((repr(s),))  # matches no known one: refused below
            continue
        kind = s.get("type")
        if kind == "Split":
            pattern = s.get("pattern")
            regex = pattern.get("Regex") if isinstance(pattern, dict) else None
            out.append(("Split", regex, s.get("behavior")))
        elif kind == "Digits":
            out.append(("Digits", s.get("individual_digits")))
        elif kind == "ByteLevel":
            out.append(("ByteLevel", s.get("use_regex", True)))
        else:
            out.append((kind,))
    return tuple(out)


def pre_name(pre: dict[str, Any] | None) -> str:
    sig = _signature(pre)
    for name, known in PRE_TOKENIZERS.items():
        if _signature(known) == sig:
            return name
    raise LocalLLMError(
        f"tokenizer.json's pre-tokenizer {json.dumps(pre)[:200]} is not one localllm convert knows "
        f"({', '.join(PRE_TOKENIZERS)})"
    )


@dataclass(slots=True)
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    add_space_prefix: bool | None = None


def looks_special(token: str) -> bool:
    """llama.cpp's does_token_look_special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def load_vocab(hf_dir: Path, n_vocab: int | None, max_tokens: int = MAX_VOCAB) -> Vocab:
    """The vocabulary of `hf_dir`'s tokenizer files; every token id below `max_tokens` (the embedding's
    rows), checked before the list of tokens is made."""
    spm = hf_dir / "tokenizer.model"
    if spm.is_file():
        if spm.stat().st_size > MAX_BYTES["tokenizer.model"]:
            raise LocalLLMError(f"{spm} is {spm.stat().st_size / MIB:,.0f} MiB; not a SentencePiece model")
        return _spm_vocab(read_spm(spm.read_bytes()), n_vocab, max_tokens)
    tok = read_json(hf_dir / "tokenizer.json")
    if tok is None:
        raise LocalLLMError(f"{hf_dir} has no tokenizer.json or tokenizer.model")
    return _bpe_vocab(tok, n_vocab, max_tokens)


def _check_count(n: int, max_tokens: int, what: str) -> None:
    if n > max_tokens:
        raise LocalLLMError(f"{what} has {n:,} tokens, more than the embedding's {max_tokens:,} rows")


def _spm_vocab(spm: SpmModel, n_vocab: int | None, max_tokens: int = MAX_VOCAB) -> Vocab:
    _check_count(len(spm.pieces), max_tokens, "tokenizer.model")
    n = max(n_vocab or 0, len(spm.pieces))
    pad = range(len(spm.pieces), n)
    return Vocab(
        "llama",
        "default",
        spm.pieces + [f"[PAD{i}]" for i in pad],
        spm.types + [UNUSED] * len(pad),
        spm.scores + [-10000.0] * len(pad),
        spm.add_dummy_prefix,
    )


def _bpe_vocab(tok: Any, n_vocab: int | None, max_tokens: int = MAX_VOCAB) -> Vocab:
    model = tok.get("model") if isinstance(tok, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise LocalLLMError(f"tokenizer.json's model is {quoted(kind)}; localllm convert reads BPE")
    by_id = _token_ids(model.get("vocab"), tok.get("added_tokens", []), max_tokens)
    _check_merges(model.get("merges"))
    n = max(n_vocab or 0, max(by_id) + 1)
    tokens, types = [], []
    for i in range(n):
        text, kind = by_id.get(i, (f"[PAD{i}]", UNUSED))
        tokens.append(text)
        types.append(kind)
    return Vocab("gpt2", pre_name(tok.get("pre_tokenizer")), tokens, types)


def _token_ids(vocab: Any, added: Any, max_tokens: int) -> dict[int, tuple[str, int]]:
    """id -> (text, type) from tokenizer.json's vocab and added_tokens, every id range-checked."""
    if not isinstance(vocab, dict) or not isinstance(added, list):
        raise LocalLLMError("tokenizer.json's model.vocab must be an object and added_tokens a list")
    by_id = {_token_id(i, t, max_tokens): (t, NORMAL) for t, i in vocab.items()}
    for entry in added:
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str):
            raise LocalLLMError(f"tokenizer.json: added token {quoted(entry)} has no content string")
        i = _token_id(entry.get("id"), content, max_tokens)
        special = entry.get("special") or looks_special(content)
        by_id[i] = (content, CONTROL) if special else (content.replace("▁", " "), USER_DEFINED)
    if not by_id:
        raise LocalLLMError("tokenizer.json holds no tokens")
    return by_id


def _token_id(i: Any, token: str, max_tokens: int) -> int:
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < max_tokens:
        raise LocalLLMError(
            f"tokenizer.json: token {quoted(token)} has id {quoted(i)}; ids go from 0 to "
            f"{max_tokens - 1:,} (the embedding's rows)"
        )
    return i


def _check_merges(merges: Any) -> None:
    """Merges as gguf's SpecialVocab reads them: all "a b" strings, or all [a, b] pairs."""
    if merges is None:
        return
    ok = isinstance(merges, list) and (
        all(isinstance(m, str) for m in merges)
        or all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m) for m in merges)
    )
    if not ok:
        raise LocalLLMError('tokenizer.json\'s merges must be all "a b" strings or all [a, b] pairs')


def special_vocab(hf_dir: Path, vocab: Vocab) -> Any:
    """gguf's SpecialVocab (special token ids, add_bos/add_eos, merges, chat template) of `hf_dir`;
    its reader trusts the files' structure, so what it trips on becomes one LocalLLMError."""
    from gguf import SpecialVocab

    config = read_json(hf_dir / "tokenizer_config.json")
    if not isinstance(config if config is not None else {}, dict):
        raise LocalLLMError(f"{hf_dir / 'tokenizer_config.json'} is not a JSON object")
    try:
        special = SpecialVocab(hf_dir, load_merges=vocab.model == "gpt2", n_vocab=len(vocab.tokens))
    except (AttributeError, TypeError, KeyError, IndexError, ValueError, RecursionError) as e:
        raise LocalLLMError(f"the tokenizer files in {hf_dir} are malformed ({quoted(e)})") from None
    except OSError as e:
        raise LocalLLMError(f"cannot read the tokenizer files in {hf_dir}: {e}") from None
    if vocab.model == "gpt2" and not special.merges:
        raise LocalLLMError(f"{hf_dir}/tokenizer.json has no BPE merges")
    template = special.chat_template
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in template
    )
    if template is not None and not isinstance(template, str) and not named:
        raise LocalLLMError(f"{hf_dir}: chat_template must be a string or a list of named templates")
    return special


def add_vocab(writer: Any, vocab: Vocab, special: Any) -> None:
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    special.add_to_gguf(writer, quiet=True)


# ---- the inverse: a GGUF vocabulary -> tokenizer files --------------------------------------------

# Hugging Face's special token kinds -> GGUF's key (gguf's spelling)
SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "sep": "seperator", "pad": "padding"}


def write_tokenizer_files(meta: dict[str, Any], out: Path) -> dict[str, int]:
    """tokenizer.json or tokenizer.model, and tokenizer_config.json, for GGUF metadata `meta`; returns
    the special token ids (for config.json)."""
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    model = meta["tokenizer.ggml.model"]
    keys = {k: f"tokenizer.ggml.{g}_token_id" for k, g in SPECIAL_KEYS.items()}
    ids = {k: int(meta[key]) for k, key in keys.items() if key in meta}
    real = [i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k != UNUSED or t != f"[PAD{i}]"]
    if model == "llama":
        scores = list(meta["tokenizer.ggml.scores"])
        spm = SpmModel([tokens[i] for i in real], [scores[i] for i in real], [types[i] for i in real])
        spm.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        (out / "tokenizer.model").write_bytes(write_spm(spm))
    elif model == "gpt2":
        _write_tokenizer_json(meta, tokens, types, real, out)
    else:
        raise LocalLLMError(f"cannot export a {model!r} vocabulary (gpt2 or llama only)")
    config: dict[str, Any] = {f"{k}_token": tokens[i] for k, i in ids.items()}
    for k in ("bos", "eos"):
        config[f"add_{k}_token"] = bool(meta.get(f"tokenizer.ggml.add_{k}_token", False))
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    config["added_tokens_decoder"] = {
        str(i): {"content": tokens[i], "special": types[i] == CONTROL, "normalized": False}
        for i in real
        if types[i] in (CONTROL, USER_DEFINED)
    }
    text = json.dumps(config, indent=1, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return ids


def _write_tokenizer_json(meta: dict, tokens: list, types: list, real: list[int], out: Path) -> None:
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise LocalLLMError(f"cannot export the {pre!r} pre-tokenizer ({', '.join(PRE_TOKENIZERS)})")
    added = [i for i in real if types[i] in (CONTROL, USER_DEFINED)]
    tok = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": tokens[i], "special": types[i] == CONTROL} for i in added],
        "normalizer": {"type": "NFC"} if pre == "qwen2" else None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "vocab": {tokens[i]: i for i in real if types[i] not in (CONTROL, USER_DEFINED)},
            "merges": [m.split(" ", 1) for m in meta["tokenizer.ggml.merges"]],
        },
    }
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
