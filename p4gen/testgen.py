"""Generate the P4Testgen path corpus of the BMv2 program: tests/p4testgen/bmv2/.

P4Testgen (p4c's ``backends/p4tools/modules/testgen``) executes a P4 program symbolically and writes,
per path, an input packet, the table entries the path needs and the output it expects. This script
renders the BMv2 template for a small K (fewer element tables, the same per-element control), runs
``p4testgen --target bmv2 --arch v1model --test-backend STF`` on it with ``-DTHC_P4TESTGEN`` (the
template's ``testgen_assume`` keeps the job entries it invents to those the control plane writes) and
statement coverage tracking, and writes the tests with their traces reduced to the counters each path
increments (the program's verdict on the packet, even where the model drops it), and a manifest of the
command, the path and test counts, the coverage and the statements left uncovered.
tests/test_p4testgen_corpus.py replays the corpus on the reference state machine.

    python -m p4gen.testgen                       # regenerate tests/p4testgen/bmv2 (needs p4testgen)
    python -m p4gen.testgen --p4testgen /opt/p4build/src/p4c/build-testgen/p4testgen

What P4Testgen (v1.2.4.8, the p4c release the toolchain script builds) cannot model here: registers
start at zero in every test (so a slot that already holds a round, a complete bank or a stale round is
out of its reach: ACTIVE, COMPLETE and STALE rows), and multicast (a packet given a multicast group
is dropped in its model), so completions show as drops. docs/bmv2.md says what that leaves checked.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from p4gen.bmv2 import INCLUDE_DIR, Geometry, render
from worker_lib.cli.args import int_in

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "p4testgen" / "bmv2"
TESTS_FILE = "corpus.stf.gz"  #: every test, each after a "# P4Testgen path N" line (gzip: 1.2 MB of text)
ELEMS = 8  #: K of the rendered program: 8 element tables instead of 32 (the same ThcElement)
PORTS = "0:3"  #: ingress and egress ports P4Testgen may pick: the 4 host ports of tests/test_bmv2_dataplane.py's rig
MAX_PACKET_BITS = 2400  #: input packets up to 300 bytes: every THC format of K = 8 fits, the corpus stays small
COVERAGE = re.compile(r"Nodes covered: ([0-9.]+) \((\d+)/(\d+)\)")
TEST = re.compile(r"============ Test (\d+):")
COUNT = re.compile(r"^# \[MethodCall\]: thc_stats\.count\((\d+)\);", re.M)  #: a counter in a path's trace


def rendered_program() -> str:
    """The program P4Testgen explores: the BMv2 template rendered with K = ``ELEMS``."""
    return render(Geometry(elems=ELEMS))


def find_p4testgen(given: str | None, *, prog: str = "p4gen.testgen", stage: str = "--with-testgen") -> str:
    """The p4testgen executable: ``given``, else on PATH; SystemExit with one line if there is none, naming
    the toolchain script's ``stage`` that builds it, or if ``given`` is not an executable file (a folder or
    a data file would otherwise fail only when run, in a traceback)."""
    exe = given or shutil.which("p4testgen")
    if not exe or not Path(exe).exists():
        raise SystemExit(f"{prog}: p4testgen not found: build it with scripts/build-p4-toolchain.sh "
                         f"{stage}, or pass --p4testgen PATH")
    if not Path(exe).is_file() or not os.access(exe, os.X_OK):
        raise SystemExit(f"{prog}: p4testgen {exe} is not an executable file: pass the p4testgen binary with "
                         f"--p4testgen PATH (scripts/build-p4-toolchain.sh {stage} builds it)")
    return exe


@dataclass
class P4TestgenRun:
    """What one P4Testgen run printed: its log, its statement coverage and the statements it left
    uncovered (paths relative to the folder it ran in and to p4src/include), and its wall time."""

    log: str
    fraction: float
    covered: int
    statements: int
    uncovered: list[str]
    wall_s: float


def run_p4testgen(cmd: list[str], cwd: Path, *, prog: str) -> P4TestgenRun:
    """Run P4Testgen (``cmd``, with --print-coverage) in ``cwd``; SystemExit with one line, named ``prog``,
    if it fails or prints no coverage."""
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=False)
    except OSError as exc:  # executable, but not a program this system runs (a script without #!, another arch)
        raise SystemExit(f"{prog}: cannot run {cmd[0]}: {exc.strerror or exc}") from None
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"{prog}: p4testgen failed: {(done.stderr or done.stdout).strip()[-500:]}")
    log = done.stdout + done.stderr
    covered = COVERAGE.findall(log)
    if not covered:
        raise SystemExit(f"{prog}: p4testgen printed no coverage line (too old a p4testgen?)")
    fraction, hit, total = covered[-1]
    uncovered = [ln.strip().replace(str(cwd) + "/", "").replace(str(INCLUDE_DIR) + "/", "")
                 for ln in log.split("Not covered program nodes:")[-1].splitlines()[1:] if ln.startswith("\t")]
    return P4TestgenRun(log, float(fraction), int(hit), int(total), uncovered, wall)


def _portable(arg: str, tmp: Path) -> str:
    """A command-line argument without this machine's paths (the manifest is checked in)."""
    return arg.replace(str(INCLUDE_DIR), "p4src/include").replace(str(tmp / "stf"), "OUT")


