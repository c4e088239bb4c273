"""Stochastic quantization onto a lookup table's values, index packing, and the aggregator's sum.

The vectorized kernels here are shared by every THC variant: uniform THC (identity table),
non-uniform THC (any table) and the training pipeline (Algorithm 3). They run on torch tensors, on CPU
or GPU unchanged; only the source of uniform random numbers differs (numpy's PCG64 on CPU, which is
faster there, torch's generator elsewhere). On the CPU, THCCodec runs the grid mapping, the uniforms
and the rounding as one compiled pass instead (``worker_lib.thc.fused``), the same arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_lib.thc.table import LookupTable
from worker_lib.values import is_integer
from worker_lib.wire.bits import pack_whole_into, unpack_whole_into


class UniformSource:
    """Uniform [0, 1) float32 random numbers for stochastic rounding on one device."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        if seed is not None and not (is_integer(seed) and seed >= 0):
            raise ValueError(f"the seed must be a non-negative integer or None, got {seed!r}")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            self._np = np.random.default_rng(seed)
        else:
            self._torch = torch.Generator(device=self.device)
            if seed is None:
                self._torch.seed()
            else:
                self._torch.manual_seed(seed)

    def next_key(self) -> int:
        """A 64-bit key for ``fused.quantize_into``'s counter-based uniforms (CPU): the next draw of
        this source's stream, so that a seed fixes every step's uniforms as ``fill`` does."""
        return int(self._np.integers(0, 1 << 63, dtype=np.int64))

    def fill(self, out: torch.Tensor) -> torch.Tensor:
        """Fill a float32 tensor of this device in place and return it."""
        if self.device.type == "cpu":
            self._np.random(dtype=np.float32, out=out.numpy())
        else:
            torch.rand(out.shape, generator=self._torch, out=out, device=self.device)
        return out


class TableQuantizer:
    """Unbiased stochastic rounding of grid positions y in [0, g] to the table's values.

    For every unit cell [c, c + 1) of the grid, the table segment [T[j], T[j+1]] containing it is
    precomputed as an affine map y -> j + (y - T[j]) / (T[j+1] - T[j]), i.e. the segment index plus
    the probability of rounding up. The index is then floor(j + frac + u) with u ~ U[0, 1): one
    gather and a few elementwise passes instead of a search over table values. Float32 keeps
    j + frac as precisely as y itself (j <= T[j] <= y), so no precision is lost on the way.
    """

    def __init__(self, table: LookupTable, device: torch.device | str = "cpu") -> None:
        self.table = table
        self.device = torch.device(device)
        g = table.granularity
        values = np.asarray(table.values, dtype=np.int64)
        seg = np.searchsorted(values, np.arange(g), side="right") - 1
        self.identity = g == table.size - 1
        self.values = torch.as_tensor(values.astype(np.int32), device=self.device)
        slope = 1.0 / (values[seg + 1] - values[seg])
        offset = seg - values[seg] * slope
        #: each grid cell's affine map, float32 arrays (the CPU's compiled path reads them)
        self.slope, self.offset = slope.astype(np.float32), offset.astype(np.float32)
        # (slope, offset) of each cell, gathered together as one 64-bit word
        pair = np.stack([self.slope, self.offset], axis=1)
        self._affine = torch.as_tensor(np.ascontiguousarray(pair).view(np.int64).ravel(), device=self.device)

    def quantize(self, y: torch.Tensor, uniforms: torch.Tensor, ws: Workspace | None = None) -> torch.Tensor:
        """Table indices (uint8) of y in [0, g]; E[T[index]] = y (up to float rounding).

        ``uniforms`` is consumed (overwritten). With a workspace the result is its ``indices`` buffer.
        """
        g, top = self.table.granularity, self.table.size - 1
        ws = ws or Workspace(y.numel(), y.device, self.table.bits)
        if self.identity:
            pos = uniforms.add_(y)
        else:
            cell = ws.cell.copy_(y).clamp_(0, g - 1)  # float -> int truncates; y >= 0
            affine = torch.index_select(self._affine, 0, cell, out=ws.pair).view(torch.float32).view(-1, 2)
            pos = torch.addcmul(affine[:, 1], y, affine[:, 0], out=ws.frac).add_(uniforms)
        # float -> uint8 truncates, which is floor for the non-negative positions
        return ws.indices.copy_(pos.clamp_(0, top))


class Workspace:
    """Preallocated buffers for vectors of one (padded) length on one device.

    Encoding a 2^20-coordinate vector through freshly allocated tensors spends as much time in page
    faults as in arithmetic; reusing these buffers step after step makes the steady state allocation
    free. Results that live in a workspace are valid until the workspace is used again.
    """

    def __init__(self, n: int, device: torch.device | str, bits: int) -> None:
        device = torch.device(device)
        self.n = n
        self.rotated = torch.empty(n, dtype=torch.float32, device=device)
        self.grid = torch.empty(n, dtype=torch.float32, device=device)
        self.uniforms = torch.empty(n, dtype=torch.float32, device=device)
        self.frac = torch.empty(n, dtype=torch.float32, device=device)
        self.cell = torch.empty(n, dtype=torch.int32, device=device)
        self.pair = torch.empty(n, dtype=torch.int64, device=device)
        self.indices = torch.empty(n, dtype=torch.uint8, device=device)
        self.packed = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=device)


