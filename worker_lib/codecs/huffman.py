"""Huffman coding with canonical codes; bit-level encoding and decoding vectorized with numpy.

The codebook is built from symbol counts (a heap over the used symbols: the only Python loop, over
the alphabet, never over the data). Codes are canonical (assigned in order of (length, symbol)), so
the decoder needs only the counts, as the Øland-Raj package ships P, and rebuilds the same lengths
because ties are broken deterministically.

Decoding without a per-symbol loop: the canonical code starting at any bit position p can be
identified from the next L_max bits alone (left-justified canonical codes are sorted, so a
``searchsorted`` gives the code, hence its length). That gives every position p a successor
p + len(p); the code starts are the chain 0 -> next(0) -> ..., which pointer doubling extracts in
ceil(log2(count)) vectorized gathers (the set {next^k(0), k < 2^(j+1)} is the set for k < 2^j plus
its image under next^(2^j), and next^(2^(j+1)) = next^(2^j) o next^(2^j)).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

MAX_CODE_LENGTH = 57  # a window of L_max bits must fit a 64-bit word shifted by up to 7 bits


def code_lengths(counts: np.ndarray) -> np.ndarray:
    """Huffman code length of each symbol (0 for symbols of count 0; 1 if only one is used)."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    if counts.size == 0 or int(counts.min()) < 0:
        raise ValueError("counts must be a non-empty array of non-negative integers")
    lengths = np.zeros(counts.size, dtype=np.int64)
    used = np.flatnonzero(counts)
    if used.size == 0:
        raise ValueError("at least one symbol must have a positive count")
    if used.size == 1:
        lengths[used] = 1
        return lengths
    # heap of (weight, tie-break, members); merging adds one bit to every member's length
    heap: list[tuple[int, int, list[int]]] = [(int(counts[s]), int(s), [int(s)]) for s in used]
    heapq.heapify(heap)
    tie = counts.size
    while len(heap) > 1:
        w1, _, m1 = heapq.heappop(heap)
        w2, _, m2 = heapq.heappop(heap)
        members = m1 + m2
        lengths[members] += 1
        heapq.heappush(heap, (w1 + w2, tie, members))
        tie += 1
    return lengths


@dataclass(frozen=True)
class HuffmanCode:
    """A canonical prefix code: per-symbol lengths and code words, and the decoder's tables."""

    lengths: np.ndarray  # int64 per symbol, 0 = unused
    codes: np.ndarray  # uint64 per symbol (right-aligned)

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> HuffmanCode:
        return cls.from_lengths(code_lengths(counts))

    @classmethod
    def from_lengths(cls, lengths: np.ndarray) -> HuffmanCode:
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.max()) > MAX_CODE_LENGTH:
            raise ValueError(f"a Huffman code longer than {MAX_CODE_LENGTH} bits is not supported")
        order = canonical_order(lengths)
        codes = np.zeros(lengths.size, dtype=np.uint64)
        code, prev = 0, 0
        for s in order:  # over the alphabet, not the data
            ln = int(lengths[s])
            code <<= ln - prev
            codes[s] = code
            code += 1
            prev = ln
        if code > (1 << prev):
            raise ValueError("code lengths violate the Kraft inequality")
        return cls(lengths, codes)

    @property
    def max_length(self) -> int:
        return int(self.lengths.max())

    def encode(self, symbols: np.ndarray) -> tuple[np.ndarray, int]:
        """(bytes, exact bit count) of the concatenated code words, MSB first."""
        s = np.asarray(symbols, dtype=np.int64).reshape(-1)
        if s.size and (int(s.min()) < 0 or int(s.max()) >= self.lengths.size):
            raise ValueError("symbol outside the alphabet")
        lens = self.lengths[s]
        if s.size and int(lens.min()) == 0:
            raise ValueError("a symbol without a code word (count 0) was encoded")
        offsets = np.cumsum(lens) - lens
        total = int(lens.sum())
        bits = np.zeros(total, dtype=np.uint8)
        codes = self.codes[s]
        for j in range(self.max_length):  # over bit positions within a code word
            m = lens > j
            shift = (lens[m] - 1 - j).astype(np.uint64)
            bits[offsets[m] + j] = ((codes[m] >> shift) & np.uint64(1)).astype(np.uint8)
        return np.packbits(bits), total

    def decode(self, buf: np.ndarray, nbits: int, count: int) -> np.ndarray:
        """The ``count`` symbols coded in the first ``nbits`` bits of ``buf`` (int64)."""
        buf = np.asarray(buf, dtype=np.uint8).reshape(-1)
        if buf.size < math.ceil(nbits / 8):
            raise ValueError(f"{buf.size} bytes cannot hold {nbits} bits")
        if count == 0:
            if nbits:
                raise ValueError("bits left over after the last symbol")
            return np.zeros(0, dtype=np.int64)
        if nbits < count:
            raise ValueError(f"{nbits} bits cannot hold {count} code words")
        lmax = self.max_length
        order = canonical_order(self.lengths)
        sorted_lengths = self.lengths[order]
        left = self.codes[order] << (lmax - sorted_lengths).astype(np.uint64)  # left-justified, sorted
        # the L_max-bit window at every bit position p
        padded = np.zeros(math.ceil(nbits / 8) + 8, dtype=np.uint8)
        padded[: math.ceil(nbits / 8)] = buf[: math.ceil(nbits / 8)]
        nwords = math.ceil(nbits / 8)
        words = np.zeros(nwords, dtype=np.uint64)
        for i in range(8):  # the big-endian 64-bit word at every byte offset
            words |= padded[i: i + nwords].astype(np.uint64) << np.uint64(56 - 8 * i)
        pos_dtype = np.int32 if nbits < (1 << 31) - 64 else np.int64
        p = np.arange(nbits, dtype=pos_dtype)
        window = (words[p >> 3] << (p & 7).astype(np.uint64)) >> np.uint64(64 - lmax)
        rank = np.searchsorted(left, window, side="right") - 1
        nxt = np.empty(nbits + 1, dtype=pos_dtype)
        nxt[:nbits] = np.minimum(p + sorted_lengths[rank].astype(pos_dtype), nbits)
        nxt[nbits] = nbits  # the sink
        starts = np.zeros(1, dtype=pos_dtype)
        jump = nxt
        while starts.size < count:
            starts = np.concatenate([starts, jump[starts]])
            if starts.size < count:
                jump = jump[jump]
        starts = starts[:count]
        if int(starts[-1]) >= nbits:
            raise ValueError("the bit stream ends before the last symbol: corrupt or truncated data")
        end = int(starts[-1]) + int(sorted_lengths[rank[starts[-1]]])
        if end != nbits:
            raise ValueError(f"the code words end at bit {end}, not at {nbits}: corrupt data")
        return order[rank[starts]].astype(np.int64)


def canonical_order(lengths: np.ndarray) -> np.ndarray:
    """Used symbols sorted by (length, symbol)."""
    used = np.flatnonzero(lengths)
    return used[np.lexsort((used, lengths[used]))]


def entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy in bits of the empirical distribution given by counts."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())
