"""The one terminal sanitizer: text from a file or a model made safe to print.

A terminal acts on some characters instead of showing them: C0/C1 controls and DEL (escape sequences
that clear the screen, set the window title or write to the clipboard start with ESC or the 8-bit
CSI/OSC), and Unicode format characters that are invisible or reorder what follows (bidi overrides
and isolates, zero-width spaces, tags). Each is shown as a Python-style escape (\\x1b, \\u202e) instead.
Lone surrogates (from JSON "\\ud800") are escaped too: printing one would raise UnicodeEncodeError.
The zero-width (non-)joiners are kept: emoji sequences and Indic and Persian text need them.

Every string that comes from a model file (metadata, names, templates, tokenizer files) or from a
model's output goes through `printable` before it reaches a terminal. No localllm imports here, so
every layer can use it.
"""

from __future__ import annotations

import re
from typing import Any

# Unicode's format characters (category Cf, up to Unicode 15.1) but ZWNJ/ZWJ (U+200C, U+200D);
# tests/test_printable.py checks this list against the running Python's unicodedata.
_FORMAT = (
    "\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b\u200e\u200f\u202a-\u202e"
    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f"
)
_OTHER = "\x7f-\x9f\u2028\u2029\ud800-\udfff"  # DEL, C1 controls, line/paragraph separators, surrogates
_UNSAFE = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHER}{_FORMAT}]")  # keeps newlines and tabs
_UNSAFE_ONE_LINE = re.compile(f"[\x00-\x1f{_OTHER}{_FORMAT}]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    if code < 0x100:
        return repr(match[0])[1:-1]  # \t, \n, \x1b, \x9b
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: Any, multiline: bool = False) -> str:
    """`str(text)` with every character a terminal would act on shown as an escape; `multiline` keeps
    newlines and tabs (chat templates, model replies), else they are escaped too (one-line fields)."""
    pattern = _UNSAFE if multiline else _UNSAFE_ONE_LINE
    return pattern.sub(_escape, str(text))
