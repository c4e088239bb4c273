"""DDP step time on an emulated network: THC vs the aggregator's int32 job vs gloo all_reduce (not a timed test).

Every worker and the aggregator run in their own network namespace (topologies.netem), every link
shaped by tc tbf to each ``--rates`` value; each worker is one torchrun node running
examples/train_ddp.py unchanged (``--nnodes N``). For each rate it runs

- ``thc``           THC 4-bit indices through ``thc-aggregator`` (results by unicast fan-out),
- ``thc-mcast``     the same with results by IP multicast,
- ``int32``         the aggregator's uncompressed job (int32 fixed point, SwitchML style), unicast,
- ``int32-mcast``   the same by multicast,
- ``gloo``          ordinary DDP: gloo's all_reduce over TCP,

and prints per-step time, training throughput (samples/s), the ratio to gloo, and where the time
goes: forward, backward (which waits for the exchange), the hook's encode / network / decode time,
the aggregator's CPU time per step, and the time the bytes need on the link at that rate. With
``--plot`` it draws throughput against link bandwidth (like Figure 6 of the THC paper). Each repeat
builds the links afresh and runs every mode on them; a mode's ratio to gloo is taken against gloo's run
on the same links, and with ``--repeats`` above 1 the report adds the median and range of those ratios.

    sudo .venv/bin/python -m benchmarks.ddp_netem --rates 1000,10000 --steps 6 --plot ddp_netem.png  # repo root

With ``--loss 0,1`` it compares lossless and 1 % lossy links, by separate runs, or with ``--loss-phases
SECONDS`` within each run (``benchmarks.loss_phases``: the loss switches every SECONDS; the figure that
settles whether a lossy step costs more than its resent bytes' wire time on a machine whose load drifts).
``--busy-neighbour`` runs every mode beside one CPU-bound process, as on a machine that is not quiet.

Needs root (exits with the reason otherwise). All namespaces, the processes in them and the temporary
files are removed at the end, also on errors, Ctrl-C, SIGTERM and SIGHUP (then the exit status is 128 +
the signal's number, as if it had killed the process).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aggregator.control import ControlAddress, send_command
from benchmarks.loss_phases import LossPhases, compare_phases
from launchers.neighbour import busy_neighbour
from topologies.netem import ExitOnSignals, NetemConfig, NetemError, Topology, require_root
from topologies.netem.ddp import run_training, start_aggregator
from worker_lib.cli.args import DDP_ROTATION, ROTATIONS, comma_list, float_in, int_in
from worker_lib.job import IP_UDP_OVERHEAD, JobConfig, JobConfigError
from worker_lib.pacing import TAIL_DUPLICATES
from worker_lib.wire.layout import HEADER_BYTES, MAX_MTU

MODES = ("thc", "thc-mcast", "int32", "int32-mcast", "gloo")
GROUP = "239.5.5.5:9700"


@dataclass(frozen=True)
class Run:
    """One measured configuration."""

    rate_mbit: float
    mode: str
    loss: float = 0.0


def model_args(args: argparse.Namespace) -> list[str]:
    return ["--width", str(args.width), "--layers", str(args.layers), "--in-features", str(args.in_features),
            "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--lr", "0.01", "--deadline", "60", "--mtu", str(args.mtu), "--timeout", str(args.timeout),
            "--slots", str(args.slots), "--gro" if args.gro else "--no-gro", "--tail-duplicates",
            str(args.tail_duplicates)]


def elems_for(job_kind: str, args: argparse.Namespace) -> int | None:
    """K of a job: ``--elems`` where its results fit the MTU, else the most that fit (None: the job's default)."""
    if args.elems is None:
        return None
    per = JobConfig(job=1, workers=args.workers, kind=job_kind, mtu=args.mtu).result_bits // 8
    return min(args.elems, (args.mtu - IP_UDP_OVERHEAD - HEADER_BYTES) // per // 8 * 8)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its reaped children) in seconds, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(net: Topology, run: Run, job: int, args: argparse.Namespace, agg_pid: int | None,
            tmp: Path) -> dict:
    out = tmp / f"{run.mode}-{run.rate_mbit:g}.json"
    extra: list[str] = ["--compression", "none"]
    if run.mode != "gloo":
        k = elems_for(kind(run.mode), args)
        extra = ["--compression", kind(run.mode), "--job-id", str(job), "--aggregator", f"{net.address('agg')}:9451",
                 *(["--elems", str(k)] if k else [])]
        if run.mode.endswith("mcast"):
            extra += ["--multicast", GROUP]
        if kind(run.mode) == "thc":
            extra += ["--rotation", args.rotation]
    cpu0 = cpu_seconds(agg_pid) if agg_pid else 0.0
    t0 = time.perf_counter()
    res = run_training(net, [*model_args(args), *extra, "--json-out", str(out)], timeout=args.run_timeout,
                       master_port=29500 + job)
    wall = time.perf_counter() - t0
    agg_cpu = (cpu_seconds(agg_pid) - cpu0) if agg_pid else 0.0
    bad = [r for r in res if r.returncode != 0]
    if bad or not out.exists():
        tail = "\n".join(f"--- {r.node} (exit {r.returncode})\n{r.output[-2500:]}" for r in (bad or res))
        raise RuntimeError(f"{run.mode} at {run.rate_mbit:g} Mbit/s failed:\n{tail}")
    s = json.loads(out.read_text())
    hook = s["hook"][0]
    steps = s["steps"]
    per = hook.get("per_timed_step", {})  # the hook's counters over the timed steps, per step
    per = {k: per.get(k, 0.0) for k in ("encode_s", "network_s", "decode_s", "cpu_s", "wait_s", "bytes_sent")}
    sent = per["bytes_sent"]  # payload bytes one worker sends per step
    down = down_bytes(sent, run.mode, args)  # payload bytes the aggregator's link carries per step
    return {"rate_mbit": run.rate_mbit, "mode": run.mode, "loss": run.loss, "workers": s["world_size"],
            "parameters": s["parameters"], "steps": steps,
            "step_s": s["step_s"], "forward_s": s["forward_s"], "backward_s": s["backward_s"],
            "optimizer_s": s["optimizer_s"], "samples_per_s": s["world_size"] * args.batch_size / s["step_s"],
            "hook_encode_s": per["encode_s"], "hook_network_s": per["network_s"], "hook_decode_s": per["decode_s"],
            "payload_bytes_up": sent, "link_up_s": sent * 8 / (run.rate_mbit * 1e6),
            "payload_bytes_down": down, "link_down_s": down * 8 / (run.rate_mbit * 1e6),
            "aggregator_cpu_s": agg_cpu / steps, "identical": s["identical"], "final_loss": s["final_loss"],
            "retransmissions": hook.get("transport_retransmissions", 0), "mtu": args.mtu, "wall_s": wall,
            "retransmissions_all": sum(h.get("transport_retransmissions", 0) for h in s["hook"] if h),
            "datagram_bytes": datagram_bytes(hook), "answer_bytes": answer_bytes(hook, run.mode, args),
            "early_retransmissions": hook.get("transport_early_retransmissions", 0),
            "slot_bound_s": hook.get("transport_slot_bound_s", 0.0) / steps,
            "window_bound_s": hook.get("transport_window_bound_s", 0.0) / steps,
            "tail_s": hook.get("transport_tail_s", 0.0) / steps, "step_marks": s.get("step_marks", []),
            "worker_cpu_s": hook.get("process_cpu_s", 0.0), "hook_cpu_s": per["cpu_s"],
            "hook_wait_s": per["wait_s"],
            "transport": {k[len("transport_"):]: v for k, v in hook.items() if k.startswith("transport_")},
            "datagrams_per_batch": hook.get("transport_datagrams_received", 0) / max(1, hook.get(
                "transport_receive_batches", 0))}


def down_bytes(sent: float, mode: str, args: argparse.Namespace) -> float:
    """Result payload bytes the aggregator's own link carries per step, given one worker's DATA payload
    ``sent``: every element comes back at the job's result width, once per worker by unicast fan-out,
    once in all by multicast (the bridge copies it). 0 for gloo."""
    if mode == "gloo":
        return 0.0
    job = JobConfig(job=1, workers=args.workers, kind=kind(mode), mtu=args.mtu)
    up_bits = job.bits if job.kind == "thc" else 32
    copies = 1 if mode.endswith("mcast") else args.workers
    return sent / up_bits * job.result_bits * copies


def kind(mode: str) -> str:
    return "thc" if mode.startswith("thc") else "uncompressed"


def job_configs(args: argparse.Namespace) -> list[JobConfig]:
    """The aggregator's jobs, one per mode other than gloo (ids 10, 11, ... in ``--modes`` order)."""
    modes = [m for m in args.modes if m != "gloo"]
    return [JobConfig(job=10 + i, workers=args.workers, kind=kind(m), multicast=GROUP if m.endswith("mcast") else None,
                      mtu=args.mtu, elems=elems_for(kind(m), args), slots=args.slots) for i, m in enumerate(modes)]


def answers_resent(control: Path) -> float:
    """The answers the aggregator listening for control on ``control`` has sent again so far from retained
    results (its ``retained`` counters, one tier and DAR): each answers a worker's resend of a complete use.
    nan, with a warning, where it does not answer (the verdict then counts the resent requests alone)."""
    try:
        totals = json.loads(send_command(ControlAddress(path=str(control)), "stats"))
        return float(totals["retained"] + totals.get("dar_retained", 0))
    except (OSError, ValueError, KeyError) as exc:  # TimeoutError is an OSError
        print(f"warning: no counters from the aggregator's control socket {control}: {exc!r}", file=sys.stderr)
        return math.nan


def answer_bytes(hook: dict, mode: str, args: argparse.Namespace) -> float:
    """Mean bytes of an answer to one of a THC rank's datagrams, with their THC, UDP and IP headers: its
    payload at the job's result width (the size of an answer the aggregator sends again); 0 for gloo."""
    request = datagram_bytes(hook)
    if mode == "gloo" or not request:
        return 0.0
    payload = request - HEADER_BYTES - IP_UDP_OVERHEAD
    return down_bytes(payload, mode, args) / (1 if mode.endswith("mcast") else args.workers) \
        + HEADER_BYTES + IP_UDP_OVERHEAD


def datagram_bytes(hook: dict) -> float:
    """Mean bytes of the datagrams a THC rank sent, with their THC, UDP and IP headers (the size of what it
    resends); 0 without the hook's counters (gloo)."""
    first = hook.get("transport_packets_sent", 0) - hook.get("transport_retransmissions", 0)
    return hook["bytes_sent"] / first + HEADER_BYTES + IP_UDP_OVERHEAD if first > 0 and "bytes_sent" in hook else 0.0


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every rate x loss x mode, ``--repeats`` times, loss rates interleaved (a fresh topology each). With
    ``--loss-phases``, one run per rate, mode and repeat, its loss alternating between 0 and ``--loss``'s
    other value (``benchmarks.loss_phases``)."""
    rows = []
    losses = [max(args.loss)] if args.loss_phases else args.loss
    with tempfile.TemporaryDirectory(prefix="ddp-netem-") as tmpd, busy_neighbour(args.busy_neighbour):
        tmp = Path(tmpd)
        for rate, k, pct in ((r, k, x) for r in args.rates for k in range(args.repeats) for x in losses):
            # with any lossy rate, the lossless runs pass the same loss rules dropping nothing (their CPU)
            rules = any(args.loss) or args.loss_phases  # (the phases start lossless and switch the rules)
            loss = {f"w{i}": 0.0 if args.loss_phases else pct for i in range(args.workers)} if rules else {}
            cfg = NetemConfig(workers=args.workers, rate_mbit=rate, qdisc=args.qdisc, loss_percent=loss,
                              loss_udp_only=args.loss_udp_only, prefix="thcbench", mtu=args.mtu)
            with Topology(cfg) as net:
                modes = [m for m in args.modes if m != "gloo"]
                jobs = {m: 10 + i for i, m in enumerate(modes)}
                agg = None
                control = tmp / f"aggregator-{rate:g}-{k}-{pct:g}.sock"  # its counters, read at each loss switch
                if jobs:
                    agg = start_aggregator(net, job_configs(args), multicast=any(m.endswith("mcast") for m in modes),
                                           extra=["--gro" if args.gro else "--no-gro", "--control", str(control)])
                for mode in args.modes:
                    cpu = (lambda pid=agg.pid: cpu_seconds(pid)) if agg else None
                    answers = (lambda path=control: answers_resent(path)) if agg else None
                    with LossPhases(net, pct, args.loss_phases, cpu, answers) if args.loss_phases else \
                            contextlib.nullcontext() as phases:
                        row = measure(net, Run(rate, mode, pct), jobs.get(mode, 9), args, agg.pid if agg else None,
                                      tmp)
                    row["switches"] = phases.switches if phases else []
                    row["repeat"] = k
                    row["busy_neighbour"] = args.busy_neighbour
                    rows.append(row)
                    print(f"  {rate:>7g} Mbit/s {pct:g} % loss {mode:<12} step {row['step_s'] * 1e3:8.1f} ms  "
                          f"{row['samples_per_s']:8.1f} samples/s  (wall {row['wall_s']:.0f} s)", flush=True)
    return rows


def _run_of(row: dict) -> tuple[float, float, int]:
    return row["rate_mbit"], row["loss"], row.get("repeat", 0)


def gloo_steps(rows: list[dict]) -> dict[tuple[float, float, int], float]:
    """gloo's step time per run (rate, loss, repeat)."""
    return {_run_of(r): r["step_s"] for r in rows if r["mode"] == "gloo"}


def against_gloo(rows: list[dict]) -> dict[tuple[float, float, str], list[float]]:
    """Each run's step over gloo's in the same topology (same rate, loss and repeat: the modes of one
    repeat run one after the other on the same links, minutes apart at most), by (rate, loss, mode).
    Pairing by run keeps the machine's drift out of the ratio: on a shared machine the same code's step
    moves by a fifth from one quarter hour to the next."""
    gloo = gloo_steps(rows)
    out: dict[tuple[float, float, str], list[float]] = {}
    for r in rows:
        if r["mode"] != "gloo" and _run_of(r) in gloo:
            out.setdefault((r["rate_mbit"], r["loss"], r["mode"]), []).append(r["step_s"] / gloo[_run_of(r)])
    return out


def report(rows: list[dict]) -> None:
    gloo = gloo_steps(rows)
    beside = ", beside a busy neighbour process" if rows[0].get("busy_neighbour") else ""
    print(f"\nDDP on an emulated network: {rows[0]['workers']} workers, {rows[0]['parameters']:,} parameters, "
          f"each node and the aggregator in its own namespace, links shaped by tc (both directions){beside}")
    print(f"{'rate':>8} {'loss':>5} {'mode':<12} {'step ms':>8} {'x gloo':>7} {'samples/s':>9} | {'fwd':>6} {'bwd':>7} "
          f"{'encode':>7} {'network':>8} {'decode':>7} {'agg cpu':>8} {'wrk cpu':>8} {'wait':>5} {'link up':>8} "
          f"{'link dn':>8} {'MB up':>6} {'retx':>5} same")
    for r in rows:
        ratio = gloo.get(_run_of(r))
        print(f"{r['rate_mbit']:>8g} {r['loss']:>5g} {r['mode']:<12} {r['step_s'] * 1e3:8.1f} "
              f"{(r['step_s'] / ratio if ratio else float('nan')):7.2f} {r['samples_per_s']:9.1f} | "
              f"{r['forward_s'] * 1e3:6.1f} {r['backward_s'] * 1e3:7.1f} {r['hook_encode_s'] * 1e3:7.1f} "
              f"{r['hook_network_s'] * 1e3:8.1f} {r['hook_decode_s'] * 1e3:7.1f} {r['aggregator_cpu_s'] * 1e3:8.1f} "
              f"{r['worker_cpu_s'] * 1e3:8.1f} {r['hook_wait_s'] * 1e3:5.1f} "
              f"{r['link_up_s'] * 1e3:8.1f} {r['link_down_s'] * 1e3:8.1f} "
              f"{r['payload_bytes_up'] / 1e6:6.2f} {r['retransmissions']:>5} {r['identical']}")
    print("(ms per step; 'x gloo' = step time / gloo's on the same links (same rate, loss and repeat); fwd/bwd "
          "from the training loop, backward includes waiting for the exchange; encode/network/decode: the hook's "
          "thread (THC quantizes beside its data exchange: in network); agg cpu: aggregator CPU time per step; "
          "wrk cpu: rank 0's process CPU time per step (all its threads); wait: the time per step its hook's "
          "thread was ready to run but had no CPU (nan where the kernel does not say); link up: one worker's DATA "
          "payload at the link rate; link dn: the results on the aggregator's link at that rate (n copies by "
          "unicast, one by multicast): the step's wire floor is the larger of the two. gloo's traffic is not counted.)")
    ratio_report(rows)
    loss_report(rows)


def ratio_report(rows: list[dict]) -> None:
    """With more than one repeat: per rate, loss and mode, the median of the runs' ratios to gloo's step in
    the same topology, and their range."""
    pairs = against_gloo(rows)
    if not any(len(v) > 1 for v in pairs.values()):
        return
    print("\nx gloo over the repeats (each run against gloo's run on the same links; median and range)")
    print(f"{'rate':>8} {'loss':>5} {'mode':<12} {'runs':>4} {'median':>7} {'min':>6} {'max':>6}")
    for (rate, pct, mode), ratios in sorted(pairs.items()):
        print(f"{rate:>8g} {pct:>5g} {mode:<12} {len(ratios):>4} {statistics.median(ratios):7.2f} "
              f"{min(ratios):6.2f} {max(ratios):6.2f}")


def loss_report(rows: list[dict]) -> None:
    """Per rate and mode, each loss rate's median step against the lossless median, and what the resent
    datagrams need on the link (issue 15's target: the step grows by no more than that)."""
    lossless = {(r["rate_mbit"], r["mode"]): [] for r in rows if r["loss"] == 0}
    for r in rows:
        if r["loss"] == 0:
            lossless[r["rate_mbit"], r["mode"]].append(r)
    lossy = sorted({(r["rate_mbit"], r["mode"], r["loss"]) for r in rows if r["loss"] and
                    (r["rate_mbit"], r["mode"]) in lossless})
    if not lossy:
        return
    print("\nloss against lossless (medians over the repeats; resent: all workers' retransmitted datagrams per "
          "step, at their mean size with IP and UDP headers, at the link rate (they all cross the aggregator's "
          "link); noise: the interquartile range of the lossless steps, their max - min below 4 repeats; where "
          "the extra goes, lossy minus lossless per step: tail, an exchange's time after its last new use, "
          "recovering its last losses; slots, sending stopped behind the oldest unanswered use's slot)")
    print(f"{'rate':>8} {'loss':>5} {'mode':<12} {'lossless':>9} {'lossy':>9} {'extra ms':>9} {'resent ms':>10} "
          f"{'noise ms':>9} met {'tail ms':>8} {'slots ms':>9}")
    for rate, mode, pct in lossy:
        steps = [r["step_s"] for r in lossless[rate, mode]]
        base = statistics.median(steps)
        if len(steps) >= 4:
            q = statistics.quantiles(steps, n=4)
            noise = q[2] - q[0]
        else:
            noise = max(steps) - min(steps)
        same = [r for r in rows if (r["rate_mbit"], r["mode"], r["loss"]) == (rate, mode, pct)]
        step = statistics.median(r["step_s"] for r in same)
        resent = statistics.median(r["retransmissions_all"] / r["steps"] * r["datagram_bytes"] * 8 / (rate * 1e6)
                                   for r in same)
        extra = step - base
        grown = {key: statistics.median(r[key] for r in same) - statistics.median(r[key] for r in lossless[rate, mode])
                 for key in ("tail_s", "slot_bound_s")}  # where the extra goes
        print(f"{rate:>8g} {pct:>5g} {mode:<12} {base * 1e3:9.1f} {step * 1e3:9.1f} {extra * 1e3:9.1f} "
              f"{resent * 1e3:10.1f} {noise * 1e3:9.1f} {'yes' if extra <= resent else 'NO ':<3} "
              f"{grown['tail_s'] * 1e3:8.1f} {grown['slot_bound_s'] * 1e3:9.1f}")


def phase_report(rows: list[dict], warmup: int) -> None:
    """Per rate, mode and loss, the lossy phases against the lossless phase before each (``--loss-phases``)."""
    print("\nloss phases within each run (steps that overlap a switch left out; extra: median over the pairs of "
          "adjacent lossless and lossy phases of the difference of their median steps, with its 90 % interval "
          "(order statistics); resent: all ranks' retransmitted datagrams per lossy step more than per lossless step "
          "(what loss added), at their mean size with IP and UDP headers, at the link rate: each crosses the "
          "aggregator's link, the busiest, inbound (rank 0's alone in brackets); answered again: the answers the "
          "aggregator sent again from retained results per lossy step more than per lossless step (a lossless "
          "step has the last worker's tail duplicates answered again), at their size, at the link rate: they "
          "cross its link outbound; verdict: met when the "
          "interval's top is within the longer of the two, missed when its bottom is above it; "
          "where the extra goes, medians over the pairs, lossy minus lossless per step: tail, an exchange's time after "
          "its last new use; slots, sending stopped behind the oldest open use's slot; window, sending stopped by "
          "a full window; the hook's encode, network and decode phases; the CPU of rank 0's hook thread, the time "
          "that thread was ready to run but had no CPU (wait), the CPU of rank 0's whole process and of the "
          "aggregator; probes: rank 0's tail probes per lossy step, the losses at an "
          "exchange's end that only silence showed)")
    print(f"{'rate':>8} {'loss':>5} {'mode':<12} {'pairs':>5} {'lossless':>9} {'lossy':>9} {'extra ms':>9} "
          f"{'90 % interval':>15} {'resent ms (rank 0)':>18} {'answered again ms':>17} {'verdict':<9} | "
          f"{'tail':>5} {'slots':>6} {'window':>6} "
          f"{'encode':>6} {'network':>7} {'decode':>6} {'hookcpu':>7} {'wait':>5} {'cpu':>6} {'aggcpu':>6} "
          f"{'probes':>6}")
    for rate, mode, pct in sorted({(r["rate_mbit"], r["mode"], r["loss"]) for r in rows}):
        same = [r for r in rows if (r["rate_mbit"], r["mode"], r["loss"]) == (rate, mode, pct)]
        cmp = compare_phases([(r["step_marks"], r["switches"], warmup) for r in same])
        if cmp is None:
            print(f"{rate:>8g} {pct:>5g} {mode:<12} no pair of phases with whole steps: lengthen --loss-phases")
            continue
        size = statistics.fmean(r["datagram_bytes"] for r in same)
        answer = statistics.fmean(r.get("answer_bytes", math.nan) for r in same)
        again = cmp.answers_resent_s(answer, rate)
        again_text = "-" if math.isnan(again) else f"{again * 1e3:.2f} ({cmp.answers_resent_per_step:.0f})"
        print(f"{rate:>8g} {pct:>5g} {mode:<12} {cmp.pairs:>5} {cmp.lossless_s * 1e3:9.1f} {cmp.lossy_s * 1e3:9.1f} "
              f"{cmp.extra_s * 1e3:9.1f} {f'{cmp.low_s * 1e3:.1f} .. {cmp.high_s * 1e3:.1f}':>15} "
              f"{f'{cmp.resent_s(size, rate) * 1e3:.2f} ({cmp.resent_s(size, rate, all_ranks=False) * 1e3:.2f})':>18} "
              f"{again_text:>17} {cmp.verdict(size, rate, answer):<9} | "
              + " ".join(f"{cmp.grown.get(k, math.nan) * 1e3:{w}.1f}" for k, w in (
                  ("tail_s", 5), ("slot_bound_s", 6), ("window_bound_s", 6), ("encode_s", 6), ("network_s", 7),
                  ("decode_s", 6), ("hook_cpu_s", 7), ("hook_wait_s", 5), ("cpu_s", 6), ("aggregator_cpu_s", 6)))
              + f" {cmp.probes_per_step:6.2f}")


def plot(rows: list[dict], path: Path) -> None:
    """Throughput vs link bandwidth, one line per mode (the shape of THC's Figure 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        pts = sorted((r["rate_mbit"] / 1000, r["samples_per_s"]) for r in rows if r["mode"] == mode)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth (Gbit/s)")
    ax.set_ylabel("training throughput (samples/s)")
    ax.set_title(f"DDP, {rows[0]['workers']} workers, {rows[0]['parameters'] / 1e6:.1f} M parameters (emulated links)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def mode(text: str) -> str:
    """An argparse type: one of ``MODES``."""
    if text not in MODES:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}; choose from {','.join(MODES)}")
    return text


def output_file(text: str) -> Path:
    """An argparse type: a file to write at the end, in a folder that exists now."""
    path = Path(text)
    if not text or path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file in an existing folder, got {text!r}")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ddp_netem", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", type=comma_list(float_in(1, 100_000), "1000,10000"), default=[1000.0, 10000.0],
                   help="link rates in Mbit/s, comma-separated, each in 1..100000")
    p.add_argument("--modes", type=comma_list(mode, "thc,gloo"), default=list(MODES),
                   help=f"subset of {','.join(MODES)}")
    p.add_argument("--workers", type=int_in(1, 200), default=2,
                   help="worker namespaces (one rank each), 1..200; at most 32 with any mode but gloo")
    p.add_argument("--steps", type=int_in(1, 1_000_000), default=6, help="training steps, more than --warmup")
    p.add_argument("--warmup", type=int_in(0, 1_000_000), default=2, help="steps excluded from the step time")
    p.add_argument("--width", type=int_in(1, 1 << 14), default=2030,
                   help="MLP width, 1..16384 (2030 x 2 layers: 4.19 M parameters, one DDP bucket just under 2^22 "
                        "coordinates)")
    p.add_argument("--layers", type=int_in(1, 64), default=2, help="hidden layers, 1..64")
    p.add_argument("--in-features", type=int_in(1, 1 << 16), default=32, help="input features, 1..65536")
    p.add_argument("--batch-size", type=int_in(1, 1 << 16), default=32, help="samples per rank and step, 1..65536")
    p.add_argument("--qdisc", choices=("tbf", "htb"), default="tbf")
    p.add_argument("--rotation", choices=ROTATIONS, default=DDP_ROTATION,
                   help=f"THC's rotation (examples/train_ddp.py --rotation): fixed, with the error feedback kept "
                        f"rotated, or new signs every step (default {DDP_ROTATION})")
    p.add_argument("--mtu", type=int_in(68, MAX_MTU), default=1500,
                   help=f"MTU of every link, 68..{MAX_MTU} (9000: jumbo frames, for every mode)")
    p.add_argument("--elems", type=int_in(8, 65528),
                   help="elements per aggregator packet K, a multiple of 8 in 8..65528 (default: the job's for the "
                        "MTU; capped at what fits it)")
    p.add_argument("--slots", type=int_in(1, 65536), default=2048,
                   help="slots S of the aggregator's jobs, 1..65536: the most uses a worker runs ahead of its oldest "
                        "unanswered one (at least the packets sent during a loss's recovery: 2048 results of 1440 "
                        "bytes are 24 ms at 1 Gbit/s; with 512, a lossy step stalled 8-11 ms behind its losses)")
    p.add_argument("--timeout", type=float_in(1e-4, 60), default=0.05,
                   help="workers' first retransmission timeout, before a round trip is measured (s), 0.0001..60")
    p.add_argument("--loss", type=comma_list(float_in(0, 99), "0,1"), default=[0.0],
                   help="random loss in %% per direction on every worker's link, comma-separated, each in 0..99: 0,1 "
                        "runs lossless and 1 %% interleaved and compares them (netem, or nftables: whole %%)")
    p.add_argument("--loss-phases", type=float_in(0.1, 3600), metavar="SECONDS",
                   help="with --loss 0,P: one run per repeat whose loss switches between 0 and P %% every SECONDS, "
                        "each lossy phase compared with the lossless one before it (cancels the machine's drift "
                        "between runs; give enough --steps for several phases); with --loss 0 a control run whose "
                        "phases differ only in name")
    p.add_argument("--repeats", type=int_in(1, 1000), default=1,
                   help="runs of every configuration, 1..1000 (medians are reported)")
    p.add_argument("--busy-neighbour", action="store_true",
                   help="run every mode beside one CPU-bound process (a spinning Python loop at normal priority), "
                        "as on a machine that is not quiet (launchers/neighbour.py)")
    p.add_argument("--gro", action=argparse.BooleanOptionalAction, default=True,
                   help="workers and aggregator read runs that arrive whole as one message (UDP_GRO; default: on, "
                        "as in thc-aggregator and train_ddp.py); --no-gro to compare with a run without it")
    p.add_argument("--tail-duplicates", type=int_in(0, 65536), default=TAIL_DUPLICATES, metavar="N",
                   help=f"the workers send the last N uses of each exchange twice (default {TAIL_DUPLICATES}, as in "
                        "train_ddp.py; 0: off, to compare)")
    p.add_argument("--loss-udp-only", action="store_true", help="drop only UDP (gloo's TCP and the rendezvous "
                                                                 "are spared)")
    p.add_argument("--run-timeout", type=float_in(1, 86400), default=300.0,
                   help="seconds for one configuration, 1..86400")
    p.add_argument("--plot", type=output_file, help="write the throughput-vs-bandwidth plot here (PNG)")
    p.add_argument("--json", type=output_file, help="write the rows here")
    return p


def check_common(ap: argparse.ArgumentParser, args: argparse.Namespace, jobs: Callable[[], object]) -> None:
    """The checks every emulated-network benchmark makes before it starts (one line and exit 2 each):
    matplotlib for ``--plot``, and jobs the aggregator would accept (``jobs()`` builds them)."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib (pip install matplotlib)")
    try:
        jobs()
    except JobConfigError as exc:
        ap.error(str(exc))


def run_as_root(prog: str, run: Callable[[], list[dict]]) -> list[dict] | int:
    """``run()``'s rows; or, with one line on stderr, 2 where namespaces cannot be made (not root) and
    1 when the run failed (a topology or training error). SIGTERM and SIGHUP end ``run()`` as an error
    would, through its cleanup (``topologies.netem.Terminated``: the process exits with 128 + the signal)."""
    why = require_root()
    if why:
        print(f"{prog}: skipped: {why}", file=sys.stderr)
        return 2
    try:
        with ExitOnSignals():  # also between two topologies (the temporary folder); each Topology has its own
            return run()
    except (NetemError, RuntimeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup}): no step would be timed")
    if args.loss_phases and (min(args.loss) != 0 or len(args.loss) > 2):
        ap.error(f"--loss-phases needs --loss 0,P (the two phases; 0 alone for a control run), got --loss {args.loss}")
    check_common(ap, args, lambda: job_configs(args))
    rows = run_as_root("ddp_netem", lambda: run_all(args))
    if isinstance(rows, int):
        return rows
    if args.loss_phases:
        phase_report(rows, args.warmup)
    else:
        report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=vars))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
