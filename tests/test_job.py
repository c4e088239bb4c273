"""The one job description (worker_lib/job.py): what a worker's requests of a job must carry."""

from __future__ import annotations

from worker_lib.job import JobConfig
from worker_lib.wire import Header, PacketType


def test_request_fields_follow_the_validation_table() -> None:
    """DATA of a THC job carries K b-bit elements, DATA of an uncompressed job K int32, NORM one 32-bit
    value; every request carries the job's id, key and table id, and the fields given."""
    thc = JobConfig(job=7, key=0x1234, workers=2, bits=2, granularity=3, elems=16, slots=4)
    assert thc.request_fields(PacketType.DATA, worker=1, slot=3) == {
        "type": 1, "job": 7, "key": 0x1234, "table_id": thc.table_id, "elems": 16, "width": 2, "worker": 1, "slot": 3}
    assert thc.table_id != 0
    norm = thc.request_fields(PacketType.NORM, round=5)
    assert (norm["type"], norm["elems"], norm["width"], norm["round"]) == (3, 1, 32, 5)
    plain = JobConfig(job=8, workers=2, kind="uncompressed", elems=16)
    assert plain.request_fields(PacketType.DATA) == {
        "type": 1, "job": 8, "key": plain.key, "table_id": 0, "elems": 16, "width": 32}
    hdr, payload = Header.parse(Header(**thc.request_fields(PacketType.DATA, chunk=9)).pack(b"\x01"))
    assert (hdr.job, hdr.chunk, hdr.width, payload) == (7, 9, 2, b"\x01")
