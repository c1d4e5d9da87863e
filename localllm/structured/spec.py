"""What a constrained request asks for: a JSON schema, any JSON object, a grammar or a regex."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from localllm.errors import InvalidRequestError

Kind = Literal["json_object", "json_schema", "grammar", "lark", "regex"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "grammar", "lark", "regex")
# llguidance's JSON options: no free whitespace (a small model can pad a document with newlines until
# max_tokens), json.dumps' separators (the JSON models saw most), unknown keywords ignored, not refused.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """`kind` and its text: a JSON schema (as JSON text), a GBNF or Lark grammar ("grammar" accepts
    either, as llguidance reads both), or a regex. Frozen and hashable: compiled grammars are cached by
    it. `name` only labels errors ("response_format", "grammar", ...)."""

    kind: Kind
    text: str = ""
    name: str = "structured output"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{self.name}: unknown kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind != "json_object" and not self.text.strip():
            raise InvalidRequestError(f"{self.name}: the {self.kind} is empty")

    @classmethod
    def json_schema(cls, schema: Any, name: str = "json_schema") -> StructuredSpec:
        """From a schema given as a dict or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{name}: the schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{name}: a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema), name)  # property order kept: models follow it


def structured_from(
    json_schema: Any = None, grammar: str | None = None, regex: str | None = None
) -> StructuredSpec | None:
    """The Python API's keywords as a spec (at most one may be given; None: unconstrained)."""
    given = [name for name, v in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex)) if v]
    if len(given) > 1:
        raise InvalidRequestError(f"give one of json_schema, grammar and regex, not {' and '.join(given)}")
    if json_schema is not None:
        return StructuredSpec.json_schema(json_schema)
    if grammar is not None:
        return StructuredSpec("grammar", grammar, "grammar")
    return StructuredSpec("regex", regex, "regex") if regex is not None else None
