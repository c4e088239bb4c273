"""The control protocol of thc-aggregator (aggregator/control.py), without a socket."""

from __future__ import annotations

import json

from aggregator.control import USAGE, apply_command
from worker_lib.job import JobConfig

JOBS = {1: JobConfig(job=1, workers=2), 3: JobConfig(job=3, workers=4)}


def totals() -> dict[str, int]:
    return {"rx": 7}


def test_add_and_remove_change_a_copy_of_the_table() -> None:
    """add configures (or replaces) a job, remove forgets one; the caller's table is never mutated."""
    reply, new = apply_command("add job=5,workers=3", JOBS, totals)
    assert reply == "ok: job 5 configured" and new is not None and sorted(new) == [1, 3, 5]
    assert new[5].workers == 3 and sorted(JOBS) == [1, 3]
    reply, new = apply_command("remove 0x3", JOBS, totals)
    assert reply == "ok: job 3 removed" and new is not None and sorted(new) == [1]


def test_list_and_stats_answer_without_changing_anything() -> None:
    reply, new = apply_command("list", JOBS, totals)
    assert new is None and [j["job"] for j in json.loads(reply)] == [1, 3]
    reply, new = apply_command(" stats \n", JOBS, totals)
    assert new is None and json.loads(reply) == {"rx": 7}


def test_bad_commands_get_one_line_and_change_nothing() -> None:
    for text, want in (("remove 9", "error: no job 9"), ("remove x", "error: invalid literal"),
                       ("add workers=99", "error: job 1: workers must be in 1..32"), ("frobnicate", USAGE),
                       ("", USAGE)):
        reply, new = apply_command(text, JOBS, totals)
        assert new is None and reply.startswith(want) and "\n" not in reply, (text, reply)
