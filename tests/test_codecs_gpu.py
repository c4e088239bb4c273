"""Every codec runs on a CUDA device and its bytes mean the same on CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from worker_lib.codecs import CODEC_NAMES, RoundContext, make_codec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_round_on_gpu_and_bytes_portable(name: str) -> None:
    d, n = 5000, 3
    xs = [torch.randn(d, device="cuda") for _ in range(n)]
    gpu = make_codec(name, device="cuda", seed=0)
    est, _, down = gpu.average(xs, RoundContext(length=d, workers=n))
    assert est.device.type == "cuda" and est.shape == (d,) and bool(torch.isfinite(est).all())
    ref = torch.stack(xs).mean(dim=0)
    assert float(((est - ref) ** 2).sum() / (ref ** 2).sum()) < 5.0
    # the same bytes decode to the same vector on CPU
    shared = gpu.combine_prelim([gpu.prelim(x) for x in xs]) if gpu.needs_prelim else None
    ctx = RoundContext(length=d, workers=n, shared=shared)
    cpu = make_codec(name, device="cpu", seed=1)
    torch.testing.assert_close(cpu.decode_result(down, ctx), est.cpu(), rtol=1e-5, atol=1e-6)
