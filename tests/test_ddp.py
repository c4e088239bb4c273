"""The DDP communication hook (worker_lib.ddp) and examples/train_ddp.py, through a real thc-aggregator.

End-to-end tests launch the example with torchrun (2-3 ranks on loopback) in its own process group,
killed in ``finally``; in-process tests drive ``THCHookState`` with a stand-in for DDP's GradBucket
against an aggregator subprocess serving a one-worker job.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.loss_phases import COUNTERS
from launchers.aggregator_process import listening_port
from worker_lib.ddp import DDPHookConfig, THCHookState, settings_disagree, thread_wait_s
from worker_lib.job import JobConfig
from worker_lib.wire.pcap import read_pcap

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
#: The loss comparison: after STEPS steps, THC's mean loss over the last 5 steps is at most
#: LOSS_TOLERANCE times the uncompressed DDP run's (plus a small absolute slack for tiny losses).
STEPS = 30
LOSS_TOLERANCE = 1.5
LOSS_SLACK = 0.05


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def torchrun(ranks: int, *args: str, timeout: float = 150) -> tuple[int, str]:
    """Run the example under torchrun; returns (exit code, stdout+stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(EXAMPLE), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    finally:
        _kill_group(proc)


def run_example(tmp_path: Path, compression: str, *extra: str, ranks: int = 2) -> dict:
    out = tmp_path / f"{compression}.json"
    rc, text = torchrun(ranks, "--steps", str(STEPS), "--compression", compression, "--check-every-step",
                        "--bucket-cap-mb", "0.01", "--json-out", str(out), *extra)
    assert rc == 0, text[-3000:]
    assert "identical parameters on all ranks: True" in text
    return json.loads(out.read_text())


def tail_mean(losses: list[float], k: int = 5) -> float:
    return sum(losses[-k:]) / k


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Ordinary DDP (gloo all_reduce) on the same task: the reference loss curve."""
    return run_example(tmp_path_factory.mktemp("none"), "none")


@pytest.fixture(scope="module")
def thc_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same with THC through a rank-0-started aggregator (one tier), for the tests that read it."""
    return run_example(tmp_path_factory.mktemp("thc"), "thc")


def test_thc_identical_every_step_and_loss_tracks_ddp(thc_run: dict, baseline: dict) -> None:
    """THC through a rank-0-started aggregator: bit-identical parameters on all ranks after every step,
    and the loss falls like plain DDP's (within LOSS_TOLERANCE over STEPS steps)."""
    s = thc_run
    assert s["identical_every_step"] == [True] * STEPS and s["identical"] is True
    hook = s["hook"][0]
    # Several buckets per step (bucket cap 10 kB) and the first-iteration layout was rebuilt: every bucket
    # of every step went through the aggregator.
    assert hook["coordinates"] == STEPS * s["parameters"] and hook["buckets"] > STEPS
    assert hook["lost_chunks"] == 0 and hook["bytes_sent"] > 0
    # every step has a mark with the counters benchmarks/loss_phases.py compares, by name; the last one's
    # running counts are rank 0's totals
    marks = s["step_marks"]
    assert len(marks) == STEPS and set(COUNTERS) <= marks[-1].keys()
    assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(marks))
    assert marks[-1]["encode_s"] == pytest.approx(hook["encode_s"]) and hook["encode_s"] > 0
    assert marks[-1]["retransmissions"] == hook["transport_retransmissions"]
    assert marks[-1]["retransmissions_all"] == sum(h["transport_retransmissions"] for h in s["hook"])
    first = baseline["losses"][0]
    assert s["losses"][0] == pytest.approx(first)  # same data and initial parameters
    thc, ref = tail_mean(s["losses"]), tail_mean(baseline["losses"])
    assert ref < 0.5 * first, "the reference run did not learn: the comparison would mean nothing"
    assert thc < LOSS_TOLERANCE * ref + LOSS_SLACK, (thc, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rotation", ["fixed", "per-step"])
def test_thc_on_cuda_tensors(tmp_path: Path, dtype: str, rotation: str) -> None:
    """Model and gradients on a GPU (both ranks share it where there is one): the hook compresses and
    decodes on the device, with either rotation, the aggregator sums, the replicas stay bit-identical
    after every step and the model learns."""
    s = run_example(tmp_path, "thc", "--device", "cuda", "--dtype", dtype, "--rotation", rotation)
    assert s["device"].startswith("cuda") and s["dtype"] == dtype
    assert s["identical_every_step"] == [True] * STEPS
    hook = s["hook"][0]
    assert hook["coordinates"] == STEPS * s["parameters"] and hook["lost_chunks"] == 0
    assert tail_mean(s["losses"]) < 0.5 * s["losses"][0], s["losses"]


def test_uncompressed_job_matches_ddp(tmp_path: Path, baseline: dict) -> None:
    """The aggregator's int32 fixed-point job gives (nearly) the float all_reduce's training curve."""
    s = run_example(tmp_path, "uncompressed", ranks=2)
    assert s["identical_every_step"] == [True] * STEPS
    for a, b in zip(s["losses"], baseline["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-5)


def test_classification_task_learns_and_reports_accuracy(tmp_path: Path) -> None:
    """--task digits: each rank trains on its shard, rank 0 evaluates every --eval-every steps (and after
    the last), the test accuracy climbs far above chance (10 classes: 0.1) through THC, the replicas stay
    identical and the training clock only moves forward. (With the paper's per-step rotation: the default
    fixed one, whose error feedback stays rotated, trains in the test above.)"""
    out = tmp_path / "digits.json"
    rc, text = torchrun(2, "--task", "digits", "--steps", "45", "--eval-every", "20", "--compression", "thc",
                        "--lr", "0.05", "--rotation", "per-step", "--json-out", str(out))
    assert rc == 0, text[-3000:]
    s = json.loads(out.read_text())
    steps, secs, acc = zip(*s["accuracy"], strict=True)
    assert s["task"] == "digits" and s["identical"] is True
    assert steps == (20, 40, 45) and 0 < secs[0] < secs[1] < secs[2]
    assert acc[-1] > 0.7, acc


def _start_aggregator(*jobs: JobConfig, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    """thc-aggregator serving ``jobs`` on a free loopback port (with the options ``extra``), in its own
    process group."""
    cmd = [sys.executable, "-m", "aggregator.cli", "--port", "0", *extra]
    for job in jobs:
        cmd += ["--job", job.spec()]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready and proc.stdout else ""
    if "listening on" not in line:
        _kill_group(proc)
        raise RuntimeError(f"thc-aggregator did not start: {line!r}")
    return proc, listening_port(line)


def test_two_aggregators_serve_one_job(tmp_path: Path) -> None:
    """--aggregator A,B: the ranks spread the job's slots over two aggregators (members 0/2 and 1/2);
    training stays bit-identical on all ranks, and both aggregators carried packets (their pcaps)."""
    job = JobConfig(job=6, key=0xBEEF, workers=2)
    pcaps = [tmp_path / f"member{i}.pcap" for i in range(2)]
    aggs = [_start_aggregator(job, extra=("--member", f"{i}/2", "--pcap", str(pcaps[i]))) for i in range(2)]
    try:
        rc, text = torchrun(2, "--steps", "6", "--compression", "thc", "--job-id", "6", "--key", "0xBEEF",
                            "--check-every-step", "--aggregator", ",".join(f"127.0.0.1:{port}" for _, port in aggs))
    finally:
        for agg, _ in aggs:
            agg.terminate()
            agg.wait(timeout=30)
    assert rc == 0 and "identical parameters on all ranks: True" in text, text[-3000:]
    assert all(len(list(read_pcap(p))) > 20 for p in pcaps)


def test_two_tiers_train_bit_identically(tmp_path: Path, thc_run: dict) -> None:
    """--leaves 1:1: rank 0 starts a spine and two leaves (thc-aggregator --role spine / leaf), each rank
    talks to its own leaf; training stays bit-identical on both ranks and its loss tracks one tier's
    (the sums are the same, so the models are)."""
    two = run_example(tmp_path, "thc", "--leaves", "1:1")
    one = thc_run
    assert two["identical"] and two["losses"] == one["losses"], (two["losses"][-3:], one["losses"][-3:])


def test_killed_aggregator_fails_clearly(tmp_path: Path) -> None:
    """Killing the aggregator mid-run makes every rank fail with a clear error within the deadline, no hang."""
    job = JobConfig(job=5, key=0xABCD, workers=3)
    agg, port = _start_aggregator(job)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(EXAMPLE),
           "--steps", "100000", "--compression", "thc", "--aggregator", f"127.0.0.1:{port}", "--job-id", "5",
           "--key", "0xABCD", "--deadline", "2", "--log-every", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        seen = ""
        limit = time.monotonic() + 120
        while "step 3 " not in seen:  # training runs through the aggregator
            assert time.monotonic() < limit and proc.poll() is None, seen[-3000:]
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                seen += proc.stdout.readline()
        os.killpg(agg.pid, signal.SIGKILL)
        agg.wait(timeout=30)
        killed_at = time.monotonic()
        rest, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
        text = seen + rest
        assert proc.returncode != 0
        assert "the THC aggregator is unreachable" in text and f"127.0.0.1:{port}" in text, text[-3000:]
        assert elapsed < 60, elapsed
    finally:
        _kill_group(proc)
        _kill_group(agg)


# -- in process: the hook's state with a stand-in for DDP's GradBucket ------------------------------------------
class FakeBucket:
    """What the hook reads of a ``dist.GradBucket``: index, flat buffer, parameters, is_last."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], last: bool) -> None:
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return self._last


class OneWorkerJobs:
    """A thc-aggregator serving one-worker jobs; each hook state gets a fresh job (its slots start at round 0)."""

    KINDS = ("thc", "uncompressed")
    PER_KIND = 12

    def __init__(self) -> None:
        self.jobs = {kind: [JobConfig(job=100 * (k + 1) + i, key=0x7700 + i, workers=1, kind=kind)
                            for i in range(self.PER_KIND)] for k, kind in enumerate(self.KINDS)}
        self.proc, self.port = _start_aggregator(*(j for js in self.jobs.values() for j in js))

    def state(self, kind: str, **kw: object) -> THCHookState:
        if not self.jobs[kind]:
            raise RuntimeError("OneWorkerJobs: no fresh job left; raise PER_KIND")
        job = self.jobs[kind].pop()
        cfg = DDPHookConfig(job, aggregator=("127.0.0.1", self.port), deadline=5.0, **kw)
        return THCHookState(cfg, rank=0, world_size=1)


@pytest.fixture(scope="module")
def one_worker() -> Iterator[OneWorkerJobs]:
    jobs = OneWorkerJobs()
    try:
        yield jobs
    finally:
        _kill_group(jobs.proc)


def _params(*sizes: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = torch.randn(n, generator=g).to(dtype)
        out.append(p)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hook_dtypes_one_worker(one_worker: OneWorkerJobs, dtype: torch.dtype) -> None:
    """float32/float16/bfloat16 buckets come back in their dtype and shape, averaging one worker's gradient
    (THC's error is small; the uncompressed job is exact up to fixed point and the dtype)."""
    params = _params(3000, 1200, dtype=dtype)
    for kind, tol in (("thc", 0.35), ("uncompressed", 1e-6)):
        with one_worker.state(kind) as st:
            bucket = FakeBucket(0, params, last=True)
            grad = bucket.buffer().clone().float()
            out = st.submit(bucket).wait()
            assert out.dtype == dtype and out.shape == grad.shape
            nmse = float(((out.float() - grad) ** 2).sum() / (grad ** 2).sum())
            assert nmse < tol, (kind, nmse)
            assert st.stats.buckets == 1 and st.stats.coordinates == grad.numel()


def test_the_hook_adds_up_its_threads_wait_per_bucket(one_worker: OneWorkerJobs,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``HookStats.wait_s`` is the exchange thread's run-queue delay over each bucket, the difference of two
    readings of ``thread_wait_s`` (here a clock that reads 0.25 s more each time): two buckets, 0.5 s."""
    readings = itertools.count()
    monkeypatch.setattr("worker_lib.ddp.thread_wait_s", lambda: 0.25 * next(readings))
    with one_worker.state("thc") as st:
        for _ in range(2):
            st.submit(FakeBucket(0, _params(3000), last=True)).wait()
        assert st.stats.buckets == 2 and st.stats.wait_s == 0.5, st.stats


_CONTENDED = """
import os, sys, time
from worker_lib.ddp import thread_wait_s
cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})
child = os.fork()
if child == 0:  # a busy peer on the same CPU at the default priority
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        pass
    os._exit(0)
time.sleep(0.05)
os.setpriority(os.PRIO_PROCESS, 0, 19)  # this thread yields to it
w0, c0, t0 = thread_wait_s(), time.thread_time(), time.monotonic()
while time.monotonic() - t0 < 0.6:
    pass
print(thread_wait_s() - w0, time.thread_time() - c0)
os.kill(child, 9)
"""


def test_thread_wait_is_the_time_without_a_cpu() -> None:
    """A thread at nice 19 that spins for 0.6 s on one CPU beside a busy process at nice 0 gets a few percent
    of it: most of the 0.6 s it waits, ready, for the CPU, and that is what ``thread_wait_s`` counts (not its
    CPU time, which is small); a sleeping thread waits for nothing."""
    if math.isnan(thread_wait_s()):
        pytest.skip("this kernel keeps no /proc/thread-self/schedstat (CONFIG_SCHED_INFO)")
    out = subprocess.run([sys.executable, "-c", _CONTENDED], capture_output=True, text=True, timeout=30,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    waited, cpu = map(float, out.stdout.split())
    assert waited > 0.4 and cpu < 0.2, (waited, cpu)
    w0 = thread_wait_s()
    time.sleep(0.3)
    assert thread_wait_s() - w0 < 0.1


def test_error_feedback_survives_bucket_rebuild(one_worker: OneWorkerJobs) -> None:
    """The per-step rotation: after a rebuild that regroups parameters, each parameter's error feedback is
    carried over, unrotated (the fixed rotation's rotated errors: the next test)."""
    p1, p2, p3 = _params(500, 700, 300, seed=1)
    with one_worker.state("thc", rotation="per-step") as st:
        st.submit(FakeBucket(0, [p1, p2], last=False)).wait()
        st.submit(FakeBucket(1, [p3], last=True)).wait()
        before = {i: st.error_of(p).clone() for i, p in enumerate((p1, p2, p3))}
        assert all(e.abs().sum() > 0 for e in before.values())  # THC's quantization leaves an error
        flat = st.bucket_errors(0, (id(p3), id(p1)), [300, 500], torch.device("cpu"))
        assert torch.equal(flat, torch.cat([before[2], before[0]]))
        st.submit(FakeBucket(0, [p3, p1], last=False)).wait()
        st.submit(FakeBucket(1, [p2], last=True)).wait()
        assert torch.equal(st.bucket_errors(1, (id(p2),), [700], torch.device("cpu")), st.error_of(p2))
        assert not torch.equal(st.error_of(p2), before[1])  # updated by the second step


def test_fixed_rotation_error_feedback_survives_bucket_rebuild(one_worker: OneWorkerJobs) -> None:
    """``rotation="fixed"``: a bucket's error is kept rotated (padded length); a rebuild that regroups the
    parameters rotates each one's error back and into its new bucket, so nothing is lost but what the
    padding carried; parameters of buckets the rebuild does not touch keep theirs rotated."""
    p1, p2, p3, p4 = _params(500, 700, 300, 256, seed=1)
    with one_worker.state("thc", rotation="fixed") as st:
        st.submit(FakeBucket(0, [p1, p2], last=False)).wait()
        st.submit(FakeBucket(1, [p3], last=False)).wait()
        st.submit(FakeBucket(2, [p4], last=True)).wait()
        kept = st.bucket_errors(0, (id(p1), id(p2)), [500, 700], torch.device("cpu"))
        assert kept.shape == (2048,)  # rotated, padded
        before = {i: st.error_of(p).clone() for i, p in enumerate((p1, p2, p3, p4))}
        assert [e.numel() for e in before.values()] == [500, 700, 300, 256]
        assert all(e.abs().sum() > 0 for e in before.values())
        untouched = st.bucket_errors(2, (id(p4),), [256], torch.device("cpu"))
        # the rebuild: bucket 0 holds p3 and p1, bucket 1 holds p2
        flat = st.bucket_errors(0, (id(p3), id(p1)), [300, 500], torch.device("cpu"))
        assert flat.shape == (1024,)
        w = st._worker_for(torch.device("cpu"))
        back = w.error_from_rotated(0, flat, 800)
        assert torch.allclose(back, torch.cat([before[2], before[0]]), atol=1e-5)
        assert torch.allclose(st.error_of(p2), before[1], atol=1e-5)  # waiting, unrotated, for its new bucket
        assert st.bucket_errors(2, (id(p4),), [256], torch.device("cpu")) is untouched
        st.submit(FakeBucket(0, [p3, p1], last=False)).wait()
        st.submit(FakeBucket(1, [p2], last=True)).wait()  # bucket 2 is gone: p4's error waits, unrotated
        assert torch.allclose(st.error_of(p4), before[3], atol=1e-5)
        assert st.error_of(p2).numel() == 700 and not torch.allclose(st.error_of(p2), before[1], atol=1e-3)


def test_error_feedback_can_be_disabled(one_worker: OneWorkerJobs) -> None:
    """error_feedback=False keeps no per-parameter error."""
    (p,) = _params(1000)
    with one_worker.state("thc", error_feedback=False) as st:
        st.submit(FakeBucket(0, [p], last=True)).wait()
        assert st.error_of(p) is None


def test_unreachable_aggregator_raises_not_hangs() -> None:
    """Nothing listening: the bucket's future fails with AggregatorUnreachable after the deadline."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but never answering
        cfg = DDPHookConfig(aggregator=("127.0.0.1", port), deadline=1.0)
        with THCHookState(cfg, rank=0, world_size=4) as st:
            t0 = time.monotonic()
            fut = st.submit(FakeBucket(0, _params(100), last=True))
            with pytest.raises(ConnectionError, match=f"no answer from the aggregator at 127.0.0.1:{port}"):
                fut.wait()
            assert time.monotonic() - t0 < 10
            # Later buckets fail at once, naming the first failure (the use sequence is broken).
            with pytest.raises(RuntimeError, match="an earlier exchange failed"):
                st.submit(FakeBucket(0, _params(100), last=True)).wait()


def test_config_validation_and_defaults() -> None:
    """Clear errors for bad settings; the default job is the one thc-aggregator serves without options."""
    with pytest.raises(ValueError, match="kind must be"):
        DDPHookConfig(JobConfig(kind="fp8"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind must be 'thc' or 'uncompressed' for the DDP hook"):
        DDPHookConfig(JobConfig(kind="dar", codec="topk10", length=100, max_message=1000))
    with pytest.raises(ValueError, match="loss_policy"):
        DDPHookConfig(loss_policy="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"job must be a JobConfig \(worker_lib.job.parse_job_spec reads a spec\), "
                                         "got 'job=2,workers=4'"):
        DDPHookConfig("job=2,workers=4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        DDPHookConfig(aggregator=("127.0.0.1", 0))
    with pytest.raises(ValueError, match=r"port in 1..65535, got \('10.0.0.2', 70000\)"):
        DDPHookConfig(more_aggregators=(("10.0.0.2", 70000),))
    with pytest.raises(ValueError):
        DDPHookConfig(JobConfig(bits=0))
    # refused here, not when the hook registers (or, for a port given as text, inside the transport)
    for kw, says in (({"timeout": 5.0}, r"timeout must be in \(0, 2.0\] seconds"),
                     ({"aggregator": ("127.0.0.1", "9451")}, "port in 1..65535"),
                     ({"seed": -1}, "seed must be a non-negative integer"),
                     ({"deadline": math.nan}, "deadline must be positive and finite"),
                     ({"retries": -2}, "retries must be a non-negative integer"),
                     ({"rotation": "once"}, "rotation must be one of 'per-step', 'fixed'")):
        with pytest.raises(ValueError, match=says):
            DDPHookConfig(**kw)  # type: ignore[arg-type]
    job = JobConfig(workers=3)
    assert DDPHookConfig(JobConfig(workers=3)).job.table_id == job.table_id  # the hook's table is the aggregator's
    assert DDPHookConfig().job == JobConfig()  # by default, thc-aggregator's default job
    # the rotation: fixed where error feedback keeps its error rotated, the paper's per-step signs without it
    assert DDPHookConfig().rotation == "fixed"
    assert DDPHookConfig(error_feedback=False).rotation == "per-step"
    assert DDPHookConfig(error_feedback=False, rotation="fixed").rotation == "fixed"
    assert DDPHookConfig(rotation="per-step").shared_settings()["rotation"] == "per-step"
    # The job is described once: a world size that is not its worker count is refused, clearly.
    with pytest.raises(ValueError, match="job 1 has 4 workers but the world size is 3"):
        THCHookState(DDPHookConfig(), rank=0, world_size=3)


def test_ranks_that_disagree_are_named_and_the_key_never_shown() -> None:
    """register_thc_hook gathers every rank's shared settings: a rank with another rotation, loss policy or
    job is named with the setting; a different key is said to differ without either key in the message,
    nor in what the ranks send each other."""
    base = DDPHookConfig(JobConfig(workers=2, key=0x5EC12E7))
    same = base.shared_settings()
    assert settings_disagree([same, DDPHookConfig(JobConfig(workers=2, key=0x5EC12E7)).shared_settings()]) is None
    cases = ((DDPHookConfig(JobConfig(workers=2, key=0x5EC12E7), rotation="per-step"),
              "disagree on rotation: rank 0 has 'fixed', rank 1 'per-step'"),
             (DDPHookConfig(JobConfig(workers=2, key=0x5EC12E7), loss_policy="zero-fill"),
              "disagree on loss_policy: rank 0 has 'reliable', rank 1 'zero-fill'"),
             (DDPHookConfig(JobConfig(workers=2, key=0x5EC12E7, granularity=20)),
              "disagree on the job's granularity (rank 0 has 30, rank 1 20)"),
             (DDPHookConfig(JobConfig(workers=2, key=0x5EC12E8)), "disagree on the job's key (differs)"))
    for other, says in cases:
        said = settings_disagree([same, other.shared_settings()])
        assert said is not None and says in said, said
    for cfg in (base, cases[3][0]):
        sent = repr(cfg.shared_settings())
        assert str(cfg.job.key) not in sent and hex(cfg.job.key) not in sent
    assert str(0x5EC12E8) not in str(settings_disagree([same, cases[3][0].shared_settings()]))


def test_example_help_and_without_torchrun() -> None:
    """--help documents the switches; run without torchrun it says how to launch it."""
    h = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert h.returncode == 0 and "--compression" in h.stdout and "--aggregator" in h.stdout
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 2 and "torchrun" in r.stderr


#: Run in a fresh interpreter (numba's loaded code is per process): a one-rank DDP model with the THC hook
#: through ``register_thc_hook``, then two training steps; prints each codec pass's loaded signatures after
#: the registration and after the steps.
_FIRST_STEP = """
import json, socket, sys
import torch, torch.distributed as dist
from numba.core.registry import CPUDispatcher
from torch.nn.parallel import DistributedDataParallel
from worker_lib.ddp import AggregatorStateError, DDPHookConfig, register_thc_hook
from worker_lib.job import parse_job_spec
from worker_lib.thc import fused

port, spec, rotation = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    free = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free}", rank=0, world_size=1)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 10)))
cfg = DDPHookConfig(parse_job_spec(spec), aggregator=("127.0.0.1", port), deadline=5.0, rotation=rotation)

def loaded():
    return {n: [str(s) for s in f.signatures] for n, f in vars(fused).items() if isinstance(f, CPUDispatcher)}

state = register_thc_hook(model, cfg)
after_registration = loaded()
for step in range(2):
    model.zero_grad()
    model(torch.randn(8, 64)).square().sum().backward()
state.close()
try:  # a second run on the same job: the aggregator holds the first run's state
    register_thc_hook(DistributedDataParallel(torch.nn.Linear(64, 10)), cfg)
    again = "registered"
except AggregatorStateError as exc:
    again = str(exc)
print(json.dumps({"registered": after_registration, "trained": loaded(), "buckets": state.stats.buckets,
                  "again": again}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("rotation", "passes"), [
    ("fixed", ("add_squares_into", "quantize_residual_into", "unscale_signs_into", "estimate_into")),
    ("per-step", ("sum_signs_pad_only", "quantize_residual_into", "unscale_signs_into", "estimate_into"))])
def test_hook_registration_loads_what_the_first_step_runs(one_worker: OneWorkerJobs, rotation: str,
                                                          passes: tuple[str, ...]) -> None:
    """register_thc_hook loads the codec's compiled passes (numba's set-up and each pass's code) before
    training: the hook's first steps load none (in a first step it took 0.6 s of a 0.03 s step), and the
    passes a step runs are among those loaded at registration, with the types the step uses, for either
    rotation. A second registration on the same job raises AggregatorStateError."""
    job = one_worker.jobs["thc"].pop()
    proc = subprocess.run([sys.executable, "-c", _FIRST_STEP, str(one_worker.port), job.spec(), rotation],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["buckets"] >= 2  # the steps went through the hook
    assert seen["trained"] == seen["registered"]  # nothing loaded inside the steps
    for name in passes:
        assert seen["registered"][name], f"{name} was not loaded at registration"
    # registering again on the job the first run used is refused at once (Transport.open_run)
    assert "start each run with a fresh job" in seen["again"], seen["again"]
