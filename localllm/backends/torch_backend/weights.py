"""Weights on the device: GGUF blocks kept quantized, repacked losslessly into planes, or dense.

A quantized matrix (N rows of K) is stored as a few planes, each (N, blocks per row[, width]): the
blocks' fp16 scales in one, their integer quants in others, so every load a kernel makes is aligned
and a row's bytes are contiguous in each plane. Nothing is rounded: the planes hold the file's bits.
The one reshuffle is Q4_K/Q5_K's twelve bytes of packed 6-bit scales and mins, spread to sixteen
bytes (one per value: +3% of the block) so a kernel reads a sub-block's scale with one byte load.

Plane order per type (TYPES): `d` fp16 scale (Q4_1/Q5_1/Q4_K/Q5_K: `dm`, scale and min/dmin side by
side; MXFP4: `e`, its E8M0 exponent byte), `qh` high bits (int32 per block for Q5_0/Q5_1, bytes for
Q5_K/Q6_K), `scm` (K-quants: eight scales then eight mins; Q6_K: sixteen signed scales), `qs` the low
bits (MXFP4: 32 E2M1 codes, in Q4_0's nibble order).

`dequantize_torch` turns planes back into float32 with torch integer and float ops in the NumPy
dequantizers' order (quant/ggml.py), so the values are bit-identical on any device: it is the path
where Triton is absent (MPS, CPU torch), and how embeddings read their rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from localllm.quant import type_name
from localllm.quant.ggml import BLOCK_KERNELS, MXFP4_VALUES, _k4_scales_mins

# type -> (elements per block, plane names in the order kernels take them)
TYPES: dict[str, tuple[int, tuple[str, ...]]] = {
    "Q4_0": (32, ("d", "qs")),
    "Q4_1": (32, ("dm", "qs")),
    "Q5_0": (32, ("d", "qh", "qs")),
    "Q5_1": (32, ("dm", "qh", "qs")),
    "Q8_0": (32, ("d", "qs")),
    "Q4_K": (256, ("dm", "scm", "qs")),
    "Q5_K": (256, ("dm", "scm", "qh", "qs")),
    "Q6_K": (256, ("d", "scm", "qh", "qs")),
    "MXFP4": (32, ("e", "qs")),
}


@dataclass(slots=True)
class QuantWeight:
    """A matrix of N rows of K values kept in its GGUF type's blocks, as planes on the device."""

    qtype: str
    shape: tuple[int, int]  # (N, K)
    planes: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes)

    @property
    def block_size(self) -> int:
        return TYPES[self.qtype][0]

    def plane(self, name: str) -> torch.Tensor:
        return self.planes[TYPES[self.qtype][1].index(name)]

    def rows(self, ids: torch.Tensor) -> QuantWeight:
        """The rows `ids` only (an embedding lookup's)."""
        return QuantWeight(self.qtype, (len(ids), self.shape[1]), tuple(p[ids] for p in self.planes))


def keeps_quantized(ggml_type: int) -> bool:
    return type_name(ggml_type) in TYPES


def repack(raw: np.ndarray, ggml_type: int) -> tuple[str, tuple[int, int], tuple[np.ndarray, ...]]:
    """Raw GGUF rows (N, row bytes) -> (type, (N, K), host planes), losslessly."""
    qtype = type_name(ggml_type)
    layout, block_size, _ = BLOCK_KERNELS[qtype]
    rows = np.ascontiguousarray(raw.reshape(-1, raw.shape[-1]).view(np.uint8))
    blocks = rows.view(layout)  # (N, blocks per row) structs
    shape = (rows.shape[0], blocks.shape[1] * block_size)
    fields = {name: np.ascontiguousarray(blocks[name]) for name in layout.names}
    low = next((f for f in ("m", "dmin") if f in fields), None)  # the block's min, where it has one
    if low is not None:
        fields["dm"] = np.stack([fields["d"], fields[low]], axis=-1)
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k4_scales_mins(fields["scales"])
        fields["scm"] = np.concatenate([sc, mn], axis=-1).astype(np.uint8)
    elif qtype == "Q6_K":
        fields["scm"], fields["qs"] = fields["scales"], fields["ql"]
    if qtype in ("Q5_0", "Q5_1"):
        fields["qh"] = fields["qh"].view(np.int32)  # torch's uint32 support is thin; the bits are kept
    return qtype, shape, tuple(fields[name] for name in TYPES[qtype][1])


