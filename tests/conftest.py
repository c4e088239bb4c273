"""Shared test configuration."""

import os

import torch

# Several test processes share two cores in CI; one intra-op thread each avoids OpenMP thrashing.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests marked `alone` run by themselves when pytest-xdist runs the suite in parallel.
pytest_plugins = ("tests.alone_lock",)
