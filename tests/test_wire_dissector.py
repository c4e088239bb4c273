"""The generated Wireshark Lua dissector decodes pcaps written by our dpkt helpers (with tshark)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from worker_lib.wire import FIELDS, THC_UDP_PORT, Header
from worker_lib.wire.dissector import lua_dissector
from worker_lib.wire.pcap import PcapWriter, read_pcap

TSHARK = shutil.which("tshark")


def _random_headers(n: int) -> list[dict[str, int]]:
    rng = np.random.default_rng(42)
    return [{f.name: int(rng.integers(0, 1 << f.bits, dtype=np.uint64)) for f in FIELDS} for _ in range(n)]


def test_lua_declares_every_layout_field() -> None:
    """Every field of the layout appears in the Lua source with its offset and width."""
    lua = lua_dissector()
    off = 0
    for f in FIELDS:
        assert f'"thc.{f.name}"' in lua and f"sub:add(f_{f.name}, buf({off}, {f.bits // 8}))" in lua
        off += f.bits // 8


def test_pcap_round_trip(tmp_path: Path) -> None:
    """Datagrams written with PcapWriter read back with the same addresses and payloads."""
    pkts = [Header(**h).pack(bytes([i]) * i) for i, h in enumerate(_random_headers(4))]
    with PcapWriter(tmp_path / "x.pcap") as w:
        for p in pkts:
            w.write(("127.0.0.1", 40000), ("127.0.0.1", THC_UDP_PORT), p)
    caps = read_pcap(tmp_path / "x.pcap")
    assert [c.payload for c in caps] == pkts
    assert all(c.src == ("127.0.0.1", 40000) and c.dst == ("127.0.0.1", THC_UDP_PORT) for c in caps)


@pytest.mark.skipif(TSHARK is None, reason="tshark is not installed (apt-get install tshark); it runs the "
                                           "generated Lua dissector")
def test_tshark_decodes_every_field(tmp_path: Path) -> None:
    """tshark with the generated dissector reads back each header field of random packets."""
    heads = _random_headers(6)
    with PcapWriter(tmp_path / "thc.pcap") as w:
        for h in heads:
            w.write(("127.0.0.1", 40000), ("127.0.0.1", THC_UDP_PORT), Header(**h).pack(b"\xab\xcd"))
    lua = tmp_path / "thc.lua"
    lua.write_text(lua_dissector())
    cmd = [TSHARK, "-X", f"lua_script:{lua}", "-r", str(tmp_path / "thc.pcap"), "-T", "fields",
           "-E", "separator=,"]
    for f in FIELDS:
        cmd += ["-e", f"thc.{f.name}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line.split(",") for line in r.stdout.strip().splitlines()]
    assert len(rows) == len(heads)
    for row, h in zip(rows, heads, strict=True):
        assert [int(v, 0) for v in row] == [h[f.name] for f in FIELDS]
