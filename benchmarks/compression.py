"""Speed of THC compression on one worker: encode, decode, and the break-even link rate.

encode = norm + RHT (sign generation included: every step has new signs) + clamp + stochastic
         quantization onto the table + b-bit packing
decode = taking the aggregator's result payload into the sums array, as the transport does (8-bit sums
         as uint8) + scaling + inverse RHT

The result payload is a single worker's sums, the table values of its indices, computed between the
two timings and not counted: the switch or the aggregator computes them, not the worker (their cost
is ``benchmarks/aggregator.py``'s; before 2026-11-27's fifth session, decode counted an unpack and a
table lookup here as well, 1.4 ms of the 2.5 ms decode at 2^20).

The break-even link rate is the bandwidth at which the bits THC saves upstream, (w - b) per
coordinate for gradients of w bits (32 for float32, 16 for float16 and bfloat16), take as long to send
as encode + decode take to compute: above it, compressing pays. With ``--dtype float16|bfloat16`` the
gradient is held in that type, encode includes its conversion to float32 and decode the conversion back.

    python benchmarks/compression.py [--dim 1048576] [--repeats 30] [--device cpu|cuda] [--dtype float32]
                                     [--threads N] [--json]
    python benchmarks/compression.py --contention   # 1 and 2 threads, quiet and beside a busy process
    python benchmarks/compression.py --hook --dim 4191951   # a worker's codec CPU per DDP step, by phase

``--contention`` runs the measurement in a fresh process for each of 1 and 2 torch threads, alone and
next to one CPU-bound neighbour process (a spinning Python loop), and prints the four break-even rates
side by side: a worker shares its cores with the training loop, the aggregator or other jobs, and a
thread count that is best on a quiet machine can collapse on a busy one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from launchers.checkout import checkout_env
from launchers.neighbour import busy_neighbour
from worker_lib.cli.args import DDP_ROTATION, FLOAT_DTYPES, ROTATIONS, int_in
from worker_lib.thc import THCCodec, THCConfig, THCWorker
from worker_lib.thc.hadamard import have_fht_cpu, next_pow2
from worker_lib.thc.quantize import unpack_indices
from worker_lib.thc.signs import SignKey


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config: THCConfig, dim: int, repeats: int, device: torch.device,
            dtype: torch.dtype = torch.float32) -> dict:
    """Median encode and decode times (seconds) over `repeats` steps, each with fresh signs, of a
    gradient of type ``dtype`` (converted to float32 in encode and back in decode)."""
    codec = THCCodec(config, device=device, seed=1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(dim, generator=gen).to(device, dtype)
    values = codec.quantizer.values
    buffers = codec.buffers(dim, SignKey.derive(1, 0, 0))
    # the receive side's own buffers, as a training loop reuses them every step
    padded = buffers.rht.padded
    received = torch.empty(padded, dtype=torch.uint8, device=device)
    # one worker's sums need 8 bits up to g = 255, and the transport then keeps them as uint8
    sums_type = torch.uint8 if config.granularity <= 255 else torch.int32
    result = torch.empty(padded, dtype=sums_type, device=device)
    sums = torch.empty(padded, dtype=sums_type, device=device)
    est = torch.empty(dim, dtype=torch.float32, device=device)
    out = est if dtype == torch.float32 else torch.empty(dim, dtype=dtype, device=device)
    enc_times, dec_times = [], []
    for step in range(repeats + 3):
        key = SignKey.derive(1, 0, step)
        _sync(device)
        t0 = time.perf_counter()
        flat = x.to(torch.float32)
        # as a worker does: the rotation with its norm (one pass on the CPU), then the quantization
        rotated, norm = codec.rotate_norm(flat, key, buffers)
        enc = codec.quantize_rotated(rotated, norm, dim, buffers)
        payload = enc.packed()
        _sync(device)
        t1 = time.perf_counter()
        indices = unpack_indices(payload, config.bits, padded, out=received)  # the aggregator's work
        result.copy_(values[indices.to(torch.int64)])
        _sync(device)
        t2 = time.perf_counter()
        sums.copy_(result)
        codec.decode(sums, 1, enc.scale, dim, key, buffers, out=est)
        if out is not est:
            out.copy_(est)
        _sync(device)
        t3 = time.perf_counter()
        if step >= 3:  # warm-up excluded
            enc_times.append(t1 - t0)
            dec_times.append(t3 - t2)
    xf, of = x.double(), out.double()
    nmse = float(torch.sum((of - xf) ** 2) / torch.sum(xf ** 2))
    enc_s, dec_s = statistics.median(enc_times), statistics.median(dec_times)
    dense_bits = torch.finfo(dtype).bits
    saved_bits = (dense_bits - config.bits) * dim
    return {
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "dense_bits": dense_bits,
        "dim": dim, "bits": config.bits, "granularity": config.granularity,
        "p": config.p, "backend": "fht-cpu" if device.type == "cpu" and have_fht_cpu() else "torch",
        "threads": torch.get_num_threads(), "repeats": repeats,
        "encode_ms": enc_s * 1e3, "decode_ms": dec_s * 1e3,
        "encode_coords_per_s": dim / enc_s, "decode_coords_per_s": dim / dec_s,
        "break_even_gbit_s": saved_bits / (enc_s + dec_s) / 1e9,
        "nmse_single_worker": nmse,
    }


def measure_hook(config: THCConfig, dim: int, repeats: int, device: torch.device) -> dict:
    """Median milliseconds of one worker's CPU work per step as the DDP hook arranges it (caller-kept error
    feedback; ``worker_lib.allreduce``): ``begin`` (gradient + error, norm, rotation), ``compress``, the new
    error x - RHT^-1(X_i) (which the hook computes beside the index exchange), and ``finish`` (decoding the
    int32 sums of two workers into the gradient's buffer). The codec's CPU cost of a DDP step, apart from
    the network. With ``config.rotation == "fixed"`` the error stays rotated: compress writes it, and the
    error phase has nothing left to do."""
    worker = THCWorker(THCConfig(bits=config.bits, granularity=config.granularity, backend=config.backend,
                                 error_feedback=False, rotation=config.rotation), job=1, device=device, seed=1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    grad = torch.randn(dim, generator=gen).to(device)
    error = torch.zeros(next_pow2(dim) if worker.fixed else dim, device=device)
    out = torch.empty(dim, device=device)
    phases: dict[str, list[float]] = {"begin": [], "compress": [], "error": [], "finish": []}
    for step in range(repeats + 3):
        _sync(device)
        t0 = time.perf_counter()
        norm = worker.begin(grad, 0, step, error=error)
        _sync(device)
        t1 = time.perf_counter()
        enc = worker.compress(0, norm)
        _sync(device)
        t2 = time.perf_counter()
        worker.residual(0, out=error)
        _sync(device)
        t3 = time.perf_counter()
        sums = enc.indices.to(torch.int32) * 2  # two workers that sent the same indices (not timed)
        _sync(device)
        t4 = time.perf_counter()
        worker.finish(0, sums, 2, out=out)
        _sync(device)
        t5 = time.perf_counter()
        if step >= 3:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
                phases[name].append(seconds)
    ms = {f"{name}_ms": statistics.median(times) * 1e3 for name, times in phases.items()}
    return {"device": str(device), "dim": dim, "threads": torch.get_num_threads(), "repeats": repeats, **ms,
            "total_ms": sum(ms.values())}


def contention(args: argparse.Namespace) -> list[dict]:
    """The measurement at 1 and 2 threads, quiet and beside one busy process, each in a fresh process."""
    rows = []
    for busy in (False, True):
        for threads in (1, 2):
            with busy_neighbour(busy):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--threads", str(threads),
                       "--dim", str(args.dim), "--repeats", str(args.repeats), "--bits", str(args.bits),
                       "--granularity", str(args.granularity), "--backend", args.backend, "--dtype", args.dtype]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                                      env=checkout_env())
            if proc.returncode != 0:
                raise SystemExit(f"compression benchmark failed: {proc.stderr.strip().splitlines()[-1:]}")
            rows.append({**json.loads(proc.stdout), "busy_neighbour": busy})
    return rows


def device_of(parser: argparse.ArgumentParser, text: str) -> torch.device:
    """``--device`` as a torch device this machine has (cpu, or cuda[:N] with CUDA); else the parser's error."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"--device: expected cpu or cuda[:N], got {text!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu or cuda[:N], got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {text}: this torch has no usable CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int_in(1, 1 << 28), default=1 << 20,
                        help="coordinates per vector, 1..2^28 (default 2^20)")
    parser.add_argument("--repeats", type=int_in(1, 1000), default=30,
                        help="measured steps, 1..1000 (median reported; default 30)")
    parser.add_argument("--bits", type=int_in(1, 8), default=4, help="index width b, 1..8 (default 4)")
    parser.add_argument("--granularity", type=int_in(1, 4096), default=30,
                        help="table granularity g, 2^b - 1..4096 (default 30)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=FLOAT_DTYPES,
                        help="the gradient's type; the break-even counts the bits it would send (default float32)")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "fht-cpu"],
                        help="Hadamard engine (auto: fht-cpu on CPU when installed)")
    parser.add_argument("--threads", type=int_in(1, 1024),
                        help="torch intra-op threads, 1..1024 (default: torch's, the core count)")
    parser.add_argument("--contention", action="store_true",
                        help="1 and 2 threads, alone and beside a CPU-bound neighbour, side by side (on the CPU)")
    parser.add_argument("--hook", action="store_true",
                        help="one worker's codec work per step as the DDP hook does it (error feedback kept by "
                             "the hook, averages decoded into the bucket), phase by phase")
    parser.add_argument("--rotation", choices=ROTATIONS,
                        help=f"with --hook: THC's rotation, fixed (error feedback kept rotated) or new signs every "
                             f"step (default {DDP_ROTATION}, the hook's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    device = device_of(parser, args.device)
    if args.hook and (args.contention or args.dtype != "float32"):
        parser.error("--hook measures float32 gradients on its own: leave out --contention and --dtype")
    if args.rotation is not None and not args.hook:
        parser.error("--rotation applies to --hook only (the other measurements keep no error feedback)")
    if args.contention and device.type != "cpu":
        parser.error("--contention measures on the CPU: leave out --device")
    if args.backend == "fht-cpu" and (device.type != "cpu" or not have_fht_cpu()):
        parser.error("--backend fht-cpu needs the fht-cpu package and --device cpu")
    try:
        config = THCConfig(bits=args.bits, granularity=args.granularity, backend=args.backend,
                           rotation=(args.rotation or DDP_ROTATION) if args.hook else "per-step")
    except ValueError as exc:
        parser.error(f"--bits {args.bits} --granularity {args.granularity}: {exc}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.contention:
        rows = contention(args)
        if args.json:
            print(json.dumps(rows))
            return
        print(f"THC b={args.bits} g={args.granularity} d={args.dim} on cpu, median of {args.repeats} steps each")
        print(f"  {'neighbour':>10} {'threads':>7} {'encode ms':>9} {'decode ms':>9} {'break-even Gbit/s':>17}")
        for r in rows:
            print(f"  {'busy' if r['busy_neighbour'] else 'none':>10} {r['threads']:>7} {r['encode_ms']:9.2f} "
                  f"{r['decode_ms']:9.2f} {r['break_even_gbit_s']:17.2f}")
        return
    if args.hook:
        res = measure_hook(config, args.dim, args.repeats, device)
        if args.json:
            print(json.dumps(res))
            return
        print(f"THC b={args.bits} g={args.granularity} d={args.dim} float32 on {res['device']}, the DDP hook's "
              f"arrangement ({res['threads']} threads, {config.rotation} rotation), median of {res['repeats']}, "
              "ms per step:")
        print("  " + "  ".join(f"{name} {res[f'{name}_ms']:.2f}" for name in ("begin", "compress", "error", "finish"))
              + f"  total {res['total_ms']:.2f}")
        return
    dtype = getattr(torch, args.dtype)
    res = measure(config, args.dim, args.repeats, device, dtype)
    if not args.json and args.backend == "auto" and device.type == "cpu":
        torch_only = measure(THCConfig(bits=args.bits, granularity=args.granularity, backend="torch"),
                             args.dim, args.repeats, torch.device("cpu"), dtype)
        res["torch_backend_break_even_gbit_s"] = torch_only["break_even_gbit_s"]
    if args.json:
        print(json.dumps(res))
        return
    print(f"THC b={res['bits']} g={res['granularity']} d={res['dim']} {res['dtype']} on {res['device']} "
          f"({res['backend']}, {res['threads']} threads), median of {res['repeats']}")
    print(f"  encode {res['encode_ms']:8.2f} ms  {res['encode_coords_per_s'] / 1e6:8.1f} M coords/s")
    print(f"  decode {res['decode_ms']:8.2f} ms  {res['decode_coords_per_s'] / 1e6:8.1f} M coords/s")
    print(f"  break-even link rate {res['break_even_gbit_s']:.2f} Gbit/s (targets: >= 5 on a quiet machine, "
          ">= 2 beside a busy process: --contention)")
    if "torch_backend_break_even_gbit_s" in res:
        print(f"  same with the pure-torch transform: {res['torch_backend_break_even_gbit_s']:.2f} Gbit/s")


if __name__ == "__main__":
    main()
