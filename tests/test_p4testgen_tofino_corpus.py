"""The P4Testgen path corpora of the Tofino program (tests/p4testgen/tofino*, ``python -m p4gen.testgen_tofino``:
K = 8, and the claimed K = 64 on Tofino 1 and K = 160 on Tofino 2) replayed on the reference state machine:
each path's verdict, read from its trace, must be the reference aggregator's for the same packet in the
state the path's registers encode.

The mapping (docs/tofino.md, "Path tests"):

- **Pass 1** (a packet from a front-panel port). The frame is a THC request when the program takes it as one
  (IPv4 without options, UDP to 9451, a ``thc_service`` entry for its destination); then the path must
  count RX. The ``thc_jobs`` entry becomes a JobConfig (the corpus's K, b = 4); the table id is opaque to both
  sides, as in the BMv2 corpus. The registers the path reads become the reference's slot and bank: the
  ``slot_state`` cell at slot_base + slot (0: never used; round ++ 0x0001: the slot's round) and, at bank
  (slot_base + slot) * 2 + round mod 2, ``bank_tag`` (kind ++ round; 0: empty), ``bank_seen`` (the bitmap),
  ``bank_count`` (the count; complete when it reached the threshold). Cells the program never writes
  (another low half, another kind) are counted apart. The counters of pass 1 must be the reference's
  (but ACCEPTED, COMPLETED and ELEMENTS, which pass 2 counts), and the bridge header pass 1 writes must say
  what the reference did: start a round (OP_SET, count 1), add (OP_ADD and the count after it), the retained
  result (OP_READ), nothing but learning (a duplicate or kind mismatch), or a straggler notice whose THC
  header is the reference's.
- **Pass 2** (a packet from the recirculation port, its bridge header as pass 1 writes it). The reference
  job has the bridge's threshold, and its bank the state pass 1 saw: FRESH for OP_SET, the round with
  count - 1 contributors and the ``bank_result_bitmap`` cell for OP_ADD, complete with the count, the
  bitmap and the sum words for OP_READ. Pass 2's counters (ACCEPTED, COMPLETED) must be the reference's,
  its answer (multicast or unicast) the reference's kind of answer, and the answer's THC header and, for
  a retained result, its sums (four 8-bit lanes per word) the reference's (the words of the corpora as
  checked in are all 0: lane order is not exercised, docs/tofino.md).

P4Testgen's Tofino model (p4c 34b86e9) models neither the packet replication engine nor the loop of
recirculation, so what is compared is each pass's decision and the headers it writes; a multicast
result's sums come from lookup entries P4Testgen invents, which no reference table reproduces, and are
not compared.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aggregator.state import ReferenceAggregator
from p4gen.headers import p4_name
from p4gen.testgen_tofino import CORPORA, TESTS_FILE, CorpusSpec
from tests.p4_support import ETH, IP4, UDP, thc_destination
from worker_lib.job import JobConfig
from worker_lib.wire.layout import FIELDS, HEADER_BYTES, THC_UDP_PORT, PacketType, field_offsets
from worker_lib.wire.protocol import Counter, Header

ROOT = Path(__file__).resolve().parents[1]

BRIDGE = 28  #: bytes of the bridge header in front of a pass-2 packet's Ethernet header
OP_SET, OP_ADD, OP_READ = 1, 2, 3
PHASE_RECIRC, PHASE_ANSWER = 1, 2
EMIT_NONE, EMIT_MULTICAST, EMIT_RETAINED, EMIT_STRAGGLER = 0, 1, 2, 3
NO_ROW = 0xFFFF
_TABLE_ID = field_offsets()["table_id"]
PASS2_COUNTERS = {"ACCEPTED", "COMPLETED"}  #: what the switch counts in pass 2 (ELEMENTS: from ACCEPTED)
#: fields of the bridge header in order, with their bytes (p4src/tofino/thc.p4.in, thc_bridge_h)
BRIDGE_FIELDS = (("phase", 1), ("op", 1), ("emit", 1), ("learn", 1), ("fanout", 1), ("kind", 1), ("count", 1),
                 ("threshold", 1), ("in_port", 2), ("job_index", 2), ("worker_row", 2), ("mcast_grp", 2),
                 ("slot", 2), ("bitmap", 4), ("switch_mac", 6))


class Skip(Exception):
    """The test is outside what the reference can be held to (the reason is its message)."""


#: the corpora checked in (p4gen.testgen_tofino.CORPORA; each is replayed)
SPECS = [spec for spec in CORPORA.values() if (spec.folder / "manifest.json").exists()]


def load_corpus(spec: CorpusSpec) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress((spec.folder / TESTS_FILE).read_bytes()).splitlines()]


def switch_counters(rec: dict) -> dict[str, int]:
    """The counters the path updates, under the reference's names."""
    out: collections.Counter[str] = collections.Counter()
    for name, index in rec["counters"]:
        out[{"thc_rx": "RX", "thc_accepted": "ACCEPTED", "thc_completed": "COMPLETED"}.get(name)
            or Counter(index).name] += 1
    return dict(out)


