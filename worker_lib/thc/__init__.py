"""Tensor Homomorphic Compression: RHT, optimal lookup tables, stochastic quantization, error feedback."""

from worker_lib.thc.codec import (
    Encoded,
    THCCodec,
    THCConfig,
    THCWorker,
    table_decode,
    table_encode,
    uniform_encode,
)
from worker_lib.thc.hadamard import RandomizedHadamard, fwht, next_pow2
from worker_lib.thc.quantize import lookup_sum, pack_indices, packed_size, unpack_indices
from worker_lib.thc.signs import SignKey, rademacher
from worker_lib.thc.table import (
    LookupTable,
    solve_table,
    table_objective,
    truncation_threshold,
    uniform_table,
)

__all__ = [
    "Encoded", "LookupTable", "RandomizedHadamard", "SignKey", "THCCodec", "THCConfig", "THCWorker",
    "fwht", "lookup_sum", "next_pow2", "pack_indices", "packed_size", "rademacher", "solve_table",
    "table_decode", "table_encode", "table_objective", "truncation_threshold", "uniform_encode",
    "uniform_table", "unpack_indices",
]
