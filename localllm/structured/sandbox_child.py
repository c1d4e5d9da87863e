"""The grammar sandbox's child process: turns a spec's text into an llguidance grammar and validates it.

Run by sandbox.py as `python -m localllm.structured.sandbox_child STACK_BYTES MEMORY_BYTES`. It reads
requests from stdin and writes answers to stdout, each a 4-byte big-endian length and a JSON object:
{"kind", "text"} in, {"grammar"} or {"error"} out. A grammar that crashes llguidance, or runs past its
time, ends this process, never the server. GBNF is converted to Lark here too (in Python, quadratic in
the worst case: the time budget bounds it).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import threading
from typing import Any, BinaryIO

from localllm.structured.spec import JSON_OPTIONS


def grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar for a spec's kind and text (not validated yet)."""
    import llguidance

    m = llguidance.LLMatcher
    if kind == "json_object":
        return m.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "json_schema":
        return m.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "regex":
        return m.grammar_from_regex(text)
    if kind == "lark":
        return m.grammar_from_lark(text)
    return llguidance.grammar_from("grammar", text)  # GBNF, or Lark: llguidance reads both


def answer(request: dict[str, Any]) -> dict[str, str]:
    import llguidance

    try:
        grammar = grammar_text(request["kind"], request["text"])
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RecursionError) as e:
        return {"error": str(e).strip() or type(e).__name__}
    except MemoryError:
        return {"error": "compiling it needs more memory than a grammar may use"}
    return {"error": error.strip()} if error else {"grammar": grammar}


def send(answers: BinaryIO, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    answers.write(struct.pack(">I", len(data)) + data)
    answers.flush()


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    send(answers, {"ready": "1"})  # the parent's time budget starts after this process's start-up
    while len(head := requests.read(4)) == 4:
        (size,) = struct.unpack(">I", head)
        send(answers, answer(json.loads(requests.read(size))))


def main() -> None:
    stack, memory = int(sys.argv[1]), int(sys.argv[2])
    import llguidance  # noqa: F401  (loaded before the memory limit applies)

    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the library prints goes to stderr, not into the answers
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    threading.stack_size(stack)
    worker = threading.Thread(target=serve, args=(sys.stdin.buffer, answers), name="grammar-sandbox")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
