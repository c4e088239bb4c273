"""One interface for every gradient codec, and the two ways an aggregator can combine them.

A round of aggregation for one tensor of ``d`` coordinates and ``n`` workers::

    shared = codec.combine_prelim([codec.prelim(x_i) for each worker])   # only if codec.needs_prelim
    ctx = RoundContext(length=d, workers=n, shared=shared, tensor=t, step=s)
    up_i = codec.encode(x_i, ctx, state_i)              # worker -> aggregator, exactly up_i.bits bits
    down = codec.aggregate([up_1, ..., up_n], ctx)      # the aggregator's work; exactly down.bits bits
    avg = codec.decode_result(down, ctx)                # every worker: estimate of mean_i x_i

How ``aggregate`` works is what ``kind`` declares:

* ``CodecKind.HOMOMORPHIC`` (THC, TernGrad with a shared scalar): each coordinate of an uplink
  message is a small index; the aggregator maps it through an integer table and adds integers
  (``aggregate_integers``), which a programmable switch can do. Nothing is decompressed; the downlink
  carries the integer sums, packed at the width that ``n`` times the largest table value needs.
* ``CodecKind.DAR`` (decompress-aggregate-recompress: TopK, natural compression, 3LC, dynamic
  quantization): the aggregator must ``decode_one`` every message, add in floating point, and
  ``reencode`` the average for the downlink, a parameter-server job (the THC paper's Figure 2).

Codecs whose encoding needs a value agreed on by all workers (THC's maximum norm, TernGrad's shared
scalar) publish ``prelim(x)`` first and receive ``combine_prelim`` of all of them (the maximum) in
``RoundContext.shared``; ``prelim_bits`` is what that exchange costs each worker per direction.

Error feedback (3LC's error accumulation buffer; optional for TopK and THC) lives in a
``CodecState`` owned by the caller, one per worker and tensor (and one on the aggregator for codecs
whose downlink re-encoding keeps its own buffer, as 3LC's servers do). Passing no state means no
error feedback, which is also what the first round of any run sees.

Messages are numpy uint8 arrays (host memory, as they go to a socket) with their exact bit count;
the arithmetic runs on torch tensors on the codec's device.
"""

from __future__ import annotations

import enum
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from worker_lib.codecs.bits import width_for
from worker_lib.thc.quantize import UniformSource
from worker_lib.wire.bits import pack_bits, unpack_bits

log = logging.getLogger(__name__)


class CodecKind(enum.Enum):
    """How an aggregator combines the uplink messages of a codec."""

    HOMOMORPHIC = "homomorphic"
    DAR = "decompress-aggregate-recompress"


@dataclass(frozen=True)
class Message:
    """Bytes for the wire and the exact number of meaningful bits in them.

    ``payload`` holds ``ceil(bits / 8)`` bytes; the unused low bits of the last byte are zero.
    """

    payload: np.ndarray
    bits: int

    def __post_init__(self) -> None:
        if not isinstance(self.payload, np.ndarray) or self.payload.dtype != np.uint8:
            raise TypeError("payload must be a numpy uint8 array")
        if self.bits < 0 or self.payload.size != math.ceil(self.bits / 8):
            raise ValueError(f"a payload of {self.payload.size} bytes cannot carry exactly {self.bits} bits")

    @property
    def nbytes(self) -> int:
        return int(self.payload.size)

    def tobytes(self) -> bytes:
        return self.payload.tobytes()


@dataclass(frozen=True)
class RoundContext:
    """What every party knows about a round before any payload moves.

    ``length`` is the tensor's number of coordinates d, ``workers`` the number of messages that are
    (or were) aggregated, ``shared`` the combined preliminary value for codecs that need one, and
    (job, tensor, step) name the round (THC derives its rotation signs from them).
    """

    length: int
    workers: int = 1
    shared: float | None = None
    job: int = 0
    tensor: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"length must be a positive integer, got {self.length!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        if self.shared is not None and not (math.isfinite(self.shared) and self.shared >= 0):
            raise ValueError(f"shared must be finite and non-negative, got {self.shared!r}")

    def with_workers(self, workers: int) -> RoundContext:
        return replace(self, workers=workers)


