"""The P4Testgen path corpus of the BMv2 program (tests/p4testgen/bmv2, ``python -m p4gen.testgen``)
replayed on the reference state machine: every path's packet, through the job entries P4Testgen chose,
must make the reference aggregator answer what P4Testgen expects of the switch.

The mapping from a test to the reference (docs/bmv2.md, "Path tests"):

- A frame is a THC datagram when the program would take it as one: IPv4 without options or
  fragmentation, UDP to port 9451, a ``thc_service`` entry for its destination address. The datagram
  is the UDP payload as long as the UDP length says (what a host's socket would deliver); tests whose
  frame holds fewer bytes than that are not comparable (a host drops a truncated datagram; the switch
  reads the length field only) and are counted apart, as are frames the program forwards.
- Each ``thc_jobs`` entry becomes a JobConfig with its job id, key, workers, threshold and slots
  (K = 8, b = 4). The table id the packet must carry is an opaque value to both sides: a packet
  carrying the entry's ``table_id`` is given the reference job's table id, any other value another one.
  (The element lookup entries set the values of sums, which no modelled path outputs: see below.)
- The counters each path increments (from its trace) must be the reference's, counter for counter:
  the program's verdict on the packet (which check dropped it, a new round, an accepted contribution,
  a completion), also where the model drops what the switch would multicast.
- P4Testgen's BMv2 model (v1.2.4.8) starts every register at zero and drops a packet given a multicast
  group: a test that expects nothing allows the reference only answers to all workers (a completion);
  a test that expects a packet wants exactly that packet's UDP payload from the reference, as a reply
  to the sender. No path the model reaches answers with sums (RETAINED needs a complete bank): a
  corpus that expects one fails here, so that its lookup entries get mapped first.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aggregator.state import ReferenceAggregator
from p4gen.testgen import CORPUS, ELEMS, TESTS_FILE, rendered_program
from tests.p4_support import ETH, IP4, UDP, thc_destination
from worker_lib.job import JobConfig
from worker_lib.wire.layout import PacketType, field_offsets
from worker_lib.wire.protocol import Counter

ROOT = Path(__file__).resolve().parents[1]
_JOB, _TABLE_ID = field_offsets()["job"], field_offsets()["table_id"]
_ADD = re.compile(r'^add "([^"]+)" (?:\d+ )?(.*?)"([^"]+)"\((.*)\)$')
_MATCH = re.compile(r'"([^"]+)":([^\s,]+)')


@dataclass
class Case:
    """One P4Testgen test: its table entries, input frame and expected frames."""

    path: int
    counters: list[int] = field(default_factory=list)  #: the switch counters the path increments, in order
    entries: list[tuple[str, dict[str, str], str, dict[str, int]]] = field(default_factory=list)
    port: int = -1
    frame: bytes = b""
    expect: list[tuple[int, str]] = field(default_factory=list)  #: (port, hex with '*' for any nibble)


def load_corpus(path: Path) -> list[Case]:
    """Parse the STF tests of the corpus file (add / packet / expect lines)."""
    cases: list[Case] = []
    for line in gzip.decompress(path.read_bytes()).decode().splitlines():
        if line.startswith("# P4Testgen path "):
            cases.append(Case(int(line.rsplit(" ", 1)[1])))
        elif line.startswith("# counters:"):
            cases[-1].counters = [int(c) for c in line.split(":", 1)[1].split()]
        elif line.startswith("add "):
            m = _ADD.match(line)
            assert m, line
            table, matches, action, params = m.groups()
            args = {k: int(v, 16) for k, v in _MATCH.findall(params)}
            cases[-1].entries.append((table, dict(_MATCH.findall(matches)), action, args))
        elif line.startswith("packet "):
            _, port, hexa = line.split()
            cases[-1].port, cases[-1].frame = int(port), bytes.fromhex(hexa)
        elif line.startswith("expect "):
            _, port, hexa = line.split()
            cases[-1].expect.append((int(port), hexa.rstrip("$")))
    return cases


def thc_datagram(case: Case) -> bytes | None:
    """The UDP payload the program takes as a THC datagram, or None if it forwards the frame."""
    f = case.frame
    dst = thc_destination(f)
    if dst is None or not any(t.endswith("thc_service") and int(m["hdr.ipv4.dstAddr"], 16) == dst
                              for t, m, _, _ in case.entries):
        return None
    ulen = int.from_bytes(f[38:40], "big")
    return f[ETH + IP4 + UDP: ETH + IP4 + ulen]


def reference_for(case: Case) -> tuple[ReferenceAggregator, dict[int, tuple[int, int]]]:
    """The reference with one job per ``thc_jobs`` entry, and per job (entry table id, reference table id)."""
    jobs, ids = [], {}
    for table, match, action, a in case.entries:
        if table.endswith("thc_jobs") and action.endswith("job_config"):
            cfg = JobConfig(job=int(match["hdr.thc.job"], 16), key=a["key"], workers=a["workers"],
                            threshold=a["threshold"], slots=a["slots"], elems=ELEMS, bits=4)
            jobs.append(cfg)
            ids[cfg.job] = (a["table_id"], cfg.table_id)
    return ReferenceAggregator(jobs), ids


def matches(pattern: str, data: bytes) -> bool:
    """Whether ``data`` is the hex ``pattern`` ('*' matches any nibble)."""
    got = data.hex().upper()
    return len(got) == len(pattern) and all(p in ("*", g) for p, g in zip(pattern, got, strict=True))


def replay(case: Case) -> str:
    """'forwarded', 'truncated', 'silent' or 'reply' when the reference agrees; raise AssertionError if not."""
    datagram = thc_datagram(case)
    if datagram is None:
        return "forwarded"
    ulen = int.from_bytes(case.frame[38:40], "big")
    if ulen < UDP or len(datagram) < ulen - UDP:
        return "truncated"
    ref, ids = reference_for(case)
    data = bytearray(datagram)
    if len(data) >= _TABLE_ID + 2:
        job = int.from_bytes(data[_JOB:_JOB + 2], "big")
        carried = int.from_bytes(data[_TABLE_ID:_TABLE_ID + 2], "big")
        entry_id, ref_id = ids.get(job, (None, 0))
        data[_TABLE_ID:_TABLE_ID + 2] = (ref_id if carried == entry_id else (ref_id + 1) & 0xFFFF).to_bytes(2, "big")
    out = ref.handle(bytes(data))
    unicast = [pkt for to_all, pkt in out if not to_all]
    where = f"P4Testgen path {case.path}"
    # The program counts accepted DATA packets under ELEMENTS (its control plane multiplies by K).
    got = {Counter(i).name: n // (ELEMS if i == Counter.ELEMENTS else 1) for i, n in enumerate(ref.counters) if n}
    want = {Counter(i).name: n for i, n in collections.Counter(case.counters).items()}
    assert got == want, f"{where}: switch counters {want}, reference {got}"
    if not case.expect:
        assert not unicast, f"{where}: the switch sends nothing, the reference answers the sender {unicast[0].hex()}"
        return "silent"
    assert len(case.expect) == 1 and len(unicast) == 1, f"{where}: expected {case.expect}, reference {out}"
    port, pattern = case.expect[0]
    assert port == case.port, f"{where}: the switch answers on port {port}, not the sender's {case.port}"
    reply = bytes.fromhex(pattern.replace("*", "0"))
    start = ETH + IP4 + UDP
    length = int.from_bytes(reply[38:40], "big") - UDP
    assert unicast[0][1] != PacketType.RESULT, f"{where}: a reply carrying sums: map the lookup entries first"
    assert matches(pattern[2 * start: 2 * (start + length)], unicast[0]), \
        f"{where}: switch {pattern[2 * start: 2 * (start + length)]}\nreference {unicast[0].hex().upper()}"
    return "reply"


def test_manifest_matches_the_corpus() -> None:
    """The corpus was generated from today's template, and the manifest describes it: its test counts,
    and the coverage P4Testgen reported."""
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    assert manifest["program_sha256"] == hashlib.sha256(rendered_program().encode()).hexdigest(), \
        "p4src/bmv2/thc.p4.in changed since the corpus was generated: run python -m p4gen.testgen (P4Testgen: " \
        "scripts/build-p4-toolchain.sh --with-testgen)"
    cases = load_corpus(CORPUS / TESTS_FILE)
    assert len(cases) == manifest["tests"] and manifest["elems"] == ELEMS
    assert sum(bool(c.expect) for c in cases) == manifest["tests_with_output"]
    cov = manifest["statement_coverage"]
    assert 0 < cov["covered"] <= cov["statements"]
    assert cov["fraction"] == pytest.approx(cov["covered"] / cov["statements"], abs=1e-5)


def test_every_path_agrees_with_the_reference() -> None:
    """Every test of the corpus through the reference: no disagreement, and most paths really compared
    (so that a mapping that skipped everything cannot pass)."""
    cases = load_corpus(CORPUS / TESTS_FILE)
    kinds: dict[str, int] = {}
    failures = []
    for case in cases:
        try:
            kind = replay(case)
        except AssertionError as exc:
            failures.append(str(exc))
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    assert not failures, f"{len(failures)} of {len(cases)} paths disagree:\n" + "\n".join(failures[:10])
    compared = kinds.get("silent", 0) + kinds.get("reply", 0)
    assert compared >= len(cases) // 2, kinds


def test_generator_without_p4testgen_says_so_in_one_line(tmp_path: Path) -> None:
    """Without P4Testgen the generator names what is missing and how to get it; nothing is written."""
    r = subprocess.run([sys.executable, "-m", "p4gen.testgen", "--p4testgen", str(tmp_path / "none"),
                        "--out", str(tmp_path / "corpus")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == ["p4gen.testgen: p4testgen not found: build it with "
                                             "scripts/build-p4-toolchain.sh --with-testgen, or pass --p4testgen PATH"]
    assert not (tmp_path / "corpus").exists()
