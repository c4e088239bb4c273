"""THC compression as the paper's Algorithms 1-3 define it, split where the network sits.

A worker first publishes its norm (the preliminary stage), then compresses with the job's maximum
norm, hands the b-bit indices to a network, and later resumes from the integer sums that come back
(from all n workers or fewer: decoding divides by the count that arrived). ``THCCodec`` is the
stateless arithmetic; ``THCWorker`` adds error feedback and the bookkeeping between the two halves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker_lib.thc.hadamard import Backend, RandomizedHadamard
from worker_lib.thc.quantize import (
    TableQuantizer,
    UniformSource,
    from_grid,
    lookup_sum,
    pack_indices,
    to_grid,
    unpack_indices,
)
from worker_lib.thc.signs import SignKey
from worker_lib.thc.table import LookupTable, solve_table, truncation_threshold, uniform_table


@dataclass(frozen=True)
class THCConfig:
    """THC's knobs. Defaults are the paper's testbed setting (b = 4, g = 30, p = 1/32)."""

    bits: int = 4
    granularity: int = 30
    p: float = 1 / 32
    error_feedback: bool = True
    backend: Backend = "auto"

    def __post_init__(self) -> None:
        self.table()  # validates bits, granularity and p with clear messages

    def table(self) -> LookupTable:
        """The optimal table T_{b,g,p} (cached)."""
        truncation_threshold(self.p)
        return solve_table(self.bits, self.granularity, self.p)

    @property
    def t_p(self) -> float:
        return truncation_threshold(self.p)


def check_vector(x: torch.Tensor, name: str = "gradient") -> torch.Tensor:
    """Flatten a tensor and refuse what THC cannot encode (empty, non-float, non-finite)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    flat = x.detach().reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError(f"{name} holds NaN or infinite values")
    return flat


def check_norm(value: float, name: str = "norm") -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and non-negative, got {value}")
    return value


@dataclass
class Encoded:
    """One worker's compressed vector: indices over the padded transformed length, and its scale."""

    indices: torch.Tensor  # uint8, one per transformed coordinate
    scale: float  # M: the grid spans [-M, M]
    length: int  # d, the original length
    bits: int

    @property
    def padded(self) -> int:
        return self.indices.numel()

    def packed(self) -> torch.Tensor:
        """The wire bytes: b-bit indices, MSB first."""
        return pack_indices(self.indices, self.bits)


class THCCodec:
    """Stateless non-uniform THC over the RHT (Algorithm 3 without error feedback)."""

    def __init__(self, config: THCConfig | None = None, *, device: torch.device | str = "cpu",
                 seed: int | None = None, table: LookupTable | None = None) -> None:
        self.config = config or THCConfig()
        self.table = table or self.config.table()
        if (self.table.bits, self.table.granularity) != (self.config.bits, self.config.granularity):
            raise ValueError("the table does not match the configured bits and granularity")
        self.device = torch.device(device)
        self.quantizer = TableQuantizer(self.table, self.device)
        self.uniforms = UniformSource(self.device, seed)
        self._rotation: tuple[tuple[int, SignKey], RandomizedHadamard] | None = None

    def rotation(self, d: int, key: SignKey) -> RandomizedHadamard:
        """The RHT of length d for this key (the last one is kept: encode and decode share it)."""
        if self._rotation is None or self._rotation[0] != (d, key):
            rht = RandomizedHadamard(d, key, device=self.device, backend=self.config.backend)
            self._rotation = ((d, key), rht)
        return self._rotation[1]

    def scale(self, max_norm: float, padded: int) -> float:
        """M = t_p * max_norm / sqrt(D), D the transformed (padded) length."""
        return self.config.t_p * check_norm(max_norm, "max_norm") / math.sqrt(padded)

    def encode_rotated(self, rotated: torch.Tensor, max_norm: float, length: int) -> Encoded:
        """Clamp, quantize and map to indices an already rotated vector (may be overwritten)."""
        big_m = self.scale(max_norm, rotated.numel())
        y = to_grid(rotated, -big_m, big_m, self.table.granularity)
        u = self.uniforms.fill(torch.empty(y.shape, dtype=torch.float32, device=self.device))
        return Encoded(self.quantizer.quantize(y, u), big_m, length, self.table.bits)

    def encode(self, x: torch.Tensor, max_norm: float, key: SignKey) -> Encoded:
        """Compress x given the job's maximum norm and the step's sign key."""
        flat = check_vector(x).to(self.device, torch.float32)
        return self.encode_rotated(self.rotation(flat.numel(), key).forward(flat), max_norm, flat.numel())

    def aggregate(self, indices: Sequence[torch.Tensor | np.ndarray]) -> torch.Tensor:
        """What the aggregator computes: the integer sum of T[index] over workers (int64, on CPU)."""
        stacked = np.stack([np.asarray(i.cpu() if isinstance(i, torch.Tensor) else i) for i in indices])
        return torch.from_numpy(lookup_sum(self.table.as_array(), stacked))

    def rotated_estimate(self, sums: torch.Tensor, count: int, scale: float) -> torch.Tensor:
        """m + (sums / count)(M - m) / g in the rotated domain."""
        if count < 1:
            raise ValueError(f"the contributor count must be positive, got {count}")
        g = self.table.granularity
        if sums.numel() and (int(sums.min()) < 0 or int(sums.max()) > g * count):
            raise ValueError(f"sums outside [0, g * count] = [0, {g * count}]: wrong count or corrupt data")
        return from_grid(sums.to(self.device), count, -scale, scale, g)

    def decode(self, sums: torch.Tensor, count: int, scale: float, length: int, key: SignKey) -> torch.Tensor:
        """The average estimate from integer sums of `count` workers."""
        rht = self.rotation(length, key)
        if sums.numel() != rht.padded:
            raise ValueError(f"expected {rht.padded} sums, got {sums.numel()}")
        return rht.inverse(self.rotated_estimate(sums.reshape(-1), count, scale))

    def own_values(self, enc: Encoded) -> torch.Tensor:
        """X_i, the rotated-domain values this worker's indices stand for."""
        return self.rotated_estimate(self.quantizer.values[enc.indices.long()], 1, enc.scale)

    def unpack(self, buf: torch.Tensor, count: int) -> torch.Tensor:
        return unpack_indices(buf, self.table.bits, count)


