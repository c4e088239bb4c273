"""THC compression as the paper's Algorithms 1-3 define it, split where the network sits.

A worker first publishes its norm (the preliminary stage), then compresses with the job's maximum
norm, hands the b-bit indices to a network, and later resumes from the integer sums that come back
(from all n workers or fewer: decoding divides by the count that arrived). ``THCCodec`` is the
stateless arithmetic; ``THCWorker`` adds error feedback and the bookkeeping between the two halves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import torch

from worker_lib.thc import fused
from worker_lib.thc.hadamard import Backend, RandomizedHadamard
from worker_lib.thc.quantize import (
    TableQuantizer,
    UniformSource,
    Workspace,
    from_grid,
    lookup_sum,
    pack_indices,
    to_grid,
    unpack_indices,
)
from worker_lib.thc.signs import SignKey
from worker_lib.thc.table import LookupTable, solve_table, truncation_threshold, uniform_table
from worker_lib.values import FLOAT32_MAX, is_integer

#: ``quantize(start, stop)``: a pass of ``THCCodec.quantize_rotated_in_pieces`` over coordinates start..stop-1.
Quantize = Callable[[int, int], None]


def _quantized_already(_start: int, _stop: int) -> None:
    """The ``Quantize`` of a vector quantized in one go already (a GPU's, or a zero scale's)."""


#: How the rotation's signs change from step to step: the paper's fresh signs per (job, tensor, step), or one
#: rotation per (job, tensor) for every step, which lets error feedback stay in the rotated domain (no
#: inverse transform for it; see ``THCWorker``).
Rotation = Literal["per-step", "fixed"]


@dataclass(frozen=True)
class THCConfig:
    """THC's knobs. Defaults are the paper's testbed setting (b = 4, g = 30, p = 1/32)."""

    bits: int = 4
    granularity: int = 30
    p: float = 1 / 32
    error_feedback: bool = True
    backend: Backend = "auto"
    rotation: Rotation = "per-step"

    def __post_init__(self) -> None:
        self.table()  # validates bits, granularity and p with clear messages
        for name, value, allowed in (("backend", self.backend, get_args(Backend)),
                                     ("rotation", self.rotation, get_args(Rotation))):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")

    def table(self) -> LookupTable:
        """The optimal table T_{b,g,p} (cached)."""
        truncation_threshold(self.p)
        return solve_table(self.bits, self.granularity, self.p)

    @property
    def t_p(self) -> float:
        return truncation_threshold(self.p)


def check_vector(x: torch.Tensor, name: str = "gradient") -> tuple[torch.Tensor, float]:
    """Flatten a tensor to float32, refusing what THC cannot encode; also return its norm."""
    flat = flat_float32(x, name)
    return flat, finite_norm(flat, name)


def flat_float32(x: torch.Tensor, name: str = "gradient") -> torch.Tensor:
    """A tensor flattened to float32 (a view where it already is), refusing other types and empty ones."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach().reshape(-1).to(torch.float32)


def finite_norm(flat: torch.Tensor, name: str = "gradient") -> float:
    """The norm of a flat float32 tensor, refusing NaN, infinities and a norm that overflows. A finite
    norm proves every coordinate finite, so the O(d) scan for NaN and infinities runs only to explain a
    failure."""
    return checked_norm(float(torch.linalg.vector_norm(flat)), flat, name)


def checked_norm(norm: float, flat: torch.Tensor, name: str = "gradient") -> float:
    """``norm`` (flat's, computed by the caller) if it is finite and within float32's range, as the norm
    stage carries it; otherwise the error that says what is wrong with ``flat``."""
    if math.isfinite(norm) and norm <= FLOAT32_MAX:
        return norm
    if bool(torch.isfinite(flat).all()):
        raise ValueError(f"{name}'s norm overflows float32 (values around 1e19 or larger)")
    raise ValueError(f"{name} holds NaN or infinite values")


def check_norm(value: float, name: str = "norm") -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and non-negative, got {value}")
    return value


@dataclass
class Encoded:
    """One worker's compressed vector: indices over the padded transformed length, and its scale.

    When produced through reusable buffers (the default), ``indices`` lives in them and stays valid
    until the same tensor is encoded again; copy it to keep it longer.
    """

    indices: torch.Tensor  # uint8, one per transformed coordinate
    scale: float  # M: the grid spans [-M, M]
    length: int  # d, the original length
    bits: int
    packed_out: torch.Tensor | None = None

    @property
    def padded(self) -> int:
        return self.indices.numel()

    def packed(self) -> torch.Tensor:
        """The wire bytes: b-bit indices, MSB first."""
        return pack_indices(self.indices, self.bits, out=self.packed_out)