def reference_counters(ref: ReferenceAggregator, keep: set[str] | None = None, drop: set[str] = frozenset()) -> dict:
    got = {Counter(i).name: n for i, n in enumerate(ref.counters) if n and Counter(i).name != "ELEMENTS"}
    return {k: v for k, v in got.items() if (keep is None or k in keep) and k not in drop}


def emitted(rec: dict, field: str) -> dict | None:
    """The first header the ingress deparser emits that has ``field`` (bridge: phase; THC: type_)."""
    return next((e for e in rec["emits"] if field in e), None)


def thc_fields(hdr: Header) -> dict[str, int]:
    """A THC header as the P4 program names its fields, but the table id (opaque to the replay)."""
    return {p4_name(f.name): getattr(hdr, f.name) for f in FIELDS if f.name != "table_id"}


def assert_thc_header(rec: dict, answer: bytes, where: str) -> None:
    """The THC header the switch emits is the reference's answer's (but the opaque table id)."""
    got = emitted(rec, "type_")
    assert got is not None, f"{where}: the switch emits no THC header"
    want = thc_fields(Header.parse(answer)[0])
    differ = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    assert not differ, f"{where}: THC header fields (switch, reference): {differ}"


def datagram_of(frame: bytes, start: int) -> bytes:
    """The UDP payload of the frame whose Ethernet header begins at ``start``, as long as UDP says."""
    udp = start + ETH + IP4
    ulen = int.from_bytes(frame[udp + 4:udp + 6], "big")
    if ulen < UDP or len(frame) < udp + ulen:
        raise Skip("truncated")
    return frame[udp + UDP: udp + ulen]


def served(frame: bytes, entries: list) -> bool:
    """Whether pass 1 takes the frame as a THC request (thc_service hit, UDP to the THC port)."""
    dst = thc_destination(frame)
    return dst is not None and any(t.endswith("thc_service") and act.endswith("thc_serve")
                                   and k["hdr.ipv4.dstAddr"][0] == dst for t, k, act, _ in entries)


def bank_index(slot: int, rnd: int) -> str:
    return str(slot * 2 + (rnd & 1))


