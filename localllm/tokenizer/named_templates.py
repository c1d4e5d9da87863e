"""Chat templates known by name (for models without one, e.g. base models): `--chat-template chatml`
on the command line, or `chat_template = "chatml"` in models.toml; and the one rule that turns a user's
template value (a name, Jinja text or a file) into template text. No Jinja import: the registry reads
these while parsing models.toml."""

from __future__ import annotations

from pathlib import Path

from localllm.errors import ConfigError


class TemplateError(ConfigError):
    """A chat template that cannot be read, compiled or rendered, or that rejected the conversation."""


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NAMED_TEMPLATES = {"chatml": CHATML}


def named_template(value: str) -> str | None:
    """The template a name stands for, or None when `value` is not a known name."""
    return NAMED_TEMPLATES.get(value.strip().lower())


def is_template_text(value: str) -> bool:
    """Jinja markup means inline template text; anything else is a name or a file path."""
    return "{{" in value or "{%" in value or "\n" in value


def template_text(value: str) -> str:
    """A user's template value as Jinja text: a known name ("chatml"), the text itself, or a file."""
    if is_template_text(value):
        return value
    named = named_template(value)
    if named is not None:
        return named
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or "not UTF-8 text"
        raise TemplateError(
            f"cannot read the chat template file {path}: {reason} (pass a file, Jinja text or 'chatml')."
        ) from None
