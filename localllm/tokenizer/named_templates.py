"""Chat templates known by name (for models without one, e.g. base models): `--chat-template chatml`
on the command line, or `chat_template = "chatml"` in models.toml. No Jinja import: the registry reads
these names while parsing models.toml."""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NAMED_TEMPLATES = {"chatml": CHATML}


def named_template(value: str) -> str | None:
    """The template a name stands for, or None when `value` is not a known name."""
    return NAMED_TEMPLATES.get(value.strip().lower())
