"""The (randomized) Walsh-Hadamard transform: orthonormal, O(d log d), exact inverse, any length.

Lengths that are not a power of two are zero-padded to the next power of two D. The padding is the
price of a single global rotation: the transformed vector (D coordinates) is what gets quantized and
sent, so a length just above a power of two costs up to 2x the bits of the unpadded vector. We keep
the global rotation rather than transforming fixed-size blocks because THC's scale
M = t_p * max_norm / sqrt(D) assumes that every transformed coordinate is ~N(0, ||x||^2 / D), which
holds for a whole-vector rotation but not for blocks whose norms differ.

Two engines compute the same transform: the ``fht-cpu`` package (SIMD, CPU float32/float64, in place)
and a vectorized pure-torch butterfly that runs unchanged on CPU and GPU.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch

from worker_lib.thc import fused
from worker_lib.thc.signs import SignKey, rademacher, sign_words_u32

try:  # optional fast CPU engine
    import fht_cpu as _fht_cpu
except ImportError:  # pragma: no cover - exercised on machines without the wheel
    _fht_cpu = None

Backend = Literal["auto", "torch", "fht-cpu"]


def have_fht_cpu() -> bool:
    """Whether the fht-cpu engine is importable here."""
    return _fht_cpu is not None


def next_pow2(d: int) -> int:
    """Smallest power of two >= d (d >= 1)."""
    if d < 1:
        raise ValueError(f"length must be positive, got {d}")
    return 1 << (d - 1).bit_length()


def _fwht_torch(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(x.shape)


def _use_fht_cpu(x: torch.Tensor, backend: Backend) -> bool:
    eligible = (_fht_cpu is not None and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.float64) and x.dim() in (1, 2))
    if backend == "fht-cpu" and not eligible:
        raise ValueError("the fht-cpu backend needs the fht-cpu package and a 1-D or 2-D CPU "
                         "float32/float64 tensor")
    return eligible and backend != "torch"


def fwht(x: torch.Tensor, *, normalize: bool = True, backend: Backend = "auto",
         inplace: bool = False) -> torch.Tensor:
    """Walsh-Hadamard transform along the last dimension (a power of two).

    With ``normalize`` the transform is H / sqrt(n), orthonormal and its own inverse. With ``inplace``
    the result is written into x (which must then be contiguous) and x is returned.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"the last dimension must be a power of two, got {n}")
    if not x.is_floating_point():
        raise TypeError(f"need a floating-point tensor, got {x.dtype}")
    if inplace and not x.is_contiguous():
        raise ValueError("an in-place transform needs a contiguous tensor")
    if _use_fht_cpu(x, backend):
        out = x if inplace else x.detach().clone(memory_format=torch.contiguous_format)
        _fht_cpu.fht(out.detach().numpy(), inplace=True)
    else:
        out = _fwht_torch(x)
        if inplace:
            out = x.copy_(out)
    if normalize:
        out.mul_(1.0 / math.sqrt(n))
    return out


