"""Decompress-aggregate-recompress (dar) jobs: codec messages as fragments through ``thc-aggregator``.

The oracle everywhere is the codec itself in process: ``make_codec(name, seed=S).aggregate(messages,
ctx)`` on the same messages (in worker-id order), with S the per-round seed docs/protocol.md defines
(recomputed here from its formula, not taken from the aggregator's code). The network path must
return exactly those bytes and bits to every worker.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator.dar import DarAggregator
from aggregator.engine import Aggregator
from launchers.aggregator_process import listening_port, stop_process
from worker_lib.codecs import Message, RoundContext, make_codec
from worker_lib.job import JobConfig, JobConfigError, load_jobs, parse_job_spec
from worker_lib.transport import AggregatorUnreachable, MessageResult, Transport, TransportConfig
from worker_lib.wire import Header, PacketType
from worker_lib.wire.protocol import Counter, DarCounter, fragment_count

D = 2048
JOB = 7
KEY = 0xDA12
SEED = 11
PREFIX = 8


def expected_seed(seed: int, job: int, slot: int, rnd: int) -> int:
    """The per-round re-encoding seed as docs/protocol.md writes it."""
    return int(np.random.SeedSequence([seed, job, slot, rnd]).generate_state(1, np.uint32)[0])


def dar_spec(codec: str, workers: int, *, slots: int = 2, elems: int | None = None, d: int = D) -> str:
    spec = f"job={JOB},key={KEY:#x},kind=dar,codec={codec},length={d},max_message={8 * d},workers={workers}," \
           f"slots={slots},seed={SEED}"
    return spec + (f",elems={elems}" if elems else "")


@contextlib.contextmanager
def aggregator(*args: str) -> Iterator[tuple[subprocess.Popen, int, int]]:
    """thc-aggregator on free loopback ports (data, control); always stopped (then killed)."""
    proc = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", "0", "--control", "127.0.0.1:0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line + proc.stderr.read()
        port = listening_port(line)
        ctrl = int(line.split("control=")[1].split()[0].rsplit(":", 1)[1])
        yield proc, port, ctrl
    finally:
        stop_process(proc, timeout=5)


def control(port: int, command: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(3)
        s.sendto(command.encode(), ("127.0.0.1", port))
        return s.recvfrom(65536)[0].decode()


def messages(codec: str, workers: int, uses: int, seed: int = 0, d: int = D) -> list[list[Message]]:
    """uses x workers uplink messages of random gradients (encoded in process, the workers' side)."""
    rng = np.random.default_rng(seed)
    enc = make_codec(codec, seed=seed)
    ctx = RoundContext(length=d)
    return [[enc.encode(torch.from_numpy(rng.standard_normal(d).astype(np.float32)), ctx) for _ in range(workers)]
            for _ in range(uses)]


def oracle(codec: str, msgs: Sequence[Message], slot: int, rnd: int, d: int = D) -> Message:
    """What the codec's aggregate path gives in process for these messages (round's seed)."""
    return make_codec(codec, seed=expected_seed(SEED, JOB, slot, rnd)).aggregate(
        list(msgs), RoundContext(length=d, workers=len(msgs), job=JOB))


def run_workers(port: int, cfg: JobConfig, msgs: list[list[Message]], **transport: object
                ) -> tuple[list[list[MessageResult]], list[dict[str, int]]]:
    """Every worker (a thread with its own Transport) exchanges its message of every use in order."""
    n = cfg.workers
    results: list[list[MessageResult | None]] = [[None] * n for _ in msgs]
    stats: list[dict[str, int]] = [{} for _ in range(n)]
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", port), deadline=8.0,
                                           **transport)) as tr:
                for u, row in enumerate(msgs):
                    results[u][w] = tr.exchange_message(row[w].payload, row[w].bits, tensor=u)
                stats[w] = tr.stats.as_dict()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a worker did not finish"
    assert not errors, errors
    return results, stats  # type: ignore[return-value]


