"""`localllm quantize` and the quantizers in quant/: bit-exact against gguf's reference quantizers, whole
files with their metadata, tensor types llama.cpp's way, and loadable by the engine."""

from __future__ import annotations

from collections import Counter

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from tiny_model import write_tiny_model
from typer.testing import CliRunner

from localllm.cli import quantize as _quantize  # noqa: F401  (registers the command)
from localllm.cli.app import app
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.errors import LocalLLMError
from localllm.quant import dequantize
from localllm.quant.quantize_gguf import FILE_TYPES, choose_type, convert_rows, quantize_file
from localllm.quant.quantize_legacy import QUANTIZERS, _roundf

LEGACY = list(QUANTIZERS)


def _awkward_rows() -> np.ndarray:
    """Random rows of very different scales, plus blocks that stress the edge cases."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((48, 256)) * rng.exponential(1.0, (48, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: d = 0
    x[1, :32] = 2.5  # constant: max == min
    x[2, :32] = -3.0  # ties for the largest magnitude
    x[3, :32] = np.linspace(-1, 1, 32)  # values landing on halves of the grid
    x[4, :64] = rng.integers(-127, 128, 64) / 127  # on Q8_0's grid exactly
    x[5, 7], x[5, 40] = 1e-30, -1e4  # subnormal-ish and a huge outlier
    return x


@pytest.mark.parametrize("name", LEGACY)
def test_bit_exact_with_gguf_reference(name: str) -> None:
    x = _awkward_rows()
    qtype = gguf.GGMLQuantizationType[name]
    ours = convert_rows(x, name)
    np.testing.assert_array_equal(ours, gguf_quantize(x, qtype))
    # and the round trip through our dequantizer is gguf's, within one quantization step of each block
    back = dequantize(ours, qtype)
    np.testing.assert_array_equal(back, gguf_dequantize(ours, qtype))
    blocks = x.reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / {"4": 8, "5": 16, "8": 127}[name[1]]
    assert (np.abs(back.reshape(-1, 32) - blocks) <= step * 1.01 + 1e-6).all()


def test_roundf_rounds_halves_away_from_zero() -> None:
    v = np.array([0.5, -0.5, 1.5, -2.5, 0.49999997, 2.4999998, 0.0], np.float32)
    np.testing.assert_array_equal(_roundf(v), [1, -1, 2, -3, 0, 2, 0])


def test_tensor_types_as_llama_cpp_chooses_them() -> None:
    assert choose_type("blk.0.attn_norm.weight", (64,), "Q4_0", tied=True) == "F32"
    assert choose_type("blk.0.attn_q.weight", (64, 64), "Q4_0", tied=True) == "Q4_0"
    assert choose_type("token_embd.weight", (269, 64), "Q4_0", tied=True) == "Q8_0"  # doubles as output
    assert choose_type("token_embd.weight", (269, 64), "Q4_0", tied=False) == "Q4_0"
    assert choose_type("output.weight", (269, 64), "Q5_1", tied=False) == "Q8_0"
    assert choose_type("blk.0.ffn_down.weight", (64, 48), "Q4_0", tied=True) == "F32"  # 48: not whole blocks
    assert choose_type("output.weight", (269, 64), "F16", tied=False) == "F16"
    assert choose_type("output.weight", (269, 512), "Q4_0", tied=False) == "Q6_K"  # whole super-blocks
    assert choose_type("output.weight", (269, 512), "Q8_0", tied=False) == "Q8_0"
    assert choose_type("blk.0.ffn_down.weight", (64, 576), "Q6_K", tied=True) == "Q8_0"  # 576 = 2.25 x 256


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_model(tmp_path_factory.mktemp("f32") / "tiny-f32.gguf", quant="F32")


def _engine(path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), threads=2, ctx_size=64, max_num_seqs=1))


@pytest.mark.parametrize("name", [*LEGACY, "F16"])
def test_quantized_file_keeps_metadata_and_loads(f32_model, tmp_path, name: str) -> None:
    out = tmp_path / f"tiny-{name}.gguf"
    report = quantize_file(f32_model, out, name)
    src, dst = gguf.GGUFReader(f32_model), gguf.GGUFReader(out)
    changed = {"general.file_type", "general.quantization_version"}
    kept = {k: f.contents() for k, f in src.fields.items() if not k.startswith("GGUF.") and k not in changed}
    assert {k: dst.fields[k].contents() for k in kept} == kept
    assert dst.fields["general.file_type"].contents() == FILE_TYPES[name]
    types = {t.name: t.tensor_type.name for t in dst.tensors}
    embd = "F16" if name == "F16" else "Q8_0"  # tied embeddings: the output projection stays high
    assert types.pop("token_embd.weight") == embd and types.pop("output_norm.weight") == "F32"
    assert {v for k, v in types.items() if "norm" in k} == {"F32"}
    assert {v for k, v in types.items() if "norm" not in k} == {name}
    for s, d in zip(src.tensors, dst.tensors, strict=True):
        if d.tensor_type.name == name and name != "F16":
            np.testing.assert_array_equal(d.data, gguf_quantize(s.data, d.tensor_type))
    expected = Counter({"F32": 5, name: 14})
    expected[embd] += 1
    assert report.types == dict(expected)
    ids = list(range(5, 40))
    ref, ours = np.asarray(score_tokens(_engine(f32_model), ids)), np.asarray(score_tokens(_engine(out), ids))
    # the int8 kernels also round the activations: close to the F32 model, not equal
    tolerance = {"Q8_0": 0.05, "F16": 0.05}.get(name, 0.25)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < tolerance


def test_requantize_needs_the_flag_and_leaves_nothing_behind(tiny_model_path, tmp_path) -> None:
    out = tmp_path / "re.gguf"
    with pytest.raises(LocalLLMError, match="already quantized .* --allow-requantize"):
        quantize_file(tiny_model_path, out, "Q4_0")
    assert not out.exists() and not list(tmp_path.iterdir())
    quantize_file(tiny_model_path, out, "q4_0", allow_requantize=True)
    types = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types == {"Q4_0", "Q8_0", "F32"}
    with pytest.raises(LocalLLMError, match="exists; pass --force"):
        quantize_file(tiny_model_path, out, "Q4_0", allow_requantize=True)
    quantize_file(tiny_model_path, out, "F16", allow_requantize=True, force=True)
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["re.gguf"]


def test_a_failed_write_leaves_no_partial_file(f32_model, tmp_path, monkeypatch) -> None:
    import localllm.quant.quantize_gguf as qg

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(qg, "convert_tensor", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        quantize_file(f32_model, tmp_path / "out.gguf", "Q8_0")
    assert not list(tmp_path.iterdir())


def test_cli(f32_model, tmp_path) -> None:
    out = tmp_path / "cli.gguf"
    result = CliRunner().invoke(app, ["quantize", str(f32_model), str(out), "--type", "Q5_0"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{out}: Q5_0,") and "14 Q5_0" in result.stdout
    bad = CliRunner().invoke(app, ["quantize", str(f32_model), str(tmp_path / "x.gguf"), "--type", "Q9_9"])
    assert bad.exit_code != 0 and "unknown quantization type 'Q9_9' (choose Q4_0" in str(bad.exception)
    missing = CliRunner().invoke(app, ["quantize", str(tmp_path / "nope.gguf"), str(tmp_path / "y.gguf")])
    assert "no such file" in str(missing.exception)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    result = CliRunner().invoke(app, ["quantize", str(not_gguf), str(tmp_path / "z.gguf")])
    assert "not a readable GGUF file" in str(result.exception)


@pytest.mark.slow
def test_smollm2_requantized_to_q8_0_predicts_like_the_original(smollm2_path, tmp_path) -> None:
    out = tmp_path / "smollm2-q8_0.gguf"
    report = quantize_file(smollm2_path, out, "Q8_0", allow_requantize=True)
    assert report.types["Q8_0"] == 211 and report.types["F32"] == 61
    original = _engine(smollm2_path)
    ids = original.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    ref = np.asarray(score_tokens(original, ids))
    ours = np.asarray(score_tokens(_engine(out), ids))
    assert (ref.argmax(-1) == ours.argmax(-1)).mean() >= 0.9


def _scalar_q6_k_levels(block: np.ndarray) -> tuple[float, list[int], list[int]]:
    """ggml's quantize_row_q6_K_ref for one super-block, one float32 operation at a time: (d, scales, L)."""
    f32 = np.float32

    def trial(x, iscale, nmax):
        levels, sumlx, suml2 = [], f32(0), f32(0)
        for v in x:
            q = int(min(max(np.rint(iscale * v), -nmax), nmax - 1))
            levels.append(q + nmax)
            sumlx, suml2 = f32(sumlx + v * v * v * f32(q)), f32(suml2 + v * v * f32(q) * f32(q))
        return levels, sumlx, suml2

    def make_qx(x, nmax=32):
        top = max(x, key=abs)  # the first of the largest magnitude
        if abs(top) < f32(1e-15):
            return f32(0), [0] * len(x)
        levels, lx, l2 = trial(x, f32(-nmax) / top, nmax)
        scale = lx / l2 if l2 else f32(0)
        best = scale * lx
        for step in [s for s in range(-9, 10) if s]:
            cand, lx, l2 = trial(x, -(f32(nmax) + f32(0.1) * f32(step)) / top, nmax)
            if l2 > 0 and lx * lx > best * l2:
                levels, scale = cand, lx / l2
                best = scale * lx
        return scale, levels

    subs = [make_qx(list(block[i : i + 16])) for i in range(0, 256, 16)]
    max_scale = max((s for s, _ in subs), key=abs)
    iscale = f32(-128) / max_scale
    d = np.float16(f32(1) / iscale)
    scales = [int(min(127, np.rint(iscale * s))) for s, _ in subs]
    levels = []
    for (_, sub_levels), sc, i in zip(subs, scales, range(0, 256, 16), strict=True):
        sub_d = f32(d) * f32(sc)
        if not sub_d:
            levels += sub_levels
            continue
        levels += [int(min(max(np.rint(v / sub_d), -32), 31)) + 32 for v in block[i : i + 16]]
    return float(d), scales, levels