class RandomizedHadamard:
    """RHT(x) = H D x / sqrt(D) for one (job, tensor, step): fixed length, fixed signs, exact inverse.

    On the CPU in float32 with fht-cpu, the signs stay as the key's 32-bit words and the sign flips,
    padding, normalisation and (for ``inverse_into``) a subtraction run as compiled passes
    (``worker_lib.thc.fused``) around fht-cpu's transform: the same float32 arithmetic as the torch
    composition, bit for bit, in fewer passes over memory. Elsewhere the float signs are materialised.
    """

    def __init__(self, d: int, key: SignKey, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, backend: Backend = "auto") -> None:
        self.d = d
        self.padded = next_pow2(d)
        self.backend: Backend = backend
        self.key = key
        self.device, self.dtype = torch.device(device), dtype
        self._compiled = (self.device.type == "cpu" and dtype == torch.float32 and _fht_cpu is not None
                          and backend != "torch")
        self._words = sign_words_u32(key, (self.padded + 31) // 32) if self._compiled else None
        self._signs = None if self._compiled else rademacher(key, self.padded, device=device, dtype=dtype)
        self._signs_key: SignKey | None = None if self._compiled else key

    @property
    def signs(self) -> torch.Tensor:
        """The D signs (+1/-1) of the current key as a tensor of the rotation's device and dtype."""
        if self._signs is None or self._signs_key != self.key:
            self._signs = rademacher(self.key, self.padded, device=self.device, dtype=self.dtype, out=self._signs)
            self._signs_key = self.key
        return self._signs

    def rekey(self, key: SignKey) -> None:
        """Switch to another step's signs (the float signs, where used, are rebuilt into their buffer)."""
        if key != self.key:
            self.key = key
            if self._compiled:
                self._words = sign_words_u32(key, (self.padded + 31) // 32)

    def _fast(self, *tensors: torch.Tensor) -> bool:
        return self._compiled and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                                      and not t.requires_grad for t in tensors)

    def _prescale(self) -> np.float32:
        """The normalisation 1/sqrt(D) where it is a power of two (D = 4^k), applied before the transform
        by the compiled sign pass: the transform adds and subtracts only, so scaling by a power of two
        commutes with it exactly and the result is the torch composition's bit for bit, one pass over
        memory fewer. Otherwise 1 (the transform normalises after)."""
        even = (self.padded.bit_length() - 1) % 2 == 0
        return np.float32(1.0 / math.sqrt(self.padded)) if even else np.float32(1.0)

    def _check_forward(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if x.shape != (self.d,):
            raise ValueError(f"expected a vector of length {self.d}, got shape {tuple(x.shape)}")
        return torch.empty(self.padded, dtype=self.dtype, device=self.device) if out is None else out

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Transform a length-d vector into the padded length-D rotated vector (into ``out`` if given)."""
        return self.forward_norm(x, out, norm=False)[0]

    def forward_norm(self, x: torch.Tensor, out: torch.Tensor | None = None, *,
                     norm: bool = True) -> tuple[torch.Tensor, float]:
        """``forward`` and the norm of x: the compiled path sums x's squares in the sign pass (float64),
        so the norm costs no pass over memory of its own; elsewhere it is torch's, in float64. The norm
        is NaN or infinite where x holds NaN or infinities (the caller checks it); 0.0 without ``norm``."""
        out = self._check_forward(x, out)
        if self._fast(x, out):
            c = self._prescale()
            squares = fused.signs_pad_into(x.numpy(), self._words, c, out.numpy())
            return fwht(out, normalize=c == 1, backend=self.backend, inplace=True), math.sqrt(squares)
        value = float(torch.linalg.vector_norm(x, dtype=torch.float64)) if norm else 0.0
        torch.mul(x, self.signs[: self.d], out=out[: self.d])
        out[self.d:].zero_()
        return fwht(out, backend=self.backend, inplace=True), value

    def forward_sum(self, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor | None,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """x = a + b (length d; x may be a or b; None: the sum is not kept), then ``forward_norm(x, out)``: the
        compiled path computes the sum, the sign flip and the squares in one pass (the error feedback's
        addition read and wrote 4 bytes per coordinate more, the norm read them again). Returns the rotated
        vector and x's norm."""
        out = self._check_forward(a, out)
        if a.shape != b.shape or (x is not None and x.shape != a.shape):
            raise ValueError(f"expected vectors of length {self.d}, got shapes {tuple(a.shape)}, {tuple(b.shape)}"
                             f"{'' if x is None else f' and {tuple(x.shape)}'}")
        if self._fast(a, b, out, *(() if x is None else (x,))):
            c = self._prescale()
            if x is None:
                squares = fused.sum_signs_pad_only(a.numpy(), b.numpy(), self._words, c, out.numpy())
            else:
                squares = fused.sum_signs_pad_into(a.numpy(), b.numpy(), self._words, c, x.numpy(), out.numpy())
            return fwht(out, normalize=c == 1, backend=self.backend, inplace=True), math.sqrt(squares)
        return self.forward_norm(torch.add(a, b, out=x), out)

    def inverse(self, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate a length-D vector back and return its first d coordinates (y is left unchanged)."""
        if y.shape != (self.padded,):
            raise ValueError(f"expected a vector of length {self.padded}, got shape {tuple(y.shape)}")
        out = y.to(self.dtype, copy=True) if out is None else out.copy_(y)
        return self.inverse_into(out, out[: self.d])

    def inverse_into(self, y: torch.Tensor, dest: torch.Tensor, *, minus: torch.Tensor | None = None) -> torch.Tensor:
        """dest = RHT^-1(y)[:d], or ``minus`` - RHT^-1(y)[:d]; returns dest. ``y`` (length D, of the
        rotation's dtype) is transformed in place: its contents are lost. ``dest`` may be y's head."""
        if y.shape != (self.padded,) or dest.shape != (self.d,):
            raise ValueError(f"expected a vector of length {self.padded} into one of {self.d}, got shapes "
                             f"{tuple(y.shape)} and {tuple(dest.shape)}")
        if self._fast(y, dest, *(() if minus is None else (minus,))):
            fwht(y, normalize=False, backend=self.backend, inplace=True)
            c = np.float32(1.0 / math.sqrt(self.padded))
            if minus is None:
                fused.unscale_signs_into(y.numpy(), self._words, c, dest.numpy())
            else:
                fused.minus_unscale_signs_into(minus.numpy(), y.numpy(), self._words, c, dest.numpy())
            return dest
        fwht(y, backend=self.backend, inplace=True)
        back = y.mul_(self.signs)[: self.d]
        return dest.copy_(back) if minus is None else torch.sub(minus, back, out=dest)