def replay_pass1(rec: dict, spec: CorpusSpec) -> str:
    frame, where = bytes.fromhex(rec["packet"]), f"P4Testgen run {rec['run']} path {rec['path']} (pass 1)"
    counted = switch_counters(rec)
    if not served(frame, rec["entries"]):
        assert "RX" not in counted, f"{where}: not a THC request, yet counted {counted}"
        return "forwarded"
    if not rec["ingress"]:
        # Too short for a header the parser extracts: Tofino's parser drops the packet before ingress runs,
        # so it is not counted (the reference counts SHORT or the check it fails); both drop it.
        assert not counted and not emitted(rec, "phase"), f"{where}: counted {counted} without ingress"
        return "parser drop"
    assert "RX" in counted, f"{where}: a THC request (thc_service hit, UDP to {THC_UDP_PORT}) not counted"
    data = bytearray(datagram_of(frame, 0))
    jobs = [(k, a) for t, k, act, a in rec["entries"] if t.endswith("thc_jobs") and act.endswith("job_config")]
    ref = ReferenceAggregator()
    cfg = None
    if jobs:
        (key, a), = jobs
        cfg = JobConfig(job=key["hdr.thc.job"][0], key=a["key"], workers=a["workers"], threshold=a["threshold"],
                        slots=a["slots"], elems=spec.elems, bits=4)
        ref.add_job(cfg)
    hdr = Header.parse(bytes(data))[0] if len(data) >= HEADER_BYTES else None
    if cfg is not None and hdr is not None and hdr.job == cfg.job:
        table_id = cfg.table_id if hdr.table_id == a["table_id"] else (cfg.table_id + 1) & 0xFFFF
        data[_TABLE_ID:_TABLE_ID + 2] = table_id.to_bytes(2, "big")
        if hdr.slot < cfg.slots:
            set_pass1_state(ref, cfg, hdr, rec["registers"], a["slot_base"])
    out = ref.handle(bytes(data))
    want = reference_counters(ref, drop=PASS2_COUNTERS)
    assert counted == want, f"{where}: switch counters {counted}, reference {want}"
    if ref.counters[Counter.ACCEPTED] + ref.counters[Counter.RETAINED] + ref.counters[Counter.DUPLICATE] \
            + ref.counters[Counter.KIND_MISMATCH] + ref.counters[Counter.STRAGGLER] == 0:
        assert rec["ingress_drop"], f"{where}: the reference drops the request, the switch does not"
        return "dropped"
    bridge = emitted(rec, "phase")
    assert bridge is not None, f"{where}: no bridge header"
    w = Header.parse(bytes(data))[0]
    slot = ref.jobs[w.job].slots[w.slot]
    common = {"kind": w.type, "threshold": cfg.threshold, "slot": a["slot_base"] + w.slot, "in_port": rec["port"],
              "mcast_grp": a["mcast_grp"]}
    assert {k: bridge[k] for k in common} == common, f"{where}: bridge {bridge}, expected {common}"
    bank = slot.banks[w.round % 2]
    if ref.counters[Counter.NEW_ROUND]:
        expect = {"phase": PHASE_RECIRC, "op": OP_SET, "count": 1, "bitmap": 1 << w.worker,
                  "job_index": a["job_index"]}
    elif ref.counters[Counter.ACCEPTED]:
        expect = {"phase": PHASE_RECIRC, "op": OP_ADD, "count": bank.count, "bitmap": 1 << w.worker,
                  "job_index": a["job_index"]}
    elif ref.counters[Counter.RETAINED]:
        expect = {"phase": PHASE_RECIRC, "op": OP_READ, "count": bank.count, "bitmap": 0, "job_index": NO_ROW}
    elif ref.counters[Counter.STRAGGLER]:
        expect = {"phase": PHASE_ANSWER, "emit": EMIT_STRAGGLER}
        (to_all, notice), = out
        assert not to_all
        assert_thc_header(rec, notice, where)
    else:  # a duplicate before completion or a kind mismatch: egress learns the sender, then drops it
        expect = {"phase": PHASE_ANSWER, "emit": EMIT_NONE, "learn": 1}
    assert {k: bridge[k] for k in expect} == expect, f"{where}: bridge {bridge}, reference says {expect}"
    return "compared"


def set_pass1_state(ref: ReferenceAggregator, cfg: JobConfig, hdr: Header, regs: dict, slot_base: int) -> None:
    """The reference slot and bank of ``hdr`` as the pass-1 registers the path reads hold them."""
    where = slot_base + hdr.slot
    cell = regs.get("slot_state", {}).get(str(where), 0)
    if cell and cell & 0xFFFF != 1:
        # P4Testgen picks any cell; the program writes round ++ 0x0001. Another low half stands for the
        # slot's round when slot_check decides as it would on the cell of that round (it does but at the
        # edges: a low half of 0 makes the same round look newer).
        written = cell & 0xFFFF0000 | 1
        if starts_round(cell, hdr.round) != starts_round(written, hdr.round):
            raise Skip("a slot cell the program never writes")
        cell = written
    slot = ref.jobs[cfg.job].slots[hdr.slot]
    slot.used, slot.round = cell != 0, cell >> 16
    b = bank_index(where, hdr.round)
    tag = regs.get("bank_tag", {}).get(b, 0)
    if not tag:
        return
    bank = slot.banks[hdr.round % 2]
    bank.sums, bank.norm = np.zeros(cfg.elems, np.int32), 0
    if tag not in (PacketType.DATA << 16 | hdr.round, PacketType.NORM << 16 | hdr.round):
        # any other cell (P4Testgen's choice) is, to tag_check, a bank of another round: one of the same
        # parity stands for it (the program writes kind ++ round); its count and bitmap are not read
        bank.round, bank.kind = (hdr.round + 2) & 0xFFFF, hdr.type
        return
    bank.round, bank.kind = hdr.round, tag >> 16
    count = regs.get("bank_count", {}).get(b, 0)
    if count > 32:
        raise Skip("a count the program never writes")
    bank.bitmap, bank.count = regs.get("bank_seen", {}).get(b, 0), count
    bank.complete = count >= cfg.threshold


def starts_round(cell: int, rnd: int) -> bool:
    """slot_check's test (p4src/tofino/thc.p4.in): the packet of round ``rnd`` starts its round on ``cell``."""
    diff = ((rnd << 16 | 1) - cell) & 0xFFFFFFFF
    return cell == 0 or 0 < diff < 1 << 31


