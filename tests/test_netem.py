"""The emulated network (topologies.netem): namespaces, shaping, random loss, multicast, cleanup, DDP across it.

Needs root (namespaces, veth, bridge, tc, nftables): every test but the first skips with the reason
otherwise. Traffic stays inside the namespaces the tests create; they are removed in all cases.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from topologies.netem import NetemConfig, NetemError, Topology, remove_prefix, require_root
from topologies.netem.ddp import ROOT

ROOT_REASON = require_root()
needs_root = pytest.mark.skipif(ROOT_REASON is not None, reason=f"emulated network: {ROOT_REASON}")
PROBE = [sys.executable, "-m", "topologies.netem.probe"]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _measure(net: Topology, receiver: str, recv_args: list[str], sender: str, send_args: list[str]) -> dict:
    rx = net.popen(receiver, [*PROBE, "recv", *recv_args, "--idle", "0.5"], stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "ready"
    subprocess.run(net.command(sender, [*PROBE, "send", *send_args]), check=True, capture_output=True, timeout=60)
    return json.loads(rx.communicate(timeout=60)[0])


def test_without_root_the_reason_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not root: require_root names what is missing and up() refuses with it (nothing is created)."""
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    reason = require_root()
    assert reason is not None and "root" in reason
    with pytest.raises(NetemError, match="need root"):
        Topology(NetemConfig(workers=1, prefix="thcnr")).up()


def test_config_errors() -> None:
    """Bad settings fail at configuration with a message."""
    with pytest.raises(ValueError, match="unknown node"):
        NetemConfig(workers=2, loss_percent={"w5": 1})
    with pytest.raises(ValueError, match="percentage"):
        NetemConfig(workers=2, loss_percent={"w1": 100})
    with pytest.raises(ValueError, match="too long"):
        NetemConfig(prefix="x" * 11)


@pytest.mark.alone  # measures a rate
@needs_root
@pytest.mark.parametrize("qdisc", ["tbf", "htb"])
def test_links_are_shaped(qdisc: str) -> None:
    """An unpaced UDP sender in w0 gets the configured rate to agg (within 60-110 %), not more."""
    rate = 40.0
    with Topology(NetemConfig(workers=1, rate_mbit=rate, qdisc=qdisc, prefix="thcts")) as net:
        agg = net.address("agg")
        got = _measure(net, "agg", ["--bind", f"{agg}:9000"], "w0", ["--to", f"{agg}:9000", "--seconds", "1"])
    assert 0.6 * rate < got["mbit_s"] < 1.1 * rate, got


@needs_root
def test_random_loss_and_multicast() -> None:
    """20 % UDP loss on w1's link drops about 20 % of its datagrams (counted by the rules); w0's link, listed
    with 0 % (the rules a lossless baseline passes), loses nothing; a datagram multicast by agg reaches every
    worker."""
    cfg = NetemConfig(workers=2, rate_mbit=100, loss_percent={"w1": 20, "w0": 0}, loss_method="nftables",
                      loss_udp_only=True, prefix="thctl")
    with Topology(cfg) as net:
        agg = net.address("agg")
        lossy = _measure(net, "agg", ["--bind", f"{agg}:9001"], "w1",
                         ["--to", f"{agg}:9001", "--count", "2000", "--pps", "2000"])
        clean = _measure(net, "agg", ["--bind", f"{agg}:9002"], "w0",
                         ["--to", f"{agg}:9002", "--count", "500", "--pps", "2000"])
        drops = net.counters()
        rx = [net.popen(w, [*PROBE, "recv", "--bind", f"{net.address(w)}:9500", "--group", "239.7.7.7", "--idle",
                            "0.5"], stdout=subprocess.PIPE, text=True) for w in ("w0", "w1")]
        for r in rx:
            assert r.stdout.readline().strip() == "ready"
        send = [*PROBE, "send", "--to", "239.7.7.7:9500", "--count", "100", "--pps", "1000"]
        subprocess.run(net.command("agg", send), check=True, capture_output=True, timeout=60)
        mcast = [json.loads(r.communicate(timeout=60)[0]) for r in rx]
        # where br_netfilter is loaded, the bridge's frames skip its IP hooks (the rules are nftables' bridge family)
        knobs = [subprocess.run(["ip", "netns", "exec", net.bridge_ns, "cat", f"/proc/sys/net/bridge/bridge-nf-call-{n}"
                                 ], capture_output=True, text=True) for n in ("iptables", "ip6tables", "arptables")]
    assert all(k.returncode != 0 or k.stdout.strip() == "0" for k in knobs), [k.stdout for k in knobs]
    assert 1400 < lossy["packets"] < 1800, lossy
    assert drops["w1 up"] == 2000 - lossy["packets"]
    assert clean["packets"] == 500 and drops["w0 up"] == 0
    assert mcast[0]["packets"] == 100 and 65 < mcast[1]["packets"] < 95  # w1's downlink loses 20 % too


