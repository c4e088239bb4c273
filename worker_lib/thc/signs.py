"""Random signs of the randomized Hadamard transform, derived from a shared seed.

Every worker of a job must flip the same coordinates for a given (job, tensor, step) without
exchanging the signs, on any device and any torch version. torch's generators give different
streams on CPU and GPU, so the signs come from a counter-based hash evaluated with exact integer
arithmetic instead. The derivation is specified in docs/rht-signs.md, which also lists test vectors;
tests check this module against an independent pure-Python rendering of that text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_lib.values import is_integer

MASK32 = 0xFFFFFFFF
MUL_A = 0x21F0AAAD
MUL_B = 0x735A2D97
GOLDEN = 0x9E3779B9
KEY1_SALT = 0x85EBCA6B


def mix32_int(x: int) -> int:
    """The 32-bit mixing function on a Python int (the normative definition)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MUL_A) & MASK32
    x ^= x >> 15
    x = (x * MUL_B) & MASK32
    x ^= x >> 15
    return x


@dataclass(frozen=True)
class SignKey:
    """The two 32-bit key words from which the signs of one (job, tensor, step) are drawn."""

    k0: int
    k1: int

    @classmethod
    def derive(cls, job: int, tensor: int, step: int) -> SignKey:
        """Key for a job id (u32), a tensor id (u32) and a training step (u64)."""
        for name, value, bits in (("job", job, 32), ("tensor", tensor, 32), ("step", step, 64)):
            if not (is_integer(value) and 0 <= int(value) < (1 << bits)):
                raise ValueError(f"{name} must be an integer in [0, 2^{bits}), got {value!r}")
        job, tensor, step = int(job), int(tensor), int(step)
        k = mix32_int(job ^ GOLDEN)
        k = mix32_int(k ^ tensor)
        k = mix32_int(k ^ (step & MASK32))
        k = mix32_int(k ^ (step >> 32))
        return cls(k0=k, k1=mix32_int(k ^ KEY1_SALT))


def _mul32(x: torch.Tensor, const: int) -> torch.Tensor:
    """(x * const) mod 2^32 for int64 tensors holding values in [0, 2^32), without overflow."""
    lo, hi = const & 0xFFFF, const >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, MUL_B)
    return x ^ (x >> 15)


def sign_words(key: SignKey, n_words: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The first n_words 32-bit hash words (as int64) of the key: word c = mix(mix(c ^ k0) ^ k1)."""
    if n_words >= (1 << 32):
        raise ValueError("at most 2^32 sign words (2^37 coordinates) per tensor")
    c = torch.arange(n_words, dtype=torch.int64, device=device)
    return _mix32(_mix32(c ^ key.k0) ^ key.k1)



def sign_words_u32(key: SignKey, n_words: int) -> np.ndarray:
    """``sign_words`` on the CPU in numpy uint32, whose products wrap modulo 2^32 natively (no limbs): what
    the compiled CPU passes of the rotation (``worker_lib.thc.fused``) read their signs from."""
    with np.errstate(over="ignore"):
        x = np.arange(n_words, dtype=np.uint32)
        for k in (key.k0, key.k1):
            x ^= np.uint32(k)
            x ^= x >> np.uint32(16)
            x *= np.uint32(MUL_A)
            x ^= x >> np.uint32(15)
            x *= np.uint32(MUL_B)
            x ^= x >> np.uint32(15)
    return x


def _byte_signs() -> np.ndarray:
    """byte -> its 8 signs as one 32-byte item (bit i set: coordinate i is -1), for one gather per byte."""
    b = np.arange(256)
    signs = np.where((b[:, None] >> np.arange(8)) & 1, -1.0, 1.0).astype(np.float32)
    return np.ascontiguousarray(signs).view(np.dtype((np.void, 32))).reshape(256)


_BYTE_SIGNS = _byte_signs()


def rademacher(key: SignKey, d: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The d signs (+1/-1) of the key: coordinate i takes bit i mod 32 of word i // 32 (1 means -1).

    ``out`` (length d, of the wanted device and dtype) receives the signs without a new allocation.
    """
    if d <= 0:
        raise ValueError(f"need a positive length, got {d}")
    if out is not None:
        if out.shape != (d,):
            raise ValueError(f"out must have shape ({d},), got {tuple(out.shape)}")
        device, dtype = out.device, out.dtype
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        # little-endian bytes of each word, least significant bit first: bit i of word c; each byte
        # becomes its 8 signs with one gather
        words = sign_words_u32(key, (d + 31) // 32).astype("<u4", copy=False)
        signs = _BYTE_SIGNS[words.view(np.uint8)].view(np.float32)[:d]
        if out is None:
            return torch.from_numpy(signs)
        out.numpy()[:] = signs
        return out
    words = sign_words(key, (d + 31) // 32, device)
    shifts = torch.arange(32, dtype=torch.int64, device=words.device)
    bits = ((words[:, None] >> shifts) & 1).reshape(-1)[:d]
    signs = (1 - 2 * bits).to(dtype)
    return signs if out is None else out.copy_(signs)
