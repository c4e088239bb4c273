"""The short version of benchmarks/soak.py: two jobs through a relay that drops, duplicates and
reorders; every step exact, memory flat, counters adding up (the 10-minute run is the benchmark)."""

from __future__ import annotations

import argparse

from benchmarks.soak import soak


def test_short_soak_through_a_hostile_relay() -> None:
    res = soak(argparse.Namespace(minutes=0.1, dim=1 << 14, drop=0.02, dup=0.02, reorder=0.03, max_growth_mib=16.0))
    assert res["errors"] == [] and res["exact"], res
    assert res["counters_add_up"] and res["memory_flat"], res
    assert res["steps"] >= 20 and res["uses_finished"] > 0
    relay = res["relay"]
    assert relay["dropped"] > 0 and relay["duplicated"] > 0 and relay["reordered"] > 0, relay
    assert res["aggregator"]["retained"] > 0 and res["aggregator"]["duplicate"] > 0  # the network was hostile
    assert res["passed"]