def parse_bridge(frame: bytes) -> dict[str, int]:
    out, at = {}, 0
    for name, size in BRIDGE_FIELDS:
        out[name] = int.from_bytes(frame[at:at + size], "big")
        at += size
    return out


def replay_pass2(rec: dict, spec: CorpusSpec) -> str:
    frame, where = bytes.fromhex(rec["packet"]), f"P4Testgen run {rec['run']} path {rec['path']} (pass 2)"
    br = parse_bridge(frame)
    data = bytearray(datagram_of(frame, BRIDGE))
    hdr = Header.parse(bytes(data))[0]
    n = max(br["threshold"], br["count"], hdr.worker + 1)
    try:  # the program's 8-bit sums, at a granularity whose sums over n workers fit them
        cfg = JobConfig(job=hdr.job, key=hdr.key, workers=n, threshold=br["threshold"], slots=hdr.slot + 1,
                        elems=spec.elems, bits=4, result_bits=8, granularity=255 // n)
    except ValueError:
        raise Skip("no job of 8-bit sums for this many workers at b = 4") from None
    data[_TABLE_ID:_TABLE_ID + 2] = cfg.table_id.to_bytes(2, "big")
    ref = ReferenceAggregator([cfg])
    slot = ref.jobs[cfg.job].slots[hdr.slot]
    regs, b = rec["registers"], bank_index(br["slot"], hdr.round)
    bitmap = regs.get("bank_result_bitmap", {}).get(b, 0)
    if br["op"] != OP_SET:
        slot.used, slot.round = True, hdr.round
        bank = slot.banks[hdr.round % 2]
        bank.round, bank.kind, bank.bitmap = hdr.round, hdr.type, bitmap
        if br["op"] == OP_ADD:  # the sums of a multicast result are not compared (see the module's text)
            if bitmap >> hdr.worker & 1:
                raise Skip("a result bitmap that already holds the new contributor (pass 1 saw it new)")
            bank.count, bank.sums = br["count"] - 1, np.zeros(spec.elems, np.int32)
        else:
            words = [regs.get(f"word_{i}.sums", {}).get(b, 0) for i in range(spec.elems // 4)]
            bank.sums = np.array([w >> s & 0xFF for w in words for s in (24, 16, 8, 0)], np.int32)
            bank.norm = regs.get("bank_norm", {}).get(b, 0)
            bank.count, bank.complete = br["count"], True
    out = ref.handle(bytes(data))
    took = Counter.RETAINED if br["op"] == OP_READ else Counter.ACCEPTED
    assert ref.counters[took] == 1, f"{where}: the reference does not take the request as pass 1 did: " \
        f"{reference_counters(ref)}"
    counted = switch_counters(rec)
    want = reference_counters(ref, keep=PASS2_COUNTERS)
    assert counted == want, f"{where}: switch counters {counted}, reference {want}"
    bridge = emitted(rec, "phase")
    if not out:
        assert rec["ingress_drop"] and bridge["emit"] == EMIT_NONE, f"{where}: the reference answers nothing"
        return "compared"
    (to_all, answer), = out
    assert bridge["emit"] == (EMIT_MULTICAST if to_all else EMIT_RETAINED), f"{where}: bridge {bridge}, {out}"
    assert_thc_header(rec, answer, where)
    if not to_all:  # a retained result: the sums (or norm) the registers hold, in the reference's layout
        got = emitted(rec, "w0") if hdr.type == PacketType.DATA else emitted(rec, "value")
        payload = b"".join(v.to_bytes(4, "big") for v in got.values())
        want = answer[HEADER_BYTES:]
        assert payload == want, f"{where}: switch {payload.hex()}, reference {want.hex()}"
    return "compared"


def replay(rec: dict, spec: CorpusSpec) -> str:
    """'compared', 'dropped', 'forwarded' or a skip reason; AssertionError on a disagreement."""
    try:
        return replay_pass2(rec, spec) if rec["port"] == spec.recirc_port else replay_pass1(rec, spec)
    except Skip as why:
        return str(why)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_manifest_matches_the_corpus(spec: CorpusSpec) -> None:
    """The corpus was generated from today's template, and the manifest describes it."""
    manifest = json.loads((spec.folder / "manifest.json").read_text())
    assert manifest["program_sha256"] == hashlib.sha256(spec.rendered_program().encode()).hexdigest(), \
        f"p4src/tofino/thc.p4.in changed since the corpus was generated: run python -m p4gen.testgen_tofino " \
        f"--corpus {spec.name} (P4Testgen with its tofino target: scripts/build-p4-toolchain.sh --with-tofino)"
    assert len(load_corpus(spec)) == manifest["tests"]
    assert (manifest["target"], manifest["elems"], manifest["recirc_port"]) == \
        (spec.target, spec.elems, spec.recirc_port)
    cov = manifest["statement_coverage"]
    assert 0 < cov["covered"] <= cov["statements"]


def test_the_corpora_are_checked_in() -> None:
    """Every corpus p4gen.testgen_tofino names is in the repository (a missing one would skip silently)."""
    assert [spec.name for spec in SPECS] == list(CORPORA)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_every_path_agrees_with_the_reference(spec: CorpusSpec) -> None:
    """Every test of the corpus through the reference: no disagreement, and every verdict of both passes
    compared (a mapping that skipped everything cannot pass)."""
    records = load_corpus(spec)
    kinds: collections.Counter[str] = collections.Counter()
    verdicts: collections.Counter[str] = collections.Counter()
    failures = []
    for rec in records:
        try:
            kind = replay(rec, spec)
        except AssertionError as exc:
            failures.append(str(exc))
            continue
        kinds[kind] += 1
        if kind == "compared":
            verdicts[verdict(rec, spec)] += 1
    assert not failures, f"{len(failures)} of {len(records)} paths disagree:\n" + "\n".join(failures[:10])
    # Most of P4Testgen's paths are plain IPv4 forwarding, with no THC verdict to compare; docs/tofino.md
    # gives the counts of each corpus as checked in (about 700 validation drops and 300 to 770 others).
    assert kinds["dropped"] >= 500 and kinds["compared"] >= 250, kinds
    every = {f"pass 1 {v}" for v in ("start", "add", "retained", "learn only", "straggler")} | \
        {f"pass 2 {v}" for v in ("start", "add", "retained")}
    assert all(verdicts[v] >= 10 for v in every), verdicts


def verdict(rec: dict, spec: CorpusSpec) -> str:
    """What a compared path's pass decided, from the bridge header it wrote."""
    b = emitted(rec, "phase")
    if rec["port"] == spec.recirc_port:
        return "pass 2 " + {OP_SET: "start", OP_ADD: "add", OP_READ: "retained"}[b["op"]]
    if b["phase"] == PHASE_RECIRC:
        return "pass 1 " + {OP_SET: "start", OP_ADD: "add", OP_READ: "retained"}[b["op"]]
    return "pass 1 " + ("straggler" if b["emit"] == EMIT_STRAGGLER else "learn only")


def test_generator_without_p4testgen_says_so_in_one_line(tmp_path: Path) -> None:
    """Without P4Testgen the generator names what is missing and how to get it; nothing is written."""
    r = subprocess.run([sys.executable, "-m", "p4gen.testgen_tofino", "--p4testgen", str(tmp_path / "none"),
                        "--corpus", "tofino", "--out", str(tmp_path / "corpus")], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == ["p4gen.testgen_tofino: p4testgen not found: build it with "
                                             "scripts/build-p4-toolchain.sh --with-tofino, or pass --p4testgen PATH"]
    assert not (tmp_path / "corpus").exists()


@pytest.mark.parametrize("field", ["op", "count"])
def test_a_wrong_bridge_is_caught(field: str) -> None:
    """The replay can fail: a pass-1 path whose bridge header says another operation or count than the
    reference's decision is reported."""
    spec = CORPORA["tofino"]
    rec = next(r for r in load_corpus(spec) if r["port"] != spec.recirc_port and replay(r, spec) == "compared"
               and emitted(r, "phase")["op"] in (OP_SET, OP_ADD))
    emitted(rec, "phase")[field] += 1
    with pytest.raises(AssertionError, match="reference says"):
        replay(rec, spec)


def test_a_wrong_retained_result_is_caught() -> None:
    """The replay can fail in pass 2 too: a retained result whose sums differ from the registers' words
    (as the reference lays them out) is reported."""
    spec = CORPORA["tofino"]
    rec = next(r for r in load_corpus(spec) if r["port"] == spec.recirc_port and replay(r, spec) == "compared"
               and emitted(r, "phase")["emit"] == EMIT_RETAINED)
    payload = emitted(rec, "w0") or emitted(rec, "value")
    payload[next(iter(payload))] ^= 1
    with pytest.raises(AssertionError, match="switch"):
        replay(rec, spec)