def test_q6_k_matches_a_scalar_transcription_of_ggml() -> None:
    from localllm.quant.quantize_k import quantize_q6_k

    x = _awkward_rows()[:3].reshape(-1, 256)  # 3 super-blocks with the zero/constant/tied blocks in them
    x[1, 16:32] = 0  # a zero sub-block inside a non-zero super-block
    blocks = quantize_q6_k(x)
    back = dequantize(blocks.view(np.uint8).reshape(len(x), -1), gguf.GGMLQuantizationType.Q6_K)
    for i, row in enumerate(x):
        d, scales, levels = _scalar_q6_k_levels(row)
        assert float(blocks["d"][i]) == d and blocks["scales"][i].tolist() == scales
        expected = np.array(levels, np.float32).reshape(16, 16) - 32
        expected *= np.float32(d) * np.array(scales, np.float32)[:, None]
        np.testing.assert_array_equal(back[i].reshape(16, 16), expected)
    assert np.abs(back - x).max() <= np.abs(x).max() / 31  # within about one of 63 levels
    np.testing.assert_array_equal(quantize_q6_k(np.zeros((1, 256), np.float32)).view(np.uint8), 0)


def _scalar_qkx2(x: list, w: list, nmax: int, rmin: float, nstep: int) -> tuple[float, float]:
    """ggml's make_qkx2_quants (squared error), one float32 operation at a time: (scale, -min)."""
    f = np.float32
    low, high, sum_w, sum_x = min(f(0), min(x)), max(x), w[0], w[0] * x[0]
    for xi, wi in zip(x[1:], w[1:], strict=True):
        sum_w, sum_x = f(sum_w + wi), f(sum_x + wi * xi)
    if high == low:
        return 0.0, float(-low)

    def levels(iscale, low):
        return [f(min(max(np.rint(iscale * (xi - low)), 0), nmax)) for xi in x]

    def error(scale, low, ls):
        total = f(0)
        for xi, wi, li in zip(x, w, ls, strict=True):
            total = f(total + wi * ((scale * li + low - xi) * (scale * li + low - xi)))
        return total

    iscale = f(nmax) / (high - low)
    scale = f(1) / iscale
    best = error(scale, low, levels(iscale, low))
    for step in range(nstep + 1):
        ls = levels((f(rmin) + f(0.1) * f(step) + f(nmax)) / (high - low), low)
        sl = sl2 = sxl = f(0)
        for xi, wi, li in zip(x, w, ls, strict=True):
            sl, sl2, sxl = f(sl + wi * li), f(sl2 + wi * li * li), f(sxl + wi * li * xi)
        det = sum_w * sl2 - sl * sl
        if det > 0:
            this_scale, this_min = (sum_w * sxl - sum_x * sl) / det, (sl2 * sum_x - sl * sxl) / det
            if this_min > 0:
                this_scale, this_min = sxl / sl2, f(0)
            if (cur := error(this_scale, this_min, ls)) < best:
                best, scale, low = cur, this_scale, this_min
    return float(scale), float(-low)


