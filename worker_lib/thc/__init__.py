"""Tensor Homomorphic Compression: RHT, optimal lookup tables, stochastic quantization, error feedback.

Names are imported lazily (PEP 562): an aggregator that only needs ``solve_table`` does not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Encoded": "codec", "THCCodec": "codec", "THCConfig": "codec", "THCWorker": "codec",
    "table_decode": "codec", "table_encode": "codec", "uniform_encode": "codec",
    "RandomizedHadamard": "hadamard", "fwht": "hadamard", "next_pow2": "hadamard",
    "lookup_sum": "quantize", "pack_indices": "quantize", "packed_size": "quantize",
    "unpack_indices": "quantize",
    "SignKey": "signs", "rademacher": "signs",
    "LookupTable": "table", "solve_table": "table", "table_objective": "table",
    "truncation_threshold": "table", "uniform_table": "table",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
