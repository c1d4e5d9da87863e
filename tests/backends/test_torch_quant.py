"""Quantized weights on the torch backend against the NumPy oracle (quant.dequantize): the lossless
planes and their torch dequantization, the Triton kernels (run by Triton's interpreter where there is
no GPU: dequantized values bit-equal, GEMV and GEMM within float32 rounding, lowered to sm_90 machine
code without a GPU), and whole models through both quantized paths."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from quant_blocks import random_rows

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'localllm[torch]')")
import torch  # noqa: E402

from localllm.backends.device_weights import DEVICE_QUANTIZED, device_weight_bytes  # noqa: E402
from localllm.backends.torch_backend.weights import TYPES, dequantize_torch, repack, upload  # noqa: E402
from localllm.quant import dequantize  # noqa: E402

TRITON_MODULE = "localllm.backends.torch_backend.triton_quant"
HAS_TRITON = importlib.util.find_spec("triton") is not None
CPU = torch.device("cpu")
# K per type: legacy blocks where K is no multiple of the kernels' 256-wide K tiles (masked tails)
SHAPES = {t: (20, 96 if TYPES[t][0] == 32 else 512) for t in TYPES}


def test_info_knows_which_types_stay_quantized() -> None:
    assert set(DEVICE_QUANTIZED) == set(TYPES)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", list(TYPES))
def test_planes_are_lossless_and_torch_dequantizes_like_numpy(qtype: str) -> None:
    ggml_type, raw = random_rows(qtype, *SHAPES[qtype])
    _, shape, planes = repack(raw, ggml_type)
    assert shape == SHAPES[qtype]
    # every bit of the file is kept: the planes hold as many bytes (+4 per K-quant block: spread scales)
    extra = 4 * raw.shape[0] * (shape[1] // 256) if qtype in ("Q4_K", "Q5_K") else 0
    assert sum(p.nbytes for p in planes) == raw.nbytes + extra
    # and `info`'s prediction (no torch import there) counts the same bytes
    info = SimpleNamespace(ggml_type=ggml_type, shape=shape, nbytes=raw.nbytes)
    assert device_weight_bytes([info], "cuda") == raw.nbytes + extra
    w = upload(raw, ggml_type, CPU)
    assert same_bits(dequantize_torch(w).numpy(), dequantize(raw, ggml_type))
    ids = torch.tensor([3, 0, 19, 3])
    assert same_bits(dequantize_torch(w.rows(ids)).numpy(), dequantize(raw, ggml_type)[ids.numpy()])


# ---- the Triton kernels ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tq():
    """The kernel module: compiled on a GPU, else run by Triton's interpreter (TRITON_INTERPRET=1,
    read when the kernels are defined and again when they launch, so it stays set in this process)."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if not torch.cuda.is_available():
        if TRITON_MODULE in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the kernels were already defined for a GPU in this process")
        os.environ["TRITON_INTERPRET"] = "1"
    return importlib.import_module(TRITON_MODULE)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else CPU


def within_f32_rounding(got: torch.Tensor, x: np.ndarray, w: np.ndarray) -> None:
    """|got - exact| <= K * 2^-23 * (|x| @ |w|.T): any order of K float32 products and sums."""
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = w.shape[1] * 2.0**-23 * (np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64))
    err = np.abs(got.cpu().numpy().astype(np.float64) - exact)
    assert (err <= bound + 1e-30).all(), float((err / (bound + 1e-30)).max())


@pytest.mark.parametrize("qtype", list(TYPES))
def test_triton_kernels_match_the_oracle(tq, qtype: str) -> None:
    ggml_type, raw = random_rows(qtype, *SHAPES[qtype], seed=1)
    ref = dequantize(raw, ggml_type)
    w = upload(raw, ggml_type, _device())
    assert same_bits(tq.dequantize(w).cpu().numpy(), ref)
    rng = np.random.default_rng(2)
    for m in (1, 3):
        x = rng.standard_normal((m, ref.shape[1])).astype(np.float32)
        for split in (1, 2):
            within_f32_rounding(tq.gemv(torch.from_numpy(x).to(_device()), w, split_k=split), x, ref)
    x = rng.standard_normal((21, ref.shape[1])).astype(np.float32)
    for split in (1, 2):
        got = tq.gemm(torch.from_numpy(x).to(_device()), w, precision="ieee", split_k=split)
        within_f32_rounding(got, x, ref)


# GEMV launch configs past the defaults: steps longer than a split or a row (masked tails), several
# splits, tiny and wide row tiles; K of 7 blocks / 3 super-blocks so no step divides it
GEMV_CONFIGS = [(8, 1, 1), (16, 4, 2), (32, 2, 3), (4, 16, 1)]


