"""Chat templates: the model's Jinja template (GGUF `tokenizer.chat_template`) rendered the way
Hugging Face transformers renders it, then tokenized the way llama.cpp does.

The environment matches transformers' `_compile_jinja_template`: a sandbox, trim_blocks and
lstrip_blocks, loop controls, `raise_exception`, a non-escaping `tojson`, `strftime_now`, and the
`{% generation %}` block (rendered as its plain content).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from localllm.errors import LocalLLMError
from localllm.tokenizer.named_templates import (  # noqa: F401 (re-exported)
    CHATML,
    NAMED_TEMPLATES,
    TemplateError,
    named_template,
    template_text,
)
from localllm.tokenizer.template_budget import (
    Meter,
    TemplateBudget,
    TemplateBudgetError,
    check_binop,
    check_call,
    check_format,
    check_size,
)

PROBE = ({"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"})


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template rejected the conversation: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON, as in transformers.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _generation_block() -> type:
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class _GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return _GenerationBlock


def _environment(budget: TemplateBudget) -> Any:
    # jinja2 is imported here, when a template is compiled: memory a run without one never needs
    env = _budgeted_class()(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_block()]
    )
    env.budget = budget
    env.filters = {name: _checked_filter(f, budget) for name, f in env.filters.items()}
    env.filters["tojson"] = _tojson
    env.globals.pop("lipsum", None)  # generates text by the paragraph: a size bomb no template needs
    env.globals["namespace"] = _checked_namespace(budget)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.cache
def _budgeted_class() -> type:
    """The sandbox with `*`, `**` and `%` intercepted (so neither a render nor Jinja's constant folding
    at compile time builds a huge value) and every call's arguments checked."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})
        budget = TemplateBudget()

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            check_binop(operator, left, right, self.budget)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            check_call(__obj, args, kwargs, __self.budget)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value: Any) -> Any:  # Jinja >= 3.1.5 wraps str.format on access
            owner = getattr(value, "__self__", None)
            if getattr(value, "__name__", "") in ("format", "format_map") and isinstance(owner, str):
                check_format(owner)
            return super().wrap_str_format(value)

    return BudgetedEnvironment