@needs_root
def test_loss_changes_on_running_links() -> None:
    """set_loss turns w0's 0 % into 50 % and back on the running topology: the same sender loses about half
    its datagrams in between, none before or after; nodes not built with loss are refused."""
    cfg = NetemConfig(workers=1, rate_mbit=100, loss_percent={"w0": 0}, loss_method="nftables",
                      loss_udp_only=True, prefix="thcsl")
    with Topology(cfg) as net:
        agg = net.address("agg")

        def received(port: int) -> int:
            return _measure(net, "agg", ["--bind", f"{agg}:{port}"], "w0",
                            ["--to", f"{agg}:{port}", "--count", "1000", "--pps", "4000"])["packets"]

        before = received(9011)
        net.set_loss({"w0": 50})
        halved = received(9012)
        net.set_loss({"w0": 0})
        after = received(9013)
        with pytest.raises(NetemError, match="exactly the nodes built with loss"):
            net.set_loss({"w0": 1, "agg": 1})
    assert before == after == 1000
    assert 350 < halved < 650, halved


GSO_SENDER = """
import socket, struct, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for run in range(20):
    buf = b"".join(bytes([run]) * 100 for _ in range(64))
    s.sendmsg([buf], [(socket.IPPROTO_UDP, 103, struct.pack("=H", 100))], 0, (sys.argv[1], 9003))
    time.sleep(0.01)
"""
GSO_RECEIVER = """
import collections, json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9003))
s.settimeout(5.0)
print("ready", flush=True)
runs = collections.Counter()
try:
    while True:
        runs[s.recv(65536)[0]] += 1
        s.settimeout(1.0)
except TimeoutError:
    pass
print(json.dumps([runs[r] for r in range(20)]))
"""