@dataclass
class CodecState:
    """Per-worker, per-tensor error-feedback state (the residual not yet transmitted)."""

    error: torch.Tensor | None = None

    def add_to(self, x: torch.Tensor) -> torch.Tensor:
        """x plus the stored residual (x itself if there is none or its shape changed)."""
        if self.error is None:
            return x
        if self.error.shape != x.shape:
            log.warning("dropping an error-feedback buffer of shape %s for a tensor of shape %s",
                        tuple(self.error.shape), tuple(x.shape))
            self.error = None
            return x
        return x + self.error.to(x.device)


def check_input(x: torch.Tensor, ctx: RoundContext | None = None) -> torch.Tensor:
    """Flattened float32 view of a finite, non-empty float tensor; ValueError/TypeError otherwise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"the input must be a torch.Tensor, got {type(x).__name__}")
    if x.numel() == 0:
        raise ValueError("the input tensor is empty")
    if not x.is_floating_point():
        raise TypeError(f"the input must be a floating-point tensor, got {x.dtype}")
    flat = x.detach().reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("the input holds NaN or infinite values (or values beyond float32's range)")
    if ctx is not None and flat.numel() != ctx.length:
        raise ValueError(f"tensor has {flat.numel()} coordinates but the round is for {ctx.length}")
    return flat


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds (knob validation)."""
    if not condition:
        raise ValueError(message)


