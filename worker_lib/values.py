"""Checks of argument values shared by the library's modules (the job, the codec, the transport)."""

from __future__ import annotations

import numpy as np

#: The largest finite float32: a norm travels as one (the norm stage's payload), so none may exceed it.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer, Python's or numpy's, and not a bool (a bool is an int to Python, but
    ``workers=True`` or ``tensor=False`` is a mistake, not a count or an id)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