@pytest.mark.parametrize(("nmax", "rmin", "nstep"), [(15, -1.0, 20), (31, -0.5, 15)])
def test_k_quant_scale_search_matches_a_scalar_transcription(nmax, rmin, nstep) -> None:
    from localllm.quant.quantize_k import make_qkx2_quants

    x = _awkward_rows()[:6].reshape(-1, 32)[::3]  # 16 sub-blocks, the edge cases among them
    w = np.sqrt(np.cumsum(x * x, axis=1, dtype=np.float32)[:, -1] / np.float32(32))[:, None] + np.abs(x)
    scales, mins, _ = make_qkx2_quants(x, w, nmax, rmin, nstep)
    for i in range(len(x)):
        assert (float(scales[i]), float(mins[i])) == _scalar_qkx2(list(x[i]), list(w[i]), nmax, rmin, nstep)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_k_quants_round_trip(name: str) -> None:
    from localllm.quant.quantize_k import QUANTIZERS as K_QUANTIZERS

    x = _awkward_rows().reshape(-1, 256)
    blocks = K_QUANTIZERS[name](x).view(np.uint8).reshape(len(x), -1)
    back = gguf_dequantize(blocks, gguf.GGMLQuantizationType[name])
    np.testing.assert_array_equal(back, dequantize(blocks, gguf.GGMLQuantizationType[name]))
    # random rows (the edge-case rows 0-5 aside): the error is a small part of the signal
    error, signal = np.sqrt(((back - x)[6:] ** 2).mean(axis=1)), np.sqrt((x[6:] ** 2).mean(axis=1))
    assert (error < signal * (0.12 if name == "Q4_K" else 0.06)).all()