class Codec(ABC):
    """A gradient codec: knobs in a frozen dataclass ``config``, a name, and a ``kind``.

    Instances hold only their configuration, device and random number source (one per worker
    process in a real deployment); per-tensor state is passed in explicitly.
    """

    name: ClassVar[str]
    kind: ClassVar[CodecKind]
    needs_prelim: ClassVar[bool] = False
    prelim_bits: ClassVar[int] = 0  # bits per worker per direction of the preliminary exchange

    def __init__(self, config: Any, *, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.uniforms = UniformSource(self.device, seed)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def rand(self, n: int) -> torch.Tensor:
        """n uniform [0, 1) float32 numbers from this codec's source."""
        return self.uniforms.fill(torch.empty(n, dtype=torch.float32, device=self.device))

    # -- preliminary exchange ------------------------------------------------------------------
    def prelim(self, x: torch.Tensor, state: CodecState | None = None) -> float | None:
        """The value this worker publishes before encoding (None: the codec needs none)."""
        return None

    def combine_prelim(self, values: Sequence[float | None]) -> float | None:
        """How the published values combine (the maximum, for the codecs here)."""
        if not self.needs_prelim:
            return None
        if not values or any(v is None for v in values):
            raise ValueError("every worker must publish a preliminary value")
        return max(float(v) for v in values)  # type: ignore[arg-type]

    def shared(self, ctx: RoundContext) -> float:
        if ctx.shared is None:
            raise ValueError(f"{self.name} needs the combined preliminary value in RoundContext.shared")
        return ctx.shared

    # -- the round -----------------------------------------------------------------------------
    @abstractmethod
    def encode(self, x: torch.Tensor, ctx: RoundContext, state: CodecState | None = None) -> Message:
        """One worker's uplink message (with error feedback when a state is given and enabled)."""

    @abstractmethod
    def decode_one(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        """The vector one uplink message stands for (float32, length ctx.length)."""

    @abstractmethod
    def aggregate(self, msgs: Sequence[Message], ctx: RoundContext,
                  state: CodecState | None = None) -> Message:
        """The aggregator's work: uplink messages in, the downlink message out."""

    @abstractmethod
    def decode_result(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        """Every worker's estimate of the average from the downlink message."""

    def average(self, xs: Sequence[torch.Tensor], ctx: RoundContext | None = None,
                states: Sequence[CodecState | None] | None = None, agg_state: CodecState | None = None,
                ) -> tuple[torch.Tensor, list[Message], Message]:
        """Run one whole round in process: (average estimate, uplink messages, downlink message).

        ``states`` are the workers' error-feedback states, ``agg_state`` the aggregator's (used by
        DAR codecs that keep one for the downlink, as 3LC's servers do).
        """
        if not xs:
            raise ValueError("need at least one worker's tensor")
        d = check_input(xs[0]).numel()
        ctx = ctx or RoundContext(length=d, workers=len(xs))
        ctx = ctx.with_workers(len(xs))
        states = list(states) if states is not None else [None] * len(xs)
        if self.needs_prelim:
            published = [self.prelim(x, s) for x, s in zip(xs, states, strict=True)]
            ctx = replace(ctx, shared=self.combine_prelim(published))
        ups = [self.encode(x, ctx, s) for x, s in zip(xs, states, strict=True)]
        down = self.aggregate(ups, ctx, agg_state)
        return self.decode_result(down, ctx), ups, down


class HomomorphicCodec(Codec):
    """A codec whose aggregator adds table values of indices: no decompression in the network.

    Subclasses define ``table`` (the integer value of each index), ``index_bits`` (the uplink width
    per transmitted coordinate), ``transmitted(ctx)`` (how many indices a message carries) and
    ``from_sums`` (the average estimate from integer sums).
    """

    kind = CodecKind.HOMOMORPHIC
    needs_prelim = True
    prelim_bits = 32

    @property
    @abstractmethod
    def table(self) -> np.ndarray:
        """Integer value of each index (int64, non-negative)."""

    @property
    @abstractmethod
    def index_bits(self) -> int:
        """Bits per index on the uplink."""

    @abstractmethod
    def transmitted(self, ctx: RoundContext) -> int:
        """Number of indices in one uplink message."""

    @abstractmethod
    def from_sums(self, sums: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        """Average estimate from the integer sums of ctx.workers messages."""

    def indices(self, msg: Message, ctx: RoundContext) -> np.ndarray:
        """The indices an uplink message carries (int64)."""
        count = self.transmitted(ctx)
        if msg.bits != count * self.index_bits:
            raise ValueError(f"expected {count * self.index_bits} bits, got {msg.bits}")
        idx = unpack_bits(msg.payload, self.index_bits, count).astype(np.int64)
        if idx.size and int(idx.max()) >= self.table.size:
            raise ValueError(f"an index is outside the table of {self.table.size} values: corrupt data")
        return idx

    def sum_width(self, workers: int) -> int:
        """Downlink bits per coordinate: the sums lie in [0, workers * max(table)]."""
        return width_for(workers * int(self.table.max()))

    def aggregate_integers(self, msgs: Sequence[Message], ctx: RoundContext) -> np.ndarray:
        """What a switch computes: per coordinate, the sum over messages of table[index] (int64)."""
        if not msgs:
            raise ValueError("no messages to aggregate")
        table = self.table.astype(np.int64)
        sums = np.zeros(self.transmitted(ctx), dtype=np.int64)
        for m in msgs:  # over messages: one table lookup and one integer add per coordinate each
            sums += np.take(table, self.indices(m, ctx))
        return sums

    def aggregate(self, msgs: Sequence[Message], ctx: RoundContext,
                  state: CodecState | None = None) -> Message:
        sums = self.aggregate_integers(msgs, ctx)
        width = self.sum_width(len(msgs))
        return Message(pack_bits(sums, width), sums.size * width)

    def sums(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        """The integer sums a downlink message carries (int64 tensor on the codec's device)."""
        count, width = self.transmitted(ctx), self.sum_width(ctx.workers)
        if msg.bits != count * width:
            raise ValueError(f"expected {count * width} downlink bits for {ctx.workers} workers, "
                             f"got {msg.bits}")
        return torch.from_numpy(unpack_bits(msg.payload, width, count).astype(np.int64)).to(self.device)

    def decode_result(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        return self.from_sums(self.sums(msg, ctx), ctx)

    def decode_one(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        values = torch.from_numpy(self.table[self.indices(msg, ctx)]).to(self.device)
        return self.from_sums(values, ctx.with_workers(1))


class DARCodec(Codec):
    """A codec the aggregator must decompress, sum in float, and compress again for the downlink."""

    kind = CodecKind.DAR

    def aggregate(self, msgs: Sequence[Message], ctx: RoundContext,
                  state: CodecState | None = None) -> Message:
        if not msgs:
            raise ValueError("no messages to aggregate")
        total = self.decode_one(msgs[0], ctx).clone()
        for m in msgs[1:]:
            total += self.decode_one(m, ctx)
        return self.reencode(total.div_(len(msgs)), ctx, state)

    def reencode(self, average: torch.Tensor, ctx: RoundContext, state: CodecState | None = None) -> Message:
        """The downlink message for the aggregated average (by default the uplink format)."""
        return self.encode(average, ctx, state)

    def decode_result(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        return self.decode_one(msg, ctx)
