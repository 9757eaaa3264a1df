"""Batch entries encoded in bulk: the protobuf bytes of N WriteEntry/ReadEntry messages built with
numpy from column arrays, then parsed once by the protobuf runtime (C), instead of N Python-level
message constructions (which cost microseconds each: 10⁵ descriptors would take a good part of a
second)."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

#: ("varint", field, values) or ("table", field, (keys, byte strings)).
Piece = Tuple[str, int, Any]

_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)


def varints(v: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(N×W uint8 matrix, lengths): each value's base-128 varint in the first `length` bytes of
    its row (W: the longest)."""
    v = np.asarray(v, dtype=np.uint64)
    lens = np.ones(len(v), dtype=np.int64)
    for k in range(1, 10):
        more = v >= np.uint64(1 << (7 * k))
        if not more.any():
            break
        lens += more
    w = int(lens.max()) if len(v) else 1
    shifted = v[:, None] >> _SHIFTS[None, :w]
    cont = np.arange(w)[None, :] < (lens[:, None] - 1)
    mat = ((shifted & np.uint64(0x7F)) | (cont.astype(np.uint64) << np.uint64(7))).astype(np.uint8)
    return mat, lens


def _key(field: int, wire: int) -> int:
    return (field << 3) | wire


def varint(v: int) -> bytes:
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def blobs(field: int, values: Sequence[bytes]) -> List[bytes]:
    """Each value as a whole length-delimited field (key, length, bytes): a table piece's rows,
    encoded once per prepared list."""
    return [bytes([_key(field, 2)]) + varint(len(v)) + bytes(v) for v in values]


def table_piece(keys: np.ndarray, rows: Sequence[bytes]) -> Piece:
    """A field whose bytes are rows[keys[i]] for entry i (rows from `blobs`)."""
    return ("table", 0, (keys, rows))


def varint_piece(field: int, values: np.ndarray) -> Piece:
    return ("varint", field, values)


def _scatter_varint(out: np.ndarray, at: np.ndarray, mat: np.ndarray, lens: np.ndarray) -> None:
    w = mat.shape[1]
    mask = np.arange(w)[None, :] < lens[:, None]
    pos = at[:, None] + np.arange(w)[None, :]
    out[pos[mask]] = mat[mask]


#: Up to this many entries, a plain loop is quicker than numpy's per-call overhead.
SMALL = 64


def _entries_small(field: int, pieces: List[Piece], n: int, per: int) -> List[bytes]:
    cols = []
    for kind, f, data in pieces:
        if kind == "varint":
            cols.append((bytes([_key(f, 0)]), [int(x) for x in data]))
        else:
            keys, rows = data
            cols.append((b"", [rows[int(k)] for k in keys]))
    head = bytes([_key(field, 2)])
    out: List[bytes] = []
    cur = bytearray()
    for i in range(n):
        body = b"".join(tag + (varint(vals[i]) if tag else vals[i]) for tag, vals in cols)  # type: ignore[operator]
        cur += head + varint(len(body)) + body
        if (i + 1) % per == 0:
            out.append(bytes(cur))
            cur = bytearray()
    if cur:
        out.append(bytes(cur))
    return out


def entries(field: int, pieces: List[Piece], per: int) -> List[bytes]:
    """The bytes of N repeated length-delimited messages (field number `field` of the enclosing
    message), each made of the pieces' fields in order, cut every `per` messages."""
    n = len(pieces[0][2][0]) if pieces[0][0] == "table" else len(pieces[0][2])
    if n <= SMALL:
        return _entries_small(field, pieces, n, per)
    prepared: List[Tuple[str, int, Any]] = []
    body = np.zeros(n, dtype=np.int64)
    for kind, f, data in pieces:
        if kind == "varint":
            mat, lens = varints(data)
            prepared.append((kind, _key(f, 0), (mat, lens)))
            body += 1 + lens
        else:
            keys, rows = data
            arrs = [np.frombuffer(r, dtype=np.uint8) for r in rows]
            ks = np.asarray(keys, dtype=np.int64)
            prepared.append((kind, 0, (ks, arrs)))
            body += np.array([len(r) for r in rows], dtype=np.int64)[ks]
    bmat, blens = varints(body.astype(np.uint64))
    total = 1 + blens + body
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(total[:-1], out=start[1:])
    out = np.zeros(int(total.sum()), dtype=np.uint8)
    out[start] = _key(field, 2)
    _scatter_varint(out, start + 1, bmat, blens)
    at = start + 1 + blens
    for kind, tag, data in prepared:
        if kind == "varint":
            mat, lens = data
            out[at] = tag
            _scatter_varint(out, at + 1, mat, lens)
            at = at + 1 + lens
        else:
            ks, arrs = data
            order = np.argsort(ks, kind="stable")
            ends = np.cumsum(np.bincount(ks, minlength=len(arrs)))
            for k, blob in enumerate(arrs):
                sel = order[(ends[k - 1] if k else 0):ends[k]]
                if len(sel):
                    out[(at[sel][:, None] + np.arange(len(blob))[None, :]).reshape(-1)] = np.tile(blob, len(sel))
            at = at + np.array([len(b) for b in arrs], dtype=np.int64)[ks]
    cuts = list(start[per::per]) + [len(out)]
    edges = [0] + cuts
    return [out[a:b].tobytes() for a, b in zip(edges[:-1], edges[1:])]


_SMALL_VARINTS = [bytes([i]) for i in range(128)]


def V(v: int) -> bytes:
    """A varint (one byte below 128, from a table)."""
    return _SMALL_VARINTS[v] if v < 128 else varint(v)
