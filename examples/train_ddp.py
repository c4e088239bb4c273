"""Train a model with PyTorch DDP, gradients averaged through a THC aggregator (or plain gloo/NCCL).

One machine, four processes, rank 0 starts ``thc-aggregator`` on loopback::

    torchrun --nproc-per-node 4 examples/train_ddp.py --steps 100 --compression thc

Several machines (the same command on each, rank 0's node starts the aggregator on the address
that routes to the rendezvous host, or pass ``--aggregator HOST:PORT`` of a running one or a switch)::

    torchrun --nnodes 2 --node-rank R --nproc-per-node 4 --master-addr 10.0.0.1 --master-port 29500 \\
        examples/train_ddp.py --steps 100 --compression thc

``--compression none`` is ordinary DDP (the process group's all_reduce); ``thc`` and
``uncompressed`` (int32 fixed point through the aggregator's uncompressed job type) register the
hook of ``worker_lib.ddp``. The default task is a synthetic regression (a fixed random teacher
network; each rank draws its own batches), so it needs no data set. ``--task mnist`` (or
``digits``) trains a small CNN (an MLP for digits) on a bundled data set instead, each rank on its
own shard, and rank 0 measures the test accuracy every ``--eval-every`` steps (outside the timed
steps: ``benchmarks/time_to_accuracy.py`` plots it against the training time). At the end rank 0
prints the final loss (mean over ranks) and whether all ranks hold identical parameters;
``--json-out`` writes the losses, step times, accuracies, where the time went, the hook's
counters, and per step its start, end and rank 0's counters so far (``step_marks``, each a dict by name:
``step_counters``), with the datagrams every rank has resent so far (``retransmissions_all``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launchers.aggregator_process import local_aggregator, local_tiers
from sim.data import DATASETS, Dataset, load_dataset, shard_indices
from sim.models import make_model as make_classifier
from worker_lib.cli.args import DDP_ROTATION, FLOAT_DTYPES, ROTATIONS, comma_list, float_in, fraction, host_port, int_in
from worker_lib.ddp import AggregatorUnreachable, DDPHookConfig, THCHookState, register_thc_hook
from worker_lib.job import DEFAULT_JOB_ID, DEFAULT_KEY, JobConfig, JobConfigError, job_from_mapping
from worker_lib.pacing import TAIL_DUPLICATES
from worker_lib.transport import STALE_JOB_ADVICE
from worker_lib.wire.layout import MAX_MTU

log = logging.getLogger("train_ddp")
_STORE_KEY = "thc/aggregator"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_ddp.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="DDP training of a synthetic regression MLP with gradients averaged through a THC "
                    "aggregator (--compression thc), through the aggregator's int32 fixed-point job "
                    "(uncompressed), or by the process group (none). Launch with torchrun.",
        epilog="Without --aggregator, rank 0 starts thc-aggregator (loopback on a single node, otherwise "
               "on its address towards --master-addr) and publishes HOST:PORT and the job through the "
               "torch.distributed store.")
    p.add_argument("--steps", type=int_in(1, 10**9), default=50, help="training steps, at least 1")
    p.add_argument("--compression", choices=("none", "thc", "uncompressed"), default="thc")
    p.add_argument("--aggregator", metavar="HOST:PORT", type=comma_list(host_port, "10.0.0.9:9451,10.0.0.10:9451"),
                   help="a running thc-aggregator (or switch) to use; several, comma-separated, in member order "
                        "(thc-aggregator --member I/N on each): the job's slots spread over them")
    p.add_argument("--leaves", metavar="N0:N1:...",
                   help="two tiers (docs/protocol.md 'Two tiers'): the ranks, in order, split over leaves of N0, "
                        "N1, ... (their sum is the world size); rank 0 starts a spine and the leaves, or "
                        "--aggregator lists the running leaves in leaf order")
    p.add_argument("--aggregator-host", help="address rank 0's aggregator binds to (default: see epilog)")
    p.add_argument("--bind-host", help="this worker's local address for the aggregator traffic "
                                       "(default: the address that routes to the aggregator)")
    p.add_argument("--job-id", type=int_in(0, 65535), default=DEFAULT_JOB_ID, help="aggregator job id, 0..65535")
    p.add_argument("--key", type=int_in(0, (1 << 32) - 1), default=DEFAULT_KEY,
                   help="the job's 32-bit key (decimal or 0x hex)")
    p.add_argument("--bits", type=int_in(1, 8), default=4, help="THC bits per coordinate b, 1..8")
    p.add_argument("--granularity", type=int_in(1, 1 << 16), default=30,
                   help="THC granularity g, at least 2^b - 1")
    p.add_argument("--p", type=fraction, default=1 / 32,
                   help="THC table parameter p, a decimal or a fraction like 1/32")
    p.add_argument("--slots", type=int_in(1, 65536), default=128, help="aggregator slots S of the job, 1..65536")
    p.add_argument("--elems", type=int_in(8, 65528),
                   help="indices per packet K, a multiple of 8 (default: the aggregator's, MTU-bound)")
    p.add_argument("--mtu", type=int_in(68, MAX_MTU), default=1500,
                   help=f"path MTU the job's packets must fit, 68..{MAX_MTU} (9000: jumbo frames)")
    p.add_argument("--shards", type=int_in(1, 64), default=1, help="aggregator shards (ports PORT..PORT+P-1), 1..64")
    p.add_argument("--gro", action=argparse.BooleanOptionalAction, default=True,
                   help="read runs of answers that arrive whole as one message (UDP_GRO, where the kernel has it; "
                        "default: on)")
    p.add_argument("--multicast", metavar="GROUP:PORT", help="results by IP multicast to this group")
    p.add_argument("--tail-duplicates", type=int_in(0, 65536), default=TAIL_DUPLICATES, metavar="N",
                   help="the last N uses of each exchange go out twice, so that a request lost at its end costs "
                        f"no recovery (docs/protocol.md; 0: off; default {TAIL_DUPLICATES})")
    p.add_argument("--loss-policy", choices=("reliable", "zero-fill"), default="reliable")
    p.add_argument("--timeout", type=float_in(1e-4, 60), default=0.05,
                   help="retransmit timeout, s, 0.0001..60, until the round trip is measured "
                        "(then 3 round trips, at least min(2 ms, this)); zero-fill: always this")
    p.add_argument("--deadline", type=float_in(0.01, 86400), default=10.0,
                   help="seconds without any answer from the aggregator before failing, 0.01..86400")
    p.add_argument("--no-error-feedback", action="store_true", help="disable THC's error feedback")
    p.add_argument("--rotation", choices=ROTATIONS,
                   help=f"THC's rotation: one rotation per bucket for the whole run, whose error feedback stays "
                        f"rotated (one transform per step fewer), or new random signs every step (the paper's); "
                        f"default {DDP_ROTATION}, per-step with --no-error-feedback")
    p.add_argument("--no-overlap", action="store_true", help="exchange inside the hook, not on a thread")
    p.add_argument("--bucket-cap-mb", type=float_in(0.001, 1 << 16), default=25.0, help="DDP bucket size, MB")
    p.add_argument("--task", choices=("regression", *DATASETS), default="regression",
                   help="regression: synthetic MLP regression; mnist / digits: classification of a bundled "
                        "data set (a CNN for mnist, an MLP for digits), rank r training on shard r")
    p.add_argument("--eval-every", type=int_in(0, 10**9), default=0,
                   help="mnist/digits: rank 0 measures the test accuracy every N steps (0: after the last)")
    p.add_argument("--width", type=int_in(1, 1 << 16), default=64,
                   help="hidden layer width of the MLP (mnist: of the CNN's fully connected layer), 1..65536")
    p.add_argument("--layers", type=int_in(0, 64), default=2,
                   help="hidden layers of the MLP, 0..64 (0: a linear model)")
    p.add_argument("--in-features", type=int_in(1, 1 << 16), default=32, help="regression inputs, 1..65536")
    p.add_argument("--batch-size", type=int_in(1, 1 << 20), default=32, help="samples per rank and step, at least 1")
    p.add_argument("--lr", type=float_in(1e-9, 100), default=0.05, help="SGD learning rate, 1e-9..100")
    p.add_argument("--momentum", type=float_in(0, 0.999), default=0.9, help="SGD momentum, 0..0.999")
    p.add_argument("--dtype", choices=FLOAT_DTYPES, default="float32", help="parameter and gradient dtype")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per local rank, or ranks sharing the GPUs round-robin where there are fewer")
    p.add_argument("--backend", help="process group backend (default: nccl with a GPU per local rank, else gloo)")
    p.add_argument("--seed", type=int_in(0, (1 << 32) - 1), default=0,
                   help="seed of the model, the data and the quantization")
    p.add_argument("--warmup", type=int_in(0, 10**9 - 1),
                   help="steps excluded from the step-time figures, fewer than --steps (default: 1, or 0 with "
                        "--steps 1)")
    p.add_argument("--check-every-step", action="store_true",
                   help="compare a digest of the parameters of all ranks after every step")
    p.add_argument("--log-every", type=int_in(0, 10**9), default=0,
                   help="rank 0 prints 'step N loss L' every N steps (0: never)")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the run's summary here (in a folder that exists)")
    p.add_argument("--threads", type=int_in(1, 1024), default=1, help="torch intra-op threads per rank, at least 1")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, rank: int = 0) -> argparse.Namespace:
    """Refuse (``parser.error``: one line, exit 2) what each option's own type cannot see, before any
    rank starts: a --warmup that leaves no step to time (its default: 1, or 0 with --steps 1), and on
    rank 0, which writes it only after the training, a --json-out whose folder does not exist or cannot
    be written. Returns ``args`` with --warmup resolved."""
    if args.warmup is None:
        args.warmup = min(1, args.steps - 1)
    elif args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be less than --steps ({args.steps}): no step would be timed")
    if args.json_out is not None and rank == 0:
        folder = args.json_out.parent
        if args.json_out.is_dir():
            parser.error(f"--json-out {args.json_out} is a folder; give a file in it")
        if not folder.is_dir():
            parser.error(f"--json-out {args.json_out}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            parser.error(f"--json-out {args.json_out}: the folder {folder} is not writable")
    return args


def make_model(args: argparse.Namespace, data: Dataset | None = None) -> nn.Module:
    """The regression MLP, or ``data``'s classifier; the same seed on every rank (DDP broadcasts rank 0's
    parameters anyway)."""
    if data is not None:
        return make_classifier(data.image_shape, data.classes, seed=args.seed, hidden=args.width)
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = []
    width = args.in_features
    for _ in range(args.layers):
        layers += [nn.Linear(width, args.width), nn.Tanh()]
        width = args.width
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def teacher(args: argparse.Namespace) -> torch.Tensor:
    """Weights of the fixed target function y = tanh(x @ w1) @ w2 (the same on all ranks)."""
    g = torch.Generator().manual_seed(10_000 + args.seed)
    return torch.randn(args.in_features, 8, generator=g) / args.in_features ** 0.5


def batch(args: argparse.Namespace, w: torch.Tensor, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's batch of a step: x ~ N(0, I), y = sum(tanh(x @ w)) (deterministic per rank and step)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 65_537 + step)
    x = torch.randn(args.batch_size, args.in_features, generator=g)
    return x, torch.tanh(x @ w).sum(1, keepdim=True)


def class_batch(args: argparse.Namespace, data: Dataset, shard: torch.Tensor, step: int) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """Rank's batch of a step from its shard: epochs of the shard in an order drawn from the seed and
    the epoch (deterministic per rank and step)."""
    per_epoch = max(1, shard.numel() // args.batch_size)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(shard.numel(), generator=torch.Generator().manual_seed(args.seed * 7919 + epoch))
    rows = shard[order[k * args.batch_size:(k + 1) * args.batch_size]]
    return data.train_x[rows], data.train_y[rows]


@torch.no_grad()
def accuracy(model: nn.Module, data: Dataset, device: torch.device, dtype: torch.dtype) -> float:
    """Share of ``data``'s test images that ``model`` classifies correctly."""
    was = model.training
    model.eval()
    pred = model(data.test_x.to(device, dtype)).argmax(1).cpu()
    model.train(was)
    return float((pred == data.test_y).float().mean())


