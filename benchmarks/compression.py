"""Speed of THC compression on one worker: encode, decode, and the break-even link rate.

encode = norm + RHT (sign generation included: every step has new signs) + clamp + stochastic
         quantization onto the table + b-bit packing
decode = unpacking b-bit indices + table lookup (the sums of a single worker) + scaling + inverse RHT

The break-even link rate is the bandwidth at which the bits THC saves upstream, (32 - b) per
coordinate, take as long to send as encode + decode take to compute: above it, compressing pays.

    python benchmarks/compression.py [--dim 1048576] [--repeats 30] [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from worker_lib.thc import THCCodec, THCConfig
from worker_lib.thc.hadamard import have_fht_cpu
from worker_lib.thc.quantize import unpack_indices
from worker_lib.thc.signs import SignKey


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config: THCConfig, dim: int, repeats: int, device: torch.device) -> dict:
    """Median encode and decode times (seconds) over `repeats` steps, each with fresh signs."""
    codec = THCCodec(config, device=device, seed=1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(dim, generator=gen).to(device)
    values = codec.quantizer.values
    buffers = codec.buffers(dim, SignKey.derive(1, 0, 0))
    # the receive side's own buffers, as a training loop reuses them every step
    padded = buffers.rht.padded
    received = torch.empty(padded, dtype=torch.uint8, device=device)
    sums = torch.empty(padded, dtype=torch.int32, device=device)
    est = torch.empty(dim, dtype=torch.float32, device=device)
    enc_times, dec_times = [], []
    for step in range(repeats + 3):
        key = SignKey.derive(1, 0, step)
        _sync(device)
        t0 = time.perf_counter()
        norm = float(torch.linalg.vector_norm(x))
        enc = codec.encode(x, norm, key, buffers)
        payload = enc.packed()
        _sync(device)
        t1 = time.perf_counter()
        indices = unpack_indices(payload, config.bits, padded, out=received)
        torch.index_select(values, 0, indices.to(torch.int32), out=sums)
        codec.decode(sums, 1, enc.scale, dim, key, buffers, out=est)
        _sync(device)
        t2 = time.perf_counter()
        if step >= 3:  # warm-up excluded
            enc_times.append(t1 - t0)
            dec_times.append(t2 - t1)
    nmse = float(torch.sum((est - x) ** 2) / torch.sum(x ** 2))
    enc_s, dec_s = statistics.median(enc_times), statistics.median(dec_times)
    saved_bits = (32 - config.bits) * dim
    return {
        "device": str(device), "dim": dim, "bits": config.bits, "granularity": config.granularity,
        "p": config.p, "backend": "fht-cpu" if device.type == "cpu" and have_fht_cpu() else "torch",
        "threads": torch.get_num_threads(), "repeats": repeats,
        "encode_ms": enc_s * 1e3, "decode_ms": dec_s * 1e3,
        "encode_coords_per_s": dim / enc_s, "decode_coords_per_s": dim / dec_s,
        "break_even_gbit_s": saved_bits / (enc_s + dec_s) / 1e9,
        "nmse_single_worker": nmse,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1 << 20, help="coordinates per vector (default 2^20)")
    parser.add_argument("--repeats", type=int, default=30, help="measured steps (median reported)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--granularity", type=int, default=30)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "fht-cpu"],
                        help="Hadamard engine (auto: fht-cpu on CPU when installed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    config = THCConfig(bits=args.bits, granularity=args.granularity, backend=args.backend)
    res = measure(config, args.dim, args.repeats, torch.device(args.device))
    if not args.json and args.backend == "auto" and args.device == "cpu":
        torch_only = measure(THCConfig(bits=args.bits, granularity=args.granularity, backend="torch"),
                             args.dim, args.repeats, torch.device("cpu"))
        res["torch_backend_break_even_gbit_s"] = torch_only["break_even_gbit_s"]
    if args.json:
        print(json.dumps(res))
        return
    print(f"THC b={res['bits']} g={res['granularity']} d={res['dim']} on {res['device']} "
          f"({res['backend']}, {res['threads']} threads), median of {res['repeats']}")
    print(f"  encode {res['encode_ms']:8.2f} ms  {res['encode_coords_per_s'] / 1e6:8.1f} M coords/s")
    print(f"  decode {res['decode_ms']:8.2f} ms  {res['decode_coords_per_s'] / 1e6:8.1f} M coords/s")
    print(f"  break-even link rate {res['break_even_gbit_s']:.2f} Gbit/s (target > 3, stretch 5)")
    if "torch_backend_break_even_gbit_s" in res:
        print(f"  same with the pure-torch transform: {res['torch_backend_break_even_gbit_s']:.2f} Gbit/s")


if __name__ == "__main__":
    main()
