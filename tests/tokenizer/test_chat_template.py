"""Chat templates: HF-compatible Jinja rendering and llama.cpp-style tokenization of the result."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from paths import DATA

from localllm.errors import LocalLLMError
from localllm.tokenizer import load_tokenizer
from localllm.tokenizer.chat_template import ChatTemplate, TemplateError, apply_chat_template
from localllm.tokenizer.template_budget import TemplateBudget, TemplateBudgetError

# SmolLM2-135M-Instruct's template, as stored in its GGUF.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye?"},
]


@pytest.fixture()
def smollm2_template() -> ChatTemplate:
    return ChatTemplate(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>")


def test_smollm2_template_full_conversation(smollm2_template: ChatTemplate) -> None:
    text = smollm2_template.render(CONVERSATION)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_template_default_system_and_no_generation_prompt(smollm2_template: ChatTemplate) -> None:
    text = smollm2_template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text == DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"


def test_trim_and_lstrip_blocks_like_hf() -> None:
    template = ChatTemplate("  {% for m in messages %}\n    {{ m.content }}\n  {% endfor %}\n")
    assert template.render([{"content": "a"}, {"content": "b"}]) == "    a\n    b\n"


def test_bos_eos_and_extra_variables() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ extra }}", "<s>", "</s>"
    )
    assert template.render([{"role": "user", "content": "x"}], extra="!") == "<s>x</s>!"


def test_raise_exception_becomes_template_error() -> None:
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Roles must alternate') }}{% endif %}"
    )
    with pytest.raises(TemplateError, match="Roles must alternate") as info:
        template.render([{"role": "assistant", "content": "x"}])
    assert isinstance(info.value, LocalLLMError)


def test_tojson_is_plain_json() -> None:
    template = ChatTemplate("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}")
    tools = [{"name": "café <b>", "n": 1}]
    plain, indented = template.render([], tools=tools).split("|")
    assert plain == json.dumps(tools, ensure_ascii=False)
    assert json.loads(indented) == tools and "\n  " in indented


def test_strftime_now() -> None:
    assert ChatTemplate("{{ strftime_now('%Y') }}").render([]) == str(datetime.now().year)


def test_loop_controls_and_generation_block() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert (
        template.render([{"role": "a", "content": "1"}, {"role": "stop"}, {"role": "a", "content": "2"}])
        == "1"
    )


def test_syntax_error_is_one_sentence() -> None:
    with pytest.raises(TemplateError, match="syntax error on line 1"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[3].content.upper() }}",  # undefined
        "{{ messages.append(1) }}",  # the sandbox forbids mutation
        "{{ ''.__class__.__mro__ }}",
        "{{ 1 / 0 }}",
    ],
)
def test_render_errors_are_template_errors(source: str) -> None:
    with pytest.raises(TemplateError, match="failed to render"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_from_metadata() -> None:
    meta = {"tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"], "tokenizer.ggml.bos_token_id": 1}
    meta["tokenizer.ggml.eos_token_id"] = 2
    assert ChatTemplate.from_metadata(meta) is None
    template = ChatTemplate.from_metadata(
        {**meta, "tokenizer.chat_template": "{{ bos_token }}hi{{ eos_token }}"}
    )
    assert template is not None and template.render([]) == "<s>hi</s>"
    override = ChatTemplate.from_metadata(meta, override="custom")
    assert override is not None and override.render([]) == "custom"


# -- tokenizing the rendered prompt -----------------------------------------------------------------


def _tiny_metadata(add_bos: bool) -> dict:
    tokens = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *"abhiuserĊĠ"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * 5 + [1] * (len(tokens) - 5),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
    }


@pytest.mark.parametrize("add_bos", [True, False])
def test_apply_chat_template_never_doubles_bos(add_bos: bool) -> None:
    tok = load_tokenizer(_tiny_metadata(add_bos))
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "<s>", "</s>"
    )
    assert apply_chat_template(tok, template, [{"role": "user", "content": "hi"}]) == [
        1,
        tok.piece_to_id("h"),
        tok.piece_to_id("i"),
    ]


def test_apply_chat_template_adds_bos_when_template_does_not() -> None:
    tok = load_tokenizer(_tiny_metadata(True))
    template = ChatTemplate("<|im_start|>{{ messages[0].content }}<|im_end|>", "<s>", "</s>")
    assert apply_chat_template(tok, template, [{"role": "user", "content": "a"}]) == [1, 3, 5, 4]


@pytest.mark.slow
def test_smollm2_chat_prompt_matches_llama_cpp(smollm2_path: Path, index_dir: Path) -> None:
    from localllm.loading.file import GGUFFile

    metadata = GGUFFile.open(smollm2_path, index_dir).metadata
    tok = load_tokenizer(metadata)
    template = ChatTemplate.from_metadata(metadata)
    assert template is not None and template.source == SMOLLM2_TEMPLATE
    ids = apply_chat_template(
        tok, template, [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi there!"}]
    )
    cases = json.loads((DATA / "smollm2_tokens.json").read_text(encoding="utf-8"))
    chatml = next(c for c in cases["cases"] if c["name"] == "chatml_special")
    # The reference prompt is "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n".
    assert (
        ids[-len(chatml["ids_add_special=1_parse_special=1"]) :]
        == chatml["ids_add_special=1_parse_special=1"]
    )
    assert ids[0] == 1 and ids.count(1) == 3  # one <|im_start|> per turn, no extra BOS


# ------------------------------------------------------------ which template: one rule for every front end


def test_resolve_chat_template_precedence(tmp_path: Path) -> None:
    """The caller's value (a name, Jinja text or a file) > models.toml's (text) > the GGUF's own."""
    from localllm.tokenizer.chat_template import CHATML, resolve_chat_template

    metadata = {"tokenizer.chat_template": "{{ 'gguf' }}"}
    assert resolve_chat_template(metadata).source == "{{ 'gguf' }}"
    assert resolve_chat_template(metadata, configured="{{ 'toml' }}").source == "{{ 'toml' }}"
    assert resolve_chat_template(metadata, "chatml", "{{ 'toml' }}").source == CHATML
    assert resolve_chat_template(metadata, "ChatML").source == CHATML
    assert resolve_chat_template(metadata, "{{ 'text' }}").source == "{{ 'text' }}"
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'file' }}")
    assert resolve_chat_template(metadata, str(path), "{{ 'toml' }}").source == "{{ 'file' }}"
    assert resolve_chat_template({}) is None