def upload(raw: np.ndarray, ggml_type: int, device: torch.device) -> QuantWeight:
    qtype, shape, planes = repack(raw, ggml_type)
    return QuantWeight(qtype, shape, tuple(torch.from_numpy(p).to(device) for p in planes))


# ---- torch dequantization (NumPy's order of float operations, so the values are the same) ------------


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32): low nibbles are elements 0..15, high ones 16..31."""
    q = qs.to(torch.int32)
    return torch.cat([q & 15, q >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """(...,) int32 -> (..., 32): bit j is the fifth bit of element j."""
    return (qh[..., None] >> torch.arange(32, device=qh.device, dtype=torch.int32)) & 1


def _legacy(w: QuantWeight) -> torch.Tensor:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 -> (N, blocks, 32) float32."""
    t = w.qtype
    if t == "Q8_0":
        return w.plane("d").float()[..., None] * w.plane("qs").float()
    q = _nibbles(w.plane("qs"))
    if t in ("Q5_0", "Q5_1"):
        q = q | (_bits32(w.plane("qh")) << 4)
    if t in ("Q4_0", "Q5_0"):
        return w.plane("d").float()[..., None] * (q - (8 if t == "Q4_0" else 16)).float()
    dm = w.plane("dm").float()
    return dm[..., 0:1] * q.float() + dm[..., 1:2]


def _k4(w: QuantWeight) -> torch.Tensor:
    """Q4_K, Q5_K -> (N, blocks, 256): (d * sc) * q - dmin * m, one (sc, m) per 32 values."""
    qs = w.plane("qs").to(torch.int32)
    n, nb = qs.shape[:2]
    shifts = torch.tensor([0, 4], device=qs.device, dtype=torch.int32).view(2, 1)
    q = ((qs.view(n, nb, 4, 1, 32) >> shifts) & 15).view(n, nb, 8, 32)
    if w.qtype == "Q5_K":
        bit = torch.arange(8, device=qs.device, dtype=torch.int32).view(8, 1)
        q = q | (((w.plane("qh").to(torch.int32)[:, :, None, :] >> bit) & 1) << 4)
    dm, scm = w.plane("dm").float(), w.plane("scm").float()
    d = (dm[..., 0:1] * scm[..., :8])[..., None]
    m = (dm[..., 1:2] * scm[..., 8:])[..., None]
    return (d * q.float() - m).view(n, nb, 256)


def _q6_k(w: QuantWeight) -> torch.Tensor:
    """Q6_K -> (N, blocks, 256): (d * sc) * (q - 32), one signed scale per 16 values."""
    ql, qh = w.plane("qs").to(torch.int32), w.plane("qh").to(torch.int32)
    n, nb = ql.shape[:2]
    dev = ql.device
    nib = torch.tensor([0, 4], device=dev, dtype=torch.int32).view(2, 1, 1)
    crumbs = torch.tensor([0, 2, 4, 6], device=dev, dtype=torch.int32).view(4, 1)
    low = ((ql.view(n, nb, 2, 1, 2, 32) >> nib) & 15).view(n, nb, 2, 4, 32)
    high = (qh.view(n, nb, 2, 1, 32) >> crumbs) & 3
    q = ((low | (high << 4)) - 32).float().view(n, nb, 16, 16)
    dl = w.plane("d").float()[..., None] * w.plane("scm").float()
    return (dl[..., None] * q).view(n, nb, 256)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> float32 2^(e - 128) from the bits (e < 2: subnormal), as quant/ggml.py."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(w: QuantWeight) -> torch.Tensor:
    """MXFP4 -> (N, blocks, 32): 2^(e - 128) times the doubled E2M1 value, an exact product."""
    codes = _nibbles(w.plane("qs"))
    table = torch.from_numpy(MXFP4_VALUES.astype(np.float32)).to(codes.device)
    return e8m0_half(w.plane("e"))[..., None] * table[codes.long()]


def dequantize_torch(w: QuantWeight) -> torch.Tensor:
    """The (N, K) float32 values of w, equal to quant.dequantize's of the same blocks."""
    if w.qtype in ("Q4_K", "Q5_K"):
        values = _k4(w)
    elif w.qtype == "Q6_K":
        values = _q6_k(w)
    elif w.qtype == "MXFP4":
        values = _mxfp4(w)
    else:
        values = _legacy(w)
    return values.reshape(w.shape)


def dequantized_rows(w: QuantWeight, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of w as float32 (a chunk of a matrix the torch path multiplies by)."""
    part = QuantWeight(w.qtype, (stop - start, w.shape[1]), tuple(p[start:stop] for p in w.planes))
    return dequantize_torch(part)
