"""Budgets for rendering a chat template: a GGUF's template is an untrusted program.

Jinja's sandbox stops attribute tricks but not cost: nested `range(100000)` loops run for hours, and
`'x' * 3000000000` or `'{0:>3000000000}'.format(1)` build gigabytes in one expression. A render here
gets a step budget and a deadline (counted on the template's own lines by a trace function on the
rendering thread, so it ends by itself: no thread is left running), a cap on its output, and
operations that could build a huge value in one step (`*`, `**`, `%`, a call or filter given a huge
number, a huge format width) checked before they run.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from localllm.errors import LocalLLMError

TEMPLATE_FILE = "<template>"  # the file name Jinja compiles template code under
_WIDTH = re.compile(r"\d{7,}")  # a number of 7+ digits in a format spec: a width of a million or more


class TemplateBudgetError(LocalLLMError):
    """A chat template that ran past its budget (steps, time, output size or one huge value)."""


@dataclass(frozen=True, slots=True)
class TemplateBudget:
    """What one render may cost. Real templates take a few thousand steps and a small fraction of the
    time allowed."""

    max_steps: int = 2_000_000  # lines of template code executed
    max_seconds: float = 2.0
    max_chars: int = 8 << 20  # the rendered prompt
    max_number: int = 1_000_000  # an int given to `*`, `**`, a call or a filter


def check_number(value: Any, budget: TemplateBudget, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > budget.max_number:
        raise TemplateBudgetError(
            f"the chat template {what} with {value:,}, over the limit of {budget.max_number:,}"
        )


def check_size(value: Any, budget: TemplateBudget, what: str) -> None:
    if isinstance(value, str | list | tuple | bytes) and len(value) > budget.max_chars:
        raise TemplateBudgetError(
            f"the chat template {what} with a value of {len(value):,} items, over the limit of "
            f"{budget.max_chars:,}"
        )


def check_binop(operator: str, left: Any, right: Any, budget: TemplateBudget) -> None:
    """Refuse `*` / `**` / `%` / `+` that would build a huge value, before Python builds it."""
    if operator == "**":
        check_number(right, budget, "raises a number to a power")
    elif operator == "*":
        for count, other in ((left, right), (right, left)):
            if isinstance(other, str | list | tuple | bytes) and isinstance(count, int):
                check_number(count * max(len(other), 1), budget, "repeats a value")
    elif operator == "%" and isinstance(left, str):
        check_format(left)
    elif operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
        if len(left) + len(right) > budget.max_chars:
            raise TemplateBudgetError(
                f"the chat template joins two values into {len(left) + len(right):,} items, over the "
                f"limit of {budget.max_chars:,}"
            )


def check_format(text: str) -> None:
    if _WIDTH.search(text):
        raise TemplateBudgetError("the chat template formats a value with a huge width")


def check_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any], budget: TemplateBudget) -> None:
    name = getattr(obj, "__name__", "a function")
    for value in (*args, *kwargs.values()):
        check_number(value, budget, f"calls {name}")
        check_size(value, budget, f"calls {name}")
    owner = getattr(obj, "__self__", None)
    if name in ("format", "format_map") and isinstance(owner, str):
        check_format(owner)


class Meter:
    """Counts the template's steps on the rendering thread (sys.settrace) and ends the render, by
    raising inside it, once the step budget or the deadline is spent."""

    def __init__(self, budget: TemplateBudget):
        self.budget = budget
        self.steps = 0
        self.deadline = time.monotonic() + budget.max_seconds

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        return self._local if frame.f_code.co_filename == TEMPLATE_FILE else None

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        self.steps += 1
        if self.steps > self.budget.max_steps:
            raise TemplateBudgetError(f"the chat template ran past {self.budget.max_steps:,} steps")
        if not self.steps % 4096 and time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"the chat template ran past {self.budget.max_seconds:g} s")
        return self._local

    def render(self, template: Any, context: dict[str, Any]) -> str:
        """`template` rendered with `context`, within the budget."""
        previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            chunks, size = [], 0
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > self.budget.max_chars:
                    raise TemplateBudgetError(
                        f"the chat template's output passed {self.budget.max_chars:,} characters"
                    )
                chunks.append(chunk)
            return "".join(chunks)
        except MemoryError:
            raise TemplateBudgetError("the chat template ran out of memory") from None
        finally:
            sys.settrace(previous)
