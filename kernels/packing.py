"""Load-time repacking of GGUF weights into the layout the Numba matmul kernels read.

Why repack: the kernels put one *row* of the weight matrix in each SIMD lane (a "tile" of
`TILE_ROWS` rows is processed together), so every field is stored lane-minor: for tile t, block b,
byte j, the `TILE_ROWS` rows' bytes are contiguous.  A 16-byte load then feeds 16 rows at once and
per-row accumulators never need a horizontal reduction.  Scales stay fp16 (bits) so the packed copy
is the same size as the file's (K-quants: +2-3% for unpacked 6-bit scales; rows are padded to a whole
tile).  Every 32-element block uses one nibble order: byte j holds element j (low nibble) and
element j + 16 (high nibble), whatever the original type did.

Types without a fast integer kernel (F32, F16, BF16, Q2_K, Q3_K) keep the file's row-major bytes
and are dequantized row by row inside the kernel.

All fields of a weight live in one uint8 buffer (so a kernel call passes one array); `layout()` is
the single description of where each field starts, shared by this packer and the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ..quant.types import QUANT_TYPES

TILE_ROWS = 64  # rows per tile = lanes per weight block; 64 is faster than 32 (fewer per-block
# broadcasts of the activations per row), at the cost of padding small matrices to 64 rows

# Kernel ids ("kinds").  Lane kinds (repacked, integer kernels) first, then row kinds.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = range(8)
F32, F16, BF16, Q2_K, Q3_K = range(8, 13)
MXFP4 = 13  # a lane kind added after the row kinds (ids are only names: nothing orders them)
LANE_KINDS = frozenset((*range(8), MXFP4))

# GGML type id -> kind.
KIND_OF_GGML = {
    0: F32,
    1: F16,
    30: BF16,
    2: Q4_0,
    3: Q4_1,
    6: Q5_0,
    7: Q5_1,
    8: Q8_0,
    10: Q2_K,
    11: Q3_K,
    12: Q4_K,
    13: Q5_K,
    14: Q6_K,
    39: MXFP4,
}
# Bytes per block and elements per block of each kind, as stored in the file (from quant's type table).
_FILE_BLOCK = {
    kind: (QUANT_TYPES[t].type_size, QUANT_TYPES[t].block_size) for t, kind in KIND_OF_GGML.items()
}
_ROW_BLOCK = {kind: size for kind, size in _FILE_BLOCK.items() if kind not in LANE_KINDS}


@njit(cache=True)
def layout(kind: int, n: int, k: int) -> tuple[int, int, int, int]:
    """Byte offsets of the packed fields (f0, f1, f2, qs) and the total size.

    Lane kinds: up to three small fields (fp16 scales first, for alignment) then the quants.
    Shapes: nt tiles, nb 32-blocks, ns 256-superblocks, R = TILE_ROWS:
      Q4_0 d(nt,nb,R)u16 | qs(nt,nb,16,R)      Q4_1 dm(nt,nb,2,R)u16 | qs
      Q5_0 d | qh(nt,nb,2,R)u16 | qs           Q5_1 dm | qh | qs
      Q8_0 d | qs(nt,nb,8,R,4)i8 (quads)       Q4_K dd(nt,ns,2,R)u16 | sm(nt,nb,2,R)u8 | qs
      Q5_K dd | qh | sm | qs                   Q6_K d(nt,ns,R)u16 | sc(nt,nb,2,R)i8 | qh2(nt,nb,8,R) | qs
      MXFP4 (no f0) | e(nt,nb,R)u8 E8M0 exponents | qs (E2M1 codes, nibbles as Q4_0)
    Returns (o1, o2, o3, total): field i spans [o_i, o_{i+1}); unused fields are empty.
    """
    R = TILE_ROWS
    nt = (n + R - 1) // R
    nb, ns = k // 32, k // 256
    per_tile = nb * R  # one byte per (block, lane)
    if kind == Q4_0:
        sizes = (2 * per_tile, 0, 0, 16 * per_tile)
    elif kind == Q4_1:
        sizes = (4 * per_tile, 0, 0, 16 * per_tile)
    elif kind == Q5_0:
        sizes = (2 * per_tile, 4 * per_tile, 0, 16 * per_tile)
    elif kind == Q5_1:
        sizes = (4 * per_tile, 4 * per_tile, 0, 16 * per_tile)
    elif kind == Q8_0:
        sizes = (2 * per_tile, 0, 0, 32 * per_tile)
    elif kind == Q4_K:
        sizes = (4 * ns * R, 2 * per_tile, 0, 16 * per_tile)
    elif kind == Q5_K:
        sizes = (4 * ns * R, 4 * per_tile, 2 * per_tile, 16 * per_tile)
    elif kind == Q6_K:
        sizes = (2 * ns * R, 2 * per_tile, 8 * per_tile, 16 * per_tile)
    elif kind == MXFP4:
        sizes = (0, per_tile, 0, 16 * per_tile)
    else:
        return 0, 0, 0, 0
    o1 = nt * sizes[0]
    o2 = o1 + nt * sizes[1]
    o3 = o2 + nt * sizes[2]
    return o1, o2, o3, o3 + nt * sizes[3]


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight matrix (n rows of k) ready for the kernels: `buf` holds every field."""

    kind: int
    ggml_type: int
    n: int
    k: int
    buf: np.ndarray  # uint8, 1-D (a view of the file's bytes for row kinds)
    kernels: tuple[int, int] = (0, 0)  # range-kernel addresses (int path, float path), see matmul
    addr: int = 0  # address of buf's data

    @property
    def gemm(self) -> int:
        """Address of the shared float GEMM kernel, loaded on first use: with AVX2 a quantized model
        never takes the float path, and loading it would add to start-up."""
        from .gemm import gemm_kernel

        return gemm_kernel().address

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes)

    @property
    def lane(self) -> bool:
        return self.kind in LANE_KINDS


