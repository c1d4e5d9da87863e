"""The one terminal sanitizer (localllm.printable): what it escapes, what it keeps, and that every
place that prints a file's or a model's text uses it."""

from __future__ import annotations

import sys
import unicodedata

import pytest

from localllm.printable import printable

KEPT_FORMAT = {"\u200c", "\u200d"}  # ZWNJ, ZWJ: emoji sequences and Persian/Indic text need them


def test_every_control_and_format_character_is_escaped() -> None:
    unsafe = [
        chr(c)
        for c in range(sys.maxunicode + 1)
        if unicodedata.category(chr(c)) in ("Cc", "Cf", "Cs", "Zl", "Zp") and chr(c) not in KEPT_FORMAT
    ]
    assert len(unsafe) > 2000  # C0, C1, DEL, bidi, tags, surrogates, ...
    for ch in unsafe:
        shown = printable(f"a{ch}b")
        assert shown != f"a{ch}b" and shown.isascii(), (hex(ord(ch)), shown)
    for ch in ("\n", "\t"):
        assert printable(ch, multiline=True) == ch and printable(ch) == repr(ch)[1:-1]


def test_escapes_read_like_python_and_text_is_untouched() -> None:
    hostile = "evil\x1b]0;pwned\x07\x1b[2J\x9b31m\u202etxt\u2066\ud800\U000e0041\r"
    assert printable(hostile) == r"evil\x1b]0;pwned\x07\x1b[2J\x9b31m\u202etxt\u2066\ud800\U000e0041\r"
    text = "Héllo, 世界! 👨\u200d👩\u200d👧 می\u200cخواهم [bold] \\x1b"
    assert printable(text) == text and printable(text, multiline=True) == text
    printable(hostile).encode("utf-8")  # a lone surrogate no longer breaks printing
    assert printable(42) == "42"


@pytest.mark.parametrize("module", ["localllm.chat.repl", "localllm.model_info", "localllm.cli.tables"])
def test_one_sanitizer(module: str) -> None:
    import importlib

    assert importlib.import_module(module).printable is printable