def assert_exact(codec: str, cfg: JobConfig, msgs: list[list[Message]], results: list[list[MessageResult]]) -> None:
    for u, row in enumerate(msgs):
        want = oracle(codec, row, u % cfg.slots, u // cfg.slots)
        for w, got in enumerate(results[u]):
            assert got.contributors == cfg.workers, (u, w)
            assert got.bits == want.bits, (u, w, got.bits, want.bits)
            assert np.array_equal(got.payload, want.payload), f"use {u}, worker {w}: result bytes differ"


# -- over UDP with a real thc-aggregator -----------------------------------------------------------

@pytest.mark.parametrize("codec,workers,elems", [("topk10", 3, None), ("natural", 2, None), ("3lc", 3, 100)])
def test_result_equals_in_process_aggregate(codec: str, workers: int, elems: int | None) -> None:
    """4 uses over 2 slots (both banks, a second round per slot): every worker gets exactly the bytes
    and bits of codec.aggregate of the same messages, and the aggregator counts CPU time per round."""
    spec = dar_spec(codec, workers, elems=elems)
    cfg = parse_job_spec(spec)
    msgs = messages(codec, workers, uses=4)
    assert max(m.nbytes for row in msgs for m in row) > cfg.elems  # really fragmented
    with aggregator("--job", spec) as (_proc, port, ctrl):
        results, _ = run_workers(port, cfg, msgs)
        stats = json.loads(control(ctrl, "stats"))
    assert_exact(codec, cfg, msgs, results)
    assert stats["dar_completed"] == 4 and stats["dar_messages"] == 4 * workers
    assert stats["dar_cpu_ns"] > 0
    assert stats["bad_type"] == 0  # DAR_DATA never reached the switch state machine


def test_reliable_under_seeded_loss_is_exact() -> None:
    """10 % loss each way (seeded): the reliable policy retransmits and the results stay exact."""
    codec, workers = "natural", 3
    spec = dar_spec(codec, workers, elems=512)
    cfg = parse_job_spec(spec)
    msgs = messages(codec, workers, uses=4, seed=5)
    with aggregator("--job", spec) as (_proc, port, _ctrl):
        results, stats = run_workers(port, cfg, msgs, drop_up=0.1, drop_down=0.1, seed=9, timeout=0.03)
    assert_exact(codec, cfg, msgs, results)
    assert sum(s["dropped_up"] + s["dropped_down"] for s in stats) > 0
    assert sum(s["retransmissions"] for s in stats) > 0


def test_two_shards_and_metrics() -> None:
    """With --shards 2 each slot's fragments go to its shard's port; results stay exact, and the
    Prometheus endpoint exports the DAR counters, CPU time included."""
    codec, workers = "topk10", 2
    spec = dar_spec(codec, workers)
    cfg = parse_job_spec(spec)
    msgs = messages(codec, workers, uses=4, seed=4)
    metrics = free_tcp_port()
    with aggregator("--job", spec, "--shards", "2", "--metrics-port", str(metrics)) as (_proc, port, _ctrl):
        results, _ = run_workers(port, cfg, msgs, shards=2)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
    assert_exact(codec, cfg, msgs, results)
    completed = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("thc_aggregator_dar_completed_total")}
    assert completed == {'shard="0"': 2.0, 'shard="1"': 2.0}
    cpu = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("thc_aggregator_dar_cpu_ns_total")]
    assert len(cpu) == 2 and all(v > 0 for v in cpu)