def _checked_namespace(budget: TemplateBudget) -> type:
    """Jinja's `namespace`, refusing a value past the budget (a loop doubling a string in one)."""
    from jinja2.utils import Namespace

    class CheckedNamespace(Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            check_size(value, budget, "stores a value")
            super().__setitem__(name, value)

    return CheckedNamespace


def _checked_filter(fn: Any, budget: TemplateBudget) -> Any:
    """A Jinja filter whose arguments are checked first (`'x'|center(3000000000)`)."""

    @functools.wraps(fn)  # keeps jinja_pass_arg, so context-taking filters still get it
    def checked(*args: Any, **kwargs: Any) -> Any:
        check_call(fn, args[1:], kwargs, budget)
        return fn(*args, **kwargs)

    return checked


class ChatTemplate:
    """A compiled chat template plus the BOS/EOS texts it may refer to."""

    def __init__(
        self,
        template_text: str,
        bos_token: str = "",
        eos_token: str = "",
        budget: TemplateBudget | None = None,
    ):
        self.source = template_text
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.budget = budget or TemplateBudget()
        import jinja2

        try:
            self._template = _environment(self.budget).from_string(template_text)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"the chat template has a syntax error on line {e.lineno}: {e.message}."
            ) from None
        except (MemoryError, RecursionError) as e:
            raise TemplateError(f"the chat template cannot be compiled: {type(e).__name__}.") from None
        self._probe()

    def _probe(self) -> None:
        """Render a short conversation once, so a template that blows its budget on every conversation
        is refused when it is loaded, not on each request (other errors wait for a real conversation)."""
        try:
            self.render(PROBE, add_generation_prompt=True)
        except TemplateBudgetError as e:
            raise TemplateError(f"{e}, on a two-line conversation: it cannot be used.") from None
        except TemplateError:
            pass

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], override: str | None = None) -> ChatTemplate | None:
        """The GGUF's template (or `override`, template text), None when there is neither."""
        text = override or metadata.get("tokenizer.chat_template")
        if not text:
            return None
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        return cls(str(text), _token_text(tokens, metadata, "bos"), _token_text(tokens, metadata, "eos"))

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages`; extra keyword arguments (tools, ...) reach the template."""
        import jinja2

        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        context |= {"messages": list(messages), "add_generation_prompt": add_generation_prompt}
        try:
            return Meter(self.budget).render(self._template, context)
        except (TemplateError, TemplateBudgetError):
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed to render: {_one_line(e)}.") from None
        except Exception as e:  # the template called something that failed (a bad index, 1/0, ...)
            raise TemplateError(
                f"the chat template failed to render: {type(e).__name__}: {_one_line(e)}."
            ) from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()).rstrip(".") or type(error).__name__


def _token_text(tokens: Sequence[str], metadata: Mapping[str, Any], role: str) -> str:
    tid = metadata.get(f"tokenizer.ggml.{role}_token_id")
    if tid is None or not 0 <= int(tid) < len(tokens):
        return ""
    return str(tokens[int(tid)])


def apply_chat_template(
    tokenizer: Any,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    continue_final: bool = False,
    **kwargs: Any,
) -> list[int]:
    """Render and tokenize a conversation like llama.cpp's chat path.

    The text is tokenized with parse_special=True. Where the model adds BOS itself, a BOS the
    template wrote at the start is dropped first (and likewise a trailing EOS), so no token appears
    twice - what llama.cpp's common_chat_template_direct_apply does. `continue_final` leaves the last
    message open (assistant prefill): the text ends with its content.
    """
    text = template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final:
        text = open_final_message(text, messages[-1].get("content") or "")
    bos, eos = template.bos_token, template.eos_token
    if tokenizer.add_bos and bos and text.startswith(bos):
        text = text[len(bos) :]
    if tokenizer.add_eos and eos and text.endswith(eos):
        text = text[: -len(eos)]
    return tokenizer.encode(text, add_special=True, parse_special=True)


def open_final_message(text: str, content: str) -> str:
    """`text` (a rendered conversation) cut right after the last message's content, so the model goes
    on writing that message (what vLLM's continue_final_message and transformers do). A template that
    trims the content is matched on the trimmed text."""
    for wanted in (content, content.strip()):
        at = text.rfind(wanted) if wanted else -1
        if at >= 0:
            return text[: at + len(wanted)]
    raise LocalLLMError("the final message's content is not in the rendered prompt: it cannot be continued")


# ------------------------------------------------------------------ which template: the one rule

TEMPLATE_HINT = "give one (a Jinja template, a file holding one, or 'chatml') or use a raw prompt"


def chat_template_source(value: str | None, configured: str | None = None) -> str | None:
    """The template text chosen for the model: the caller's `value` (a name, Jinja text or a file:
    --chat-template, `LLM(chat_template=...)`) over `configured` (the models.toml entry's, already
    text); None means the GGUF's own template."""
    return template_text(value) if value else configured


def resolve_chat_template(
    metadata: Mapping[str, Any], value: str | None = None, configured: str | None = None
) -> ChatTemplate | None:
    """The template a conversation is rendered with, the same in run, chat, serve and the Python API:
    the caller's `value` > the models.toml entry's `configured` > the GGUF's tokenizer.chat_template.
    None when there is none of them."""
    return ChatTemplate.from_metadata(metadata, override=chat_template_source(value, configured))


def require_chat_template(
    metadata: Mapping[str, Any],
    model_name: str,
    value: str | None = None,
    configured: str | None = None,
    hint: str = TEMPLATE_HINT,
) -> ChatTemplate:
    """resolve_chat_template, refusing a model with no template in one sentence."""
    template = resolve_chat_template(metadata, value, configured)
    if template is None:
        raise TemplateError(f"{model_name} has no chat template (is it a base model?); {hint}.")
    return template