class TensorBuffers:
    """The rotation and preallocated buffers of one tensor length, reused from step to step."""

    def __init__(self, d: int, key: SignKey, device: torch.device, backend: Backend, bits: int) -> None:
        self.rht = RandomizedHadamard(d, key, device=device, backend=backend)
        self.ws = Workspace(self.rht.padded, device, bits)

    def use(self, key: SignKey) -> TensorBuffers:
        self.rht.rekey(key)
        return self


class THCCodec:
    """Stateless non-uniform THC over the RHT (Algorithm 3 without error feedback).

    Buffers are kept per vector length; pass ``buffers`` explicitly to keep several vectors of the
    same length in flight at once (THCWorker does so per tensor).
    """

    def __init__(self, config: THCConfig | None = None, *, device: torch.device | str = "cpu",
                 seed: int | None = None, table: LookupTable | None = None) -> None:
        self.config = config or THCConfig()
        self.table = table or self.config.table()
        if (self.table.bits, self.table.granularity) != (self.config.bits, self.config.granularity):
            raise ValueError("the table does not match the configured bits and granularity")
        self.device = torch.device(device)
        self.quantizer = TableQuantizer(self.table, self.device)
        self.uniforms = UniformSource(self.device, seed)
        self._buffers: dict[int, TensorBuffers] = {}
        if self.device.type == "cpu":  # load (or compile) the CPU passes now, not inside the first step
            for residual in (False, True):
                self._quantize_cpu(np.zeros(2, np.float32), 1.0, 0, np.empty(2, np.uint8), residual)
            fused.add_squares_into(np.zeros(2, np.float32), np.zeros(2, np.float32))

    def buffers(self, d: int, key: SignKey) -> TensorBuffers:
        """New buffers for vectors of length d (for callers that keep one set per tensor)."""
        return TensorBuffers(d, key, self.device, self.config.backend, self.table.bits)

    def _default(self, d: int, key: SignKey) -> TensorBuffers:
        if d not in self._buffers:
            if len(self._buffers) >= 8:
                self._buffers.pop(next(iter(self._buffers)))
            self._buffers[d] = self.buffers(d, key)
        return self._buffers[d].use(key)

    def scale(self, max_norm: float, padded: int) -> float:
        """M = t_p * max_norm / sqrt(D), D the transformed (padded) length."""
        return self.config.t_p * check_norm(max_norm, "max_norm") / math.sqrt(padded)

    def rotate_norm(self, x: torch.Tensor, key: SignKey, buffers: TensorBuffers | None = None,
                    name: str = "gradient") -> tuple[torch.Tensor, float]:
        """RHT of a flat float32 vector into the buffers' ``rotated`` (valid until they are reused), and x's
        norm, refused as ``finite_norm`` refuses it (naming x as ``name``); where the compiled path applies
        the norm comes from the rotation's own pass over memory."""
        buf = buffers.use(key) if buffers else self._default(x.numel(), key)
        rotated, norm = buf.rht.forward_norm(x, out=buf.ws.rotated)
        return rotated, checked_norm(norm, x, name)

    def rotate_sum(self, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor | None, key: SignKey,
                   buffers: TensorBuffers, name: str = "gradient") -> tuple[torch.Tensor, float]:
        """x = a + b (flat float32, x may be a or b; None: the sum is not kept), its RHT into the buffers'
        ``rotated`` and x's norm (refused as in ``rotate_norm``), in one compiled pass over memory where the
        CPU path applies (``RandomizedHadamard.forward_sum``)."""
        buf = buffers.use(key)
        rotated, norm = buf.rht.forward_sum(a, b, x, out=buf.ws.rotated)
        if x is None and not (math.isfinite(norm) and norm <= FLOAT32_MAX):
            x = torch.add(a, b)  # made only to say what is wrong with it
        return rotated, norm if x is None else checked_norm(norm, x, name)

    def add_rotated(self, rotated: torch.Tensor, error: torch.Tensor,
                    name: str = "the gradient plus its error feedback") -> float:
        """rotated += error (both of the padded length: error feedback kept in the rotated domain) and the
        norm of the sum, refused as ``checked_norm`` refuses it; one compiled pass on the CPU."""
        if (rotated.device.type == "cpu" and error.device == rotated.device and error.dtype == torch.float32
                and rotated.is_contiguous() and error.is_contiguous()):
            norm = math.sqrt(fused.add_squares_into(rotated.numpy(), error.numpy()))
        else:
            rotated.add_(error)
            norm = float(torch.linalg.vector_norm(rotated, dtype=torch.float64))
        return checked_norm(norm, rotated, name)

    def quantize_rotated(self, rotated: torch.Tensor, max_norm: float, length: int,
                         buffers: TensorBuffers, *, residual: bool = False,
                         residual_into: torch.Tensor | None = None) -> Encoded:
        """Clamp, stochastically quantize and map to table indices an already rotated vector.

        With ``residual``, ``rotated`` is then overwritten with ``rotated - X_i``, what the indices fail to
        carry (``own_values``' X_i, then one float32 subtraction; on the CPU in the quantization's pass):
        the error feedback's residual in the rotated domain, for ``THCWorker.residual``. With
        ``residual_into`` (as long as ``rotated``) it goes there instead and ``rotated`` is left as it was."""
        enc, quantize = self.quantize_rotated_in_pieces(rotated, max_norm, length, buffers, residual=residual,
                                                        residual_into=residual_into)
        quantize(0, rotated.numel())
        return enc

    def quantize_rotated_in_pieces(self, rotated: torch.Tensor, max_norm: float, length: int,
                                   buffers: TensorBuffers, *, residual: bool = False,
                                   residual_into: torch.Tensor | None = None) -> tuple[Encoded, Quantize]:
        """``quantize_rotated`` whose compiled pass has not run yet: ``quantize(start, stop)`` writes the indices
        (and residuals) of coordinates start..stop-1 (start a multiple of ``fused.BLOCK``), the same bits in any
        pieces, so that a caller can send the first chunks while the rest is quantized (and on a thread of its
        own: the pass releases the GIL). Where there is no compiled pass (a GPU, a zero scale), everything is
        quantized here and ``quantize`` does nothing."""
        ws = buffers.ws
        big_m = self.scale(max_norm, rotated.numel())
        dest = rotated if residual and residual_into is None else residual_into
        if rotated.device.type == "cpu" and big_m > 0 and (dest is None or dest.is_contiguous()):
            # one compiled pass (fused.py), the same arithmetic
            x, out, key = rotated.numpy(), ws.indices.numpy(), self.uniforms.next_key()
            res = None if dest is None else dest.numpy()

            def quantize(start: int, stop: int) -> None:
                self._quantize_cpu(x[start:stop], big_m, key, out[start:stop], res is not None,
                                   None if res is None else res[start:stop], first=start)

            return Encoded(ws.indices, big_m, length, self.table.bits, ws.packed), quantize
        y = to_grid(rotated, -big_m, big_m, self.table.granularity, out=ws.grid)
        indices = self.quantizer.quantize(y, self.uniforms.fill(ws.uniforms), ws)
        enc = Encoded(indices, big_m, length, self.table.bits, ws.packed)
        if dest is not None:
            torch.sub(rotated, self.own_values(enc, out=ws.grid), out=dest)
        return enc, _quantized_already

    def encode(self, x: torch.Tensor, max_norm: float, key: SignKey,
               buffers: TensorBuffers | None = None) -> Encoded:
        """Compress x given the job's maximum norm and the step's sign key."""
        flat = check_vector(x)[0].to(self.device)
        buf = buffers.use(key) if buffers else self._default(flat.numel(), key)
        rotated = buf.rht.forward(flat, out=buf.ws.rotated)
        return self.quantize_rotated(rotated, max_norm, flat.numel(), buf)

    def _quantize_cpu(self, x: np.ndarray, big_m: float, key: int, out: np.ndarray, residual: bool = False,
                      res: np.ndarray | None = None, *, first: int = 0) -> None:
        """``fused.quantize_into`` over [-M, M] with this codec's table: the indices of x into ``out``; with
        ``residual``, ``fused.quantize_residual_into`` (``res``, x itself by default, becomes x - X_i, as
        ``own_values`` computes X_i). ``first``: where x starts in the whole vector (``fused.quantize_into``)."""
        g = self.table.granularity
        scale = g / (2 * big_m)  # as to_grid: x * scale + (-low) * scale, each rounded to float32
        q = self.quantizer
        args = (x, np.float32(scale), np.float32(big_m * scale), g, q.slope, q.offset, self.table.size - 1,
                np.uint64(key), out)
        if residual:
            fused.quantize_residual_into(*args, q.values.numpy(), *self._own_map(big_m), x if res is None else res,
                                         first)
        else:
            fused.quantize_into(*args, first)

    def aggregate(self, indices: Sequence[torch.Tensor | np.ndarray]) -> torch.Tensor:
        """What the aggregator computes: the integer sum of T[index] over workers (int64, on CPU)."""
        rows = [np.asarray(i.cpu() if isinstance(i, torch.Tensor) else i) for i in indices]
        if not rows or len({r.shape for r in rows}) != 1 or rows[0].ndim != 1:
            raise ValueError(f"aggregate takes one flat index vector per worker, all of one length; got shapes "
                             f"{[r.shape for r in rows]}")
        stacked = np.stack(rows)
        return torch.from_numpy(lookup_sum(self.table.as_array(), stacked))

    def rotated_estimate(self, sums: torch.Tensor, count: int | torch.Tensor, scale: float,
                         out: torch.Tensor | None = None, lost: torch.Tensor | None = None) -> torch.Tensor:
        """m + (sums / count)(M - m) / g in the rotated domain.

        ``count`` is the number of contributors: one for all coordinates, or one per coordinate when
        chunks completed with different counts. Coordinates flagged in ``lost`` (chunks whose result
        never arrived) are taken as zero in the rotated domain: the zero-fill policy.
        """
        g = self.table.granularity
        sums = sums.to(self.device)
        lost = None if lost is None else lost.to(self.device, torch.bool).reshape(-1)
        if lost is not None and lost.numel() != sums.numel():
            raise ValueError(f"the lost mask has {lost.numel()} entries for {sums.numel()} sums")
        if isinstance(count, torch.Tensor):
            if count.is_floating_point() or count.is_complex() or count.dtype == torch.bool:
                raise ValueError(f"contributor counts must be integers, got dtype {count.dtype}")
            counts = count.to(self.device, torch.int64).reshape(-1)
            if counts.numel() != sums.numel():
                raise ValueError(f"{counts.numel()} contributor counts for {sums.numel()} sums")
            live = counts if lost is None else counts[~lost]
            if live.numel() and int(live.min()) < 1:
                raise ValueError("every contributor count must be positive (mark missing chunks as lost)")
            counts = counts.clamp(min=1)
            if sums.numel() and (int(sums.min()) < 0 or bool((sums > g * counts).any())):
                raise ValueError("sums outside [0, g * count]: wrong counts or corrupt data")
            est = from_grid(sums.to(torch.float64) / counts, 1, -scale, scale, g, out=out)
        else:
            if not is_integer(count):
                raise ValueError(f"the contributor count must be an integer (or a tensor of them), got {count!r}")
            if count < 1:
                raise ValueError(f"the contributor count must be positive, got {count}")
            bad = ValueError(f"sums outside [0, g * count] = [0, {g * count}]: wrong count or corrupt data")
            if sums.device.type == "cpu" and out is not None and sums.is_contiguous() and sums.numel():
                # the range check and from_grid in one compiled pass (fused.py), the same arithmetic
                step = (2 * scale) / (g * count)
                if not fused.estimate_into(sums.numpy(), g * count, np.float32(step), np.float32(-scale),
                                           out.numpy()):
                    raise bad
                est = out
            else:
                if sums.numel() and (int(sums.min()) < 0 or int(sums.max()) > g * count):
                    raise bad
                est = from_grid(sums, count, -scale, scale, g, out=out)
        if lost is not None:
            est.masked_fill_(lost, 0.0)
        return est

    def decode(self, sums: torch.Tensor, count: int | torch.Tensor, scale: float, length: int, key: SignKey,
               buffers: TensorBuffers | None = None, out: torch.Tensor | None = None,
               lost: torch.Tensor | None = None) -> torch.Tensor:
        """The average estimate (length d) from the integer sums of `count` workers.

        ``count`` and ``lost`` are as for ``rotated_estimate``. The result is a new tensor unless
        ``out`` (length d, float32) is given.
        """
        check_norm(scale, "scale")
        buf = buffers.use(key) if buffers else self._default(length, key)
        if buf.rht.d != length:
            raise ValueError(f"buffers are for length {buf.rht.d}, not {length}")
        if sums.numel() != buf.rht.padded:
            raise ValueError(f"expected {buf.rht.padded} sums, got {sums.numel()}")
        est = self.rotated_estimate(sums.reshape(-1), count, scale, out=buf.ws.rotated, lost=lost)
        dest = torch.empty(length, dtype=torch.float32, device=self.device) if out is None else out
        return buf.rht.inverse_into(est, dest)

    def _own_map(self, big_m: float) -> tuple[np.float32, np.float32]:
        """(step, low) of the compiled passes' X_i = float32(T[index]) * step + low on [-M, M]: from_grid's
        float32 constants, shared by ``own_values`` and the residual pass so that the two agree bit for bit."""
        return np.float32((2 * big_m) / self.table.granularity), np.float32(-big_m)

    def own_values(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """X_i, the rotated-domain values this worker's indices stand for."""
        g = self.table.granularity
        if (out is not None and enc.indices.device.type == "cpu" and out.dtype == torch.float32
                and out.is_contiguous() and enc.indices.is_contiguous()):  # one compiled pass (fused.py)
            fused.lookup_estimate_into(enc.indices.numpy(), self.quantizer.values.numpy(), *self._own_map(enc.scale),
                                       out.numpy())
            return out
        looked_up = torch.index_select(self.quantizer.values, 0, enc.indices.to(torch.int32))
        return from_grid(looked_up, 1, -enc.scale, enc.scale, g, out=out)

    def unpack(self, buf: torch.Tensor, count: int) -> torch.Tensor:
        return unpack_indices(buf, self.table.bits, count)


@dataclass
class _TensorState:
    buffers: TensorBuffers
    d: int  # the tensor's length
    #: per-step rotation: gradient + error feedback, float32 (unused with the fixed rotation); with a caller's
    #: error feedback only made when a step needs it (``THCWorker._sum``), from ``addends``
    x: torch.Tensor
    #: error feedback carried to the next step: length d, or with the fixed rotation the padded length D, rotated
    error: torch.Tensor
    #: fixed rotation: where ``compress`` writes this step's residual x_rot - X_i (``finish`` makes it the error)
    pending: torch.Tensor | None = None
    key: SignKey | None = None
    norm: float = 0.0
    shape: torch.Size = field(default_factory=torch.Size)
    dtype: torch.dtype = torch.float32
    encoded: Encoded | None = None
    has_error: bool = False
    #: the caller keeps this step's error feedback (it passed ``error``) and takes the new one from
    #: ``residual``: compress leaves the residual x_rot - X_i in the rotation's buffer for it. (The
    #: worker's own error feedback is updated in ``finish`` after decoding, which reuses that buffer.)
    keeps_error: bool = False
    #: what the rotation's buffer holds (per-step rotation): x_rot; this step's residual x_rot - X_i, not
    #: yet rotated back (``residual`` consumes it); or nothing of use any more (rotated back in place, or
    #: reused by ``residual``'s lookup or by decoding). ``compress`` rotates x again unless it holds x_rot.
    buffer: Literal["x_rot", "residual", "spent"] = "x_rot"
    #: fixed rotation: the error the caller passed to ``begin``, which ``compress`` overwrites with the residual
    caller_error: torch.Tensor | None = None
    #: per-step rotation with a caller's error feedback: (gradient, error) whose sum x is, not written by
    #: ``begin`` (the step's quantization leaves the residual, which needs no x), None once x is made
    addends: tuple[torch.Tensor, torch.Tensor] | None = None
    #: ``residual`` wrote into one of ``addends`` before x was made: x cannot be made any more
    addends_overwritten: bool = False


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of one storage (writing one may change the other)."""
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@dataclass
class THCWorker:
    """One worker's side of THC training (Algorithm 3), with per-tensor error feedback.

    Usage::

        w = THCWorker(THCConfig(), job=7, worker=0)
        norm = w.begin(grad, tensor=0, step=s)          # send norm, receive the job's max norm
        payload = w.compress(tensor=0, max_norm=mx)     # send payload.packed() to the aggregator
        avg = w.finish(tensor=0, sums=sums, count=n)    # integer sums and contributor count back

    Each tensor id keeps its own buffers and error feedback; a tensor whose length changes starts
    afresh (its error feedback is dropped).

    With ``THCConfig.rotation = "fixed"`` every step of a tensor uses the same rotation R, so error feedback
    can stay rotated: x_rot = R(g) + e_rot is quantized and e_rot' = x_rot - X_i is kept as it is, where the
    per-step rotation computes e' = x - R_t^-1(X_i) with an inverse transform of its own. It is the same
    error feedback, e_rot = R(e), for the padded vector: the residual in the padding's coordinates is carried
    too (the per-step rotation drops it with the padding). Error feedback then lives in the padded length D
    and rotated, in ``error`` and in what a caller passes as ``error``.
    """

    config: THCConfig
    job: int
    worker: int = 0
    device: torch.device | str = "cpu"
    seed: int | None = None
    codec: THCCodec = field(init=False)
    _tensors: dict[int, _TensorState] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.codec = THCCodec(self.config, device=self.device, seed=self.seed)

    @property
    def fixed(self) -> bool:
        """Whether the rotation is fixed across steps (error feedback kept rotated, of the padded length)."""
        return self.config.rotation == "fixed"

    def key(self, tensor: int, step: int) -> SignKey:
        """The rotation's sign key for a tensor at a step (the same for every step with the fixed rotation)."""
        key = SignKey.derive(self.job, tensor, step)  # checks the ranges of all three
        return SignKey.derive(self.job, tensor, 0) if self.fixed else key

    def error(self, tensor: int) -> torch.Tensor | None:
        """The error feedback this tensor carries into its next step (None if there is none): length d, or
        with the fixed rotation rotated and of the padded length (``error_from_rotated`` turns it back)."""
        st = self._tensors.get(tensor)
        return st.error if st is not None and st.has_error else None

    def error_to_rotated(self, tensor: int, error: torch.Tensor) -> torch.Tensor:
        """An error-feedback vector of the tensor's length d in the fixed rotation's domain (a new tensor of
        the padded length): what a caller that kept it unrotated (a DDP bucket rebuilt) passes to ``begin``."""
        flat = flat_float32(error, "error feedback").to(self.codec.device)
        rht = RandomizedHadamard(flat.numel(), self.key(tensor, 0), device=self.codec.device,
                                 backend=self.config.backend)
        return rht.forward(flat)

    def error_from_rotated(self, tensor: int, rotated: torch.Tensor, length: int) -> torch.Tensor:
        """``error_to_rotated`` undone: the first ``length`` coordinates of the inverse rotation (the residual of
        the padding's coordinates is dropped), as a new tensor."""
        rht = RandomizedHadamard(length, self.key(tensor, 0), device=self.codec.device, backend=self.config.backend)
        if rotated.shape != (rht.padded,):
            raise ValueError(f"expected a rotated error of {rht.padded} coordinates for length {length}, got shape "
                             f"{tuple(rotated.shape)}")
        return rht.inverse(rotated.to(self.codec.device, torch.float32))

    def _new_state(self, d: int, key: SignKey) -> _TensorState:
        buffers = self.codec.buffers(d, key)
        zeros = torch.zeros(buffers.rht.padded if self.fixed else d, dtype=torch.float32, device=self.codec.device)
        if self.fixed:
            return _TensorState(buffers, d, zeros[:0], zeros, pending=zeros.clone())
        return _TensorState(buffers, d, zeros.clone(), zeros)

    def begin(self, grad: torch.Tensor, tensor: int, step: int, *, error: torch.Tensor | None = None) -> float:
        """Add error feedback, rotate, and return the norm to publish in the preliminary stage.

        ``error``: error feedback kept by the caller (the DDP hook keeps it per parameter), added to the
        gradient here instead of this worker's own; ``residual`` then computes the next one. With the fixed
        rotation it is rotated and of the padded length, and ``compress`` overwrites it with the next one.
        With the per-step rotation the sum of the two is not copied: a step quantized again reads the
        caller's gradient and error, which must be left as they were, and refuses once ``residual`` has
        written into that error.
        """
        flat = flat_float32(grad)
        key = self.key(tensor, step)
        st = self._tensors.get(tensor)
        if st is None or st.d != flat.numel():  # kept only once the gradient passed (below)
            st = self._new_state(flat.numel(), key)
        own = self.config.error_feedback and st.has_error
        want = st.error.numel()
        if error is not None and error.shape != (want,):
            raise ValueError(f"the error feedback has shape {tuple(error.shape)}, the gradient {flat.numel()} "
                             "coordinates" + (f": with the fixed rotation it is kept rotated, {want} coordinates "
                                              "(the padded length)" if self.fixed else ""))
        try:
            if self.fixed:
                norm = self.codec.rotate_norm(flat, key, st.buffers)[1]
                add = error if error is not None else st.error if own else None
                if add is not None:
                    norm = self.codec.add_rotated(st.buffers.ws.rotated, add)
            elif error is None and not own:
                st.x.copy_(flat)
                norm = self.codec.rotate_norm(st.x, key, st.buffers)[1]
            else:
                # the sum, rotated and its norm taken in one pass (the gradient's own norm is computed only to
                # name a bad gradient); written into the tensor's buffer for the worker's own error feedback,
                # which ``finish`` computes from it, not for a caller's (``_sum`` makes it if asked)
                norm = self.codec.rotate_sum(flat, st.error if error is None else error,
                                             st.x if error is None else None, key, st.buffers,
                                             "the gradient plus its error feedback")[1]
        except ValueError:
            if self._tensors.get(tensor) is st:
                st.encoded = None  # nothing of this step may be quantized or decoded
            finite_norm(flat)
            raise
        self._tensors[tensor] = st  # a tensor of a new length replaces its state (and error) only now
        st.key, st.shape, st.dtype, st.encoded, st.norm = key, grad.shape, grad.dtype, None, norm
        st.keeps_error, st.buffer = error is not None, "x_rot"
        st.caller_error = error if self.fixed else None
        st.addends = (flat, error) if error is not None and not self.fixed else None
        st.addends_overwritten = False
        return st.norm

    def _sum(self, st: _TensorState) -> torch.Tensor:
        """This step's x, gradient + error feedback (per-step rotation), made now from the caller's tensors
        where ``begin`` did not write it; refused once ``residual`` has overwritten one of them."""
        if st.addends is not None:
            if st.addends_overwritten:
                raise RuntimeError("residual() has overwritten the error feedback passed to begin(), which this "
                                   "step's sum x = gradient + error needs: call begin() again first")
            torch.add(*st.addends, out=st.x)
            st.addends = None
        return st.x

    def compress(self, tensor: int, max_norm: float) -> Encoded:
        """Quantize with the job's max norm.

        The max norm is normally at least this worker's own; under a partial completion threshold a
        straggler's may exceed it, and clamping (with error feedback) absorbs the difference.
        """
        enc, quantize = self.compress_in_pieces(tensor, max_norm)
        quantize(0, enc.padded)
        return enc

    def compress_in_pieces(self, tensor: int, max_norm: float) -> tuple[Encoded, Quantize]:
        """``compress`` whose quantization runs in pieces afterwards, ``quantize(start, stop)`` in order over the
        padded length (``THCCodec.quantize_rotated_in_pieces``): the indices, and the residual of the error
        feedback, are those of ``compress`` once every piece has run, and nothing else may use the tensor's
        state until then."""
        st = self._require(tensor)
        check_norm(max_norm, "max_norm")
        rotated = st.buffers.ws.rotated
        if self.fixed:  # the residual goes beside the rotated vector, which stays for another compress
            into = st.caller_error if st.caller_error is not None else st.pending
            st.encoded, quantize = self.codec.quantize_rotated_in_pieces(rotated, max_norm, st.d, st.buffers,
                                                                         residual_into=into)
            return st.encoded, quantize
        if st.buffer != "x_rot":  # quantized again in the same step: the buffer holds something else now
            self.codec.rotate_norm(self._sum(st), st.key, st.buffers)  # x_rot again, the same bits
        st.encoded, quantize = self.codec.quantize_rotated_in_pieces(rotated, max_norm, st.d, st.buffers,
                                                                     residual=st.keeps_error)
        st.buffer = "residual" if st.keeps_error else "x_rot"
        return st.encoded, quantize

    def residual(self, tensor: int, x: torch.Tensor | None = None, *, out: torch.Tensor) -> torch.Tensor:
        """out = x - RHT^-1(X_i): what this step's own indices failed to carry of ``x`` (Algorithm 3's
        error), computed with this step's rotation after ``compress`` (for callers that keep error
        feedback themselves, such as the DDP hook; the signs are not generated again). ``x`` defaults to
        what ``begin`` rotated: the gradient plus the error it was given.

        For that default, ``compress`` has left x_rot - X_i in the rotation's buffer, and the error is its
        inverse rotation, RHT^-1(RHT(x) - X_i): x - RHT^-1(X_i) up to the float32 rounding of the
        transform's round trip (about 1e-7 of x), two passes over memory fewer than the lookup of X_i, its
        inverse rotation and the subtraction, which run instead for an explicit ``x`` or a residual taken
        already.

        With the fixed rotation the error stays rotated: ``compress`` has written x_rot - X_i (padded length)
        into the error passed to ``begin``, and this copies it into ``out`` unless ``out`` is that tensor."""
        st = self._require(tensor)
        if st.encoded is None:
            raise RuntimeError(f"tensor {tensor}: compress() must come before residual()")
        ws = st.buffers.ws
        if self.fixed:
            if x is not None:
                raise ValueError("with the fixed rotation the error feedback stays rotated: residual() takes no x")
            src = st.caller_error if st.caller_error is not None else st.pending
            if out.shape != src.shape:
                raise ValueError(f"out must have the padded length {src.numel()}, got shape {tuple(out.shape)}")
            return out if out is src else out.copy_(src)
        if x is None and st.buffer == "residual":
            st.buffer = "spent"  # transformed in place: consumed
            if st.addends is not None and any(_shares_memory(out, t) for t in st.addends):
                st.addends_overwritten = True
            return st.buffers.rht.inverse_into(ws.rotated, out)
        minus = self._sum(st) if x is None else x
        st.buffer = "spent"  # the lookup below goes into the same buffer
        own = self.codec.own_values(st.encoded, out=ws.rotated)
        return st.buffers.rht.inverse_into(own, out, minus=minus)

    def finish(self, tensor: int, sums: torch.Tensor, count: int | torch.Tensor,
               out: torch.Tensor | None = None, lost: torch.Tensor | None = None) -> torch.Tensor:
        """Decode the average from integer sums and update this worker's error feedback.

        ``count`` is the contributor count (or one per padded coordinate); ``lost`` flags padded
        coordinates whose result never came (taken as zero in the rotated domain). Error feedback
        keeps the paper's definition, x - RHT^-1(X_i), whatever the network lost.
        """
        st = self._require(tensor)
        if st.encoded is None:
            raise RuntimeError(f"tensor {tensor}: compress() must come before finish()")
        if out is not None and (not isinstance(out, torch.Tensor) or out.numel() != st.d):
            what = f"{out.numel()} elements" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"tensor {tensor}: out must be a torch tensor of {st.d} elements, got {what}")
        if isinstance(sums, np.ndarray):  # as the transport returns them (UseResults.sums)
            sums = torch.from_numpy(sums)
        direct = (out is not None and out.dtype == st.dtype == torch.float32 and out.device == st.error.device
                  and out.is_contiguous() and out.numel() == st.d)  # decoded in place: no copy
        st.buffer = "spent"  # decoding goes through the rotation's buffer
        avg = self.codec.decode(sums, count, st.encoded.scale, st.d, st.key, st.buffers, lost=lost,
                                out=out.view(-1) if direct else None)
        if self.config.error_feedback and st.caller_error is None:  # only once the sums decoded: a refused
            if self.fixed:  # step changes nothing; compress wrote the new error beside the old
                st.error, st.pending = st.pending, st.error
            else:
                self.residual(tensor, out=st.error)
            st.has_error = True
        st.key = None
        if direct:
            return out
        result = avg.reshape(st.shape).to(st.dtype)
        return result if out is None else out.copy_(result)

    def _require(self, tensor: int) -> _TensorState:
        st = self._tensors.get(tensor)
        if st is None or st.key is None:
            raise RuntimeError(f"tensor {tensor}: begin() was not called for this step")
        return st


