#!/bin/bash
# The GPU checks behind the README's "On a GPU", in one go (about 4 minutes on an H100 with 16 cores):
# the CUDA tests, compression on the GPU at 2^20 and 2^26 coordinates in three dtypes, a DDP step with
# CUDA tensors through the aggregator against gloo, and the aggregator benchmark on the machine's cores.
#
#   bash scripts/gpu-checks.sh [OUTDIR] [WHEELDIR]
#
# Run it from the repository root with a python3 that has a CUDA build of torch. OUTDIR (default
# gpu-checks-out) receives the logs and JSON summaries. WHEELDIR, for an offline machine, holds wheels
# of what the project needs and that machine lacks (scapy, dpkt, fht-cpu); they are installed under
# /tmp/thc-site and put on PYTHONPATH.
set -u
out=${1:-gpu-checks-out}; wheels=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/thc-site "$wheels"/*.whl || exit 1
  export PYTHONPATH="/tmp/thc-site:$PYTHONPATH"
fi
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')" || exit 1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import os, torch, numba; print('torch', torch.__version__, 'numba', numba.__version__, torch.cuda.get_device_name(), os.cpu_count(), 'CPUs')"
} 2>&1 | tee "$out/machine.txt"

echo "== CUDA tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts= -rs tests/test_codecs_gpu.py tests/test_ddp.py -k "gpu or cuda" 2>&1 | tee "$out/tests.txt" | tail -5

echo "== compression on the GPU (one JSON line per size and dtype)"
for dim in 1048576 67108864; do for dtype in float32 float16 bfloat16; do
  timeout 60 python3 benchmarks/compression.py --device cuda --dim "$dim" --dtype "$dtype" --repeats 20 --json
done; done | tee "$out/compression.jsonl"

echo "== DDP step with CUDA tensors, 2 ranks sharing the GPU, 4.19 M parameters, loopback"
for compression in thc none; do
  timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_ddp.py --device cuda \
    --compression "$compression" --steps 25 --warmup 5 --width 2030 --layers 2 --lr 0.01 \
    --json-out "$out/ddp_$compression.json" 2>&1 | tail -1
done

echo "== aggregator against the Python and C reflectors"
timeout 110 python3 benchmarks/aggregator.py --seconds 2 --skip-allreduce --repeats 1 2>&1 | tee "$out/aggregator.txt" | grep -E "CPUs|/ Python"