def to_grid(x: torch.Tensor, low: float, high: float, granularity: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Clamp x to [low, high] and map it affinely onto [0, g] (float32, into ``out`` if given)."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device) if out is None else out
    if not high > low:  # a zero range: every coordinate is the single point low == high
        return out.zero_()
    scale = granularity / (high - low)
    return torch.mul(x, scale, out=out).add_(-low * scale).clamp_(0, granularity)


def from_grid(y_sum: torch.Tensor, count: int, low: float, high: float, granularity: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """low + (sum / count) (high - low) / g: the estimate of the average from integer sums."""
    scale = (high - low) / (granularity * count)
    out = torch.empty(y_sum.shape, dtype=torch.float32, device=y_sum.device) if out is None else out
    return out.copy_(y_sum).mul_(scale).add_(low)


def packed_size(count: int, bits: int) -> int:
    """Bytes that `count` b-bit indices occupy (count rounded up to a multiple of 8)."""
    return ((count + 7) // 8) * bits


def pack_indices(z: torch.Tensor, bits: int, out: torch.Tensor | None = None, *,
                 compiled: bool = True) -> torch.Tensor:
    """Pack b-bit indices into bytes, most significant bits first (index 0 in the top bits of byte 0).

    MSB-first is the order in which a P4 parser extracts consecutive bit<b> fields. The index count is
    padded with zeros to a multiple of 8 so that every b fits a whole number of bytes. On the CPU, b = 1,
    2 and 4 pack in one compiled pass (``worker_lib.wire.bits``; 0.03 against 1 ms for 2^20 indices);
    ``compiled=False`` runs the torch kernels that every device has (for tests and comparisons).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    z = z.to(torch.uint8).reshape(-1)
    n = z.numel()
    if n % 8:
        z = torch.cat([z, z.new_zeros(8 - n % 8)])
    size = packed_size(n, bits)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=z.device)
    elif out.shape != (size,) or out.dtype != torch.uint8:
        raise ValueError(f"out must be a uint8 tensor of {size} bytes")
    if bits == 8:
        return out.copy_(z)
    if compiled and z.device.type == "cpu" and 8 % bits == 0 and out.is_contiguous():
        pack_whole_into(z.contiguous().numpy(), bits, out.numpy())
        return out
    if 8 % bits == 0:  # Horner: byte = ((z0 * 2^b + z1) * 2^b + z2) ...
        groups = z.view(-1, 8 // bits)
        out.copy_(groups[:, 0])
        for k in range(1, 8 // bits):
            torch.add(groups[:, k], out, alpha=1 << bits, out=out)
        return out
    groups = z.view(-1, 8).to(torch.int64)
    word = groups[:, 0] << (bits * 7)
    for k in range(1, 8):
        word |= groups[:, k] << (bits * (7 - k))
    shifts = torch.arange(bits - 1, -1, -1, device=z.device, dtype=torch.int64) * 8
    return out.copy_(((word[:, None] >> shifts) & 0xFF).reshape(-1))


def unpack_indices(buf: torch.Tensor, bits: int, count: int, out: torch.Tensor | None = None, *,
                   compiled: bool = True) -> torch.Tensor:
    """Inverse of pack_indices: the first `count` indices (uint8, into ``out`` if given); ``compiled`` as
    for ``pack_indices``."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    buf = buf.reshape(-1)
    if buf.dtype != torch.uint8:
        raise TypeError(f"packed indices must be uint8, got {buf.dtype}")
    size = packed_size(count, bits)
    if buf.numel() < size:
        raise ValueError(f"{buf.numel()} bytes cannot hold {count} indices of {bits} bits")
    full = (size * 8) // bits
    if out is not None and (out.dtype != torch.uint8 or out.numel() not in (count, full)):
        raise ValueError(f"out must be a uint8 tensor of {count} (or {full}) indices")
    if bits == 8:
        return buf[:count].clone() if out is None else out.copy_(buf[: out.numel()])
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        if compiled and buf.device.type == "cpu" and (out is None or (out.numel() == full and out.is_contiguous())):
            whole = torch.empty(full, dtype=torch.uint8) if out is None else out
            unpack_whole_into(buf[:size].contiguous().numpy(), bits, whole.numpy())
            return whole[:count] if out is None else out
        shifts = torch.arange(8 - bits, -1, -bits, device=buf.device, dtype=torch.uint8)
        if out is not None and out.numel() == full:
            target = out.view(-1, per)
            torch.bitwise_right_shift(buf[:size, None], shifts, out=target)
            return out.bitwise_and_(mask)
        res = ((buf[:size, None] >> shifts) & mask).reshape(-1)[:count]
        return res if out is None else out.copy_(res)
    groups = buf[:size].view(-1, bits).to(torch.int64)
    word = groups[:, 0] << (8 * (bits - 1))
    for j in range(1, bits):
        word |= groups[:, j] << (8 * (bits - 1 - j))
    shifts = torch.arange(7, -1, -1, device=buf.device, dtype=torch.int64) * bits
    res = ((word[:, None] >> shifts) & mask).to(torch.uint8).reshape(-1)
    if out is None:
        return res[:count]
    out.copy_(res[: out.numel()])
    return out


def lookup_sum(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The aggregator's arithmetic: sum over workers of T[index], per coordinate (int64).

    ``indices`` has shape (workers, coordinates); ``values`` is the table as integers.
    """
    values = np.asarray(values)
    indices = np.asarray(indices)
    if indices.ndim != 2:
        raise ValueError("indices must have shape (workers, coordinates): one row per worker, rows of one length")
    if indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be integers, got {indices.dtype}")
    if indices.size and not 0 <= int(indices.min()) <= int(indices.max()) < len(values):
        raise ValueError(f"an index is outside the table's 0..{len(values) - 1}")
    return values.astype(np.int64)[indices].sum(axis=0)
