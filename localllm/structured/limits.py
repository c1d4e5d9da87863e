"""Bounds on a grammar before anything compiles it: a grammar is an untrusted program.

llguidance recurses once per link of a chain of rules (or of `$ref`s), a few KB of stack each, so
a request with a few thousand chained rules overflowed an 8 MiB thread stack and killed the server
(SIGSEGV). Three layers keep that and slow compiles away from the server: these static bounds (far below
what crashes the library), validation in a child process with a time and memory budget (sandbox.py), and
compilation on a thread with a large stack (matcher.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from localllm.errors import InvalidRequestError
from localllm.structured.spec import StructuredSpec

# A rule definition in Lark (`name:`, `?name:`, `NAME.2:`) or GBNF (`name ::=`) at the start of a line.
MAX_CHOICES = 2_000  # guided_choice: llguidance's row limit (max_items_in_row); past it, choices leak
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?:::=|:)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one constraint may cost. Defaults are far above real schemas and grammars (a JSON grammar is
    ~30 rules, a tool schema a few dozen `$ref`s) and far below what breaks llguidance (a few thousand
    chained rules on an 8 MiB stack: the sandbox validates on `sandbox_stack` and the server compiles on
    `compile_stack`, both far larger)."""

    max_bytes: int = 256 * 1024  # the schema (as JSON text) or grammar text
    max_rules: int = 2_000  # rule definitions in a Lark/GBNF grammar
    max_refs: int = 1_000  # `$ref`s in a JSON schema
    timeout_s: float = 2.0  # the sandbox's time to turn a spec into a grammar and validate it
    memory_bytes: int = 2 << 30  # the sandbox's address space
    sandbox_stack: int = 32 << 20  # the sandbox's validating thread
    compile_stack: int = 256 << 20  # the compile threads: 8x the sandbox's, so what validated compiles
    sandbox_workers: int = 2  # child processes validating at once


def check_bounds(spec: StructuredSpec, limits: GrammarLimits) -> None:
    """Refuse, naming the limit, a spec that is larger or more deeply chained than `limits` allow."""
    size = len(spec.text.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_bytes:
        raise InvalidRequestError(
            f"{spec.name}: the {spec.kind} is {size:,} bytes; the limit is {limits.max_bytes:,}"
        )
    if spec.kind in ("grammar", "lark"):
        rules = len(_RULE.findall(spec.text))
        if rules > limits.max_rules:
            raise InvalidRequestError(
                f"{spec.name}: the grammar defines {rules:,} rules; the limit is {limits.max_rules:,}"
            )
    if spec.kind == "json_schema":
        refs = spec.text.count('"$ref"')
        if refs > limits.max_refs:
            raise InvalidRequestError(
                f"{spec.name}: the schema has {refs:,} $refs; the limit is {limits.max_refs:,}"
            )
