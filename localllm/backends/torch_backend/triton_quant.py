"""Triton kernels that multiply by GGUF-quantized weights (weights.py's planes) without a dense copy.

`_dequant` forms any tile of weight values exactly as quant/ggml.py's NumPy dequantizers do: fp16
scales widened to float32, scale products in float32 (d * sc, dmin * m), then times the integer quant
and minus the min. Where a min is subtracted, the products before it are exact in float32 (at most
22 significant bits), so a fused multiply-add cannot change the value; Q6_K's (d * sc) * q, which can
round, is its last operation, rounded once as NumPy rounds it. So the kernels' weights equal the
oracle's bit for bit, and only the order of the float32 sums differs.

- `dequant_kernel` writes the values out (the tests' exact check, and a tool).
- `gemv` (decode rows) launches block-structured kernels, triton_legacy.py's for the 32-value types
  and triton_kquant.py's for the k-quants. Each program owns BLOCK_N weight rows and a range of K;
  split-K: several programs share a row's K range so a launch has thousands of programs (a
  memory-bound kernel needs many bytes in flight per SM), their partial sums added after.
- Launch parameters are a `KernelConfig` per (kernel, type), GEMV_CONFIGS / GEMM_CONFIGS, which
  `gemv` and `gemm` take as an override (scripts/gpu_kernel_sweep.py tries alternatives).
- `gemm` (prefill and batched decode) launches triton_legacy.py's or triton_kquant.py's
  block-structured GEMM; `gemm_kernel` here is the per-value one (`gemm(generic=True)`); in each a
  dequantized tile meets a float32 x tile in `tl.dot`, with `input_precision`
  "tf32x3" on CUDA by default (tensor cores, about float32's error), "ieee" for exact float32 products;
  split-K as the GEMV's, so a 64-row decode batch still fills the device.

Importing this module imports Triton: the backend imports it only where Triton is present. With
TRITON_INTERPRET=1 set before the import, the kernels run on the CPU in NumPy (the tests' way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from localllm.backends.torch_backend import triton_legacy as tl_legacy
from localllm.backends.torch_backend.weights import TYPES, QuantWeight

QTYPE_IDS = {name: i for i, name in enumerate(TYPES)}  # a kernel's QT constexpr
GEMM_BLOCK_N, GEMM_BLOCK_K = 64, 64


@dataclass(frozen=True)
class KernelConfig:
    """How one kernel is launched for one type.

    block_n: weight rows per program. step: 32-value blocks (legacy types) or 256-value super-blocks
    (k-quants) per loop step (the k-quant GEMM steps one; the per-value GEMM, K values). programs:
    split-K is added until a launch has at least this many programs. kernel: "2d" launches the
    k-quant GEMM of 2-D tiles (triton_kquant2d.py, step: super-blocks) instead of the default one.
    block_m (GEMMs): x rows per program; 0: 16, 32 or 64 by the row count."""

    block_n: int
    step: int
    num_warps: int = 4
    num_stages: int = 1
    programs: int = 1024
    kernel: str = "default"
    block_m: int = 0


# Defaults: the best of scripts/gpu_kernel_sweep.py's grid on an H200 over three shapes (weights read
# from HBM; docs/benchmarks.md, "GPU"): 16 rows a program, and steps long enough to keep ~8 KB of
# weight loads in flight per program. num_stages: these loops are not software-pipelined (1 and 3 give
# the same PTX); the unrolled step is what puts loads in flight. The programs target barely mattered.
GEMV_CONFIGS: dict[str, KernelConfig] = {
    "Q4_0": KernelConfig(block_n=16, step=16),
    "Q4_1": KernelConfig(block_n=16, step=16),
    "Q5_0": KernelConfig(block_n=16, step=16),
    "Q5_1": KernelConfig(block_n=16, step=16),
    "Q8_0": KernelConfig(block_n=16, step=16),
    "MXFP4": KernelConfig(block_n=16, step=16),  # as the other 32-value types (not timed on a GPU)
    "Q4_K": KernelConfig(block_n=16, step=4),
    "Q5_K": KernelConfig(block_n=16, step=4),
    "Q6_K": KernelConfig(block_n=32, step=2),
}
GEMM_CONFIGS: dict[str, KernelConfig] = {  # 3 stages: Triton's default, as before the configs
    t: KernelConfig(block_n=32, step=1, num_stages=3, programs=264)
    if TYPES[t][0] == 256
    else KernelConfig(block_n=64, step=4, num_stages=3, programs=264)
    for t in TYPES
}
GENERIC_GEMM = KernelConfig(block_n=GEMM_BLOCK_N, step=GEMM_BLOCK_K, num_stages=3, programs=264)
# The 2-D-tile k-quant GEMM (not yet timed on a GPU: selected by config only). 16 rows a program: at
# 16 its values form in the tensor-core operand layout (sm_90 PTX: no shared-memory store, 2 barriers
# a loop step); at 32 Triton re-lays them out through shared memory and at 64 (wgmma) stores each of
# its eight dots' tiles there, so more rows take more programs instead.
KQUANT_GEMM_2D = KernelConfig(block_n=32, step=1, num_stages=3, programs=264, kernel="2d", block_m=16)


@triton.jit
def _nibble(qs_ptr, b, j, width: tl.constexpr, half: tl.constexpr):
    """Value j of a block whose `width` bytes hold low nibbles first (elements 0..half-1 of each run)."""
    byte = tl.load(qs_ptr + b * width + (j % half)).to(tl.int32)
    return (byte >> ((j // half) * 4)) & 15


@triton.jit
def _dequant(p0, p1, p2, p3, n, k, nb, QT: tl.constexpr, BS: tl.constexpr):
    """Float32 weights at rows n and columns k (broadcastable int tensors, in range)."""
    blk = k // BS
    j = k % BS
    b = n * nb + blk  # the block's index in every plane
    if QT == 0:  # Q4_0: d * (q - 8)
        w = tl.load(p0 + b).to(tl.float32) * (_nibble(p1, b, j, 16, 16) - 8).to(tl.float32)
    elif QT == 1:  # Q4_1: d * q + m
        q = _nibble(p1, b, j, 16, 16).to(tl.float32)
        w = tl.load(p0 + 2 * b).to(tl.float32) * q + tl.load(p0 + 2 * b + 1).to(tl.float32)
    elif QT == 2:  # Q5_0: d * (q - 16), the fifth bit from qh
        hi = ((tl.load(p1 + b) >> j) & 1) << 4
        w = tl.load(p0 + b).to(tl.float32) * ((_nibble(p2, b, j, 16, 16) | hi) - 16).to(tl.float32)
    elif QT == 3:  # Q5_1: d * q + m
        q = (_nibble(p2, b, j, 16, 16) | (((tl.load(p1 + b) >> j) & 1) << 4)).to(tl.float32)
        w = tl.load(p0 + 2 * b).to(tl.float32) * q + tl.load(p0 + 2 * b + 1).to(tl.float32)
    elif QT == 4:  # Q8_0: d * q
        w = tl.load(p0 + b).to(tl.float32) * tl.load(p1 + b * 32 + j).to(tl.float32)
    elif QT == 5 or QT == 6:  # Q4_K, Q5_K: (d * sc) * q - dmin * m, per 32 values
        w = _k4_value(p0, p1, p2, p3, b, j, QT == 6)
    elif QT == 8:  # MXFP4: 2^(e - 128) * the doubled E2M1 value
        code = tl_legacy.e2m1_biased(_nibble(p1, b, j, 16, 16)) - 12
        w = tl_legacy.e8m0_half(tl.load(p0 + b)) * code.to(tl.float32)
    else:  # Q6_K: (d * sc) * (q - 32), per 16 values
        w = _q6_k_value(p0, p1, p2, p3, b, j)
    return w


@triton.jit
def _k4_value(p0, p1, p2, p3, b, j, FIVE: tl.constexpr):
    sub = j // 32
    d = tl.load(p0 + 2 * b).to(tl.float32) * tl.load(p1 + b * 16 + sub).to(tl.float32)
    m = tl.load(p0 + 2 * b + 1).to(tl.float32) * tl.load(p1 + b * 16 + 8 + sub).to(tl.float32)
    if FIVE:  # planes dm, scm, qh, qs: bit `sub` of byte j % 32 is the fifth bit
        q = _k4_nibble(p3, b, j)
        q = q | (((tl.load(p2 + b * 32 + j % 32).to(tl.int32) >> sub) & 1) << 4)
    else:  # planes dm, scm, qs: each 64 values are 32 bytes' low nibbles, then their high ones
        q = _k4_nibble(p2, b, j)
    return d * q.to(tl.float32) - m


@triton.jit
def _k4_nibble(qs_ptr, b, j):
    byte = tl.load(qs_ptr + b * 128 + (j // 64) * 32 + j % 32).to(tl.int32)
    return (byte >> (((j % 64) // 32) * 4)) & 15


@triton.jit
def _q6_k_value(p0, p1, p2, p3, b, j):
    """Planes d, scm (16 signed scales), qh (64 bytes), qs (128 bytes of low nibbles)."""
    half = j // 128
    i = j % 128
    run = i // 32
    lane = i % 32
    low = tl.load(p3 + b * 128 + half * 64 + (run % 2) * 32 + lane).to(tl.int32)
    low = (low >> ((run // 2) * 4)) & 15
    high = (tl.load(p2 + b * 64 + half * 32 + lane).to(tl.int32) >> (2 * run)) & 3
    d = tl.load(p0 + b).to(tl.float32) * tl.load(p1 + b * 16 + j // 16).to(tl.float32)
    return d * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def dequant_kernel(out_ptr, p0, p1, p2, p3, N, K, nb, QT: tl.constexpr, BS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.minimum(rn, N - 1)[:, None]  # clamped: out-of-range lanes read a real block, store nothing
    k = tl.minimum(rk, K - 1)[None, :]
    w = _dequant(p0, p1, p2, p3, n.to(tl.int64), k, nb, QT, BS)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], w, mask=mask)


@triton.jit
def gemm_kernel(x_ptr, out_ptr, p0, p1, p2, p3, M, N, K, nb, stride_xm, k_per_split,
                QT: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """out[split, m, n] = sum over this split's k of x[m, k] * w[n, k], one (BLOCK_M, BLOCK_N) tile
    per program; grid (m tiles, n tiles, splits)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.minimum(rn, N - 1).to(tl.int64)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm < M)[:, None] & (rk < k_end)[None, :]
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        w = _dequant(p0, p1, p2, p3, n, tl.minimum(rk, K - 1)[:, None], nb, QT, BS)
        w = tl.where((rk < k_end)[:, None], w, 0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    out = out_ptr + (tl.program_id(2) * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


# ---- launchers ----------------------------------------------------------------------------------------

KQUANTS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # triton_kquant's KIND


def _planes(w: QuantWeight) -> tuple[torch.Tensor, ...]:
    """The four plane arguments every kernel takes: triton_kquant's order for the k-quants; types with
    fewer planes repeat their first."""
    if w.qtype == "Q4_K":
        return (w.planes[0], w.planes[1], w.planes[2], w.planes[2])
    return tuple(w.planes) + (w.planes[0],) * (4 - len(w.planes))


def _meta(w: QuantWeight) -> tuple[int, int, int, int, int]:
    n, k = w.shape
    return n, k, k // w.block_size, QTYPE_IDS[w.qtype], w.block_size


def _splits(k: int, step: int, programs: int, target: int, asked: int = 0) -> tuple[int, int]:
    """(splits, K per split, a multiple of step): enough splits for `target` programs in all (one
    split has `programs`), each with at least one step of K; `asked` > 0 overrides."""
    splits = asked if asked > 0 else max(1, min(triton.cdiv(target, programs), k // step))
    per_split = triton.cdiv(triton.cdiv(k, splits), step) * step
    return triton.cdiv(k, per_split), per_split


def _summed(out: torch.Tensor) -> torch.Tensor:
    return out[0] if out.shape[0] == 1 else out.sum(0)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The (N, K) float32 values of w, through the kernels' own dequantization."""
    n, k, nb, qt, bs = _meta(w)
    out = torch.empty((n, k), dtype=torch.float32, device=w.planes[0].device)
    grid = (triton.cdiv(n, 16), triton.cdiv(k, 256))
    dequant_kernel[grid](out, *_planes(w), n, k, nb, QT=qt, BS=bs, BLOCK_N=16, BLOCK_K=256)
    return out


def gemv(
    x: torch.Tensor, w: QuantWeight, split_k: int = 0, config: KernelConfig | None = None
) -> torch.Tensor:
    """x (M, K) float32, M small, times w transposed -> (M, N) float32. split_k 0: chosen by size;
    config: GEMV_CONFIGS' for w's type unless given."""
    from localllm.backends.torch_backend import triton_kquant as kq

    c = config or GEMV_CONFIGS[w.qtype]
    n, k, nb, qt, bs = _meta(w)
    x = x.float().contiguous()
    m = x.shape[0]
    tiles = triton.cdiv(n, c.block_n)
    splits, per_split = _splits(nb, c.step, tiles * m, c.programs, split_k)
    out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    launch = {"BLOCK_N": c.block_n, "num_warps": c.num_warps, "num_stages": c.num_stages}
    if w.qtype in KQUANTS:
        kq.gemv_kquant_kernel[(tiles, splits, m)](
            x, out, *_planes(w), n, nb, x.stride(0), per_split, KIND=KQUANTS[w.qtype], STEP=c.step, **launch
        )  # fmt: skip
    else:
        tl_legacy.gemv_legacy_kernel[(tiles, splits, m)](
            x, out, *_planes(w)[:3], n, nb, x.stride(0), per_split, QT=qt, BLOCK_B=c.step, **launch
        )  # fmt: skip
    return _summed(out)


def gemm(
    x: torch.Tensor,
    w: QuantWeight,
    precision: str = "tf32x3",
    split_k: int = 0,
    config: KernelConfig | None = None,
    generic: bool = False,
) -> torch.Tensor:
    """x (M, K) float32 times w transposed -> (M, N) float32, in tensor-core tiles. Legacy types take
    triton_legacy's block-structured kernel (config step: blocks), or with `generic` the per-value
    gemm_kernel (step: K values); k-quants triton_kquant's, or with config.kernel "2d" triton_kquant2d's
    (step: super-blocks)."""
    from localllm.backends.torch_backend import triton_kquant as kq
    from localllm.backends.torch_backend import triton_kquant2d as kq2d

    c = config or (GENERIC_GEMM if generic else GEMM_CONFIGS[w.qtype])
    n, k, nb, qt, bs = _meta(w)
    x = x.float().contiguous()
    m = x.shape[0]
    block_m = c.block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    kquant = w.qtype in KQUANTS
    tiles = (triton.cdiv(m, block_m), triton.cdiv(n, c.block_n))
    two_d = kquant and c.kernel == "2d"
    grid_k, step = (k, c.step) if generic and not kquant else (nb, 1 if kquant and not two_d else c.step)
    splits, per_split = _splits(grid_k, step, tiles[0] * tiles[1], c.programs, split_k)
    out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    args = (x, out, *_planes(w))
    common = {"BLOCK_M": block_m, "BLOCK_N": c.block_n, "PRECISION": precision}
    common.update(num_warps=c.num_warps, num_stages=c.num_stages)
    grid = (tiles[0], tiles[1], splits)
    if two_d:
        kq2d.gemm_kquant2d_kernel[grid](
            *args, m, n, nb, x.stride(0), per_split, KIND=KQUANTS[w.qtype], STEP=step, **common
        )  # fmt: skip
    elif kquant:
        kq.gemm_kquant_kernel[grid](*args, m, n, nb, x.stride(0), per_split, KIND=KQUANTS[w.qtype], **common)
    elif generic:
        gemm_kernel[grid](*args, m, n, k, nb, x.stride(0), per_split, QT=qt, BS=bs, BLOCK_K=step, **common)
    else:
        tl_legacy.gemm_legacy_kernel[grid](
            *args[:5], m, n, nb, x.stride(0), per_split, QT=qt, BLOCK_B=step, **common
        )  # fmt: skip
    return _summed(out)


# Up to this many rows the GEMV (which reads the weight once per row) beat the k-quant GEMM on an H200
# (docs/benchmarks.md, "GPU"): 2 rows at half the GEMM's time, 8 rows at 1.7 times it.
GEMV_ROWS = 3


def matmul(
    x: torch.Tensor, w: QuantWeight, gemv_rows: int = GEMV_ROWS, precision: str = "tf32x3"
) -> torch.Tensor:
    """The kernel for x's row count: GEMV for up to gemv_rows rows (decode), tiled GEMM beyond."""
    if x.shape[0] == 0:  # (no launch has an empty grid)
        return torch.empty((0, w.shape[0]), dtype=torch.float32, device=x.device)
    return gemv(x, w) if x.shape[0] <= gemv_rows else gemm(x, w, precision)
