"""THC behind the common interface: bits per direction, integer aggregation, error feedback."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker_lib.codecs import THC, CodecKind, CodecState, RoundContext
from worker_lib.thc.codec import THCConfig
from worker_lib.thc.quantize import pack_indices


def shared_round(codec: THC, xs: list[torch.Tensor], step: int = 0) -> RoundContext:
    return RoundContext(length=xs[0].numel(), workers=len(xs), step=step,
                        shared=codec.combine_prelim([codec.prelim(x) for x in xs]))


@pytest.mark.parametrize(("d", "n"), [(1000, 2), (1024, 4), (3, 8), (5000, 3)])
def test_bits_per_direction(d: int, n: int) -> None:
    cfg = THCConfig(error_feedback=False)
    codec = THC(cfg, seed=1)
    xs = [torch.randn(d) for _ in range(n)]
    ctx = shared_round(codec, xs)
    msgs = [codec.encode(x, ctx) for x in xs]
    padded = 1 << (d - 1).bit_length()
    for m in msgs:
        assert m.bits == cfg.bits * padded and m.nbytes == math.ceil(cfg.bits * padded / 8)
    down = codec.aggregate(msgs, ctx)
    width = math.ceil(math.log2(cfg.granularity * n + 1))  # sums lie in [0, g n]
    assert down.bits == width * padded
    assert codec.prelim_bits == 32 and codec.kind is CodecKind.HOMOMORPHIC


def test_wire_bytes_match_thc_index_packing() -> None:
    codec = THC(THCConfig(error_feedback=False), seed=2)
    x = torch.randn(4096)
    ctx = shared_round(codec, [x])
    msg = codec.encode(x, ctx)
    idx = codec.indices(msg, ctx)
    assert msg.payload.tobytes() == pack_indices(torch.from_numpy(idx.astype(np.uint8)), 4).numpy().tobytes()


def test_aggregate_is_linear_and_accurate() -> None:
    d, n = 1 << 14, 4
    codec = THC(THCConfig(error_feedback=False), seed=3)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.empty(d).log_normal_(0, 1, generator=gen) for _ in range(n)]
    ctx = shared_round(codec, xs)
    msgs = [codec.encode(x, ctx) for x in xs]
    est = codec.decode_result(codec.aggregate(msgs, ctx), ctx)
    singles = torch.stack([codec.decode_one(m, ctx) for m in msgs]).mean(dim=0)
    torch.testing.assert_close(est, singles, rtol=1e-4, atol=1e-4)
    ref = torch.stack(xs).mean(dim=0)
    nmse = float(((est - ref) ** 2).sum() / (ref ** 2).sum())
    assert nmse < 0.05  # 4-bit THC; the uplink-only baseline of 8-bit natural compression is ~0.04


def test_refuses_max_norm_below_own_norm() -> None:
    codec = THC(seed=0)
    x = torch.randn(100)
    with pytest.raises(ValueError, match="max_norm"):
        codec.encode(x, RoundContext(length=100, shared=0.5 * float(x.norm())))


def test_error_feedback_telescopes() -> None:
    d = 512
    codec = THC(THCConfig(error_feedback=True), seed=4)
    state = CodecState()
    rng = np.random.default_rng(5)
    inputs = [torch.from_numpy(rng.standard_normal(d).astype(np.float32)) for _ in range(5)]
    sent = torch.zeros(d, dtype=torch.float64)
    for step, x in enumerate(inputs):
        ctx = RoundContext(length=d, step=step, shared=codec.prelim(x, state))
        sent += codec.decode_one(codec.encode(x, ctx, state), ctx).double()
    total = torch.stack(inputs).double().sum(dim=0)
    torch.testing.assert_close(sent + state.error.double(), total, atol=1e-3, rtol=1e-4)