def generate(exe: str, out: Path, *, seed: int, max_tests: int) -> dict:
    """Run P4Testgen on the K = ``ELEMS`` program and write the corpus and its manifest into ``out``."""
    with tempfile.TemporaryDirectory(prefix="p4testgen-") as tmpd:
        tmp = Path(tmpd)
        program = tmp / "thc.p4"
        text = rendered_program()
        program.write_text(text)
        program_sha256 = hashlib.sha256(text.encode()).hexdigest()
        cmd = [exe, "--target", "bmv2", "--arch", "v1model", "--std", "p4-16", "-I", str(INCLUDE_DIR),
               "-DTHC_P4TESTGEN", "--test-backend", "STF", "--out-dir", str(tmp / "stf"), "--seed", str(seed),
               "--max-tests", str(max_tests), "--packet-size-range", f"0:{MAX_PACKET_BITS}", "--port-ranges", PORTS,
               "--track-coverage", "STATEMENTS", "--path-selection", "GREEDY_STATEMENT_SEARCH",
               "--stop-metric", "MAX_NODE_COVERAGE", "--print-coverage", str(program)]
        run = run_p4testgen(cmd, tmp, prog="p4gen.testgen")
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.split()[-1]
        out.mkdir(parents=True, exist_ok=True)  # its two files are overwritten; nothing else is touched
        tests = sorted((int(p.stem.rsplit("_", 1)[1]), p) for p in (tmp / "stf").glob("*.stf"))  # (path number, file)
        with_output = 0
        corpus = []
        for number, path in tests:
            stf = path.read_text()
            lines = [ln for ln in stf.splitlines() if ln.strip() and not ln.startswith("#")]
            with_output += any(ln.startswith("expect") for ln in lines)
            # the counters the path increments, from its trace: the program's verdict on the packet
            corpus += [f"# P4Testgen path {number}", "# counters: " + " ".join(COUNT.findall(stf)), *lines]
        # mtime=0: the same tests give the same bytes
        (out / TESTS_FILE).write_bytes(gzip.compress(("\n".join(corpus) + "\n").encode(), 9, mtime=0))
        paths = TEST.findall(run.log)
    manifest = {
        "p4testgen": version, "program": f"p4src/bmv2/thc.p4.in rendered with K = {ELEMS} (p4gen.bmv2)",
        "program_sha256": program_sha256,
        "command": ["p4testgen", *(_portable(a, tmp) for a in cmd[1:-1]), "thc.p4"], "seed": seed, "elems": ELEMS,
        "paths_explored": int(paths[-1]) + 1 if paths else None,  # P4Testgen numbers its tests from 0
        "tests": len(tests), "tests_with_output": with_output,
        "statement_coverage": {"fraction": run.fraction, "covered": run.covered, "statements": run.statements},
        "uncovered": run.uncovered, "generation_s": round(run.wall_s, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p4gen.testgen", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--p4testgen", help="the p4testgen executable (default: the one on PATH)")
    ap.add_argument("--out", type=Path, default=CORPUS,
                    help=f"corpus folder; its corpus.stf.gz and manifest.json are overwritten (default {CORPUS})")
    ap.add_argument("--seed", type=int_in(0, 2**31 - 1), default=1, help="P4Testgen's random seed")
    ap.add_argument("--max-tests", type=int_in(0, 10**9), default=0,
                    help="stop after this many tests (0: until the paths or the coverage run out)")
    args = ap.parse_args(argv)
    m = generate(find_p4testgen(args.p4testgen), args.out, seed=args.seed, max_tests=args.max_tests)
    cov = m["statement_coverage"]
    print(f"{m['tests']} tests ({m['tests_with_output']} with an output packet) from {m['paths_explored']} paths in "
          f"{m['generation_s']} s; statement coverage {cov['covered']}/{cov['statements']} "
          f"({cov['fraction']:.1%}); corpus in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