def warm_up(config: THCConfig, *, device: torch.device | str = "cpu", sums_type: np.dtype | type = np.uint8,
            caller_error: bool = False) -> None:
    """Run one step of 64 coordinates through a throwaway ``THCWorker``'s passes (begin, compress, the new
    error feedback if ``caller_error``, finish from ``sums_type`` sums: the type the transport hands
    over), so that what a process's first step would load once is loaded now.

    Why: on the CPU the passes are numba functions cached on disk. The first of them that a process
    calls sets up numba's compiler (0.2-0.3 s of CPU here) and each loads its machine code (a few ms).
    Inside the first step of a DDP training, that made it take 0.6 s against 0.03 s for the next ones;
    ``worker_lib.ddp.register_thc_hook`` calls this before training starts instead. The loaded code is
    the process's, so the worker that trains is untouched (its random stream included)."""
    worker = THCWorker(config, job=0, device=device, seed=0)
    grad = torch.linspace(-1.0, 1.0, 64, device=worker.codec.device)
    error = torch.zeros_like(grad) if caller_error else None
    norm = worker.begin(grad, 0, 0, error=error)
    enc = worker.compress(0, norm)
    if error is not None:
        worker.residual(0, out=error)
    sums = worker.codec.aggregate([enc.indices]).numpy().astype(sums_type)
    worker.finish(0, torch.from_numpy(sums), 1, out=grad)


