"""The benchmark CLIs answer out-of-range and malformed options with one line on stderr, never a traceback.

Every value here is refused before a benchmark starts (at parse time, or by the checks right after it), so
no case runs a benchmark. As a safety belt against a regression that would start one anyway, PATH holds
only the interpreter's folder: no ip, tc, nft, p4c or switch to build namespaces or start BMv2 with.

Each case calls the module's ``main`` in this process (a new interpreter per case cost 2-4 s of torch
imports, two minutes for the table); one case per module runs ``python -m`` as a user would, for the exit
status the module hands the shell.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_support import assert_one_line_refusal, call_main

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    # benchmarks.loss
    ("loss", ["--run-timeout", "-1"], "--run-timeout: must be in 1..86400, got -1"),
    ("loss", ["--run-timeout", "0"], "--run-timeout: must be in 1..86400"),
    ("loss", ["--losses", "0,1.5"], "--losses: must be in 0..0.99, got 1.5"),
    ("loss", ["--losses", "0,0.01,0"], "--losses: 0 given twice"),
    ("loss", ["--losses", "0,abc"], "--losses: expected a number, got 'abc'"),
    ("loss", ["--repeats", "0"], "--repeats: must be in 1..1000, got 0"),
    ("loss", ["--workers", "33"], "--workers: must be in 1..32, got 33"),
    ("loss", ["--dim", "-1"], "--dim: must be in 1..268435456, got -1"),
    ("loss", ["--netns", "-1"], "--netns: must be in 1..100000, got -1"),
    ("loss", ["--netns", "1000", "--losses", "0,0.015"], "--netns wants losses in whole percent"),
    # benchmarks.compression
    ("compression", ["--dim", "-1"], "--dim: must be in 1..268435456, got -1"),
    ("compression", ["--repeats", "-1"], "--repeats: must be in 1..1000, got -1"),
    ("compression", ["--bits", "-1"], "--bits: must be in 1..8, got -1"),
    ("compression", ["--granularity", "-1"], "--granularity: must be in 1..4096, got -1"),
    ("compression", ["--granularity", "10"], "granularity must be >= 2^bits - 1 = 15 for 4 bits, got 10"),
    ("compression", ["--bits", "8"], "--bits 8 --granularity 30: granularity must be >= 2^bits - 1 = 255"),
    ("compression", ["--device", "-1"], "--device: expected cpu or cuda[:N], got '-1'"),
    ("compression", ["--device", "abc"], "--device: expected cpu or cuda[:N], got 'abc'"),
    ("compression", ["--device", ""], "--device: expected cpu or cuda[:N], got ''"),
    ("compression", ["--device", "meta"], "--device: expected cpu or cuda[:N], got 'meta'"),
    ("compression", ["--threads", "0"], "--threads: must be in 1..1024, got 0"),
    ("compression", ["--backend", "gpu"], "--backend: invalid choice"),
    ("compression", ["--hook", "--contention"], "--hook measures float32 gradients on its own"),
    ("compression", ["--hook", "--dtype", "bfloat16"], "--hook measures float32 gradients on its own"),
    # benchmarks.aggregator
    ("aggregator", ["--seconds", "-1"], "--seconds: must be in 0.1..3600, got -1"),
    ("aggregator", ["--elems", "-1"], "--elems: must be in 8..65528, got -1"),
    ("aggregator", ["--elems", "256,9000"], "--elems: a result of 9000 x 8-bit sums"),
    ("aggregator", ["--elems", "256,x"], "--elems: expected an integer, got 'x'"),
    ("aggregator", ["--repeats", "-1"], "--repeats: must be in 1..1000, got -1"),
    ("aggregator", ["--dim", "0"], "--dim: must be in 1..268435456, got 0"),
    ("aggregator", ["--cost-dim", "99999999"], "--cost-dim: must be in 1..8388608"),
    ("aggregator", ["--cost-rounds", "0"], "--cost-rounds: must be in 1..1000, got 0"),
    ("aggregator", ["--lone-rounds", "5"], "--lone-rounds: must be in 10..1000000, got 5"),
    # benchmarks.nmse_table
    ("nmse_table", ["--dim", "-1"], "--dim: must be in 1..268435456, got -1"),
    ("nmse_table", ["--trials", "-1"], "--trials: must be in 1..1000, got -1"),
    ("nmse_table", ["--trials", "abc"], "--trials: expected an integer, got 'abc'"),
    # benchmarks.ddp_netem
    ("ddp_netem", ["--rates", "-1"], "--rates: must be in 1..100000, got -1"),
    ("ddp_netem", ["--rates", "1000,"], "--rates: expected a comma-separated list like 1000,10000"),
    ("ddp_netem", ["--workers", "-1"], "--workers: must be in 1..200, got -1"),
    ("ddp_netem", ["--workers", "33"], "workers must be in 1..32, got 33"),
    ("ddp_netem", ["--steps", "-1"], "--steps: must be in 1..1000000, got -1"),
    ("ddp_netem", ["--steps", "2", "--warmup", "2"], "--steps (2) must be more than --warmup (2)"),
    ("ddp_netem", ["--modes", "thc,bogus"], "--modes: unknown mode 'bogus'"),
    ("ddp_netem", ["--loss", "100"], "--loss: must be in 0..99, got 100"),
    ("ddp_netem", ["--loss-phases", "1", "--loss", "1"], "--loss-phases needs --loss 0,P (the two phases; 0 alone "),
    ("ddp_netem", ["--loss-phases", "1", "--loss", "0,1,2"], "--loss-phases needs --loss 0,P"),
    ("ddp_netem", ["--loss-phases", "0"], "--loss-phases: must be in 0.1..3600, got 0"),
    ("ddp_netem", ["--elems", "12"], "elems (K) must be a positive multiple of 8"),
    ("ddp_netem", ["--mtu", "0"], "--mtu: must be in 68..9216, got 0"),
    ("ddp_netem", ["--timeout", "0"], "--timeout: must be in 0.0001..60, got 0"),
    ("ddp_netem", ["--width", "0"], "--width: must be in 1..16384, got 0"),
    ("ddp_netem", ["--json", "/nonexistent/rows.json"], "--json: expected a file in an existing folder"),
    # benchmarks.time_to_accuracy
    ("time_to_accuracy", ["--workers", "5"], "--workers: must be in 2..4, got 5"),
    ("time_to_accuracy", ["--target", "2"], "--target: must be in 0.01..1, got 2"),
    ("time_to_accuracy", ["--modes", "thc,bogus"], "--modes: unknown mode 'bogus'"),
    ("time_to_accuracy", ["--eval-every", "0"], "--eval-every: must be in 1..1000000, got 0"),
    ("time_to_accuracy", ["--csv", "/nonexistent/a.csv"], "--csv: expected a file in an existing folder"),
    ("time_to_accuracy", ["--mtu", "100"], "--mtu: must be in 576..9000, got 100"),
    # benchmarks.exchange
    ("exchange", ["--repeats", "0"], "--repeats: must be in 1..10000, got 0"),
    ("exchange", ["--workers", "33"], "--workers: must be in 1..32, got 33"),
    ("exchange", ["--bits", "9"], "--bits: must be in 1..8, got 9"),
    # benchmarks.engine
    ("engine", ["--batches", "0"], "--batches: must be in 1..1000000, got 0"),
    ("engine", ["--slots", "100"], "--slots must be a multiple of 64, got 100"),
    ("engine", ["--elems", "12"], "--elems must be multiples of 8"),
    ("engine", ["--workers", "33"], "--workers: must be in 1..32, got 33"),
    # benchmarks.tiers
    ("tiers", ["--batches", "0"], "--batches: must be in 1..100000, got 0"),
    ("tiers", ["--elems", "12"], "--elems must be a multiple of 8"),
    # benchmarks.soak
    ("soak", ["--minutes", "0"], "--minutes: must be in 0.01..1440, got 0"),
    ("soak", ["--dim", "0"], "--dim: must be in 1..16777216, got 0"),
    ("soak", ["--drop", "0.5"], "--drop: must be in 0..0.49, got 0.5"),
    ("soak", ["--max-growth-mib", "-1"], "--max-growth-mib: must be in 0..65536, got -1"),
    ("soak", ["--netns", "0"], "--netns: must be in 1..100000, got 0"),
    ("soak", ["--link-loss", "50"], "--link-loss: must be in 0..49, got 50"),
    ("soak", ["--attach", "127.0.0.1:9"], "--attach needs --control and --agg-pid"),
    # benchmarks.table_solver (no options)
    ("table_solver", ["--bogus"], "unrecognized arguments: --bogus"),
    # benchmarks.bmv2
    ("bmv2", ["--workers", "0"], "--workers: must be in 1..32, got 0"),
    ("bmv2", ["--chunks", "-1"], "--chunks: must be in 1..100000, got -1"),
    ("bmv2", ["--bits", "8"], "granularity must be >= 2^bits - 1 = 255 for 8 bits"),
    ("bmv2", ["--elems", "2000"], "exceeds the mtu 1500"),
    ("bmv2", ["--slots", "0"], "--slots: must be in 1..65536, got 0"),
    ("bmv2", ["--workdir", ""], "--workdir: expected a folder, got ''"),
]


@pytest.mark.parametrize("module, argv, says", CASES, ids=[f"{m}:{','.join(a)}" for m, a, _ in CASES])
def test_every_bad_benchmark_option_is_one_line(module: str, argv: list[str], says: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Out-of-range and malformed options: exit 1 or 2, no traceback, one line naming the option or problem."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    assert_one_line_refusal(*call_main(importlib.import_module(f"benchmarks.{module}").main, argv, capsys), says)


FIRST_CASE = {m: (a, s) for m, a, s in reversed(CASES)}


@pytest.mark.parametrize("module", sorted(FIRST_CASE))
def test_python_dash_m_exits_with_the_refusal(module: str) -> None:
    """``python -m benchmarks.<module>`` with the module's first bad case: the shell sees the same exit status
    and line as the in-process call."""
    argv, says = FIRST_CASE[module]
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *argv], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env)
    assert_one_line_refusal(r.returncode, r.stderr, says)


@pytest.mark.parametrize("mode, workers, expected", [
    ("thc", 2, 4000.0),         # 2000 4-bit indices come back as 8-bit sums (2000 B), once per worker
    ("thc-mcast", 2, 2000.0),   # ... and once in all by multicast
    ("thc", 4, 8000.0),
    ("int32", 2, 2000.0),       # 250 int32 values come back as 250 int32 sums, twice
    ("int32-mcast", 2, 1000.0),
    ("gloo", 2, 0.0),
])
def test_ddp_netem_counts_the_results_on_the_aggregators_link(mode: str, workers: int, expected: float) -> None:
    """The wire floor of a step includes the results: 1000 bytes sent by one worker draw ``expected`` bytes
    of results on the aggregator's link (the figures worked out by hand from the result widths)."""
    from benchmarks.ddp_netem import build_parser, down_bytes

    args = build_parser().parse_args(["--workers", str(workers)])
    assert down_bytes(1000.0, mode, args) == expected


