"""docs/protocol.md is enough to implement a client: its worked example, built here with plain
``struct`` and ``zlib`` (not the project's serializer or table code), is byte for byte what the
document lists, and played against ``thc-aggregator`` it gets exactly the answers the document lists.
Its table recipe, solved here independently with scipy, gives the tables the document prints."""

from __future__ import annotations

import re
import select
import socket
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import norm

from launchers.aggregator_process import listening_port, stop_process
from worker_lib.wire.protocol import Counter

DOC = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
HEADER = struct.Struct("!BBHIHBBHHIIHBBI")  # the "Header" table, field by field: 32 bytes


def section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end]


def example_listing() -> tuple[str, list[tuple[str, str, bytes]]]:
    """The worked example's job spec and its lines: (verb, who, bytes) with verb 'send' or '->'."""
    blocks = re.findall(r"```\n(.*?)```", section("Worked example"), re.S)
    spec = blocks[0].strip()
    lines = []
    for line in blocks[1].strip().splitlines():
        verb, who, *hexes = line.split()
        lines.append((verb, who, bytes.fromhex("".join(hexes))))
    return spec, lines


def table_id(bits: int, g: int, values: list[int]) -> int:
    """The recipe of "Table id", word for word."""
    text = f"[{bits}, {g}, [{', '.join(str(v) for v in values)}]]"
    return zlib.crc32(text.encode("ascii")) & 0xFFFF


def solve(bits: int, g: int, p: float) -> list[int]:
    """The recipe of "Lookup tables from (b, g, p)", written from the document with scipy."""
    t = norm.ppf(1 - p / 2)
    a = -t + 2 * t * np.arange(g + 1) / g
    best = {0: (0.0, [0])}
    for _ in range((1 << bits) - 1):
        nxt: dict[int, tuple[float, list[int]]] = {}
        for j in range(1, g + 1):
            options = [(c + a[j] * norm.pdf(a[i]) - a[i] * norm.pdf(a[j])
                        - (1 + a[i] * a[j]) * (norm.cdf(a[j]) - norm.cdf(a[i])), [*path, j])
                       for i, (c, path) in sorted(best.items()) if i < j]
            if options:
                nxt[j] = min(options, key=lambda o: o[0])  # the first minimum: the smaller predecessor
        best = nxt
    return best[g][1]


def test_table_ids_follow_the_recipe() -> None:
    assert table_id(2, 3, [0, 1, 2, 3]) == 0x095C and "0x095c" in DOC
    assert table_id(4, 30, [0, 3, 5, 7, 9, 11, 13, 15, 16, 17, 19, 21, 23, 25, 27, 30]) == 0x941A and "0x941a" in DOC
    assert table_id(2, 9, [0, 1, 5, 9]) == 0x061E and "0x061e" in DOC


def test_tables_follow_the_recipe() -> None:
    text = section("Lookup tables from (b, g, p)")
    assert solve(4, 30, 1 / 32) == [0, 3, 5, 7, 9, 11, 13, 15, 16, 17, 19, 21, 23, 25, 27, 30]
    assert "`0, 3, 5, 7, 9, 11, 13, 15, 16, 17, 19, 21, 23, 25, 27, 30`" in text
    assert solve(2, 9, 1 / 32) == [0, 3, 6, 9] and "`0, 3, 6, 9`" in text
    assert solve(3, 7, 1 / 8) == list(range(8))  # g = 2^b - 1: the identity


def header(typ: int, worker: int, slot: int, rnd: int, elems: int, width: int, *, contributors: int = 0,
           bitmap: int = 0) -> bytes:
    """The example job's header (version 1, job 7, key 0x0a0b0c0d, table id of [2, 9, [0, 1, 5, 9]])."""
    return HEADER.pack(1, typ, 7, 0x0A0B0C0D, table_id(2, 9, [0, 1, 5, 9]), worker, contributors, slot, rnd,
                       0, 0, elems, width, 0, bitmap)


def indices(zs: list[int]) -> bytes:
    """2-bit indices packed MSB first ("Packet types", DATA)."""
    return int("".join(f"{z:02b}" for z in zs), 2).to_bytes(len(zs) // 4, "big")


DATA, RESULT, NORM, NORM_RESULT, STRAGGLER = 1, 2, 3, 4, 5
T = [0, 1, 5, 9]
Z0, Z1 = [0, 1, 2, 3, 3, 2, 1, 0], [3, 3, 3, 3, 0, 0, 0, 0]
SUMS = bytes(T[a] + T[b] for a, b in zip(Z0, Z1, strict=True))
EXPECTED = [  # the example's steps as its prose describes them
    ("send", "w0", header(NORM, 0, 0, 0, 1, 32) + struct.pack("!f", 1.5)),
    ("send", "w1", header(NORM, 1, 0, 0, 1, 32) + struct.pack("!f", 2.0)),
    ("->", "all", header(NORM_RESULT, 1, 0, 0, 1, 32, contributors=2, bitmap=0b11) + struct.pack("!f", 2.0)),
    ("send", "w0", header(DATA, 0, 1, 0, 8, 2) + indices(Z0)),
    ("send", "w1", header(DATA, 1, 1, 0, 8, 2) + indices(Z1)),
    ("->", "all", header(RESULT, 1, 1, 0, 8, 8, contributors=2, bitmap=0b11) + SUMS),
    ("send", "w0", header(DATA, 0, 1, 0, 8, 2) + indices(Z0)),
    ("->", "sender", header(RESULT, 0, 1, 0, 8, 8, contributors=2, bitmap=0b11) + SUMS),
    ("send", "w0", header(DATA, 0, 1, 2, 8, 2) + indices([0] * 8)),
    ("send", "w1", header(DATA, 1, 1, 0, 8, 2) + indices(Z1)),
    ("->", "sender", header(STRAGGLER, 1, 1, 2, 0, 0)),
]


def test_the_listing_is_what_struct_builds() -> None:
    spec, lines = example_listing()
    assert spec == "job=7,key=0x0a0b0c0d,workers=2,bits=2,granularity=9,table=0:1:5:9,slots=4,elems=8"
    assert lines == EXPECTED
    assert SUMS.hex(" ") == "09 0a 0e 12 09 05 01 00" and indices(Z0).hex(" ") == "1b e4"


def test_the_aggregator_answers_as_the_listing_says() -> None:
    spec, lines = example_listing()
    proc = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", "0", "--job", spec],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    socks = {w: socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for w in ("w0", "w1")}
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line + proc.stderr.read()
        port = listening_port(line)
        for s in socks.values():
            s.bind(("127.0.0.1", 0))
            s.settimeout(3)
        sender = None
        for verb, who, data in lines:
            if verb == "send":
                sender = who
                socks[who].sendto(data, ("127.0.0.1", port))
                continue
            receivers = list(socks) if who == "all" else [sender]
            for w in receivers:
                assert socks[w].recv(2048) == data, (w, data.hex(" "))
        ready, _, _ = select.select(list(socks.values()), [], [], 0.3)
        assert ready == [], "the aggregator sent more than the listing says"
    finally:
        for s in socks.values():
            s.close()
        stop_process(proc, timeout=5)


@pytest.mark.parametrize("counter", list(Counter), ids=lambda c: c.label)
def test_every_counter_is_documented(counter: Counter) -> None:
    assert f"`{counter.label}`" in section("Counters and refusals")