@dataclass
class _Pending:
    key: SignKey
    x: torch.Tensor  # gradient + error feedback, float32
    rotated: torch.Tensor
    norm: float
    shape: torch.Size
    dtype: torch.dtype
    encoded: Encoded | None = None


@dataclass
class THCWorker:
    """One worker's side of THC training (Algorithm 3), with per-tensor error feedback.

    Usage::

        w = THCWorker(THCConfig(), job=7, worker=0)
        norm = w.begin(grad, tensor=0, step=s)          # send norm, receive the job's max norm
        payload = w.compress(tensor=0, max_norm=mx)     # send payload.packed() to the aggregator
        avg = w.finish(tensor=0, sums=sums, count=n)    # integer sums and contributor count back
    """

    config: THCConfig
    job: int
    worker: int = 0
    device: torch.device | str = "cpu"
    seed: int | None = None
    codec: THCCodec = field(init=False)
    errors: dict[int, torch.Tensor] = field(init=False, default_factory=dict)
    _pending: dict[int, _Pending] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.codec = THCCodec(self.config, device=self.device, seed=self.seed)

    def begin(self, grad: torch.Tensor, tensor: int, step: int) -> float:
        """Add error feedback, rotate, and return the norm to publish in the preliminary stage."""
        flat = check_vector(grad).to(self.codec.device, torch.float32)
        err = self.errors.get(tensor)
        if self.config.error_feedback and err is not None and err.numel() == flat.numel():
            flat = flat + err
        key = SignKey.derive(self.job, tensor, step)
        rotated = self.codec.rotation(flat.numel(), key).forward(flat)
        norm = float(torch.linalg.vector_norm(flat))
        self._pending[tensor] = _Pending(key, flat, rotated, norm, grad.shape, grad.dtype)
        return norm

    def compress(self, tensor: int, max_norm: float) -> Encoded:
        """Quantize with the job's max norm (which must be >= this worker's own norm)."""
        pend = self._require(tensor)
        if check_norm(max_norm, "max_norm") < pend.norm * (1 - 1e-6):
            raise ValueError(f"max_norm {max_norm} is below this worker's norm {pend.norm}")
        pend.encoded = self.codec.encode_rotated(pend.rotated, max_norm, pend.x.numel())
        return pend.encoded

    def finish(self, tensor: int, sums: torch.Tensor, count: int) -> torch.Tensor:
        """Decode the average from integer sums and update this worker's error feedback."""
        pend = self._require(tensor)
        if pend.encoded is None:
            raise RuntimeError(f"tensor {tensor}: compress() must come before finish()")
        codec = self.codec
        avg = codec.decode(sums, count, pend.encoded.scale, pend.x.numel(), pend.key)
        if self.config.error_feedback:
            rht = codec.rotation(pend.x.numel(), pend.key)
            self.errors[tensor] = pend.x - rht.inverse(codec.own_values(pend.encoded))
        del self._pending[tensor]
        return avg.reshape(pend.shape).to(pend.dtype)

    def _require(self, tensor: int) -> _Pending:
        try:
            return self._pending[tensor]
        except KeyError:
            raise RuntimeError(f"tensor {tensor}: begin() was not called for this step") from None


def uniform_encode(x: torch.Tensor, low: float, high: float, bits: int,
                   uniforms: UniformSource) -> torch.Tensor:
    """Uniform THC (Algorithm 1): homomorphic USQ of x on [low, high] with 2^b levels (indices)."""
    flat = check_vector(x)
    table = uniform_table(bits)
    y = to_grid(flat, low, high, table.granularity)
    return TableQuantizer(table, flat.device).quantize(y, uniforms.fill(torch.empty_like(y)))


def table_encode(x: torch.Tensor, low: float, high: float, table: LookupTable,
                 uniforms: UniformSource) -> torch.Tensor:
    """Non-uniform THC (Algorithm 2): stochastic quantization of x on [low, high] onto the table."""
    flat = check_vector(x)
    y = to_grid(flat, low, high, table.granularity)
    return TableQuantizer(table, flat.device).quantize(y, uniforms.fill(torch.empty_like(y)))


def table_decode(sums: torch.Tensor, count: int, low: float, high: float, table: LookupTable) -> torch.Tensor:
    """Estimate of the average from the sums of T[index] (Algorithms 1 and 2, last line)."""
    if count < 1:
        raise ValueError(f"the contributor count must be positive, got {count}")
    return from_grid(sums, count, low, high, table.granularity)