def test_zero_fill_gives_up_and_silence_is_unreachable() -> None:
    """zero-fill: a use whose result never comes (the other worker is silent) is given up after the
    retries, empty and counted; with nothing answering at all, AggregatorUnreachable after the deadline."""
    codec = "topk10"
    spec = dar_spec(codec, 2)
    cfg = parse_job_spec(spec)
    (m0, _m1), = messages(codec, 2, uses=1)
    with aggregator("--job", spec) as (_proc, port, ctrl):
        with Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), loss_policy="zero-fill",
                                       retries=2, timeout=0.05)) as tr:
            got = tr.exchange_message(m0.payload, m0.bits)
            assert (got.payload.size, got.bits, got.contributors) == (0, 0, 0)
            assert tr.stats.lost_chunks == 1 and tr.stats.retransmissions == 2 * -(-m0.nbytes // cfg.elems)
        stats = json.loads(control(ctrl, "stats"))
    assert stats["dar_messages"] == 1 and stats["dar_completed"] == 0 and stats["dar_duplicate"] > 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        with Transport(TransportConfig(cfg, worker=0, aggregator=silent.getsockname(), deadline=0.3)) as tr, \
                pytest.raises(AggregatorUnreachable, match="no answer"):
            tr.exchange_message(m0.payload, m0.bits)


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hostile_packets(cfg: JobConfig) -> dict[str, list[bytes]]:
    """Fragments that are invalid on their own, by the counter each must land in."""
    base = {"type": PacketType.DAR_DATA, "job": cfg.job, "key": cfg.key, "worker": 0, "slot": 0, "round": 0,
            "width": 8}
    per = cfg.elems

    def frag(bits: int, frags: int, chunk: int, body: bytes, **over: int) -> bytes:
        fields = {**base, "chunk": chunk, "elems": len(body), **over}
        return Header(**fields).pack(np.array([bits, frags], ">u4").tobytes() + body)

    big = 8 * (cfg.max_message + 1)
    return {
        "short": [Header(**base).pack(b"")[:20], Header(**base).pack(b"\0\0\0")],
        "unknown_job": [frag(8, 1, 0, b"\1", job=cfg.job + 1)],
        "bad_key": [frag(8, 1, 0, b"\1", key=cfg.key ^ 1)],
        "bad_worker": [frag(8, 1, 0, b"\1", worker=cfg.workers)],
        "bad_slot": [frag(8, 1, 0, b"\1", slot=cfg.slots)],
        "bad_format": [frag(8, 1, 0, b"\1", width=4), frag(8 * 3 * per, 3, 0, b"\1" * 5)],
        "bad_prefix": [frag(big, -(-big // 8 // per), 0, b"\1" * per), frag(8, 2, 0, b"\1"), frag(8, 0, 0, b"\1")],
        "bad_fragment": [frag(8 * per, 1, 1, b"\1" * per), frag(8 * 2 * per, 2, 5, b"\1" * per)],
    }


def test_hostile_fragments_interleaved_change_nothing() -> None:
    """Malformed fragments sent before and between the workers' uses are counted by reason; the
    workers' results stay exactly the in-process aggregate and the server keeps running."""
    codec, workers = "topk10", 2
    spec = dar_spec(codec, workers)
    cfg = parse_job_spec(spec)
    msgs = messages(codec, workers, uses=4, seed=3)
    bad = hostile_packets(cfg)
    stop = threading.Event()
    sent = {"n": 0}

    with aggregator("--job", spec) as (proc, port, ctrl):
        def attacker() -> None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                while not stop.is_set():
                    for pkts in bad.values():
                        for p in pkts:
                            s.sendto(p, ("127.0.0.1", port))
                            sent["n"] += 1
                    stop.wait(0.002)

        t = threading.Thread(target=attacker)
        t.start()
        try:
            results, _ = run_workers(port, cfg, msgs)
        finally:
            stop.set()
            t.join(timeout=5)
        time.sleep(0.3)  # let the server drain what the attacker queued before reading its counters
        stats = json.loads(control(ctrl, "stats"))
        assert proc.poll() is None
    assert_exact(codec, cfg, msgs, results)
    rounds = sent["n"] // sum(len(v) for v in bad.values())
    assert rounds >= 1
    for reason, pkts in bad.items():
        assert stats[f"dar_{reason}"] >= rounds * len(pkts), (reason, stats)
    assert stats["dar_completed"] == 4 and stats["dar_inconsistent"] == 0


def test_config_errors_are_clear(tmp_path: Path) -> None:
    """Homomorphic or unknown codecs, missing sizes, dar keys on other kinds, and oversized buffers are
    refused with messages that say why; a TOML [[job]] and the CLI accept and refuse the same."""
    with pytest.raises(JobConfigError, match="codec 'thc' is homomorphic"):
        parse_job_spec("job=3,kind=dar,codec=thc,length=64,max_message=64")
    with pytest.raises(JobConfigError, match="codec 'terngrad' is homomorphic"):
        parse_job_spec("job=3,kind=dar,codec=terngrad,length=64,max_message=64")
    with pytest.raises(JobConfigError, match="unknown codec 'zip'"):
        parse_job_spec("job=3,kind=dar,codec=zip,length=64,max_message=64")
    with pytest.raises(JobConfigError, match="needs codec=NAME"):
        parse_job_spec("job=3,kind=dar,length=64,max_message=64")
    with pytest.raises(JobConfigError, match="needs max_message"):
        parse_job_spec("job=3,kind=dar,codec=topk10,length=64")
    with pytest.raises(JobConfigError, match="only for kind='dar'"):
        parse_job_spec("job=3,codec=topk10")
    with pytest.raises(JobConfigError, match="MiB limit"):
        parse_job_spec("job=3,kind=dar,codec=natural,length=1000000,max_message=100000000,slots=64")
    with pytest.raises(JobConfigError, match="elems"):
        parse_job_spec("job=3,kind=dar,codec=natural,length=64,max_message=64,elems=1500")
    path = tmp_path / "jobs.toml"
    path.write_text('[[job]]\njob = 4\nkind = "dar"\ncodec = "natural"\nlength = 64\nmax_message = 64\n'
                    "workers = 2\nslots = 2\n")
    (job,) = load_jobs(path)
    assert (job.kind, job.codec, job.length, job.max_message, job.elems, job.table_id) == \
        ("dar", "natural", 64, 64, 64, 0)
    r = subprocess.run([sys.executable, "-m", "aggregator.cli", "--port", "0", "--job",
                        "job=3,kind=dar,codec=thc,length=64,max_message=64"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "homomorphic" in r.stderr


# -- the state table in process ----------------------------------------------------------------------

def fragments(cfg: JobConfig, msg: Message, worker: int, slot: int = 0, rnd: int = 0,
              bits: int | None = None) -> list[bytes]:
    per = cfg.elems
    nbytes = msg.nbytes
    frags = fragment_count(nbytes, per)
    prefix = np.array([msg.bits if bits is None else bits, frags], ">u4").tobytes()
    return [Header(type=PacketType.DAR_DATA, job=cfg.job, key=cfg.key, worker=worker, slot=slot, round=rnd, chunk=k,
                   elems=min(per, nbytes - k * per), width=8)
            .pack(prefix + msg.payload[k * per:(k + 1) * per].tobytes()) for k in range(frags)]


def result_of(packets: list[tuple[bool, bytes]]) -> tuple[bytes, int, list[int], int]:
    """(message bytes, bits, fragment indices, contributors) of DAR_RESULT packets, in fragment order."""
    parsed = sorted((Header.parse(p) for _, p in packets), key=lambda hp: hp[0].chunk)
    assert all(h.type == PacketType.DAR_RESULT for h, _ in parsed)
    bits = int(np.frombuffer(parsed[0][1][:4], ">u4")[0])
    return b"".join(p[PREFIX:] for _, p in parsed), bits, [h.chunk for h, _ in parsed], parsed[0][0].contributors


def test_state_table_duplicates_inconsistent_retained_straggler_newer() -> None:
    """In process: duplicates and inconsistent totals add nothing; completion equals the oracle; a
    retransmitted fragment k of a complete round gets result fragments k, k + F_up, ... by unicast; a
    stale round gets a STRAGGLER with the slot's round; a newer round starts the bank over."""
    codec = "natural"
    cfg = parse_job_spec(dar_spec(codec, 2, slots=1, elems=300))
    agg = DarAggregator([cfg])
    (m0, m1), = messages(codec, 2, uses=1, seed=8)
    f0, f1 = fragments(cfg, m0, 0), fragments(cfg, m1, 1)
    assert len(f0) == 7
    out: list[tuple[bool, bytes]] = []
    for p in f0[:3]:
        out += agg.handle(p)
    out += agg.handle(f0[1])  # duplicate fragment
    wrong = fragments(cfg, m0, 0, bits=m0.bits - 8)[3]  # same worker, other totals
    out += agg.handle(wrong)
    for p in f0[3:] + f1:
        out += agg.handle(p)
    c = agg.counters
    assert c[DarCounter.DUPLICATE] == 1 and c[DarCounter.INCONSISTENT] == 1 and c[DarCounter.COMPLETED] == 1
    assert all(fan for fan, _ in out)
    payload, bits, chunks, contributors = result_of(out)
    want = oracle(codec, [m0, m1], 0, 0)
    assert (payload, bits, contributors) == (want.tobytes(), want.bits, 2)
    retained = agg.handle(f1[2])
    assert not any(fan for fan, _ in retained)
    assert result_of(retained)[2] == [k for k in range(len(chunks)) if k % len(f1) == 2]
    # Round 1 (newer) starts the bank of parity 1 over; then round 0 is stale only after round 2.
    for p in fragments(cfg, m1, 0, rnd=1)[:2] + fragments(cfg, m1, 0, rnd=2)[:1]:
        assert agg.handle(p) == []
    (straggler,) = agg.handle(f1[0])
    hdr, _ = Header.parse(straggler[1])
    assert hdr.type == PacketType.STRAGGLER and hdr.round == 2 and not straggler[0]
    assert c[DarCounter.NEW_ROUND] == 3 and c[DarCounter.STRAGGLER] == 1


def test_undecodable_message_is_counted_and_the_round_recovers() -> None:
    """A complete message the codec refuses (natural: exponent field 63) is discarded and counted; the
    server does not raise; the worker's valid message then completes the round exactly."""
    codec = "natural"
    cfg = parse_job_spec(dar_spec(codec, 2, slots=1))
    agg = DarAggregator([cfg])
    (m0, m1), = messages(codec, 2, uses=1, seed=2)
    corrupt = Message(np.full(m0.nbytes, 63, np.uint8), m0.bits)
    for p in fragments(cfg, m1, 1) + fragments(cfg, corrupt, 0):
        assert agg.handle(p) == []
    assert agg.counters[DarCounter.BAD_MESSAGE] == 1 and agg.counters[DarCounter.COMPLETED] == 0
    out = [x for p in fragments(cfg, m0, 0) for x in agg.handle(p)]
    payload, bits, _, _ = result_of(out)
    want = oracle(codec, [m0, m1], 0, 0)
    assert (payload, bits) == (want.tobytes(), want.bits)


def test_switch_state_machine_drops_dar_types_as_bad_type() -> None:
    """The reference state machine (what the P4 programs follow) drops DAR packets as bad_type."""
    cfg = JobConfig(job=1, workers=1, slots=4, elems=64)
    agg = Aggregator([cfg])
    for t in (PacketType.DAR_DATA, PacketType.DAR_RESULT):
        packet = Header(type=t, job=1, key=cfg.key, table_id=cfg.table_id, elems=1, width=8).pack(b"\0" * 9)
        assert agg.handle(packet) == []
    assert agg.counters[Counter.BAD_TYPE] == 2


def test_reference_state_machine_refuses_dar_jobs() -> None:
    """A DAR job handed to the switch state machine is refused, not served as an uncompressed job."""
    cfg = JobConfig(kind="dar", codec="topk10", length=1024, max_message=100_000)
    with pytest.raises(JobConfigError, match="not a switch job"):
        Aggregator([cfg])
