"""Topologies, the Vagrantfile and the namespace helpers (the parts that need no P4 toolchain)."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from topologies.netns import Netns
from topologies.nsstar import NsStar

ROOT = Path(__file__).resolve().parent.parent
VAGRANTFILE = ROOT / "Vagrantfile"


def test_vagrantfile_is_valid_ruby() -> None:
    """``ruby -c Vagrantfile`` accepts it (the VM itself cannot be booted here)."""
    ruby = shutil.which("ruby")
    if ruby is None:
        pytest.skip("needs ruby on PATH to syntax-check the Vagrantfile")
    proc = subprocess.run([ruby, "-c", str(VAGRANTFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "Syntax OK" in proc.stdout, proc.stderr


def test_vagrantfile_pins_versions_once_and_uses_dearmor() -> None:
    """Package versions appear once (in P4LANG_PACKAGES); the key goes through gpg --dearmor, no apt-key."""
    text = VAGRANTFILE.read_text()
    assert "gpg --dearmor" in text and "apt-key" not in text
    assert "24.04" in text
    for pkg in ("p4lang-p4c", "p4lang-bmv2", "p4lang-pi"):
        assert len(re.findall(rf'"{pkg}"\s*=>', text)) == 1, pkg
        assert not re.search(rf"{pkg}=\d", text), f"{pkg}: a version outside P4LANG_PACKAGES"
    assert "pytest" in text and "--system-site-packages" in text


def test_star_help_runs() -> None:
    """``python -m topologies.star --help`` documents --workers and --netns."""
    proc = subprocess.run([sys.executable, "-m", "topologies.star", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=False)
    assert proc.returncode == 0 and "--workers" in proc.stdout and "--netns" in proc.stdout


def test_nsstar_creates_and_removes_everything() -> None:
    """The namespace star has hosts with addresses and static neighbours; closing leaves no namespace."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (ip) on PATH")
    prefix = f"thc8u{os.getpid() % 10000}"
    with NsStar(2, prefix=prefix) as star:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert f"{prefix}sw" in names and f"{prefix}h1" in names
        addr = star.hosts[1].ns.exec(["ip", "-4", "addr", "show", "h1"]).stdout
        assert "10.0.0.2/24" in addr
        neigh = star.hosts[0].ns.exec(["ip", "neigh", "show", "dev", "h0"]).stdout
        assert "10.0.0.100" in neigh and "10.0.0.2" in neigh
        assert star.routes() == [("10.0.0.1/32", "02:00:00:00:00:01", 0), ("10.0.0.2/32", "02:00:00:00:00:02", 1)]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert prefix not in names


def test_netns_raw_socket_sees_frames_of_its_namespace() -> None:
    """A raw socket opened inside a namespace receives a frame sent into the veth peer there."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    with Netns(f"thc8v{os.getpid() % 10000}", ports=1) as ns:
        rx = ns.raw_socket("h0")
        tx = ns.raw_socket("s0")
        try:
            frame = bytes.fromhex("020000000001" "020000000002" "88b5") + b"thc-test" * 8
            tx.send(frame)
            got = b""
            for _ in range(20):
                r, _, _ = select.select([rx], [], [], 0.1)
                if r:
                    data = rx.recv(2048)
                    if data == frame:
                        got = data
                        break
            assert got == frame
        finally:
            rx.close()
            tx.close()


def _star(*extra: str, workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "topologies.star", "--workers", "4", "--chunks", "32",
                           "--workdir", str(workdir), *extra], capture_output=True, text=True, cwd=ROOT,
                          timeout=240, check=False)


def _need_switch_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    missing = [t for t in ("p4c-bm2-ss", "simple_switch_grpc") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} on PATH")


def test_star_on_namespaces_end_to_end(tmp_path) -> None:
    """``python -m topologies.star --workers 4 --netns``: 4 workers allreduce through BMv2, check PASS,
    and nothing (namespace, switch process) is left behind."""
    _need_switch_tools()
    proc = _star("--netns", workdir=tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "RESULT CHECK: PASS" in proc.stdout and '"sums_exact": true' in proc.stdout
    assert "thcst" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert list((tmp_path / "switch" / "pcap").glob("s*_in.pcap")), "per-port pcaps were not written"


def test_star_in_mininet_end_to_end(tmp_path) -> None:
    """``python -m topologies.star --workers 4`` in Mininet: allreduce check PASS and pingAll without loss."""
    _need_switch_tools()
    try:
        import mininet  # noqa: F401
    except ImportError:
        pytest.skip("needs Mininet importable from this interpreter (Debian's mininet package, linked into "
                    ".venv by scripts/setup-venv.sh; see docs/bmv2.md)")
    proc = _star(workdir=tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "RESULT CHECK: PASS" in proc.stdout and '"ping_loss_percent": 0.0' in proc.stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert "s1-eth" not in links, "Mininet left switch interfaces behind"


@pytest.mark.parametrize("spine", ["python", "bmv2"])
def test_tree_in_mininet_is_exact_with_loss_on_a_leaf_spine_link(tmp_path, spine: str) -> None:
    """``python -m topologies.tree --spine-loss 0.1 [--bmv2-spine]``: two BMv2 leaves of four workers under
    a Python spine or a BMv2 spine, 10 % of leaf 0's packets to and from the spine dropped; every worker gets
    the exact sums of all eight, and leaf 0 had to send partials again."""
    _need_switch_tools()
    try:
        import mininet  # noqa: F401
    except ImportError:
        pytest.skip("needs Mininet importable from this interpreter (Debian's mininet package, linked into "
                    ".venv by scripts/setup-venv.sh; see docs/bmv2.md)")
    extra = ["--bmv2-spine"] if spine == "bmv2" else []
    # 10 %: each of the ~100 packets on that link is lost with it, so none is (0.9^100) only once in 37,000 runs
    proc = subprocess.run([sys.executable, "-m", "topologies.tree", "--chunks", "48", "--spine-loss", "0.1",
                           "--workdir", str(tmp_path), *extra], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "RESULT CHECK: PASS" in proc.stdout
    summary = json.loads(proc.stdout[:proc.stdout.rindex("RESULT CHECK")])
    assert summary["sums_exact"] and summary["norm_exact"] and summary["retransmissions"] > 0
    assert summary["leaf_tier_counters"][0]["FORWARDED"] == 48 + 1  # every chunk and the norm
    assert summary["leaf_tier_counters"][0]["FORWARDED_AGAIN"] > 0  # lost partials or answers were recovered
    if spine == "bmv2":
        assert summary["spine"] == "bmv2" and summary["spine_counters"]["COMPLETED"] == 48 + 1
        assert "thc_tree_loss" not in subprocess.run(["nft", "list", "tables"], capture_output=True,
                                                     text=True).stdout, "the loss rules were left behind"
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert "s1-eth" not in links and "hs-eth" not in links, "Mininet left interfaces behind"