def test_ddp_netem_loss_report_says_where_the_extra_goes(capsys: pytest.CaptureFixture[str]) -> None:
    """The lossy comparison prints the step's extra against the resent bytes' wire time, and how much of it
    the exchanges' tails and the slot bound account for (lossy minus lossless medians; worked out by hand)."""
    from benchmarks.ddp_netem import loss_report

    def row(loss: float, step: float, tail: float, slots: float, retx: int) -> dict:
        return {"rate_mbit": 1000.0, "mode": "thc", "loss": loss, "step_s": step, "tail_s": tail,
                "slot_bound_s": slots, "retransmissions": retx // 3, "retransmissions_all": retx, "steps": 10,
                "mtu": 9000, "datagram_bytes": 1500.0}

    loss_report([row(0, 0.150, 0.010, 0.0, 0), row(0, 0.160, 0.012, 0.0, 0),
                 row(1, 0.170, 0.016, 0.004, 1000), row(1, 0.174, 0.018, 0.006, 1000)])
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    # lossless 155.0 ms, lossy 172.0 (+17.0); resent by all workers: 100 datagrams of 1500 B per step at 1
    # Gbit/s = 1.2 ms (neither rank 0's third nor the MTU counts);
    # noise 10.0 (max - min of 2); tail 17.0 - 11.0 = 6.0 ms; slots 5.0 - 0 = 5.0 ms
    assert last == ["1000", "1", "thc", "155.0", "172.0", "17.0", "1.2", "10.0", "NO", "6.0", "5.0"]


