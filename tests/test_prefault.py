"""aggregator/prefault.py: a job's banks are mapped into memory by a thread of their own, without changing
what the serving loop writes into them meanwhile."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from aggregator.engine import JobState
from aggregator.prefault import page_range, populate, populate_in_background
from worker_lib.job import JobConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore: Linux only")


def resident_pages(array: np.ndarray) -> tuple[int, int]:
    """(pages of ``array``'s whole pages that are mapped in memory, those pages), from mincore(2)."""
    start, length = page_range(array)
    pages = length // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), pages


def fresh_zeros(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """An int32 array on a new anonymous mapping: zero, and not one page of it touched yet (np.zeros may
    reuse memory malloc already touched)."""
    buf = mmap.mmap(-1, nbytes)
    return buf, np.frombuffer(buf, np.int32)


@pytest.fixture
def kernel_populates() -> None:
    probe_buf, probe = fresh_zeros(1 << 16)
    if not populate(probe):
        pytest.skip("this kernel refuses madvise(MADV_POPULATE_WRITE) (Linux 5.14+)")
    del probe
    probe_buf.close()


def test_populate_maps_every_page_and_leaves_the_zeros(kernel_populates: None) -> None:
    buf, a = fresh_zeros(8 << 20)
    assert resident_pages(a)[0] == 0  # nothing mapped before
    assert populate(a)
    mapped, pages = resident_pages(a)
    assert mapped == pages
    assert not a.any()
    del a
    buf.close()


def test_writes_made_while_the_thread_populates_are_kept(kernel_populates: None) -> None:
    buf, a = fresh_zeros(64 << 20)
    step = mmap.PAGESIZE // 4  # one int32 per page
    t = populate_in_background(a)
    assert t is not None
    a[::step] = np.arange(a[::step].size, dtype=np.int32) + 1  # the serving loop's adds, meanwhile
    a[1::step] += 7
    t.join(timeout=60)
    assert not t.is_alive()
    assert np.array_equal(a[::step], np.arange(a[::step].size, dtype=np.int32) + 1)
    assert (a[1::step] == 7).all()
    assert resident_pages(a)[0] == resident_pages(a)[1]
    del a
    buf.close()


def test_a_large_job_s_banks_are_mapped_by_their_own_thread(kernel_populates: None) -> None:
    job = JobState(JobConfig(job=3, workers=2, slots=512, elems=8192, mtu=9000))  # 32 MiB
    assert job.prefault is not None and job.prefault.name == "thc-prefault"
    job.prefault.join(timeout=60)
    mapped, pages = resident_pages(job.sums)
    assert mapped == pages
    assert not job.sums.any()


def test_small_banks_and_strided_arrays() -> None:
    assert JobState(JobConfig(job=4, workers=2, slots=8, elems=64)).prefault is None  # faults in at once
    with pytest.raises(ValueError, match="C-contiguous"):
        populate(np.zeros((64, 64), np.int32)[:, ::2])