@needs_root
@pytest.mark.parametrize("sender, receiver", [("w0", "agg"), ("agg", "w0")])
def test_loss_is_per_frame_under_segmentation_offload(sender: str, receiver: str) -> None:
    """GSO runs (one UDP_SEGMENT send of 64 datagrams) to or from a lossy node lose single frames, as on a
    wire, not whole runs: 50 % loss delivers part of most runs (a whole-run drop would deliver 0 or 64).
    Both ways: workers send their windows so, and the aggregator its answers."""
    cfg = NetemConfig(workers=1, rate_mbit=100, loss_percent={"w0": 50}, loss_method="nftables",
                      loss_udp_only=True, prefix="thcgs")
    with Topology(cfg) as net:
        to = net.address(receiver)
        rx = net.popen(receiver, [sys.executable, "-c", GSO_RECEIVER, to], stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        subprocess.run(net.command(sender, [sys.executable, "-c", GSO_SENDER, to]), check=True, timeout=60)
        per_run = json.loads(rx.communicate(timeout=60)[0])
    assert 0.35 < sum(per_run) / (20 * 64) < 0.65, per_run
    assert sum(0 < k < 64 for k in per_run) >= 15, per_run


@needs_root
def test_everything_is_removed() -> None:
    """Namespaces go away after the block, after an exception inside it, and after a failed up()."""
    cfg = NetemConfig(workers=2, rate_mbit=10, prefix="thctc")
    with Topology(cfg) as net:
        made = set(net.namespaces())
        assert made <= _namespaces() and len(made) == 4
    assert not made & _namespaces()
    with pytest.raises(RuntimeError, match="boom"), Topology(cfg) as net:
        raise RuntimeError("boom")
    assert not made & _namespaces()
    # A clash with a namespace of the same name: up() refuses, and removes what it made (nothing of the other's).
    subprocess.run(["ip", "netns", "add", "thctc-w1"], check=True)
    try:
        with pytest.raises(NetemError, match="already exist"):
            Topology(cfg).up()
        assert _namespaces() & made == {"thctc-w1"}
    finally:
        subprocess.run(["ip", "netns", "del", "thctc-w1"], check=True)


#: A program holding the cheapest topology (one worker, no aggregator, unshaped: two namespaces) with a
#: process inside it; it prints that process's pid, then waits to be signalled.
_HOLD = """
import sys, time
from topologies.netem import NetemConfig, Topology
with Topology(NetemConfig(workers=1, rate_mbit=None, aggregator=False, prefix=sys.argv[1])) as net:
    inside = net.popen("w0", ["sleep", "120"])
    print(inside.pid, flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _ip_netns_problem() -> str | None:
    """Why ``ip netns`` cannot list namespaces here (None if it can)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"ip netns list failed: {r.stderr.strip()}"


@needs_root
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_removes_the_topology(signum: signal.Signals, tmp_path: Path) -> None:
    """SIGTERM or SIGHUP to a program inside ``with Topology(...)``: the namespaces and the processes in them
    are removed before it exits, promptly, with status 128 + the signal and one line saying why (before,
    the signal's default action ended it at once and left them all behind)."""
    if (why := _ip_netns_problem()) is not None:
        pytest.skip(f"emulated network: {why}")
    prefix = f"thc{signum.name[3]}{os.getpid() % 100000}".lower()  # thct<pid> / thch<pid>: this run's alone
    names = {f"{prefix}-br", f"{prefix}-w0"}
    inside = None
    with (tmp_path / "stderr").open("w+") as err:  # a file: the process inside, if it survives, holds it open
        child = subprocess.Popen([sys.executable, "-c", _HOLD, prefix], stdout=subprocess.PIPE, stderr=err,
                                 text=True, cwd=ROOT)

        def said() -> str:
            err.seek(0)
            return err.read()

        try:
            ready, _, _ = select.select([child.stdout], [], [], 15)
            line = child.stdout.readline() if ready else ""
            assert line.strip().isdigit(), f"the topology did not come up: {line!r} {said()}"
            inside = int(line)
            assert names <= _namespaces() and _alive(inside)
            t0 = time.monotonic()
            child.send_signal(signum)
            child.wait(timeout=15)
            took = time.monotonic() - t0
            text = said()
            assert child.returncode == 128 + signum, (child.returncode, text)
            assert "Traceback" not in text and text.strip().splitlines() == [
                f"topologies.netem: {signum.name}: stopping; removing the emulated network {prefix}-*"], text
            assert not names & _namespaces()
            assert not _alive(inside)
            assert took < 10, took
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)
            if inside is not None and _alive(inside):
                os.kill(inside, signal.SIGKILL)
            remove_prefix(prefix)


@needs_root
def test_ddp_across_namespaces_multicast_and_loss(tmp_path: Path) -> None:
    """train_ddp.py with torchrun --nnodes 2 (one namespace per node, unchanged), the aggregator in its own
    namespace sending results by IP multicast, 5 % loss on w1's link: parameters identical after every step."""
    from topologies.netem.ddp import run_training, start_aggregator
    from worker_lib.job import JobConfig

    group = "239.9.9.9:9600"
    cfg = NetemConfig(workers=2, rate_mbit=200, loss_percent={"w1": 5}, prefix="thctd")
    with Topology(cfg) as net:
        start_aggregator(net, [JobConfig(job=3, workers=2, multicast=group)], multicast=True)
        res = run_training(net, ["--steps", "6", "--compression", "thc", "--job-id", "3", "--aggregator",
                                 f"{net.address('agg')}:9451", "--multicast", group, "--timeout", "0.02",
                                 "--width", "256", "--check-every-step", "--deadline", "20",
                                 "--json-out", str(tmp_path / "s.json")],
                           timeout=150)
    text = "\n".join(r.output for r in res)
    assert [r.returncode for r in res] == [0, 0], text[-4000:]
    assert "identical parameters on all ranks: True" in res[0].output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["identical_every_step"] == [True] * 6
    for hook in summary["hook"]:  # results came by multicast; w1's lost packets were retransmitted
        assert hook["transport_multicast_results"] > 0 and hook["lost_chunks"] == 0
    assert summary["hook"][1]["transport_retransmissions"] > 0


