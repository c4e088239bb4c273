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


def test_thc_worker_error_feedback_on_gpu_is_its_definition() -> None:
    """On the GPU the rotated residual comes from torch's lookup and subtraction (not the CPU's compiled
    pass): the error it rotates back is still x - RHT^-1(X_i), computed in float64 on the CPU."""
    import math

    from tests.test_codec import own_values_f64
    from worker_lib.thc import SignKey, THCConfig, THCWorker
    from worker_lib.thc.hadamard import RandomizedHadamard

    d = 3000
    g, e = torch.randn(d), torch.full((d,), 0.01)
    w = THCWorker(THCConfig(error_feedback=False), job=4, seed=3, device="cuda")
    enc = w.compress(0, w.begin(g.cuda(), 0, 1, error=e.cuda()))
    res = w.residual(0, out=torch.empty(d, device="cuda")).cpu().double()
    rht = RandomizedHadamard(d, SignKey.derive(4, 0, 1), dtype=torch.float64)
    x_i = own_values_f64(w, enc.indices, enc.scale)
    assert math.isfinite(enc.scale)
    assert torch.allclose(res, (g + e).double() - rht.inverse(x_i), atol=1e-5)