def uniform_encode(x: torch.Tensor, low: float, high: float, bits: int,
                   uniforms: UniformSource) -> torch.Tensor:
    """Uniform THC (Algorithm 1): homomorphic USQ of x on [low, high] with 2^b levels (indices)."""
    flat = check_vector(x)[0]
    table = uniform_table(bits)
    y = to_grid(flat, low, high, table.granularity)
    return TableQuantizer(table, flat.device).quantize(y, uniforms.fill(torch.empty_like(y)))


def table_encode(x: torch.Tensor, low: float, high: float, table: LookupTable,
                 uniforms: UniformSource) -> torch.Tensor:
    """Non-uniform THC (Algorithm 2): stochastic quantization of x on [low, high] onto the table."""
    flat = check_vector(x)[0]
    y = to_grid(flat, low, high, table.granularity)
    return TableQuantizer(table, flat.device).quantize(y, uniforms.fill(torch.empty_like(y)))


def table_decode(sums: torch.Tensor, count: int, low: float, high: float, table: LookupTable) -> torch.Tensor:
    """Estimate of the average from the sums of T[index] (Algorithms 1 and 2, last line)."""
    if count < 1:
        raise ValueError(f"the contributor count must be positive, got {count}")
    return from_grid(sums, count, low, high, table.granularity)
