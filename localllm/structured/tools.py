"""Tool calling: each model family's call syntax, the grammar that forces a valid call, and the parser
that turns the model's text back into OpenAI `tool_calls`.

Families (picked from the chat template's text):
- hermes: Qwen2.5/Qwen3, Hermes, and the fallback for templates that know no tools:
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row for parallel calls.
- llama3: a bare JSON object `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`).
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- harmony (gpt-oss): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
  (`<|call|>` ends the generation: one call a reply). The reasoning parser (reasoning.HarmonyParser)
  rewrites such a message as the Hermes text above, so calls are read back and streamed as Hermes'.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from localllm.structured.call_scanner import CallScanner
from localllm.structured.spec import JSON_OPTIONS, StructuredSpec


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def rebased(schema: Any, root: str) -> Any:
    """A copy of `schema` with each local `$ref` ("#...") made relative to `root` (a JSON pointer
    "#/..."), iteratively: a schema may nest deeper than Python's recursion limit."""
    copy = json.loads(json.dumps(schema))
    stack = [copy]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                node[key] = root + value[1:]
            elif isinstance(value, dict | list):
                stack.append(value)
    return copy


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolFamily:
    name: str
    start: str  # the text that opens a call: content streams until it appears
    args_key: str  # "arguments" or "parameters"
    end: str = ""  # the text that closes a call, when the family has one

    def call_schema(self, tool: Tool, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON schema of one call of `tool` in this family's object shape (`arguments`: the
        schema of its arguments, when not the tool's parameters as given)."""
        return {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                self.args_key: arguments or tool.parameters or {"type": "object"},
            },
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }

    def calls_schema(self, tools: list[Tool]) -> dict[str, Any]:
        """One schema admitting a call of any of `tools`. A tool whose parameters use `$ref` (pydantic's
        `$defs`) moves to the root's `$defs`, its references rebased there: they point into its own
        parameters, which are no longer the document's root."""
        calls, defs = [], {}
        for i, tool in enumerate(tools):
            if "$ref" not in json.dumps(tool.parameters):
                calls.append(self.call_schema(tool))
                continue
            defs[f"tool{i}"] = rebased(tool.parameters, f"#/$defs/tool{i}")
            calls.append(self.call_schema(tool, {"$ref": f"#/$defs/tool{i}"}))
        schema: dict[str, Any] = {"anyOf": calls, "x-guidance": JSON_OPTIONS}
        return schema | ({"$defs": defs} if defs else {})

    @property
    def parsed_as(self) -> str:
        """The syntax its replies' text is read in (harmony's reaches the tool parser as Hermes')."""
        return "hermes" if self.name == "harmony" else self.name

    def grammar(self, tools: list[Tool], parallel: bool, terminal: Callable[[str], str]) -> StructuredSpec:
        """A Lark grammar that admits only calls of `tools` (one, or several when `parallel`).
        `terminal` writes a marker as a Lark terminal (a quoted string, or `<[id]>` for a special
        token)."""
        if self.name == "harmony":
            return harmony_grammar(tools, terminal)
        body = f"%json {json.dumps(self.calls_schema(tools))}"
        marker = terminal(self.start)
        if self.name == "hermes":
            call = f'{marker} "\\n" json_call "\\n</tool_call>"'
            start = 'start: call ("\\n" call)*\n' if parallel else "start: call\n"
            text = f"{start}call: {call}\njson_call: {body}\n"
        elif self.name == "mistral":
            calls = 'json_call (", " json_call)*' if parallel else "json_call"
            text = f'start: {marker} "[" {calls} "]"\njson_call: {body}\n'
        else:  # llama3: a bare object
            text = f"start: json_call\njson_call: {body}\n"
        return StructuredSpec("lark", text, "tool_choice")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content left around the calls, and the calls (none when the text holds no valid call)."""
        if self.parsed_as == "hermes":
            return _parse_hermes(text)
        if self.name == "mistral":
            return _parse_mistral(text)
        return _parse_llama3(text)

    def before_cut_call(self, text: str, names: set[str]) -> str:
        """A reply cut by a length limit without the call it was writing (from its marker, a partial
        marker, or a bare call's opening), and without a partial end marker after a whole call."""
        at = text.rfind(self.start)
        if at >= 0:
            if self.parse(text[at:])[1]:
                return text
            keep = _partial_suffix(text, self.end)
            return text[:-keep] if keep and self.parse(text[at:-keep])[1] else text[:at]
        keep = _partial_suffix(text, self.start)
        if keep:
            return text[:-keep]
        head = text.lstrip()
        if head and bare_call(text, names) is None and pending_bare_call(head, names, self.args_key):
            return text[: len(text) - len(head)]
        return text


FAMILIES = {
    "hermes": ToolFamily("hermes", "<tool_call>", "arguments", "</tool_call>"),
    "llama3": ToolFamily("llama3", "<|python_tag|>", "parameters"),
    "mistral": ToolFamily("mistral", "[TOOL_CALLS]", "arguments"),
    "harmony": ToolFamily("harmony", "<tool_call>", "arguments", "</tool_call>"),  # as HarmonyParser writes
}


# gpt-oss writes its arguments compact, as harmony's examples do: `{"location":"Tokyo"}`
HARMONY_JSON = {**JSON_OPTIONS, "item_separator": ",", "key_separator": ":"}


def harmony_grammar(tools: list[Tool], terminal: Callable[[str], str]) -> StructuredSpec:
    """A forced call in harmony's own framing: the reply is one commentary message to one of `tools`,
    its arguments a JSON document of that tool's schema (its own root: `$ref`s need no rebasing),
    ended by `<|call|>` as gpt-oss ends a call. The reply is the call, no analysis message first: a
    thought of unbounded length could not be closed in time by the budget steering."""
    markers = ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>")
    channel, constrain, message, call = map(terminal, markers)
    rules = []
    for i, tool in enumerate(tools):
        head = json.dumps(f"commentary to=functions.{tool.name} ")
        rules.append(f'call{i}: {channel} {head} {constrain} "json" {message} args{i} {call}')
        schema = {**(tool.parameters or {"type": "object"}), "x-guidance": HARMONY_JSON}
        rules.append(f"args{i}: %json {json.dumps(schema)}")
    start = "start: " + " | ".join(f"call{i}" for i in range(len(tools)))
    return StructuredSpec("lark", "\n".join([start, *rules]) + "\n", "tool_choice")


def harmony_final_grammar(spec: StructuredSpec, terminal: Callable[[str], str]) -> StructuredSpec:
    """A JSON response_format in harmony's framing: the reply is one `final` message whose text is the
    document (the harmony parser hands that text to `content`); without the framing the model would be
    made to write JSON where it writes a channel header. No analysis message first, as harmony_grammar."""
    schema = json.loads(spec.text) if spec.kind == "json_schema" else {"type": "object"}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    channel, message = terminal("<|channel|>"), terminal("<|message|>")
    text = f'start: {channel} "final" {message} answer\nanswer: %json {json.dumps(schema)}\n'
    return StructuredSpec("lark", text, spec.name)


def tool_family(template_source: str) -> ToolFamily:
    """The call syntax a chat template teaches its model (hermes when it teaches none)."""
    if "<|channel|>" in template_source and "<|message|>" in template_source:
        return FAMILIES["harmony"]
    if "[TOOL_CALLS]" in template_source:
        return FAMILIES["mistral"]
    if "<|python_tag|>" in template_source or (
        "<|start_header_id|>" in template_source and '"parameters"' in template_source
    ):
        return FAMILIES["llama3"]
    return FAMILIES["hermes"]


def template_knows_tools(template_source: str) -> bool:
    """Does the template render a `tools` variable? If not, tools go in a system message of ours."""
    return re.search(r"\btools\b", template_source) is not None


def _call_from(obj: Any, args_key: str = "arguments", raw: str | None = None) -> ToolCall | None:
    """The call in `obj` (parsed from `raw`, its text). Its arguments are the model's own text of the
    arguments object, as a stream sends them piece by piece (call_scanner.py), so a streamed call
    assembles to exactly these; re-serialised only when not written as an object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    text = raw_arguments(raw, args_key) if raw is not None else None
    return ToolCall(obj["name"], text or json.dumps(args, ensure_ascii=False), new_call_id())


def raw_arguments(raw: str, args_key: str) -> str | None:
    """The text of the arguments object in a call's JSON text (None if they are not an object)."""
    scanner = CallScanner(args_key)
    scanner.feed(raw)
    found = scanner.arguments()
    return found[0] if found is not None and found[1] else None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls, kept, last = [], [], 0
    for m in _HERMES.finditer(text):
        call = _call_from(_loads(m.group(1)), raw=m.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : m.start()])
        last = m.end()
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    parts = [p for p in body.split(";") if p.strip()] if body.startswith("{") else []
    calls = [_call_from(_loads(p), "parameters", p) for p in parts]
    if not calls or any(c is None for c in calls):
        return text, []
    return "", [c for c in calls if c is not None]


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    head, marker, tail = text.partition("[TOOL_CALLS]")
    if not marker:
        return text, []
    items = _loads(tail.strip())
    items = items if isinstance(items, list) else [items]
    calls = [_call_from(item) for item in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return head.strip(), [c for c in calls if c is not None]


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def bare_call(text: str, names: set[str]) -> ToolCall | None:
    """A reply that is only a call object (maybe in a ```json fence) naming one of `names`: small models
    often drop their family's markers (Qwen2.5-Coder-0.5B writes the JSON without <tool_call>)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    raw = fenced.group(1) if fenced else body
    call = _call_from(_loads(raw), raw=raw)
    return call if call is not None and call.name in names else None


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper start of `marker` (0: none)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


def pending_bare_call(head: str, names: set[str], args_key: str) -> bool:
    """Is `head` (a reply's start, no leading space) a call object still being written: open, and either
    naming one of `names` or, unnamed so far, holding nothing but a call's keys?"""
    if head.startswith("`"):
        fence = re.match(r"```(?:json)?[ \t]*\n?", head)
        if fence is None:
            return head in ("`", "``")  # a fence's start, or not a fence
        head = head[fence.end() :]
    if not head.startswith("{"):
        return head == ""  # an open fence with nothing after it yet
    scanner = CallScanner(args_key)
    scanner.feed(head)
    if scanner.failed or scanner.done:
        return False
    if scanner.name is not None:
        return scanner.name in names
    return set(scanner.values) <= {"name", "arguments", "parameters"}


def maybe_bare_call(text: str) -> bool:
    """Could this start of a reply become a bare call? (a stream holds it back until it knows)"""
    head = text.lstrip()
    return head == "" or head.startswith(("{", "`"))


def fallback_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Tools described Hermes-style, for a template that cannot render them itself."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call>'
    )
