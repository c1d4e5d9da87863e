"""SmolLM3, Ministral 3 and Gemma 4 (issue 30 item 3): what each reads from its file, the formulas of
its new spec fields, what Gemma 4 refuses by name, and that each random-weight file's tokenizer and
chat template load (conformance with llama.cpp: tests/models/test_architectures.py)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tiny_arch import write_variant

from localllm.errors import ModelFormatError
from localllm.models import gemma4
from localllm.models.spec import NO_ROPE, LayerSpec, RopeSpec, attn_temperature


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("families")
    return {v: write_variant(d / f"{v}.gguf", v) for v in ("smollm3", "mistral3", "gemma4")}


def _engine(path: Path):
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), backend="numpy", ctx_size=64))


def test_smollm3_leaves_every_fourth_layer_unrotated(tmp_path) -> None:
    args = _engine(write_variant(tmp_path / "s.gguf", "smollm3", n_layers=8)).args
    assert [il for il, s in enumerate(args.layers) if s.rope == NO_ROPE] == [3, 7]
    assert all(s.rope.dim == 16 and not s.rope.neox for s in args.layers if s.rope != NO_ROPE)


def test_attention_temperature_as_llama_cpp_computes_it() -> None:
    got = attn_temperature(np.array([0, 15, 16, 31, 32, 63]), 0.5, 16)
    want = [1 + 0.5 * math.log(n) for n in (1, 1, 2, 2, 3, 4)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="attn_temp_length"):
        LayerSpec(RopeSpec(dim=16), attn_temp_scale=0.1)


def test_yarn_log_multiplier_divides_the_magnitude() -> None:
    """llama.cpp: attn_factor * (1 + 0.1 ln f) / (1 + 0.1 m ln f); m = 1 (Ministral 3) cancels it."""
    yarn = RopeSpec(dim=16, freq_scale=0.25, yarn_orig_ctx=16)
    assert yarn.mscale() == pytest.approx(1 + 0.1 * math.log(4))
    cancelled = RopeSpec(dim=16, freq_scale=0.25, yarn_orig_ctx=16, yarn_log_mul=1.0)
    assert cancelled.mscale() == pytest.approx(1.0)
    half = RopeSpec(dim=16, freq_scale=0.25, yarn_orig_ctx=16, yarn_log_mul=0.5, attn_factor=2.0)
    assert half.mscale() == pytest.approx(2 * (1 + 0.1 * math.log(4)) / (1 + 0.05 * math.log(4)))


def test_mistral3_reads_temperature_and_log_multiplier(files) -> None:
    args = _engine(files["mistral3"]).args
    read = {(s.attn_temp_scale, s.attn_temp_length, s.rope.yarn_log_mul) for s in args.layers}
    assert read == {(0.5, 16, 1.0)}
    assert args.layers[0].rope.mscale() == pytest.approx(1.0)


def test_gemma4_reads_its_layers(files) -> None:
    args = _engine(files["gemma4"]).args
    full = [il for il, s in enumerate(args.layers) if not s.window]
    assert full == [2, 5] and args.attn_scale == 1.0 and args.final_logit_softcap == 30.0
    assert all(s.v_from_k == (il in full) and s.v_norm and s.qk_norm for il, s in enumerate(args.layers))
    assert [len(s.rope.factors) for s in args.layers] == [0, 0, 16, 0, 0, 16]
    assert {s.rope.base for s in args.layers} == {10_000.0, 1_000_000.0}
    scales = [s.out_scale for s in args.layers]
    assert len(set(scales)) == 6 and all(0.5 <= v <= 1.5 for v in scales)


def _fake_gemma4(meta: dict, tensors: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(
        path=Path("g.gguf"), architecture="gemma4", tensors=dict.fromkeys(tensors),
        arch_get=lambda key, default=None: meta.get(key, default),
    )  # fmt: skip


@pytest.mark.parametrize(
    "meta, tensors, key",
    [
        ({}, ("blk.0.attn_qkv.weight",), "attn_qkv"),
    ],
)
def test_gemma4_refuses_what_it_does_not_run_by_name(meta: dict, tensors: tuple, key: str) -> None:
    with pytest.raises(ModelFormatError, match=key):
        gemma4._refuse_unsupported(_fake_gemma4(meta, tensors))
    gemma4._refuse_unsupported(_fake_gemma4({"attention.key_length": 32, "attention.key_length_swa": 16}))


@pytest.mark.parametrize("variant", ["smollm3", "mistral3", "gemma4"])
def test_tokenizer_and_chat_template_load(files, variant: str) -> None:
    from localllm.tokenizer.chat_template import apply_chat_template, resolve_chat_template

    e = _engine(files[variant])
    tok = e.tokenizer
    assert tok.decode(tok.encode("hello world", add_special=False)) == "hello world"
    template = resolve_chat_template(e.gguf.metadata)
    ids = apply_chat_template(tok, template, [{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in tok.decode(ids) and tok.decode(ids).endswith("assistant\n")


def _gemma4_vocab() -> dict:
    """Tokenizer metadata of llama.cpp's Gemma 4 vocabulary extract (fixtures/make_vocab_fixtures.py)."""
    import json
    import lzma

    path = Path(__file__).resolve().parents[1] / "data" / "vocab" / "ggml-vocab-gemma-4.json.xz"
    data = json.loads(lzma.decompress(path.read_bytes()))
    n = data["n_tokens"]
    return {
        **data["keys"],
        "tokenizer.ggml.tokens": [data["tokens"].get(str(i), f"\ue000{i}") for i in range(n)],
        "tokenizer.ggml.token_type": [data["types"].get(str(i), 1) for i in range(n)],
        "tokenizer.ggml.merges": data["merges"],
    }


def test_gemma4_template_renders_and_tokenizes_with_one_bos() -> None:
    from localllm.tokenizer import load_tokenizer
    from localllm.tokenizer.chat_template import apply_chat_template, resolve_chat_template

    meta = _gemma4_vocab()
    tok, template = load_tokenizer(meta), resolve_chat_template(meta)
    assert tok.add_bos and template is not None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = template.render(messages, add_generation_prompt=True)
    assert text.startswith("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\n")
    ids = apply_chat_template(tok, template, messages)
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    assert tok.decode(ids) == text


def test_per_layer_head_counts_pass_the_file_checks_and_are_refused_by_name() -> None:
    """Real Gemma 4 files give head_count_kv per layer: `info` reads them, the model refuses by key."""
    from localllm.loading.checks import check_metadata
    from localllm.models.base import read_hyper

    meta = {"embedding_length": 64, "attention.head_count": 4, "block_count": 2, "feed_forward_length": 128,
            "attention.head_count_kv": [2, 1]}  # fmt: skip
    check_metadata({"general.architecture": "gemma4", **{f"gemma4.{k}": v for k, v in meta.items()}})
    with pytest.raises(ModelFormatError, match="metadata key 'gemma4.block_count'"):
        check_metadata({"general.architecture": "gemma4", "gemma4.block_count": [2, 2]})
    gf = _fake_gemma4(meta)
    gf.get = lambda key, default=None: default
    with pytest.raises(ModelFormatError, match="'gemma4.attention.head_count_kv' gives one value per layer"):
        read_hyper(gf)