@pytest.mark.parametrize("qtype", list(TYPES))
def test_launch_configs_match_the_oracle(tq, qtype: str) -> None:
    n, k = (13, 7 * 32) if TYPES[qtype][0] == 32 else (13, 3 * 256)
    ggml_type, raw = random_rows(qtype, n, k, seed=3)
    ref = dequantize(raw, ggml_type)
    w = upload(raw, ggml_type, _device())
    x = np.random.default_rng(4).standard_normal((2, k)).astype(np.float32)
    for block_n, step, split in GEMV_CONFIGS:
        config = tq.KernelConfig(block_n=block_n, step=step, num_warps=2)
        within_f32_rounding(
            tq.gemv(torch.from_numpy(x).to(_device()), w, split_k=split, config=config), x, ref
        )


# the 2-D-tile k-quant GEMM: (block_n, super-blocks a step, split-K, block_m); K of 3 super-blocks,
# so a 2-step leaves a masked half step, and 2 splits of 2 super-blocks leave a short last split
KQUANT_2D = [(16, 1, 1, 0), (32, 1, 2, 0), (16, 2, 1, 0), (16, 2, 2, 0), (32, 1, 2, 16)]


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_2d_kquant_gemm_matches_the_oracle(tq, qtype: str) -> None:
    """gemm(config=kernel "2d"): the oracle's product within float32 rounding, at row counts that fill
    no tile (5 of 16, 21 of 32 or of two 16s) and with split-K."""
    ggml_type, raw = random_rows(qtype, 13, 3 * 256, seed=5)
    ref = dequantize(raw, ggml_type)
    w = upload(raw, ggml_type, _device())
    rng = np.random.default_rng(6)
    for m in (5, 21):
        x = rng.standard_normal((m, ref.shape[1])).astype(np.float32)
        for block_n, step, split, block_m in KQUANT_2D:
            config = tq.KernelConfig(block_n=block_n, step=step, num_stages=3, kernel="2d", block_m=block_m)
            xt = torch.from_numpy(x).to(_device())
            within_f32_rounding(tq.gemm(xt, w, precision="ieee", split_k=split, config=config), x, ref)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_kernels_lower_to_sm90_without_a_gpu() -> None:
    """The block-structured GEMVs (a legacy type's and a k-quant's, with 16-byte loads) and the
    tensor-core GEMMs (the k-quants' two) compile to Hopper machine code (in a fresh process: the
    interpreter flag must not be set there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from localllm.backends.torch_backend.triton_compile import compile_kernels\n"
        "which = [('gemv', 'Q4_K'), ('gemv', 'Q5_0'), ('gemm', 'Q6_K'), ('gemm2d', 'Q4_K')]\n"
        "for (kernel, qtype), info in compile_kernels(90, which).items():\n"
        "    print(kernel, qtype, info)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if "unsupported" in run.stdout:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 4 and all("cubin" in line for line in lines), run.stdout
    assert all("16-byte loads" in line for line in lines[:2]), "the GEMVs should read quants with wide loads"
    assert "mma" in lines[2] and "mma" in lines[3], "the GEMMs should use tensor-core instructions"
    # the 2-D-tile GEMM forms its values in the dot's operand layout: no tile stored to shared memory
    # in its loop (the default GEMM stores each dot's weight tile there)
    assert "local_alloc=0" in lines[3] and "st_shared=0" in lines[3], lines[3]
    assert "st_shared=0" not in lines[2], lines[2]


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_mxfp4_kernels_lower_to_sm90_without_a_gpu() -> None:
    """MXFP4's GEMV (16-byte loads) and GEMM (tensor cores) compile for Hopper, with no flush-to-zero
    op: triton_legacy.e2m1_float makes float32 subnormals of codes 1 and 9 on the way."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from localllm.backends.torch_backend.triton_compile import compile_kernels, lower\n"
        "which = [('gemv', 'MXFP4'), ('gemm', 'MXFP4')]\n"
        "for (kernel, qtype), info in compile_kernels(90, which).items():\n"
        "    print(kernel, qtype, info)\n"
        "    if 'unsupported' not in info:\n"
        "        print('ftz', lower(90, kernel, qtype)['ptx'].count('.ftz'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if "unsupported" in run.stdout:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    gemv, gemv_ftz, gemm, gemm_ftz = run.stdout.strip().splitlines()
    assert "cubin" in gemv and "16-byte loads" in gemv, gemv
    assert "cubin" in gemm and "mma" in gemm, gemm
    assert gemv_ftz == gemm_ftz == "ftz 0", run.stdout


# ---- whole models with quantized weights ------------------------------------------------------------

PROMPT = list(range(5, 45))


