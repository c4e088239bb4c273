"""A tensor's THC DATA packets built in one compiled pass: header, chunk number and packed indices per row.

``Transport.exchange_indices`` sends a tensor's b-bit indices as one DATA packet per chunk of K. Built as
``serializer.build_batch`` of ``bits.pack_padded_rows`` (a range check over the indices, the packing into
a payload array, a zeroed packet array, twelve strided header-field writes, a copy of the payloads), that
took 4.6 ms of a worker's thread CPU per exchange of 2^22 4-bit indices on the development machine, a
sixth of the exchange's CPU. ``index_packets`` writes each row once: the request's header from a template,
its chunk number, its indices packed MSB first (zero past the tensor's end), checking them below 2^b in
the same pass. The same bytes as the composition (tests/test_index_packets.py); widths that do not pack
whole bytes per row, or indices that are not uint8, take the composition itself.

The slot and round of each row are written afterwards by ``stamp_uses``, once the uses are claimed:
indices out of range must be refused before a use of the pool is spent on them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numba import njit

from worker_lib.wire.bits import check_fields, check_width, pack_padded_rows, packed_bytes
from worker_lib.wire.compiled_fields import put16, put32
from worker_lib.wire.layout import HEADER_BYTES, field_offsets
from worker_lib.wire.protocol import Header
from worker_lib.wire.serializer import build_batch

_H = HEADER_BYTES
_OFF = field_offsets()
_O_SLOT, _O_ROUND, _O_CHUNK = _OFF["slot"], _OFF["round"], _OFF["chunk"]


@njit(cache=True, nogil=True)
def _pack_rows(template: np.ndarray, fields: np.ndarray, width: int, elems: int, out: np.ndarray,
               first: int) -> bool:
    """Row r of ``out``: ``template``, chunk ``first`` + r, then fields r*elems .. (r+1)*elems - 1 packed at
    ``width`` (1, 2, 4 or 8 bits, MSB first; ``elems * width`` a multiple of 8), zeros past the fields' end.
    Returns False if a field is 2^width or more (the rows are then unfinished)."""
    per = 8 // width
    nbytes = elems // per
    n = fields.size
    seen = 0  # the OR of every field: one test at the end instead of one per field
    for r in range(out.shape[0]):
        row = out[r]
        for k in range(_H):
            row[k] = template[k]
        put32(row, _O_CHUNK, first + r)
        start = r * elems
        if start + elems <= n:  # a whole row: the loops LLVM vectorises
            z = fields[start:start + elems]
            for k in range(elems):
                seen |= z[k]
            if width == 4:
                for j in range(nbytes):
                    row[_H + j] = (z[2 * j] << 4) | z[2 * j + 1]
            elif width == 8:
                for j in range(nbytes):
                    row[_H + j] = z[j]
            else:
                for j in range(nbytes):
                    b = 0
                    for k in range(per):
                        b = (b << width) | z[per * j + k]
                    row[_H + j] = b
        else:  # the last row: the tensor's end, then zeros
            for j in range(nbytes):
                b = 0
                for k in range(per):
                    e = start + per * j + k
                    v = fields[e] if e < n else 0
                    seen |= v
                    b = (b << width) | v
                row[_H + j] = b
    return seen >> width == 0


@njit(cache=True, nogil=True)
def stamp_uses(packets: np.ndarray, slots: np.ndarray, rounds: np.ndarray) -> None:
    """Write row r's slot and round (``slots[r]``, ``rounds[r]``) into its header."""
    for r in range(packets.shape[0]):
        put16(packets[r], _O_SLOT, slots[r])
        put16(packets[r], _O_ROUND, rounds[r])


def index_packets(header: Mapping[str, int], fields: np.ndarray, width: int, elems: int) -> np.ndarray:
    """The DATA packets of ``fields`` (b-bit indices, b = ``width``) in chunks of ``elems``: one row per chunk,
    (chunks, HEADER_BYTES + packed bytes of ``elems``), each with the header fields ``header`` (as
    ``JobConfig.request_fields`` gives them), chunk = its row, slot and round 0 (``stamp_uses`` writes them)
    and its chunk's indices packed MSB first, zero-padded past the last. The bytes of ``build_batch`` of
    ``pack_padded_rows``. Indices outside [0, 2^width) raise ValueError before anything is returned."""
    check_width(width)
    f = np.asarray(fields).reshape(-1)
    rows = max(1, -(-f.size // elems))
    if not packs_in_pieces(f, width, elems):
        fixed = {**header, "slot": 0, "round": 0}
        return build_batch({**fixed, "chunk": np.arange(rows)}, pack_padded_rows(f, width, rows, elems))
    packer = IndexPacker(header, width, elems, f.size)
    packer.pack(f, 0, rows)
    return packer.packets


def packs_in_pieces(fields: np.ndarray, width: int, elems: int) -> bool:
    """Whether ``IndexPacker`` packs these fields (uint8, widths that pack whole bytes per row); the others
    take ``index_packets``' composition."""
    return np.asarray(fields).dtype == np.uint8 and width in (1, 2, 4, 8) and (elems * width) % 8 == 0


class IndexPacker:
    """The DATA packets of ``size`` b-bit indices (b = ``width``) in chunks of ``elems``, packed a range of rows
    at a time (``index_packets``' rows, the same bytes): a worker sends the first chunks of a tensor while its
    later indices are still being computed. ``packets`` holds the rows; a row is defined once ``pack`` wrote it."""

    def __init__(self, header: Mapping[str, int], width: int, elems: int, size: int) -> None:
        check_width(width)
        self.width, self.elems, self.size = width, elems, size
        self.rows = max(1, -(-size // elems))
        self._template = np.frombuffer(Header(**{**header, "slot": 0, "round": 0, "chunk": 0}).pack(), np.uint8)
        self.packets = np.empty((self.rows, HEADER_BYTES + packed_bytes(elems, width)), np.uint8)

    def pack(self, fields: np.ndarray, start: int, stop: int) -> None:
        """Write rows start..stop-1 from ``fields`` (all ``size`` uint8 indices; those of these rows final).
        Raises ValueError, with ``index_packets``' message, if one of their indices is 2^b or more."""
        if start >= stop:
            return
        f = fields[start * self.elems:self.size]
        if not _pack_rows(self._template, f, self.width, self.elems, self.packets[start:stop], start):
            check_fields(f[:(stop - start) * self.elems], self.width)  # raises
