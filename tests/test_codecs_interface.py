"""Properties every codec must have, the registry, and the comparison (small sizes)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_lib.cli.bench_cli import main as bench_main
from worker_lib.codecs import CODEC_NAMES, CodecKind, Message, RoundContext, make_codec
from worker_lib.codecs.compare import CompareSetting, compare, ordering

HOMOMORPHIC = {"thc", "terngrad", "terngrad-noclip"}


def ctx_for(codec, xs: list[torch.Tensor]) -> RoundContext:
    shared = codec.combine_prelim([codec.prelim(x) for x in xs]) if codec.needs_prelim else None
    return RoundContext(length=xs[0].numel(), workers=len(xs), shared=shared)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_kind_declared(name: str) -> None:
    kind = make_codec(name).kind
    assert kind is (CodecKind.HOMOMORPHIC if name in HOMOMORPHIC else CodecKind.DAR)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_refused(name: str, bad: float) -> None:
    codec = make_codec(name, seed=0)
    x = torch.randn(64)
    x[17] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        codec.prelim(x) if codec.needs_prelim else codec.encode(x, RoundContext(length=64))
    if codec.needs_prelim:
        with pytest.raises(ValueError, match="NaN or infinite"):
            codec.encode(x, RoundContext(length=64, shared=1e3))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_empty_and_wrong_inputs_refused(name: str) -> None:
    codec = make_codec(name, seed=0)
    with pytest.raises(ValueError, match="empty"):
        codec.encode(torch.zeros(0), RoundContext(length=1, shared=1.0))
    with pytest.raises(ValueError, match="coordinates"):
        codec.encode(torch.ones(5), RoundContext(length=6, shared=10.0))
    with pytest.raises(TypeError):
        codec.encode(torch.ones(5, dtype=torch.int32), RoundContext(length=5, shared=10.0))
    with pytest.raises(ValueError, match="length"):
        RoundContext(length=0)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("d", [1, 7, 1000])
def test_decoding_uses_only_the_bytes(name: str, d: int) -> None:
    """Messages rebuilt from raw bytes decode identically; payload size is ceil(bits / 8)."""
    codec = make_codec(name, seed=1)
    xs = [torch.randn(d) for _ in range(3)]
    ctx = ctx_for(codec, xs)
    ups = [codec.encode(x, ctx) for x in xs]
    down = codec.aggregate(ups, ctx)
    for m in [*ups, down]:
        assert m.nbytes == math.ceil(m.bits / 8)
    rebuilt = Message(np.frombuffer(down.tobytes(), dtype=np.uint8).copy(), down.bits)
    a = codec.decode_result(down, ctx)
    b = make_codec(name, seed=99).decode_result(rebuilt, ctx)
    assert a.shape == (d,) and torch.equal(a, b)
    assert bool(torch.isfinite(a).all())


def test_message_checks_its_bit_count() -> None:
    with pytest.raises(ValueError, match="exactly"):
        Message(np.zeros(2, dtype=np.uint8), 17)
    with pytest.raises(TypeError):
        Message(np.zeros(2, dtype=np.int16), 16)  # type: ignore[arg-type]


def test_unknown_codec() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        make_codec("zip")


def test_compare_rows_and_bit_formulas() -> None:
    d = 4096
    rows = compare(CompareSetting(dim=d, workers=(2,), inputs=("normal",), trials=1))
    by = {r.codec: r for r in rows}
    assert set(by) == set(CODEC_NAMES)
    # independent formulas: bits per coordinate including the 32-bit preliminary exchange
    assert by["natural"].bits_up == 8.0 and by["natural"].bits_down == 8.0
    assert by["terngrad"].bits_up == pytest.approx(2 + 32 / d)
    assert by["terngrad"].bits_down == pytest.approx(3 + 32 / d)
    assert by["thc"].bits_up == pytest.approx(4 + 32 / d)
    assert by["thc"].bits_down == pytest.approx(math.ceil(math.log2(30 * 2 + 1)) + 32 / d)
    assert by["topk10"].bits_up == pytest.approx(64 * math.ceil(0.1 * d) / d)
    # identical inputs: deterministic codecs give the same estimate on every worker -> nmse = nmse_up
    assert by["natural-det"].nmse == pytest.approx(by["natural-det"].nmse_up)
    for r in rows:
        assert r.nmse >= 0 and r.bits_up > 0 and r.agg_cpu_ms >= 0
    assert len(ordering(rows)) == 1


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_main(["codecs", "--json", "--dim", "2048", "--workers", "2", "--inputs", "lognormal",
                     "--codecs", "thc,topk10,terngrad-noclip"])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["codec"] for o in lines] == ["thc", "topk10", "terngrad-noclip"]
    for o in lines:
        assert {"codec", "workers", "nmse", "bits_up", "bits_down"} <= set(o) and o["workers"] == 2


def test_cli_rejects_bad_names() -> None:
    with pytest.raises(SystemExit):
        bench_main(["codecs", "--codecs", "thc,zip"])


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(CODEC_NAMES), st.integers(1, 300), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_any_length_and_worker_count_round_trips(name: str, d: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(d, generator=gen) * float(torch.rand(1, generator=gen)) for _ in range(n)]
    codec = make_codec(name, seed=seed)
    est, ups, down = codec.average(xs)
    assert est.shape == (d,) and bool(torch.isfinite(est).all())
    for m in [*ups, down]:
        assert m.nbytes == math.ceil(m.bits / 8)