def test_ddp_netem_sizes_the_resent_datagrams_by_what_was_sent() -> None:
    """A resent datagram counts at the mean size of the rank's datagrams: 7,040 payload bytes over 10 first
    sends (12 sent, 2 of them again) are 704 bytes each, plus the 32-byte THC header and 28 bytes of IPv4
    and UDP; a rank without the hook's counters (gloo) sent none."""
    from benchmarks.ddp_netem import datagram_bytes

    hook = {"bytes_sent": 7040, "transport_packets_sent": 12, "transport_retransmissions": 2}
    assert datagram_bytes(hook) == 704 + 32 + 28
    assert datagram_bytes({}) == 0.0


def test_engine_benchmark_cycles_a_slot_pool_and_compares_bank_types(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks.engine --slots: batches on the next 64 slots of the pool, rounds advancing at each wrap (it
    stops unless every slot of every batch completes), with both bank types of the compiled engine."""
    from benchmarks.engine import main

    assert main(["--batches", "5", "--workers", "2", "--slots", "128", "--elems", "64", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["elems"] == 64
    assert all(row[k] > 0 for k in ("numpy_packets_per_s", "compiled_packets_per_s", "int32_banks_packets_per_s"))


def test_aggregator_benchmark_times_each_kind_of_lone_datagram(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks.aggregator --lone: every round's three datagrams do what their cases say (it stops unless each
    round completed once and was answered once more from the retained result, and the workers got 2 and 1
    answers a round), and each case gets its median time."""
    from benchmarks.aggregator import main

    assert main(["--lone", "--lone-rounds", "20", "--json"]) == 0
    times = json.loads(capsys.readouterr().out)
    assert list(times) == ["first request", "completion", "retained answer"]
    assert all(0 < t < 1e6 for t in times.values())


def test_tier_benchmark_times_every_role_on_the_same_rounds() -> None:
    """benchmarks.tiers runs the leaf engine, the reference leaf, the reference spine and the engine over the
    same rounds (it stops if any round of any of them does not complete, or if the leaf engine's partials
    are not the reference's) and prints each rate and the ratios."""
    from benchmarks.tiers import rates

    r = rates(64, 2)
    assert set(r) == {"elems", "leaf_engine_pps", "leaf_pps", "spine_pps", "engine_pps"} and r["elems"] == 64
    assert all(r[k] > 0 for k in ("leaf_engine_pps", "leaf_pps", "spine_pps", "engine_pps"))


@pytest.mark.parametrize(("dtype", "dense_bits"), [("float32", 32), ("bfloat16", 16), ("float16", 16)])
def test_compression_counts_the_bits_of_the_gradients_type(dtype: str, dense_bits: int) -> None:
    """--dtype: the gradient is held in that type, and the break-even link rate counts the bits it would
    send (dense_bits - b per coordinate) over encode plus decode; the round trip still decodes close."""
    import torch

    from benchmarks.compression import measure
    from worker_lib.thc import THCConfig

    r = measure(THCConfig(bits=4, granularity=30), 4096, 2, torch.device("cpu"), getattr(torch, dtype))
    assert r["dtype"] == dtype and r["dense_bits"] == dense_bits
    expected = (dense_bits - 4) * 4096 / ((r["encode_ms"] + r["decode_ms"]) / 1e3) / 1e9
    assert r["break_even_gbit_s"] == pytest.approx(expected)
    assert 0 < r["nmse_single_worker"] < 0.05


def test_exchange_benchmark_times_every_workers_exchanges() -> None:
    """Two workers' exchanges through a real thc-aggregator on loopback: a row per worker, each from
    exchanges whose answers came in (receive batches), with the aggregator's CPU beside them; with
    --loss, the workers' simulated drops make them resend; with --gro the exchanges complete as well."""
    from benchmarks.exchange import measure

    res = measure(argparse.Namespace(workers=2, dim=20000, bits=4, slots=64, repeats=2, warmup=1, timeout=120,
                                     loss=0.0, gro=False))
    assert (res["elems"], res["dim"], len(res["per_worker"])) == (1440, 20000, 2)
    for row in res["per_worker"]:
        assert row["receive_batches"] >= 1 and 0 < row["cpu_s"] <= row["wall_s"] + 0.05
    assert res["aggregator_cpu_s"] >= 0
    lossy = measure(argparse.Namespace(workers=2, dim=20000, bits=4, slots=64, repeats=2, warmup=0, timeout=120,
                                       loss=0.3, gro=False))
    assert lossy["loss"] == 0.3 and sum(r["retransmissions"] for r in lossy["per_worker"]) > 0
    coalesced = measure(argparse.Namespace(workers=2, dim=200000, bits=4, slots=64, repeats=2, warmup=1,
                                           timeout=120, loss=0.0, gro=True))  # the aggregator with --gro
    assert coalesced["gro"] and all(r["receive_batches"] >= 1 for r in coalesced["per_worker"])


def test_compression_hook_times_every_phase() -> None:
    """--hook times begin, compress, the new error and finish of a worker with caller-kept error feedback,
    each phase on its own, and the total is their sum."""
    import torch

    from benchmarks.compression import measure_hook
    from worker_lib.thc import THCConfig

    r = measure_hook(THCConfig(bits=4, granularity=30), 5000, 2, torch.device("cpu"))
    phases = [r[f"{name}_ms"] for name in ("begin", "compress", "error", "finish")]
    assert all(p > 0 for p in phases) and r["total_ms"] == pytest.approx(sum(phases))
    assert r["dim"] == 5000 and r["repeats"] == 2


@pytest.mark.parametrize(("extra", "rotation"), [((), "fixed"), (("--rotation", "per-step"), "per-step")])
def test_compression_hook_measures_the_hooks_rotation(capsys: pytest.CaptureFixture[str], extra: tuple[str, ...],
                                                      rotation: str) -> None:
    """--hook measures the DDP hook's default rotation (fixed, with its error feedback) unless asked for
    another, and says which."""
    from benchmarks.compression import main

    main(["--hook", "--dim", "4096", "--repeats", "1", "--threads", "1", *extra])
    assert f"1 threads, {rotation} rotation" in capsys.readouterr().out


def test_ddp_netem_pairs_each_run_with_gloo_on_the_same_links(capsys: pytest.CaptureFixture[str]) -> None:
    """'x gloo' divides a run's step by gloo's run of the same repeat (same links, minutes apart), not by
    whichever gloo run came last; over repeats the report gives the median and the range (worked by hand)."""
    from benchmarks.ddp_netem import against_gloo, ratio_report

    def row(mode: str, repeat: int, step: float) -> dict:
        return {"rate_mbit": 1000.0, "loss": 0.0, "mode": mode, "repeat": repeat, "step_s": step}

    rows = [row("thc", 0, 0.100), row("gloo", 0, 0.200), row("thc", 1, 0.180), row("gloo", 1, 0.200),
            row("thc", 2, 0.120), row("gloo", 2, 0.100)]
    assert against_gloo(rows) == {(1000.0, 0.0, "thc"): pytest.approx([0.5, 0.9, 1.2])}
    ratio_report(rows)
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert last == ["1000", "0", "thc", "3", "0.90", "0.50", "1.20"]
    ratio_report(rows[:2])  # one repeat: the table of runs already says it all
    assert capsys.readouterr().out == ""
