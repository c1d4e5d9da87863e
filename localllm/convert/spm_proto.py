"""The few fields of a SentencePiece `tokenizer.model` (a protobuf ModelProto) that a GGUF vocabulary
needs, read and written by hand: no protobuf or sentencepiece package for a list of (piece, score, type).

ModelProto: 1 = repeated SentencePiece {1: piece (string), 2: score (float), 3: type (enum)},
2 = TrainerSpec {3: model_type (1 unigram, 2 BPE)}, 3 = NormalizerSpec {1: name, 3: add_dummy_prefix,
4: remove_extra_whitespaces, 5: escape_whitespaces}.  SentencePiece's piece types (1 normal, 2 unknown,
3 control, 4 user-defined, 5 unused, 6 byte) are GGUF's token types, number for number.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from localllm.errors import LocalLLMError


@dataclass(slots=True)
class SpmModel:
    pieces: list[str]
    scores: list[float]
    types: list[int]
    add_dummy_prefix: bool = False


MAX_VARINT_BYTES = 10  # a 64-bit value; longer runs of continuation bytes are damage
PIECE_TYPES = range(1, 7)


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    value = 0
    for k in range(MAX_VARINT_BYTES):  # bounded: a long run of 0xff bytes must not cost O(n^2)
        if i + k >= len(data):
            raise LocalLLMError("tokenizer.model is truncated")
        byte = data[i + k]
        value |= (byte & 0x7F) << (7 * k)
        if byte < 0x80:
            return value, i + k + 1
    raise LocalLLMError(f"tokenizer.model is damaged: a number at byte {i:,} runs past 64 bits")


_WIDTHS = {1: 8, 5: 4}  # fixed64, fixed32


def _fields(data: memoryview):  # noqa: ANN202 (yields (field number, wire type, value))
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            yield number, wire, value
            continue
        if wire == 2:
            n, i = _varint(data, i)
        elif wire in _WIDTHS:
            n = _WIDTHS[wire]
        else:
            raise LocalLLMError(f"tokenizer.model is not a SentencePiece model (wire type {wire})")
        if n > len(data) - i:
            raise LocalLLMError("tokenizer.model is truncated")
        yield number, wire, data[i : i + n]  # a view: nested messages are not copied
        i += n


def read_spm(data: bytes) -> SpmModel:
    """The pieces of a tokenizer.model; a damaged one is one LocalLLMError, in time linear in its size."""
    model = SpmModel([], [], [])
    view = memoryview(data)
    for number, wire, value in _fields(view):
        if number == 1 and wire == 2:
            _read_piece(value, model)
        elif number == 3 and wire == 2:
            spec = {n: v for n, w, v in _fields(value) if w == 0}
            model.add_dummy_prefix = bool(spec.get(3, 1))
    if not model.pieces:
        raise LocalLLMError("tokenizer.model holds no pieces (not a SentencePiece model?)")
    return model


def _read_piece(message: memoryview, model: SpmModel) -> None:
    piece, score, kind = "", 0.0, 1
    for n, w, v in _fields(message):
        if n == 1 and w == 2:
            try:
                piece = str(v, "utf-8")
            except UnicodeDecodeError:
                raise LocalLLMError(f"tokenizer.model: piece {len(model.pieces)} is not UTF-8") from None
        elif n == 2 and w == 5:
            score = struct.unpack("<f", v)[0]
        elif n == 3 and w == 0:
            kind = v
    if kind not in PIECE_TYPES:
        raise LocalLLMError(f"tokenizer.model: piece {len(model.pieces)} has type {kind} (1 to 6 expected)")
    model.pieces.append(piece)
    model.scores.append(score)
    model.types.append(kind)


def _key(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _message(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _encode_varint(len(payload)) + payload


def write_spm(model: SpmModel) -> bytes:
    out = bytearray()
    for piece, score, kind in zip(model.pieces, model.scores, model.types, strict=True):
        body = _message(1, piece.encode("utf-8")) + _key(2, 5) + struct.pack("<f", score)
        out += _message(1, body + _key(3, 0) + _encode_varint(kind))
    out += _message(2, _key(3, 0) + _encode_varint(2))  # trainer: BPE
    normalizer = _message(1, b"identity") + _key(3, 0) + _encode_varint(int(model.add_dummy_prefix))
    out += _message(3, normalizer + _key(4, 0) + b"\x00" + _key(5, 0) + b"\x01")
    return bytes(out)
