"""P4Testgen's paths of the BMv2 program run on simple_switch_grpc: the switch sends exactly the frames
P4Testgen expects (ports and bytes, its masks aside) and its counters move as the path's trace says.

The program is the corpus's (the template rendered with K = 8, compiled by p4c-bm2-ss); the rig is
tests/test_bmv2_dataplane.py's (four host namespaces on ports 0..3, P4Runtime on a Unix socket). Each
path gets a fresh pipeline (empty tables, zeroed registers and counters: P4Testgen's starting state),
its table entries through P4Runtime, and its frame on its ingress port. By default one path per
distinct outcome (counters, ingress port, output ports) runs, 54 of the corpus's 1,141 paths, 13 s;
``THC_P4TESTGEN_ALL=1`` runs all of them (3 minutes here; one path's 13-byte frame cannot be sent
on a Linux interface and is skipped). Needs root, p4c-bm2-ss and
simple_switch_grpc; skips naming what is missing.
"""

from __future__ import annotations

import collections
import os

import pytest

from aggregator.p4rt.thc import table_update
from aggregator.switch.entries import LogicalEntry, Match
from p4gen.testgen import CORPUS, ELEMS, TESTS_FILE
from tests.p4_support import need_root, need_tools
from tests.test_bmv2_dataplane import QUIET, Rig, running_rig
from tests.test_p4testgen_corpus import Case, load_corpus, matches
from topologies.bmv2 import compile_program
from worker_lib.wire.protocol import Counter

CASES = load_corpus(CORPUS / TESTS_FILE)


def outcome(case: Case) -> tuple:
    """What a path shows: its counters, its ingress port and the ports of its expected frames."""
    return tuple(case.counters), case.port, tuple(port for port, _ in case.expect)


def selected() -> list[Case]:
    """One path per distinct outcome, or all of them with THC_P4TESTGEN_ALL=1."""
    if os.environ.get("THC_P4TESTGEN_ALL") == "1":
        return CASES
    first: dict[tuple, Case] = {}
    for case in CASES:
        first.setdefault(outcome(case), case)
    return list(first.values())


def logical(table: str, match: dict[str, str], action: str, params: dict[str, int]) -> LogicalEntry:
    """An STF entry as a logical entry (an LPM key is a 0b... string with '*' for the bits it ignores)."""
    fields = []
    for name, text in match.items():
        if text.startswith("0b"):
            bits = text[2:]
            fields.append(Match(name, int(bits.replace("*", "0"), 2), len(bits.rstrip("*"))))
        else:
            fields.append(Match(name, int(text, 16)))
    return LogicalEntry(table, tuple(fields), action, tuple(params.items()))


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    need_tools("p4c-bm2-ss", "simple_switch_grpc")
    need_root("network namespaces and veth pairs")
    program = compile_program(tmp_path_factory.mktemp("p4testgen_k8"), elems=ELEMS)
    with running_rig(program, tmp_path_factory.mktemp("p4testgen_run"), "thcpt") as r:
        yield r


@pytest.mark.parametrize("case", selected(), ids=lambda c: f"path{c.path}")
def test_path_on_bmv2(rig: Rig, case: Case) -> None:
    """The path's frame through a fresh pipeline with its entries: P4Testgen's frames and counters."""
    if len(case.frame) < 14:
        pytest.skip(f"a {len(case.frame)}-byte frame: Linux sends no frame shorter than an Ethernet header")
    rig.ctl.load(rig.program.p4info, rig.program.json)
    idx = rig.ctl.index
    rig.ctl.client.write([table_update(idx, logical(*e)) for e in case.entries])
    rig.drain()
    rig.send(case.port, case.frame)
    got = rig.collect(len(case.expect), timeout=2.0, quiet=QUIET)
    assert [p for p, _ in got] == [p for p, _ in case.expect], f"path {case.path}: ports {got} vs {case.expect}"
    for (_, frame), (_, pattern) in zip(got, case.expect, strict=True):
        assert matches(pattern, frame[: len(pattern) // 2]), \
            f"path {case.path}: BMv2 {frame.hex().upper()}\nP4Testgen {pattern}"
    stats = rig.ctl.stats()
    stats[Counter.ELEMENTS.name] //= ELEMS  # stats() reports elements; the trace counts DATA packets
    want = {Counter(i).name: n for i, n in collections.Counter(case.counters).items()}
    assert {k: v for k, v in stats.items() if v} == want, f"path {case.path}"