def pack_weight(raw: np.ndarray, ggml_type: int) -> PackedWeight:
    """raw: the tensor as GGUFFile.raw gives it (2-D: float rows, or uint8 (rows, row_bytes))."""
    kind = KIND_OF_GGML.get(int(ggml_type))
    if kind is None:
        raise ValueError(f"no Numba kernel for GGML type {ggml_type}")
    if raw.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {raw.shape}")
    n = raw.shape[0]
    if kind not in LANE_KINDS:
        nbytes, per = _ROW_BLOCK[kind]
        row_bytes = raw.shape[1] * raw.itemsize
        buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)  # no copy for a memmap
        return PackedWeight(kind, int(ggml_type), n, row_bytes // nbytes * per, buf)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8)
    k = _LANE_ELEMS[kind](blocks.shape[1])
    fields = _LANE_PACKERS[kind](blocks, n, k)
    return PackedWeight(kind, int(ggml_type), n, k, _assemble(kind, n, k, fields))


def _assemble(kind: int, n: int, k: int, fields: list[np.ndarray]) -> np.ndarray:
    total = layout(kind, n, k)[3]
    buf = np.empty(total, np.uint8)
    pos = 0
    for f in fields:
        b = np.ascontiguousarray(f).reshape(-1).view(np.uint8)
        buf[pos : pos + b.size] = b
        pos += b.size
    assert pos == total, (pos, total)
    return buf


# ---- splitting the file's blocks into per-element arrays --------------------------------------


def _tiles(a: np.ndarray, n: int) -> np.ndarray:
    """(n, nb, *f) -> (nt, nb, *f, R): pad rows to whole tiles and move the row axis last."""
    R = TILE_ROWS
    nt = -(-n // R)
    padded = np.zeros((nt * R, *a.shape[1:]), a.dtype)
    padded[:n] = a
    t = padded.reshape(nt, R, *a.shape[1:])
    return np.moveaxis(t, 1, -1)


def _fp16_field(b: np.ndarray, start: int) -> np.ndarray:
    """The little-endian 16-bit field at byte `start` of every block -> uint16 (n, nblocks)."""
    return b[..., start].astype(np.uint16) | (b[..., start + 1].astype(np.uint16) << 8)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _nibble_pack(q: np.ndarray) -> np.ndarray:
    """(..., 32) values < 16 -> (..., 16) bytes: element j low nibble, element j + 16 high nibble."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _bits_u16(h: np.ndarray) -> np.ndarray:
    """(..., 32) bits -> (..., 2) uint16: bit j of word 0 is element j, of word 1 element 16 + j."""
    w = h.reshape(*h.shape[:-1], 2, 16).astype(np.uint16) << np.arange(16, dtype=np.uint16)
    return w.sum(axis=-1, dtype=np.uint16)


def _q4_0(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    b = _blocks(raw, _LANE_BLOCK_BYTES[Q4_0])
    return [_tiles(_fp16_field(b, 0), n), _tiles(b[..., 2:18], n)]


def _q4_1(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    b = _blocks(raw, _LANE_BLOCK_BYTES[Q4_1])
    dm = np.stack([_fp16_field(b, 0), _fp16_field(b, 2)], axis=-1)
    return [_tiles(dm, n), _tiles(b[..., 4:20], n)]


def _qh32(b: np.ndarray, start: int) -> np.ndarray:
    """Q5_0/Q5_1's 32-bit high-bit word -> (n, nb, 2) uint16 (its low and high halves)."""
    return np.stack([_fp16_field(b, start), _fp16_field(b, start + 2)], axis=-1)


def _q5_0(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    b = _blocks(raw, _LANE_BLOCK_BYTES[Q5_0])
    return [_tiles(_fp16_field(b, 0), n), _tiles(_qh32(b, 2), n), _tiles(b[..., 6:22], n)]


def _q5_1(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    b = _blocks(raw, _LANE_BLOCK_BYTES[Q5_1])
    dm = np.stack([_fp16_field(b, 0), _fp16_field(b, 2)], axis=-1)
    return [_tiles(dm, n), _tiles(_qh32(b, 4), n), _tiles(b[..., 8:24], n)]


def _q8_0(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    """Q8_0 keeps each row's elements in groups of four ("quads", (nt, nb, 8, R, 4)): one 32-byte
    load is 8 rows x 4 elements, what vpmaddubsw + vpmaddwd reduce to one int32 per row."""
    b = _blocks(raw, _LANE_BLOCK_BYTES[Q8_0])
    quads = _tiles(b[..., 2:34].reshape(n, -1, 8, 4), n)  # (nt, nb, 8, 4, R)
    return [_tiles(_fp16_field(b, 0), n), np.swapaxes(quads, -1, -2)]


def _k4_scales(sc12: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 packed bytes -> (..., 8, 2) uint8 [6-bit scale, 6-bit min] per 32-block."""
    a, b, c = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return np.stack([sc, mn], axis=-1)


def _k4_nibbles(qs128: np.ndarray) -> np.ndarray:
    """(..., 128) bytes -> (..., 256) 4-bit values: each 64-element chunk is 32 low then 32 high nibbles."""
    q = qs128.reshape(*qs128.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs128.shape[:-1], 256)


def _k_scales_fields(b: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (d, dmin) per superblock and (scale, min) per 32-block, tiled."""
    dd = np.stack([_fp16_field(b, 0), _fp16_field(b, 2)], axis=-1)
    sm = _k4_scales(b[..., 4:16]).reshape(n, -1, 2)
    return _tiles(dd, n), _tiles(sm, n)


def _q4_k(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    b = _blocks(raw, _LANE_BLOCK_BYTES[Q4_K])
    dd, sm = _k_scales_fields(b, n)
    q = _k4_nibbles(b[..., 16:144]).reshape(n, -1, 32)
    return [dd, sm, _tiles(_nibble_pack(q), n)]


def _q5_k(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    b = _blocks(raw, _LANE_BLOCK_BYTES[Q5_K])
    dd, sm = _k_scales_fields(b, n)
    # bit i of qh[l] is the fifth bit of element 32 * i + l
    h = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # (n, ns, 32 l, 8 i)
    h = np.swapaxes(h, -1, -2).reshape(n, -1, 32)
    q = _k4_nibbles(b[..., 48:176]).reshape(n, -1, 32)
    return [dd, _tiles(_bits_u16(h), n), sm, _tiles(_nibble_pack(q), n)]


def _q6_k_values(b: np.ndarray) -> np.ndarray:
    """(n, ns, 210) blocks -> (n, ns, 256) unsigned 6-bit quants in element order (ggml's layout)."""
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # half, 32-byte run, l
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=-3).reshape(*b.shape[:-1], 2, 4, 32)  # runs 0..3
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    return (low | (high << 4)).reshape(*b.shape[:-1], 256)


def _q6_k(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    b = _blocks(raw, _LANE_BLOCK_BYTES[Q6_K])
    q = _q6_k_values(b).reshape(n, -1, 32)
    c = (q >> 4).reshape(n, -1, 4, 8)  # crumb of element 8 * i + j
    qh2 = c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)
    sc = b[..., 192:208].reshape(n, -1, 2)  # int8 scale per 16 elements, two per 32-block
    return [
        _tiles(_fp16_field(b, 208), n),
        _tiles(sc, n),
        _tiles(qh2.astype(np.uint8), n),
        _tiles(_nibble_pack(q & 0x0F), n),
    ]


def _mxfp4(raw: np.ndarray, n: int, k: int) -> list[np.ndarray]:
    """The file's block is e then 16 nibble bytes in Q4_0's order: both fields tile as they are."""
    b = _blocks(raw, _LANE_BLOCK_BYTES[MXFP4])
    return [_tiles(b[..., 0], n), _tiles(b[..., 1:17], n)]


_LANE_PACKERS = {
    Q4_0: _q4_0,
    Q4_1: _q4_1,
    Q5_0: _q5_0,
    Q5_1: _q5_1,
    Q8_0: _q8_0,
    Q4_K: _q4_k,
    Q5_K: _q5_k,
    Q6_K: _q6_k,
    MXFP4: _mxfp4,
}
_LANE_BLOCK_BYTES = {kind: _FILE_BLOCK[kind][0] for kind in LANE_KINDS}
_LANE_ELEMS = {
    kind: (lambda row_bytes, bb=bb, per=per: row_bytes // bb * per)
    for kind, (bb, per) in _FILE_BLOCK.items()
    if kind in LANE_KINDS
}
