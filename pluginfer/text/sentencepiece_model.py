"""The pieces of a SentencePiece ``tokenizer.model`` (its ``ModelProto``), read without the sentencepiece package.

``ModelProto`` field 1 is each ``SentencePiece``: ``piece`` (1, a string), ``score`` (2, a float) and ``type``
(3: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6; absent means NORMAL), in id order. The
other fields (trainer and normalizer specs) are skipped by their wire type.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Piece:
    text: str
    score: float
    type: int


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(data):
            raise ValueError("a varint runs past the end")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int, object]]:
    """(field number, wire type, value) of each field: an int (varint), bytes (length-delimited) or raw bytes
    (fixed 32 / 64 bits)."""
    out, at = [], 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            value, at = data[at:at + 8], at + 8
        elif wire == 2:
            length, at = _varint(data, at)
            value, at = data[at:at + length], at + length
        elif wire == 5:
            value, at = data[at:at + 4], at + 4
        else:
            raise ValueError(f"wire type {wire} of field {number} is not a protobuf 3 type")
        if at > len(data):
            raise ValueError(f"field {number} runs past the end")
        out.append((number, wire, value))
    return out


def read_pieces(path: Path) -> list[Piece]:
    """Every piece of the model at ``path``, in id order; ValueError naming the file when it is no such model."""
    try:
        pieces = []
        for number, wire, value in _fields(path.read_bytes()):
            if number != 1 or wire != 2:
                continue
            text, score, kind = None, 0.0, NORMAL
            for inner, inner_wire, inner_value in _fields(value):
                if inner == 1 and inner_wire == 2:
                    text = inner_value.decode("utf-8")
                elif inner == 2 and inner_wire == 5:
                    score = struct.unpack("<f", inner_value)[0]
                elif inner == 3 and inner_wire == 0:
                    kind = inner_value
            if text is None:
                raise ValueError(f"piece {len(pieces)} has no text")
            pieces.append(Piece(text, score, kind))
    except (ValueError, UnicodeDecodeError, struct.error) as error:
        raise ValueError(f"{path}: not a SentencePiece model ({error})") from None
    if not pieces:
        raise ValueError(f"{path}: not a SentencePiece model (no pieces)")
    return pieces