@needs_root
def test_the_ddp_benchmark_reads_the_answers_sent_again_at_each_loss_switch(tmp_path: Path) -> None:
    """benchmarks.ddp_netem with loss phases (10 %, switched every 0.3 s): the aggregator's answers sent again
    are read from its control socket at every switch, never fall, and grow while the loss is on; an answer
    (8-bit results of two workers) is about twice a request (4-bit indices) with the same 60 bytes of headers;
    the report prints their time and count per lossy step. Without tail duplicates: this model's exchanges are
    short, a quarter of each is duplicated, and the last worker's copies are answered again in every step,
    lossless or not, so that what loss adds came out below zero (-1 answer per step)."""
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.ddp_netem", "--rates", "200", "--modes", "thc",
                          "--width", "256", "--steps", "40", "--warmup", "2", "--loss", "0,10", "--loss-udp-only",
                          "--loss-phases", "0.3", "--tail-duplicates", "0", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    row = json.loads(out.read_text())[0]
    readings = [sw["answers_resent"] for sw in row["switches"]]
    assert readings == sorted(readings), readings
    grew = [b - a for a, b, sw in zip(readings, readings[1:], row["switches"], strict=False) if sw["lossy"]]
    assert max(grew) > 0, readings
    assert row["answer_bytes"] - 60 == pytest.approx(2 * (row["datagram_bytes"] - 60), rel=0.02), row
    line = res.stdout.strip().splitlines()[-1].split("|")[0].split()
    assert line[:3] == ["200", "10", "thc"] and line[-2].startswith("(") and float(line[-3]) > 0, line


@needs_root
def test_two_aggregators_in_two_namespaces_share_a_job() -> None:
    """Two aggregators on two hosts (the agg namespace, member 0/2, and w2's, member 1/2) serve one job of
    two workers over 1 Gbit/s links with 2 % loss each way on the workers' links: every worker gets the
    table sums of both workers' indices for every chunk (a slot sent to the wrong member would be
    dropped as wrong_shard and its chunk never answered)."""
    import numpy as np

    from topologies.netem.ddp import start_aggregator
    from topologies.worker import worker_indices
    from worker_lib.job import JobConfig
    from worker_lib.thc import lookup_sum

    job = JobConfig(job=4, workers=2, slots=32)
    chunks = 64
    cfg = NetemConfig(workers=3, rate_mbit=1000, loss_method="nftables", prefix="thcma",
                      loss_percent={"w0": 2, "w1": 2})
    with Topology(cfg) as net:
        start_aggregator(net, [job], extra=("--member", "0/2"))
        start_aggregator(net, [job], extra=("--member", "1/2"), node="w2")
        members = f"{net.address('agg')}:9451,{net.address('w2')}:9451"
        procs = [net.popen(f"w{w}", [sys.executable, "-m", "topologies.worker", "--job", job.spec(), "--worker",
                                     str(w), "--aggregator", members, "--chunks", str(chunks), "--seed", "5",
                                     "--timeout", "0.05", "--deadline", "30"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
                 for w in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        dropped = sum(net.counters().values())
    assert [p.returncode for p in procs] == [0, 0], [e[-500:] for _, e in outs]
    idx = np.stack([worker_indices(5, w, chunks, job.elems, job.bits) for w in range(2)])
    want = lookup_sum(np.array(job.lookup.values), idx.reshape(2, -1)).reshape(chunks, job.elems)
    for out, _ in outs:
        r = json.loads(out)
        assert np.array_equal(np.array(r["sums"]), want) and not any(r["lost"])
    assert dropped > 0  # the loss rules dropped frames, and the transport recovered


@needs_root
def test_ddp_across_namespaces_rank0_starts_the_aggregator(tmp_path: Path) -> None:
    """No --aggregator on two nodes: rank 0 starts thc-aggregator on its address towards the rendezvous host
    (not loopback) and the other node learns it through the torch.distributed store."""
    from topologies.netem.ddp import run_training

    with Topology(NetemConfig(workers=2, rate_mbit=200, aggregator=False, prefix="thctr")) as net:
        res = run_training(net, ["--steps", "4", "--compression", "thc", "--check-every-step",
                                 "--json-out", str(tmp_path / "s.json")], timeout=150)
        w0 = net.address("w0")
    assert [r.returncode for r in res] == [0, 0], "\n".join(r.output for r in res)[-4000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["aggregator"][0] == w0 and summary["identical_every_step"] == [True] * 4
    assert all(h["transport_results"] > 0 for h in summary["hook"])