#: What a step mark records of rank 0's running counters: its name, and the attribute of the transport's or
#: the hook's stats it reads. ``benchmarks/loss_phases.py`` reads the marks by these names.
STEP_COUNTERS = (("retransmissions", "transport", "retransmissions"), ("tail_s", "transport", "tail_s"),
                 ("tail_probes", "transport", "tail_probes"),
                 ("slot_bound_s", "transport", "slot_bound_s"), ("window_bound_s", "transport", "window_bound_s"),
                 ("encode_s", "hook", "encode_s"), ("network_s", "hook", "network_s"),
                 ("decode_s", "hook", "decode_s"), ("hook_cpu_s", "hook", "cpu_s"),
                 ("hook_wait_s", "hook", "wait_s"))


def step_counters(state: THCHookState | None) -> dict[str, float]:
    """Rank 0's running counters of ``STEP_COUNTERS`` (zeros without the THC hook): the transport's
    resends and waits, the hook's phases and CPU."""
    if state is None:
        return {name: 0.0 for name, _, _ in STEP_COUNTERS}
    stats = {"transport": state.transport.stats, "hook": state.stats}
    return {name: float(getattr(stats[where], attr)) for name, where, attr in STEP_COUNTERS}


def params_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for prm in model.parameters():
        h.update(prm.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def route_address(target: str) -> str:
    """The local IPv4 address the kernel would use to reach ``target`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))
        return s.getsockname()[0]


def job_config(args: argparse.Namespace, world: int) -> JobConfig:
    leaves = job_from_mapping({"leaves": args.leaves}, "--leaves").leaves if args.leaves else None
    return JobConfig(job=args.job_id, key=args.key, workers=world, kind=args.compression, bits=args.bits,
                     granularity=args.granularity, p=args.p, slots=args.slots, elems=args.elems,
                     multicast=args.multicast, mtu=args.mtu, leaves=leaves)


def hook_config(args: argparse.Namespace, job: JobConfig, members: list[tuple[str, int]]) -> DDPHookConfig:
    host = members[0][0]
    bind = args.bind_host or ("127.0.0.1" if host.startswith("127.") else route_address(host))
    return DDPHookConfig(job, aggregator=members[0], more_aggregators=tuple(members[1:]), shards=args.shards,
                         loss_policy=args.loss_policy,
                         timeout=args.timeout, deadline=args.deadline, bind_host=bind,
                         error_feedback=not args.no_error_feedback, overlap=not args.no_overlap, seed=args.seed,
                         gro=args.gro, rotation=args.rotation, tail_duplicates=args.tail_duplicates)


def publish_aggregator(args: argparse.Namespace, stack: contextlib.ExitStack, rank: int, world: int,
                       single_node: bool) -> list[tuple[str, int]]:
    """The aggregators serving the job, in member order (two tiers: the leaves, in leaf order): --aggregator's,
    or those rank 0 starts and publishes as HOST:PORT,... through the store."""
    if args.aggregator:
        return list(args.aggregator)
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store torchrun made
    if rank == 0:
        host = args.aggregator_host or ("127.0.0.1" if single_node
                                        else route_address(os.environ.get("MASTER_ADDR", "127.0.0.1")))
        job = job_config(args, world)
        if job.tiered:
            where = stack.enter_context(local_tiers(job, host=host))[1]
        else:
            where = [stack.enter_context(local_aggregator([job], host=host, shards=args.shards,
                                                          multicast=bool(args.multicast)))]
        store.set(_STORE_KEY, ",".join(f"{h}:{p}" for h, p in where))
    store.wait([_STORE_KEY], timedelta(seconds=120))
    return [host_port(part) for part in store.get(_STORE_KEY).decode().split(",")]


def train(args: argparse.Namespace) -> dict:
    """The training loop of one rank; returns rank 0's summary (others: {})."""
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device, backend = torch.device("cpu"), args.backend or "gloo"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: this torch sees no CUDA device")
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % gpus)
        torch.cuda.set_device(device)
        # NCCL refuses two ranks on one GPU; gloo moves CUDA tensors through host memory instead
        backend = args.backend or ("nccl" if local_world <= gpus else "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=max(120.0, 6 * args.deadline)))
    try:
        return _run(args, rank, world, local_world, device)
    finally:
        # DDP (and its reducer's gloo work) must be gone before the process group is destroyed: destroying
        # the group under a live DDP aborted a rank now and then ("terminate called without an active
        # exception") and left the other nodes' torchrun agents waiting.
        gc.collect()
        dist.destroy_process_group()


def _run(args: argparse.Namespace, rank: int, world: int, local_world: int, device: torch.device) -> dict:
    summary: dict = {}
    with contextlib.ExitStack() as stack:
        dtype = getattr(torch, args.dtype)
        data = None if args.task == "regression" else load_dataset(args.task, seed=args.seed)
        shard = None if data is None else torch.as_tensor(shard_indices(len(data.train_y), world, args.seed)[rank])
        model = make_model(args, data).to(device=device, dtype=dtype)
        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        state: THCHookState | None = None
        if args.compression != "none":
            members = publish_aggregator(args, stack, rank, world, single_node=local_world == world)
            job = job_config(args, world)
            if job.tiered:  # this rank talks to its leaf alone
                if len(members) != len(job.leaves):
                    raise ValueError(f"--leaves names {len(job.leaves)} leaves but {len(members)} aggregator "
                                     "addresses are given")
                members = [members[job.tier_of(rank)[0]]]
            cfg = hook_config(args, job, members)
            state = register_thc_hook(ddp, cfg)
            stack.callback(state.close)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
        w = teacher(args)
        losses: list[float] = []
        identical_steps: list[bool] = []
        accuracies: list[tuple[int, float, float]] = []  # (steps done, training seconds so far, test accuracy)
        clock = 0.0  # seconds spent in training steps, warm-up included (evaluations excluded)
        times = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0, "step_s": 0.0}
        timed = 0
        # per step: start and end (time.perf_counter: CLOCK_MONOTONIC, comparable across processes), the
        # counters so far of ``step_counters`` and the process's CPU (cpu_s); for benchmarks that change the
        # network during a run (benchmarks/loss_phases.py)
        marks: list[dict[str, float]] = []
        base: dict[str, float] = {}
        # The objects made so far (torch's import, the model, DDP, the hook: about 330,000) move to the
        # permanent generation. Otherwise every full collection walks them all: 130 ms on a 2-core machine,
        # about once every 20 steps, holding the GIL while the hook's thread has uses in flight.
        gc.freeze()
        cpu_at_warmup = time.process_time()
        for step in range(args.steps):
            if step == args.warmup:
                cpu_at_warmup = time.process_time()  # this process's CPU (all its threads) from here
                if state is not None:
                    base = state.stats.as_dict()  # the hook's counters before the timed steps
            if data is None:
                x, y = batch(args, w, rank, step)
            else:
                x, y = class_batch(args, data, shard, step)
            t0 = time.perf_counter()
            out = ddp(x.to(device, dtype)).float()
            loss = nn.functional.mse_loss(out, y.to(device)) if data is None else \
                nn.functional.cross_entropy(out, y.to(device))
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss.backward()  # waits for every bucket's future (the hook's exchange)
            t2 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t3 = time.perf_counter()
            clock += t3 - t0
            marks.append({"start": t0, "end": t3, **step_counters(state), "cpu_s": time.process_time()})
            if step >= args.warmup:
                timed += 1
                for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                    times[k] += v
            losses.append(float(loss.detach()))
            last = step + 1 == args.steps
            if data is not None and (last or (args.eval_every and (step + 1) % args.eval_every == 0)):
                if rank == 0:
                    accuracies.append((step + 1, clock, accuracy(model, data, device, dtype)))
                dist.barrier()  # the others wait here, not inside the next step's timed exchange
            if args.check_every_step:
                digests: list[str | None] = [None] * world
                dist.all_gather_object(digests, params_digest(model))
                identical_steps.append(len(set(digests)) == 1)
            if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
                print(f"step {step + 1} loss {losses[-1]:.6f}", flush=True)
        all_losses: list[list[float] | None] = [None] * world
        dist.all_gather_object(all_losses, losses)
        # every rank's resends reach the aggregator over its one link: each mark also counts all ranks' so far
        resends: list[list[float] | None] = [None] * world
        dist.all_gather_object(resends, [m["retransmissions"] for m in marks])
        for k, mark in enumerate(marks):
            mark["retransmissions_all"] = sum(r[k] for r in resends)  # type: ignore[index]
        digests = [None] * world
        dist.all_gather_object(digests, params_digest(model))
        hook_stats: list[dict | None] = [None] * world
        mine: dict = {"process_cpu_s": (time.process_time() - cpu_at_warmup) / max(timed, 1)}
        if state is not None:
            now = state.stats.as_dict()
            mine |= {**now, **{f"transport_{k}": v for k, v in state.transport.stats.as_dict().items()},
                     "per_timed_step": {k: (v - base.get(k, 0)) / max(timed, 1) for k, v in now.items()}}
        dist.all_gather_object(hook_stats, mine)
        if rank == 0:
            mean_losses = [sum(ls[s] for ls in all_losses) / world for s in range(args.steps)]  # type: ignore[index]
            summary = {
                "compression": args.compression, "task": args.task, "accuracy": accuracies, "world_size": world,
                "steps": args.steps, "dtype": args.dtype, "device": str(device), "backend": dist.get_backend(),
                "parameters": sum(p.numel() for p in model.parameters()), "losses": mean_losses,
                "final_loss": mean_losses[-1] if mean_losses else float("nan"),
                "identical": len(set(digests)) == 1, "identical_every_step": identical_steps,
                "timed_steps": timed, **{k: v / max(timed, 1) for k, v in times.items()},
                "hook": hook_stats, "aggregator": list(state.config.aggregator) if state else None,
                "multicast": args.multicast, "step_marks": marks,
            }
        dist.barrier()  # nobody stops the aggregator while a rank still needs it
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = check_args(parser, parser.parse_args(argv), rank=int(os.environ.get("RANK", "0")))
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"),
                        format="%(asctime)s rank" + os.environ.get("RANK", "?") + " %(name)s %(message)s")
    if "RANK" not in os.environ:
        print("train_ddp.py: run me with torchrun (RANK/WORLD_SIZE are not set), e.g. "
              "torchrun --nproc-per-node 2 examples/train_ddp.py --steps 20", file=sys.stderr)
        return 2
    try:
        summary = train(args)
    except AggregatorUnreachable as exc:
        print(f"train_ddp.py rank {os.environ['RANK']}: the THC aggregator is unreachable: {exc}", file=sys.stderr)
        return 3
    except JobConfigError as exc:  # the job's options (--leaves, widths, K) refused
        print(f"train_ddp.py rank {os.environ['RANK']}: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # AggregatorStateError, or either error raised through DDP's future
        if "no answer from the aggregator" in str(exc):
            print(f"train_ddp.py rank {os.environ['RANK']}: the THC aggregator is unreachable: {exc}",
                  file=sys.stderr)
            return 3
        if STALE_JOB_ADVICE in str(exc):
            print(f"train_ddp.py rank {os.environ['RANK']}: {str(exc).splitlines()[-1]}", file=sys.stderr)
            return 3
        raise
    if summary:
        print(f"final loss {summary['final_loss']:.6f} after {summary['steps']} steps "
              f"({summary['compression']}, {summary['world_size']} ranks, {summary['parameters']:,} parameters); "
              f"identical parameters on all ranks: {summary['identical']}; "
              f"step time {summary['step_s'] * 1e3:.1f} ms", flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalization: with everything closed and written, torch's gloo
    # threads still aborted a rank there now and then ("terminate called without an active exception",
    # SIGABRT after its last line), which failed a finished run and left the other ranks' agents waiting.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