def test_require_chat_template_refuses_in_one_sentence(tmp_path: Path) -> None:
    from localllm.tokenizer.chat_template import require_chat_template

    with pytest.raises(TemplateError, match=r"^base\.gguf has no chat template .*'chatml'"):
        require_chat_template({}, "base.gguf")
    with pytest.raises(TemplateError, match="cannot read the chat template file"):
        require_chat_template({}, "base.gguf", str(tmp_path / "missing.jinja"))
    assert require_chat_template({}, "base.gguf", "chatml").render([{"role": "user", "content": "x"}])


def test_models_toml_may_name_a_template(tmp_path, monkeypatch) -> None:
    """`chat_template = "chatml"` in models.toml means the named template, not a file called chatml."""
    from localllm.registry import load_registry
    from localllm.tokenizer.named_templates import CHATML

    user = tmp_path / "models.toml"
    user.write_text(
        '[models.base-model]\nfile_name = "base.gguf"\npath = "/nowhere/base.gguf"\n\n'
        '[models.base-model.defaults]\nchat_template = "chatml"\n',
        encoding="utf-8",
    )
    entry = load_registry(user).entries["base-model"]
    assert entry.defaults.chat_template_text() == CHATML


def test_a_model_without_a_template_never_imports_jinja2() -> None:
    """jinja2 costs ~9 MiB of a run's memory: only compiling a template imports it."""
    code = (
        "import sys\n"
        "from localllm.tokenizer.chat_template import chat_template_source, resolve_chat_template\n"
        "assert resolve_chat_template({}, chat_template_source(None)) is None\n"
        "assert 'jinja2' not in sys.modules, 'jinja2 imported'\n"
        "assert resolve_chat_template({}, 'chatml') is not None and 'jinja2' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# A chat template is an untrusted program: every render runs under a budget (template_budget.py).
BOMBS = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "string times a huge count": "{{ 'x' * 3000000000 }}",
    "a huge format width": "{{ '{0:>3000000000}'.format(1) }}",
    "a huge %-width": "{{ '%3000000000d' % 1 }}",
    "a filter given a huge width": "{{ 'x'|center(3000000000) }}",
    "a method given a huge width": "{{ 'x'.ljust(3000000000) }}",
    "a huge power": "{{ 10 ** 100000000 }}",
    "doubling in a namespace": "{% set ns = namespace(s='x') %}{% for i in range(60) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "doubling by ~ in a namespace": "{% set ns = namespace(s='x') %}{% for i in range(60) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "a list times a huge count": "{{ ([1] * 999999) * 999999 }}",
    "a recursive macro": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_template_bombs_are_refused_when_loaded(name: str) -> None:
    """Each bomb fires on any conversation: refused in one sentence at load, in about the time budget
    at most, never running on or building gigabytes (the constant `'x' * 3e9` is not even folded at
    compile time, where it used to end in a MemoryError)."""
    budget = TemplateBudget(max_seconds=0.5)
    start = time.monotonic()
    with pytest.raises(TemplateError) as e:
        ChatTemplate(BOMBS[name], budget=budget)
    assert time.monotonic() - start < 3
    assert "\n" not in str(e.value) and "cannot be used" in str(e.value), str(e.value)


def test_a_bomb_on_one_conversation_is_refused_on_that_render_only() -> None:
    source = (
        "{% for m in messages %}{% if m.content == 'boom' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}{% endfor %}"
    )
    template = ChatTemplate(source, budget=TemplateBudget(max_steps=100_000))
    with pytest.raises(TemplateBudgetError, match="ran past 100,000 steps"):
        template.render([{"role": "user", "content": "boom"}])
    assert template.render([{"role": "user", "content": "fine"}]) == "fine"
    big = TemplateBudget(max_chars=1000)
    with pytest.raises(TemplateBudgetError, match="output passed 1,000 characters"):
        ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", budget=big).render(
            [{"role": "user", "content": "y" * 999}] * 2
        )


def test_lipsum_is_not_offered() -> None:
    """Jinja's lipsum global writes paragraphs of text on request: no chat template needs it."""
    with pytest.raises(TemplateError, match="lipsum"):
        ChatTemplate("{{ lipsum(n=100000, min=1000, max=1000) }}").render([])


def test_budgets_leave_real_templates_alone(smollm2_template: ChatTemplate) -> None:
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello " * 200} for i in range(200)]
    assert smollm2_template.render(long).count("<|im_start|>") == 202
    assert ChatTemplate("{{ '%5d|%-3s' % (42, 'ab') }}{{ '{:>4}'.format(7) }}").render([]) == "   42|ab    7"


def test_served_template_bomb_costs_its_request_a_400(tiny_model_path: Path, index_dir: Path) -> None:
    """A template that explodes on one conversation: that request gets a 400 within the budget, the
    next one is served, and nothing keeps running (the render ended itself)."""
    from server_harness import MODEL_ID, engine_factory, error_of, post, running_server

    source = (
        "{% for m in messages %}{% if m.content == 'boom' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}{% endfor %}"
    )
    with running_server(engine_factory(tiny_model_path, index_dir), chat_template=source) as srv:
        start = time.monotonic()
        body = {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "boom"}]}
        err = error_of(post(srv, "/v1/chat/completions", body), 400)
        assert "chat template ran past" in err["message"] and time.monotonic() - start < 10
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.5  # no render left spinning in a worker thread
        body["messages"][0]["content"] = "fine"
        assert post(srv, "/v1/chat/completions", body).status_code == 200
