"""Generate the P4Testgen path corpora of the Tofino program: tests/p4testgen/tofino*/.

The Tofino counterpart of ``p4gen.testgen`` (the BMv2 corpus). For each geometry of ``CORPORA`` (K = 8 on
Tofino 1, explored to the end of its paths; the claimed K = 64 on Tofino 1 and K = 160 on Tofino 2, pass 1
to the end of its paths and each operation of pass 2 to a budget) it renders the Tofino template, runs
``p4testgen --target tofino|tofino2 --test-backend PTF`` on it with ``-DTHC_P4TESTGEN`` and statement
coverage tracking, and keeps per test what the reference replay needs, as one JSON object a line (gzip):
the input port and packet, the table entries and register contents the path needs, and the path's
outcome read from its trace: the counters it updates, the headers the ingress deparser emits (the bridge
header pass 1 hands to egress and pass 2, an answer's headers and sums) and whether ingress drops the
packet. tests/test_p4testgen_tofino_corpus.py replays every corpus on
the reference state machine.

    python -m p4gen.testgen_tofino                   # regenerate all (needs p4testgen with its tofino
                                                     # target: scripts/build-p4-toolchain.sh --with-tofino)
    python -m p4gen.testgen_tofino --corpus tofino   # one

Why the trace and not the PTF test's expected packet: P4Testgen's Tofino model (p4c 34b86e9) does not model
the packet replication engine (a multicast completion expects nothing) or recirculation (a packet sent to
the recirculation port is an output, and its expected bytes there lack the bridge header egress keeps), so
the verdicts of pass 1 and pass 2 are read where the program makes them. What -DTHC_P4TESTGEN changes in
the program (p4src/tofino/thc.p4.in), none of it in the program a switch runs: the IDENTITY hashes of the
register indices are written out as the concatenations they compute (the model does not compute Hash
externs), and testgen_assume keeps job entries, pass-2 bridge headers and the register cells pass 1 reads
to (or near) what the control plane and the program write.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from p4gen.testgen import INCLUDE_DIR, find_p4testgen, run_p4testgen
from p4gen.tofino import TofinoGeometry, render
from worker_lib.cli.args import int_in

ROOT = Path(__file__).resolve().parents[1]
PARSER = ROOT / "p4src" / "tofino" / "parser.p4"
CORPORA_DIR = ROOT / "tests" / "p4testgen"
TESTS_FILE = "corpus.jsonl.gz"
#: where scripts/build-p4-toolchain.sh --with-tofino installs P4Testgen with its tofino target
TOFINO_P4TESTGEN = Path("/opt/p4c-head/bin/p4testgen")
SLOTS = 64  #: register slots of the rendered programs (small indices, same code)
HEADER_KEPT = 64  #: bytes kept of a packet the program does not take as a THC request (see ``slim``)
_TEST = re.compile(r"\nclass Test(\d+)\(AbstractTest\):")
_REGISTER = re.compile(r"self\.setRegisterValue\('([^']+)', (0x[0-9A-F]+), (\d+)\)")
_ENTRY = re.compile(r"self\.insertTableEntry\(\s*'([^']+)',\s*\[(.*?)\],\s*'([^']+)',\s*\[(.*?)\]\s*\)", re.S)
_KEY = re.compile(r"gc\.KeyTuple\('([^']+)', (0x[0-9A-F]+)(?:, (0x[0-9A-F]+))?\)")
_DATA = re.compile(r"gc\.DataTuple\('([^']+)', (0x[0-9A-F]+)\)")
_COUNT = re.compile(r"\[MethodCall\]: \w+/(thc_\w+)\.count\((\d+|meta\.stat)\);")
_STAT = re.compile(r"Computed: meta\.stat = (\d+);")
_EMIT = re.compile(r"\[Emit\]: \{\$headerValid:true;;(.*)\}")
_FIELD = re.compile(r"(\w+):(-?\d+|\"Taint\"|Taint);")


@dataclass(frozen=True)
class Run:
    """One P4Testgen run of a corpus: the pass it explores (None: both; else 1 or 2, by -DTHC_P4TESTGEN_PASS1_ONLY
    or _PASS2_ONLY, which make the other pass's paths fail an assumption), its path selection and its
    test budget (0: until it finds no more paths)."""

    only: int | None
    path_selection: str
    max_tests: int
    op: int | None = None  #: pass 2: only this bridge operation (-DTHC_P4TESTGEN_OP: 1 set, 2 add, 3 read)


@dataclass(frozen=True)
class CorpusSpec:
    """One corpus: the geometry P4Testgen explores, how, and the folder under tests/p4testgen it goes to."""

    name: str
    target: str  #: tofino (TNA) or tofino2 (T2NA), p4gen.tofino.TARGETS
    elems: int  #: K
    runs: tuple[Run, ...]

    @property
    def folder(self) -> Path:
        return CORPORA_DIR / self.name

    @property
    def geometry(self) -> TofinoGeometry:
        return TofinoGeometry(elems=self.elems, slots=SLOTS, target=self.target)

    @property
    def recirc_port(self) -> int:
        return int(self.geometry.recirc_port)

    @property
    def max_packet_bits(self) -> int:
        """Input packets large enough for every format of this K (and the bridge header), no larger: the
        corpus stays small."""
        return 8 * (200 + self.elems)

    def rendered_program(self) -> str:
        """The program P4Testgen explores: the Tofino template rendered for this geometry."""
        return render(self.geometry)


def _apart(pass2: int) -> tuple[Run, ...]:
    """Pass 1 to the end of its paths, and pass 2 apart, each of its operations to a budget of ``pass2``
    tests: with a large K a single search stays among the hit/miss combinations of pass 2's K/2 lookups,
    and pass 1, or all but one operation, is never reached."""
    return (Run(1, "GREEDY_STATEMENT_SEARCH", 0),
            *(Run(2, "RANDOM_BACKTRACK", pass2, op) for op in (1, 2, 3)))


#: The corpora: K = 8 on Tofino 1 explored to the end of its paths (about 8,000 tests, 3 minutes on 2
#: cores; 4 lookups and 2 sum words of the same ThcLookup and ThcWord), and the geometries the Tofino
#: README claims, K = 64 on Tofino 1 and K = 160 on Tofino 2: pass 1 to the end of its paths, each operation
#: of pass 2 to a budget.
CORPORA = {c.name: c for c in (
    CorpusSpec("tofino", "tofino", 8, (Run(None, "GREEDY_STATEMENT_SEARCH", 0),)),
    CorpusSpec("tofino-k64", "tofino", 64, _apart(200)),
    CorpusSpec("tofino2-k160", "tofino2", 160, _apart(100)))}


def parse_test(number: int, text: str) -> dict:
    """One PTF test class of P4Testgen's output as a corpus record."""
    trace, code = text.split("'''", 2)[1:]
    ingress = trace.split("[Control ThcIngressDeparser start]", 1)
    emits = []
    if len(ingress) == 2:
        for line in ingress[1].split("copy_out(\"ThcIngressDeparser\")", 1)[0].splitlines():
            m = _EMIT.search(line)
            if m:
                emits.append({k: (None if "Taint" in v else int(v)) for k, v in _FIELD.findall(m.group(1))})
    entries = [[table, {k: [int(v, 16), int(mask, 16) if mask else None] for k, v, mask in _KEY.findall(keys)},
                action, {k: int(v, 16) for k, v in _DATA.findall(data)}]
               for table, keys, action, data in _ENTRY.findall(code)]
    registers: dict[str, dict[str, int]] = {}  # without the control's name: slot_state, word_0.sums, ...
    for name, value, index in _REGISTER.findall(code):
        registers.setdefault(name.split(".", 1)[1], {})[index] = int(value, 16)
    port = re.search(r"ig_port = (\d+)", code)
    packet = re.search(r"\n        pkt = (b'[^']*')", code)
    return {"path": number, "port": int(port.group(1)) if port else None,
            "packet": _bytes(packet.group(1)).hex() if packet else "",
            "entries": entries, "registers": registers,
            "counters": counters(trace),
            # False: the parser rejected the packet (too short for a header it extracts) and ingress never ran
            "ingress": "[Control ThcIngress start]" in trace,
            "ingress_drop": "ig_dprsr_md.drop_ctl = 1;" in trace.split("[Control ThcIngressDeparser start]")[0],
            "emits": emits}


def slim(record: dict, recirc_port: int) -> dict:
    """The record as the corpus keeps it: a packet that ingress does not count as a THC request (most of
    P4Testgen's paths: plain IPv4 forwarding) keeps its first ``HEADER_KEPT`` bytes (its Ethernet, IPv4
    and UDP headers, what the program decided on) and its length."""
    if record["port"] != recirc_port and not any(name == "thc_rx" for name, _ in record["counters"]):
        record["frame_bytes"] = len(record["packet"]) // 2
        record["packet"] = record["packet"][:2 * HEADER_KEPT]
    return record


def counters(trace: str) -> list[list]:
    """The counters a path's trace updates, in order, as [name, index]: thc_stats's index is the value
    meta.stat was last given (the call reads it)."""
    out, stat = [], None
    for line in trace.splitlines():
        m = _STAT.search(line)
        if m:
            stat = int(m.group(1))
        m = _COUNT.search(line)
        if m:
            out.append([m.group(1), stat if m.group(2) == "meta.stat" else int(m.group(2))])
    return out


def _bytes(literal: str) -> bytes:
    """A Python bytes literal of P4Testgen's (only \\xNN escapes) without eval."""
    return bytes.fromhex(literal[2:-1].replace("\\x", ""))


def generate(exe: str, spec: CorpusSpec, out: Path, *, seed: int) -> dict:
    """Run P4Testgen on the program of ``spec`` (each of its runs) and write the corpus and its manifest
    into ``out``."""
    arch = spec.geometry.arch
    define = "1" if spec.target == "tofino" else "2"  # tna.p4 and t2na.p4 read __TARGET_TOFINO__
    records, runs, uncovered, total = [], [], None, 0
    text = spec.rendered_program()
    with tempfile.TemporaryDirectory(prefix="p4testgen-tofino-") as tmpd:
        tmp = Path(tmpd)
        program = tmp / "thc.p4"
        program.write_text(text)
        (tmp / "parser.p4").write_text(PARSER.read_text())
        for number, run in enumerate(spec.runs):
            cmd = [exe, "--target", spec.target, "--arch", arch, "--std", "p4-16", f"-D__TARGET_TOFINO__={define}",
                   "-DTHC_P4TESTGEN", "-I", str(INCLUDE_DIR), "--test-backend", "PTF",
                   "--out-dir", str(tmp / f"ptf{number}"), "--seed", str(seed), "--max-tests", str(run.max_tests),
                   "--track-coverage", "STATEMENTS", "--path-selection", run.path_selection,
                   "--packet-size-range", f"0:{spec.max_packet_bits}",
                   *([f"-DTHC_P4TESTGEN_PASS{run.only}_ONLY"] if run.only else []),
                   *([f"-DTHC_P4TESTGEN_OP={run.op}"] if run.op else []), "--print-coverage", str(program)]
            done = run_p4testgen(cmd, tmp, prog="p4gen.testgen_tofino")
            total = done.statements
            # a statement is uncovered by the corpus when no run covers it
            uncovered = done.uncovered if uncovered is None else [ln for ln in uncovered if ln in done.uncovered]
            parts = _TEST.split((tmp / f"ptf{number}" / "thc.py").read_text())
            found = [parse_test(int(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]
            records += [{"run": number, **r} for r in found]
            runs.append({"command": ["p4testgen", *(_portable(a, tmp) for a in cmd[1:-1]), "thc.p4"],
                         "tests": len(found), "generation_s": round(done.wall_s, 1),
                         "statement_coverage": {"fraction": done.fraction, "covered": done.covered}})
        said = subprocess.run([exe, "--target", spec.target, "--arch", arch, "--version"], capture_output=True,
                              text=True, check=False)
        version = ((said.stdout + said.stderr).split() or ["unknown"])[-1]  # "<null>" in p4c 34b86e9's build
    out.mkdir(parents=True, exist_ok=True)  # its two files are overwritten; nothing else is touched
    body = "".join(json.dumps(slim(r, spec.recirc_port), separators=(",", ":")) + "\n" for r in records)
    (out / TESTS_FILE).write_bytes(gzip.compress(body.encode(), 9, mtime=0))
    statements = total
    manifest = {
        "p4testgen": version,
        "program": f"p4src/tofino/thc.p4.in rendered for {spec.target}, K = {spec.elems}, {SLOTS} slots "
                   "(p4gen.tofino)",
        "program_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "seed": seed, "target": spec.target, "elems": spec.elems, "slots": SLOTS, "recirc_port": spec.recirc_port,
        "tests": len(records), "runs": runs,
        "statement_coverage": {"fraction": round((statements - len(uncovered)) / statements, 6),
                               "covered": statements - len(uncovered), "statements": statements},
        "uncovered": uncovered, "generation_s": round(sum(r["generation_s"] for r in runs), 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _portable(arg: str, tmp: Path) -> str:
    """A command-line argument without this machine's paths (the manifest is checked in)."""
    return re.sub(r"ptf\d+$", "OUT", arg.replace(str(INCLUDE_DIR), "p4src/include").replace(str(tmp) + "/", ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p4gen.testgen_tofino", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--p4testgen", help=f"the p4testgen executable with the tofino target (default: "
                                        f"{TOFINO_P4TESTGEN}, where scripts/build-p4-toolchain.sh --with-tofino "
                                        f"installs it, else the one on PATH)")
    ap.add_argument("--corpus", choices=sorted(CORPORA), action="append",
                    help="which corpus to regenerate (repeatable; default: all): " + "; ".join(
                        f"{c.name}: {c.target}, K = {c.elems}" for c in CORPORA.values()))
    ap.add_argument("--out", type=Path, help="write into this folder instead of tests/p4testgen/NAME "
                                             "(one --corpus only)")
    ap.add_argument("--seed", type=int_in(0, 2**31 - 1), default=1, help="P4Testgen's random seed")
    args = ap.parse_args(argv)
    names = args.corpus or sorted(CORPORA)
    if args.out is not None and len(names) != 1:
        ap.error("--out needs exactly one --corpus")
    default = TOFINO_P4TESTGEN if TOFINO_P4TESTGEN.exists() else None  # not PATH's: that one may be bmv2-only
    exe = find_p4testgen(args.p4testgen or default, prog="p4gen.testgen_tofino", stage="--with-tofino")
    for name in names:
        spec = CORPORA[name]
        out = args.out or spec.folder
        m = generate(exe, spec, out, seed=args.seed)
        cov = m["statement_coverage"]
        print(f"{name}: {m['tests']} tests in {m['generation_s']} s; statement coverage "
              f"{cov['covered']}/{cov['statements']} ({cov['fraction']:.1%}); corpus in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