def test_k_mixes_raise_the_layers_llama_cpp_raises() -> None:
    # SmolLM2's 30 layers under llama-quantize Q4_K_M: attn_v and ffn_down get Q6_K in these layers
    raised = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    for mix, base in (("Q4_K_M", "Q4_K"), ("Q5_K_M", "Q5_K")):
        got = [choose_type(f"blk.{i}.attn_v.weight", (64, 512), mix, True, (i, 30)) for i in range(30)]
        assert [i for i, t in enumerate(got) if t == "Q6_K"] == raised and set(got) == {"Q6_K", base}
        assert choose_type("blk.3.attn_q.weight", (64, 512), mix, True, None) == base
    assert choose_type("blk.3.attn_q.weight", (64, 576), "Q4_K_M", True) == "Q5_0"  # llama.cpp's fallback
    assert choose_type("blk.3.attn_q.weight", (64, 576), "Q5_K_M", True) == "Q5_1"
    assert choose_type("blk.0.ffn_down.weight", (64, 576), "Q4_K_M", True, (0, 30)) == "Q8_0"


def test_k_mix_file_loads(f32_model, tmp_path) -> None:
    out = tmp_path / "tiny-q4_k_m.gguf"
    report = quantize_file(f32_model, out, "Q4_K")  # llama-quantize's alias of Q4_K_M
    assert report.target == "Q4_K_M" and gguf.GGUFReader(out).fields["general.file_type"].contents() == 15
    # 64-wide rows are not whole super-blocks: llama.cpp's fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0)
    # Q8_0: token_embd, and layer 1's attn_v and ffn_down (the last eighth gets more bits)
    assert report.types == {"F32": 5, "Q5_0": 12, "Q8_0": 3}
    ids = list(range(5, 40))
    ref, ours = np.asarray(score_tokens(_engine(f32_model), ids)), np.asarray(score_tokens(_engine(out), ids))
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 0.25
