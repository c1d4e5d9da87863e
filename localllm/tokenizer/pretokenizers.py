"""BPE pre-tokenizers: how text is cut into words before merges, keyed by GGUF `tokenizer.ggml.pre`.

Each entry is the list of regexes llama.cpp's llama-vocab.cpp applies for that pre-type, in order.
llama.cpp applies them one after another: every regex runs inside each piece the previous one left,
and the text between its matches is kept as a piece of its own. A later regex therefore never sees
across an earlier cut (with smollm, digits are isolated first, so "  1" splits as "  " + "1", not
" " + " " + "1" as the single GPT-2 regex would). `PreTokenizer.split` does the same.

The patterns are written for the `regex` package, whose `\\s` is Unicode White_Space, the same set
llama.cpp's own tables use. One known gap: llama.cpp's generic (std::regex) path does not count '~'
as \\p{S}; that matters only for pre-types whose regexes use \\p{S} (deepseek-v3), not for those
whose regex llama.cpp implements by hand (gpt-2 style, llama3).
"""

from __future__ import annotations

from collections.abc import Sequence

import regex

from localllm.errors import ModelFormatError

# GPT-2's regex without its final `|\s+`, exactly as llama.cpp lists it; the whitespace that
# alternative would take is kept anyway, as the gap between matches.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# The (?i:...) contractions are spelled out as llama.cpp does, so no case folding is involved.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
MINICPM5 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Upper/lower-case runs via lookahead, as llama.cpp rewrites them (non-ASCII letters count as both).
_UPPER = r"((?=[\p{L}])([^a-z]))"
_LOWER = r"((?=[\p{L}])([^A-Z]))"
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[一-龥ࠀ-一가-퟿]+"
# deepseek-llm's letters and punctuation as explicit ranges, copied from llama.cpp's table (it runs
# them through std::wregex, which has no \p{L}).
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5À-ÖØ-öø-ƺƼ-ƿ\u01c4-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-\u03f5Ϸ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ"
    "-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼ\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c"
    "-\u213f\u2145-\u2149ⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿ\ufb00-\ufb06\ufb13-\ufb17\uff21-"
    "\uff3a\uff41-\uff5a𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_DEEPSEEK3_MAIN = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (regexes, ignore_merges, add_bos default) per llama.cpp pre-type; names map to these below.
_PRE_TYPES: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
    "gpt2": ((GPT2,), False, False),
    "starcoder": ((r"\p{N}", GPT2), False, False),
    "llama3": ((LLAMA3,), True, True),
    "dbrx": ((LLAMA3,), False, False),
    "chatglm4": ((LLAMA3,), False, False),
    "qwen2": ((QWEN2,), False, False),
    "qwen35": ((QWEN35,), False, False),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"), False, False),
    "deepseek-coder": ((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), False, False),
    "deepseek-llm": (
        (
            r"[\r\n]",
            rf"\s?[{_DEEPSEEK_LLM_LETTERS}]+",
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            _CJK,
            r"\p{N}+",
        ),
        False,
        False,
    ),
    "deepseek3": ((r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3_MAIN), False, False),
    "bloom": ((r" ?[^(\s|.,!?…。，、।۔،)]+",), False, False),
    "viking": ((r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"), False, False),
    "tekken": ((TEKKEN,), True, True),
    "gpt4o": ((GPT4O,), False, False),
    "seed-coder": ((SEED_CODER,), False, False),
    "bailingmoe": ((BAILINGMOE,), False, False),
    "superbpe": ((r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))"), False, False),
    "ufakzeka": ((QWEN2[len(_CONTRACTIONS) + 1 :],), False, False),
    "minicpm5": ((r"\p{N}{1,3}", MINICPM5), True, False),
}

# GGUF `tokenizer.ggml.pre` names -> pre-type, following llama.cpp's llama_vocab::impl::load.
_ALIASES: dict[str, str] = {
    **{n: "default" for n in ("default", "")},
    **{
        n: "gpt2"
        for n in (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        )
    },
    **{
        n: "starcoder"
        for n in (
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        )
    },
    **{
        n: "llama3"
        for n in (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        )
    },
    **{n: "dbrx" for n in ("dbrx", "smaug-bpe")},
    **{n: "chatglm4" for n in ("glm4", "chatglm-bpe")},
    **{
        n: "qwen2"
        for n in (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        )
    },
    "qwen35": "qwen35",
    "falcon": "falcon",
    "deepseek-coder": "deepseek-coder",
    "deepseek-llm": "deepseek-llm",
    **{n: "deepseek3" for n in ("deepseek-v3", "hunyuan-dense", "joyai-llm")},
    **{n: "bloom" for n in ("bloom", "poro-chat", "gpt3-finnish")},
    "viking": "viking",
    "tekken": "tekken",
    **{n: "gpt4o" for n in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    "seed-coder": "seed-coder",
    **{n: "bailingmoe" for n in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "superbpe": "superbpe",
    "ufakzeka": "ufakzeka",
    "minicpm5": "minicpm5",
}


class PreTokenizer:
    """Splits text into the words BPE merges run on, the way llama.cpp's unicode_regex_split does."""

    def __init__(
        self, name: str, patterns: Sequence[str], ignore_merges: bool = False, add_bos: bool = False
    ) -> None:
        self.name = name
        self.patterns = tuple(patterns)
        self.ignore_merges = ignore_merges  # a word that is itself a token skips the merges (llama3)
        self.add_bos = add_bos  # llama.cpp's default when the GGUF has no add_bos_token key
        self._compiled = [regex.compile(p) for p in self.patterns]

    def split(self, text: str) -> list[str]:
        spans = [(0, len(text))] if text else []
        for pattern in self._compiled:
            spans = _split_spans(pattern, text, spans)
        return [text[s:e] for s, e in spans]


def _split_spans(pattern: regex.Pattern, text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Cut each span at `pattern`'s matches; gaps between matches stay as pieces; empty ones vanish."""
    out: list[tuple[int, int]] = []
    append = out.append
    for start, end in spans:
        pos = start
        for m in pattern.finditer(text, start, end):
            s, e = m.span()
            if s > pos:
                append((pos, s))
            if e > s:
                append((s, e))
            pos = max(pos, e)
        if pos < end:
            append((pos, end))
    return out


def get_pretokenizer(pre: str | None) -> PreTokenizer:
    """The pre-tokenizer for a GGUF `tokenizer.ggml.pre` value (None or "" -> llama.cpp's default)."""
    key = _ALIASES.get(pre or "")
    if key is None:
        raise ModelFormatError(f"BPE pre-tokenizer '{pre}' is not supported.")
    patterns, ignore_merges, add_bos = _PRE_TYPES[key]
    return PreTokenizer(key, patterns, ignore_merges, add_bos)


def supported_pretokenizers() -> list[str]:
    return sorted(n for n in _ALIASES if n)