def _engine(path, backend: str = "torch", **kw):
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), backend=backend, device="cpu", threads=1, max_num_seqs=4,
                                  ctx_size=128, **kw))  # fmt: skip


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory) -> dict:
    from tiny_arch import write_arch_model
    from tiny_moe import write_moe_variant

    d = tmp_path_factory.mktemp("torch-quant")
    files = {q: write_arch_model(d / f"llama-{q}.gguf", "llama", q) for q in ("Q4_0", "Q5_1", "Q8_0")}
    files["gemma3-Q4_1"] = write_arch_model(d / "gemma3-Q4_1.gguf", "gemma3", "Q4_1")
    files["moe-Q4_0"] = write_moe_variant(d / "qwen3moe-q4.gguf", "qwen3moe_q4")
    files["small-Q4_0"] = write_arch_model(d / "small-Q4_0.gguf", "llama", "Q4_0", n_layers=2)
    return files


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q8_0", "gemma3-Q4_1", "moe-Q4_0"])
def test_quantized_weights_through_torch_ops(quant_models, monkeypatch, caplog, name: str) -> None:
    """The path without Triton (MPS; here the CPU): weights stay in their blocks (about the file's
    size), dequantized a chunk at a time, and the logits are the oracle's to float rounding."""
    from localllm.engine.engine import score_tokens
    from localllm.loading.file import GGUFFile

    monkeypatch.setenv("LOCALLLM_TORCH_WEIGHTS", "quantized")
    monkeypatch.setattr("localllm.backends.torch_backend.qlinear.CHUNK_ELEMENTS", 64 * 40)  # several chunks
    with caplog.at_level(logging.INFO, logger="localllm"):
        engine = _engine(quant_models[name])
    backend = engine.backend
    assert backend.weights == "quantized" and backend.qlinear.kernels == "torch"
    qtype = name.rsplit("-", 1)[-1]
    assert backend.memory.by_kind[qtype] > 0 and set(backend.memory.by_kind) <= {qtype, "float32"}
    gf = GGUFFile.open(quant_models[name])
    tensor_bytes = sum(t.nbytes for t in gf.tensors.values())
    assert backend.memory.total <= 1.15 * tensor_bytes
    matrices = [t for t in gf.tensors.values() if len(t.shape) > 1]
    assert backend.memory.total == device_weight_bytes(matrices, "cpu")  # what `info` predicts
    said = [r.getMessage() for r in caplog.records if "weights take" in r.getMessage()]
    assert said and f"{qtype} " in said[-1] and "torch kernels" in said[-1]  # the load says what they take
    expected = score_tokens(_engine(quant_models[name], "numpy"), PROMPT)
    got = score_tokens(engine, PROMPT)
    assert _rel_err(got, expected) < 5e-4
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_quantized_model_through_the_triton_kernels(tq, quant_models, monkeypatch) -> None:
    """A model's every matmul through the Triton kernels (the interpreter here): prefill by the GEMM,
    decode by the GEMV, the same greedy tokens as the oracle."""
    from localllm.engine.engine import score_tokens
    from localllm.sampling_params import SamplingParams

    monkeypatch.setenv("LOCALLLM_TORCH_WEIGHTS", "quantized")
    engine = _engine_on(quant_models["small-Q4_0"], _device().type)  # compiled kernels need GPU tensors
    engine.backend.qlinear.kernels, engine.backend.qlinear.precision = "triton", "ieee"
    reference = _engine(quant_models["small-Q4_0"], "numpy")
    expected = score_tokens(reference, PROMPT[:12])
    assert _rel_err(score_tokens(engine, PROMPT[:12]), expected) < 5e-4
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ours = engine.generate([PROMPT[:6]], params)[0].token_ids
    assert ours == reference.generate([PROMPT[:6]], params)[0].token_ids


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "moe-Q4_0"])
def test_cuda_quantized_models_track_the_oracle(quant_models, name: str) -> None:
    """On CUDA by default: blocks on the device, Triton's GEMV and tf32x3 GEMM; near float32 results."""
    from localllm.engine.engine import score_tokens

    engine = _engine_on(quant_models[name], "cuda")
    assert engine.backend.weights == "quantized" and engine.backend.qlinear.kernels == "triton"
    expected = score_tokens(_engine(quant_models[name], "numpy"), PROMPT)
    got = score_tokens(engine, PROMPT)
    assert _rel_err(got, expected) < 2e-3
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.95


@pytest.mark.gpu
@needs_cuda
def test_cuda_samples_on_the_device_as_on_the_host(quant_models) -> None:
    from localllm.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True, logprobs=2)
              for s in range(4)]  # fmt: skip
    prompts = [PROMPT[: 5 + 3 * i] for i in range(4)]
    device = _engine_on(quant_models["Q8_0"], "cuda")
    host = _engine_on(quant_models["Q8_0"], "cuda")
    host.backend.samples_on_device = False
    assert device.backend.samples_on_device
    got, expected = device.generate(prompts, params), host.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def _engine_on(path, device: str):
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), backend="torch", device=device, threads=1, max_num_seqs=4,
                                  ctx_size=128))  # fmt: skip
