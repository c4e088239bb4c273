"""Map a new job's register banks into memory off the packet path.

A job's banks (S slots x 2 banks x K int32 sums: 134 MB for 2,048 slots of 8,192 elements) come from
``np.zeros``, whose pages the kernel maps on their first write. The serving loop would then take
those faults itself, a few at every batch, while the job's first rounds go through its slots: in a
virtual machine whose memory had not been touched yet, writing 134 MB of fresh zeros took 300 ms
against 21 ms for memory already mapped, and a DDP run with jumbo frames (K = 8,192) lost 70-90 ms
on each of its first four steps (docs/measurements.md). A DPDK application allocates and touches its
memory at startup for the same reason.

``populate_in_background`` asks the kernel to map the pages writable (``madvise(MADV_POPULATE_WRITE)``,
Linux 5.14+) from a thread of its own. That call faults the pages in without writing to them, so it is
safe while the serving loop already adds into the banks, and ctypes releases the GIL during it.
Where the kernel lacks it, nothing changes: the pages fault in on first use, as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

#: madvise advice that maps a range's pages writable without touching them (Linux 5.14+).
MADV_POPULATE_WRITE = 23
#: Arrays smaller than this fault in faster than a thread starts: left alone.
MIN_BYTES = 1 << 22


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def page_range(array: np.ndarray) -> tuple[int, int]:
    """The whole pages inside ``array``'s memory: (first page's address, length in bytes; 0 if none)."""
    page = mmap.PAGESIZE
    start = -(-array.ctypes.data // page) * page
    end = (array.ctypes.data + array.nbytes) // page * page
    return start, max(0, end - start)


def populate(array: np.ndarray) -> bool:
    """Map every whole page of ``array`` (C-contiguous) writable now, leaving its contents as they are.
    False where the kernel or platform cannot (the pages then fault in on first use)."""
    if not array.flags.c_contiguous:
        raise ValueError("populate needs a C-contiguous array")
    madvise = _madvise()
    start, length = page_range(array)
    if madvise is None or not length:
        return False
    if madvise(start, length, MADV_POPULATE_WRITE) != 0:
        log.debug("madvise(MADV_POPULATE_WRITE) failed (errno %d): pages fault in on first use",
                  ctypes.get_errno())
        return False
    return True


def populate_in_background(array: np.ndarray, *, min_bytes: int = MIN_BYTES) -> threading.Thread | None:
    """Start a daemon thread that runs ``populate(array)``, holding the array until it is done; None for
    arrays under ``min_bytes``. The caller may write into ``array`` meanwhile."""
    if array.nbytes < min_bytes:
        return None
    t = threading.Thread(target=populate, args=(array,), name="thc-prefault", daemon=True)
    t.start()
    return t
