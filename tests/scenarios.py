"""Target-neutral scenario table of the aggregation state machine (docs/protocol.md, "State table").

Each scenario is DATA: job configurations, then packets sent in order, each with the exact packets
the aggregator must answer ("to": "all" = every worker of the job, "sender" = unicast back), then
the counters expected at the end. Expected sums are written by hand from the scenario's explicit
table, never computed by the code under test. tests/test_state_scenarios.py runs them against both
Python implementations (the reference aggregator/state.py and the batch engine aggregator/engine.py);
tests/test_bmv2_dataplane.py runs the same table against the BMv2 program on simple_switch_grpc.
TIER_SCENARIOS (below) do the same for a leaf of a two-tier job: tests/test_tiers.py runs them on the
reference leaf, tests/test_bmv2_leaf.py on the BMv2 leaf program.

Packet fields not given default to: version 1, job 1, key KEY, table_id of the job, tensor 0,
chunk 0, elems K, width b (THC DATA) or 32 (norms, uncompressed). A packet gives its payload as
"indices" (THC DATA), "ints" (uncompressed DATA), "norm" (NORM, a float), or "raw" (hex bytes that
replace the whole packet).
"""

from __future__ import annotations

KEY = 0x0BADC0DE
OTHER_KEY = 0x0BADC0DF

# A 2-bit table on granularity 10, non-uniform so that a missing lookup cannot go unnoticed.
TABLE = (0, 2, 7, 10)
K = 8

JOB = {"job": 1, "key": KEY, "workers": 2, "bits": 2, "granularity": 10, "table": TABLE,
       "slots": 4, "elems": K, "result_bits": 8}
JOB4 = {**JOB, "workers": 4}
JOB4_OF_3 = {**JOB, "workers": 4, "threshold": 3}
JOB2 = {**JOB, "job": 2, "key": 0x22222222}
# A job with a table of its own (granularity 9), for isolation between tables on one switch.
TABLE3 = (0, 1, 3, 9)
JOB3 = {**JOB, "job": 4, "key": 0x33333333, "granularity": 9, "table": TABLE3}
# JOB's table id (docs/protocol.md: CRC-32 of the JSON text "[2, 10, [0, 2, 7, 10]]", low 16 bits).
JOB_TABLE_ID = 0x517A
JOB_INT = {"job": 3, "key": KEY, "workers": 2, "kind": "uncompressed", "slots": 2, "elems": K}

# Indices and their table values (T = 0, 2, 7, 10), written out by hand.
A = [0, 1, 2, 3, 0, 1, 2, 3]  # values 0 2 7 10 0 2 7 10
B = [3, 3, 0, 0, 1, 1, 2, 2]  # values 10 10 0 0 2 2 7 7
C = [1, 1, 1, 1, 3, 3, 3, 3]  # values 2 2 2 2 10 10 10 10
D = [2, 0, 2, 0, 2, 0, 2, 0]  # values 7 0 7 0 7 0 7 0
A_B = [10, 12, 7, 10, 2, 4, 14, 17]
C_D = [9, 2, 9, 2, 17, 10, 17, 10]
A_B_C = [12, 14, 9, 12, 12, 14, 24, 27]
A_C = [2, 4, 9, 12, 10, 12, 17, 20]
# The same indices through TABLE3: A -> 0 1 3 9 0 1 3 9, B -> 9 9 0 0 1 1 3 3.
A_B_T3 = [9, 10, 3, 9, 1, 2, 6, 12]


def data(worker: int, slot: int, rnd: int, indices: list[int], **fields: int) -> dict:
    return {"type": "DATA", "worker": worker, "slot": slot, "round": rnd, "indices": indices, **fields}


def result(slot: int, rnd: int, sums: list[int], bitmap: int, to: str = "all", **fields: int) -> dict:
    return {"to": to, "type": "RESULT", "slot": slot, "round": rnd, "sums": sums,
            "contributors": bin(bitmap).count("1"), "bitmap": bitmap, **fields}


SCENARIOS: list[dict] = [
    {
        "name": "basic_reduction",
        "doc": "Both workers send round 0 of slot 0; the second completes it and the sums go to all.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B, 0b11, worker=1)]},
        ],
        "counters": {"ACCEPTED": 2, "NEW_ROUND": 1, "COMPLETED": 1, "ELEMENTS": 16},
    },
    {
        "name": "retransmission_after_completion",
        "doc": "A worker that lost the result retransmits; it alone gets the retained result, nothing added.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 1, 0, A), "expect": []},
            {"send": data(1, 1, 0, B), "expect": [result(1, 0, A_B, 0b11)]},
            {"send": data(0, 1, 0, A), "expect": [result(1, 0, A_B, 0b11, to="sender", worker=0)]},
        ],
        "counters": {"ACCEPTED": 2, "COMPLETED": 1, "RETAINED": 1},
    },
    {
        "name": "slot_reuse_next_round",
        "doc": "Round 1 of a slot aggregates fresh sums in the other bank, not on top of round 0.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 2, 0, A), "expect": []},
            {"send": data(1, 2, 0, B), "expect": [result(2, 0, A_B, 0b11)]},
            {"send": data(1, 2, 1, D), "expect": []},
            {"send": data(0, 2, 1, C), "expect": [result(2, 1, C_D, 0b11)]},
        ],
        "counters": {"ACCEPTED": 4, "NEW_ROUND": 2, "COMPLETED": 2},
    },
    {
        "name": "retransmission_ignored_in_progress",
        "doc": "A duplicate before completion adds nothing and produces nothing.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B, 0b11)]},
        ],
        "counters": {"ACCEPTED": 2, "DUPLICATE": 1, "COMPLETED": 1},
    },
    {
        "name": "retransmission_from_previous_round",
        "doc": "After a faster worker moved the slot to round 1, a retransmission of round 0 still gets "
               "round 0's exact sums from the shadow bank.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 3, 0, A), "expect": []},
            {"send": data(1, 3, 0, B), "expect": [result(3, 0, A_B, 0b11)]},
            {"send": data(1, 3, 1, D), "expect": []},
            {"send": data(0, 3, 0, A), "expect": [result(3, 0, A_B, 0b11, to="sender")]},
            {"send": data(0, 3, 1, C), "expect": [result(3, 1, C_D, 0b11)]},
        ],
        "counters": {"ACCEPTED": 4, "RETAINED": 1, "COMPLETED": 2, "STRAGGLER": 0},
    },
    {
        "name": "stale_round_straggler_notice",
        "doc": "A packet two rounds behind (its bank now holds a newer round) gets a straggler notice "
               "carrying the slot's current round, and changes nothing.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B, 0b11)]},
            {"send": data(0, 0, 1, A), "expect": []},
            {"send": data(1, 0, 1, B), "expect": [result(0, 1, A_B, 0b11)]},
            {"send": data(0, 0, 2, C), "expect": []},
            {"send": data(1, 0, 0, D, tensor=9, chunk=4),
             "expect": [{"to": "sender", "type": "STRAGGLER", "slot": 0, "round": 2, "worker": 1,
                         "tensor": 9, "chunk": 4, "elems": 0, "width": 0}]},
            {"send": data(1, 0, 2, D), "expect": [result(0, 2, C_D, 0b11)]},
        ],
        "counters": {"STRAGGLER": 1, "COMPLETED": 3},
    },
    {
        "name": "newer_round_resets_bank",
        "doc": "The first packet of a newer round overwrites its bank: a half-done older round's sums "
               "and bitmap are gone.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 1, 0, A), "expect": []},
            {"send": data(1, 1, 2, C), "expect": []},
            {"send": data(0, 1, 2, D), "expect": [result(1, 2, C_D, 0b11)]},
        ],
        "counters": {"NEW_ROUND": 2, "COMPLETED": 1, "ACCEPTED": 3},
    },
    {
        "name": "partial_threshold",
        "doc": "3 of 4: the round completes without worker 3, whose late packet adds nothing and gets "
               "the retained result by unicast.",
        "jobs": [JOB4_OF_3],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(2, 0, 0, C), "expect": []},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B_C, 0b0111)]},
            {"send": data(3, 0, 0, D), "expect": [result(0, 0, A_B_C, 0b0111, to="sender", worker=3)]},
        ],
        "counters": {"ACCEPTED": 3, "COMPLETED": 1, "RETAINED": 1},
    },
    {
        "name": "norm_max",
        "doc": "The norm stage keeps the max of the norms; the result carries it and the contributors.",
        "jobs": [{**JOB, "workers": 3}],
        "steps": [
            {"send": {"type": "NORM", "worker": 0, "slot": 2, "round": 0, "norm": 1.5}, "expect": []},
            {"send": {"type": "NORM", "worker": 1, "slot": 2, "round": 0, "norm": 2.25}, "expect": []},
            {"send": {"type": "NORM", "worker": 2, "slot": 2, "round": 0, "norm": 0.5},
             "expect": [{"to": "all", "type": "NORM_RESULT", "slot": 2, "round": 0, "norm": 2.25,
                         "contributors": 3, "bitmap": 0b111, "elems": 1, "width": 32}]},
            {"send": {"type": "NORM", "worker": 0, "slot": 2, "round": 0, "norm": 1.5},
             "expect": [{"to": "sender", "type": "NORM_RESULT", "slot": 2, "round": 0, "norm": 2.25,
                         "contributors": 3, "bitmap": 0b111}]},
        ],
        "counters": {"COMPLETED": 1, "RETAINED": 1, "ELEMENTS": 0},
    },
    {
        "name": "bad_norms_refused",
        "doc": "Negative, NaN and infinite norms are dropped and counted; the round is not started.",
        "jobs": [JOB],
        "steps": [
            {"send": {"type": "NORM", "worker": 0, "slot": 0, "round": 0, "norm": -1.0}, "expect": []},
            {"send": {"type": "NORM", "worker": 0, "slot": 0, "round": 0, "norm": float("nan")}, "expect": []},
            {"send": {"type": "NORM", "worker": 1, "slot": 0, "round": 0, "norm": float("inf")}, "expect": []},
            {"send": {"type": "NORM", "worker": 0, "slot": 0, "round": 0, "norm": 3.0}, "expect": []},
            {"send": {"type": "NORM", "worker": 1, "slot": 0, "round": 0, "norm": 4.0},
             "expect": [{"to": "all", "type": "NORM_RESULT", "norm": 4.0, "contributors": 2, "bitmap": 3}]},
        ],
        "counters": {"BAD_NORM": 3, "ACCEPTED": 2, "COMPLETED": 1},
    },
    {
        "name": "kind_mismatch",
        "doc": "A NORM for a round that aggregates DATA (or the reverse) is dropped and counted.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": {"type": "NORM", "worker": 1, "slot": 0, "round": 0, "norm": 1.0}, "expect": []},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B, 0b11)]},
        ],
        "counters": {"KIND_MISMATCH": 1, "COMPLETED": 1},
    },
    {
        "name": "wrong_key_or_table_dropped",
        "doc": "A packet with another key or table id is dropped, counted, and changes nothing.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(1, 0, 0, D, key=OTHER_KEY), "expect": []},
            {"send": data(1, 0, 2, D, key=OTHER_KEY), "expect": []},
            {"send": data(1, 0, 0, D, table_id=0x1234), "expect": []},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B, 0b11)]},
        ],
        "counters": {"BAD_KEY": 2, "BAD_TABLE": 1, "ACCEPTED": 2, "NEW_ROUND": 1},
    },
    {
        "name": "malformed_dropped",
        "doc": "Short, wrong version, wrong type, unknown job, worker or slot out of range, wrong "
               "element count, width or length: each dropped and counted; a real round completes intact.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": {"raw": "0101000100000000"}, "expect": []},
            {"send": {"raw": ""}, "expect": []},
            {"send": data(1, 0, 0, D, version=2), "expect": []},
            {"send": {**data(1, 0, 0, D), "type": "RESULT"}, "expect": []},
            {"send": {**data(1, 0, 0, D), "type": 99}, "expect": []},
            {"send": data(1, 0, 0, D, job=77), "expect": []},
            {"send": data(2, 0, 0, D), "expect": []},
            {"send": data(1, 4, 0, D), "expect": []},
            {"send": data(1, 0, 0, D, elems=16), "expect": []},
            {"send": data(1, 0, 0, D, width=4), "expect": []},
            {"send": {**data(1, 0, 0, D), "truncate": 1}, "expect": []},
            {"send": {**data(1, 0, 0, D), "extra": 3}, "expect": []},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B, 0b11)]},
        ],
        "counters": {"SHORT": 2, "BAD_VERSION": 1, "BAD_TYPE": 2, "UNKNOWN_JOB": 1, "BAD_WORKER": 1,
                     "BAD_SLOT": 1, "BAD_FORMAT": 4, "ACCEPTED": 2, "COMPLETED": 1},
    },
    {
        "name": "round_wraparound",
        "doc": "Round 0 after 65535 is newer (serial arithmetic); 65535's result stays retained in the "
               "other bank.",
        "jobs": [JOB],
        "steps": [
            {"send": data(0, 1, 65535, A), "expect": []},
            {"send": data(1, 1, 65535, B), "expect": [result(1, 65535, A_B, 0b11)]},
            {"send": data(0, 1, 0, C), "expect": []},
            {"send": data(1, 1, 65535, B), "expect": [result(1, 65535, A_B, 0b11, to="sender")]},
            {"send": data(1, 1, 0, D), "expect": [result(1, 0, C_D, 0b11)]},
            {"send": data(0, 1, 65534, A),
             "expect": [{"to": "sender", "type": "STRAGGLER", "slot": 1, "round": 0}]},
        ],
        "counters": {"COMPLETED": 2, "RETAINED": 1, "STRAGGLER": 1, "NEW_ROUND": 2},
    },
    {
        "name": "two_jobs_isolated",
        "doc": "Two jobs on the same slot and round never touch each other's registers.",
        "jobs": [JOB, JOB2],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(0, 0, 0, C, job=2, key=0x22222222), "expect": []},
            {"send": data(1, 0, 0, D, job=2, key=0x22222222),
             "expect": [result(0, 0, C_D, 0b11, job=2, key=0x22222222)]},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B, 0b11, job=1)]},
            {"send": data(1, 0, 0, D, job=1, key=0x22222222), "expect": []},
        ],
        "counters": {"COMPLETED": 2, "BAD_KEY": 1},
    },
    {
        "name": "two_jobs_own_tables",
        "doc": "Two jobs with different tables share the switch: the same indices sum through each job's own "
               "table, on the same slot and round, and one job's table id is refused for the other.",
        "jobs": [JOB, JOB3],
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(0, 0, 0, A, job=4, key=0x33333333), "expect": []},
            {"send": data(1, 0, 0, B, job=4, key=0x33333333, table_id=JOB_TABLE_ID), "expect": []},
            {"send": data(1, 0, 0, B, job=4, key=0x33333333),
             "expect": [result(0, 0, A_B_T3, 0b11, job=4, key=0x33333333)]},
            {"send": data(1, 0, 0, B), "expect": [result(0, 0, A_B, 0b11, job=1)]},
        ],
        "counters": {"COMPLETED": 2, "BAD_TABLE": 1},
    },
    {
        "name": "uncompressed_int32",
        "doc": "An uncompressed job sums int32 fixed-point values (negatives included), 32-bit results.",
        "jobs": [JOB_INT],
        "steps": [
            {"send": {"type": "DATA", "job": 3, "worker": 0, "slot": 1, "round": 0,
                      "ints": [1, -2, 3, -4, 100000, -100000, 2147483000, 0]}, "expect": []},
            {"send": {"type": "DATA", "job": 3, "worker": 1, "slot": 1, "round": 0,
                      "ints": [10, 20, -30, 4, 1, 1, 600, -2147483648]},
             "expect": [{"to": "all", "type": "RESULT", "job": 3, "slot": 1, "round": 0, "table_id": 0,
                         "ints": [11, 18, -27, 0, 100001, -99999, 2147483600, -2147483648],
                         "contributors": 2, "bitmap": 3, "width": 32}]},
        ],
        "counters": {"COMPLETED": 1, "ELEMENTS": 16},
    },
]


# ---- two tiers: a leaf (docs/protocol.md, "Two tiers") --------------------------------------------------
# Leaf 0 of a job with leaves 2 and 3 (5 workers; g * 5 = 50: 8-bit sums at both tiers). Its local workers
# are 0 and 1; "from": "parent" marks a packet from the parent's address (the spine), whose answers are
# written here by hand: PARTIAL sums are the leaf's own (A_B), the spine's RESULT sums are made up (the
# leaf stores and passes them on, it never checks them). "to": "parent" is a packet to the parent.
TIER_JOB = {"job": 5, "key": KEY, "leaves": [2, 3], "bits": 2, "granularity": 10, "table": TABLE, "slots": 4,
            "elems": K, "result_bits": 8}
SPINE_SUMS = [30, 31, 32, 33, 34, 35, 36, 37]


def parent_result(slot: int, rnd: int, sums: list[int], **fields: int) -> dict:
    """The spine's RESULT for both leaves (contributors: 2 leaves, bitmap 0b11), as sent by the parent."""
    return {"from": "parent", "type": "RESULT", "slot": slot, "round": rnd, "sums": sums, "contributors": 2,
            "bitmap": 0b11, "worker": 1, **fields}


def partial(slot: int, rnd: int, sums: list[int], **fields: int) -> dict:
    """Leaf 0's PARTIAL: its index, its 2 workers, their bitmap, the sums at 8 bits, to the parent."""
    return {"to": "parent", "type": "PARTIAL", "slot": slot, "round": rnd, "worker": 0, "contributors": 2,
            "bitmap": 0b11, "width": 8, "sums": sums, **fields}


TIER_SCENARIOS: list[dict] = [
    {
        "name": "leaf_forwards_then_passes_the_spine_result_down",
        "doc": "The second local worker completes the round here: the PARTIAL goes up. The spine's RESULT "
               "goes down to both workers unchanged; a retransmission gets it back, retained; the same "
               "RESULT again finds nothing forwarded.",
        "job": TIER_JOB,
        "steps": [
            {"send": data(0, 0, 0, A), "expect": []},
            {"send": data(1, 0, 0, B), "expect": [partial(0, 0, A_B)]},
            {"send": parent_result(0, 0, SPINE_SUMS),
             "expect": [result(0, 0, SPINE_SUMS, 0b11, worker=1)]},
            {"send": data(0, 0, 0, A), "expect": [result(0, 0, SPINE_SUMS, 0b11, to="sender", worker=0)]},
            {"send": parent_result(0, 0, SPINE_SUMS), "expect": []},
        ],
        "counters": {"ACCEPTED": 2, "NEW_ROUND": 1, "COMPLETED": 1, "RETAINED": 1, "ELEMENTS": 16},
        "tier_counters": {"FORWARDED": 1, "STALE_PARENT": 1},
    },
    {
        "name": "leaf_sends_the_partial_again_while_the_spine_is_silent",
        "doc": "Retransmissions of either worker before the spine answers send the PARTIAL again (a lost "
               "PARTIAL or spine RESULT is recovered this way); nothing is added twice.",
        "job": TIER_JOB,
        "steps": [
            {"send": data(0, 1, 0, C), "expect": []},
            {"send": data(1, 1, 0, D), "expect": [partial(1, 0, C_D, tensor=0)]},
            {"send": data(1, 1, 0, D), "expect": [partial(1, 0, C_D)]},
            {"send": data(0, 1, 0, C), "expect": [partial(1, 0, C_D)]},
        ],
        "counters": {"ACCEPTED": 2, "NEW_ROUND": 1, "COMPLETED": 0, "DUPLICATE": 0, "ELEMENTS": 16},
        "tier_counters": {"FORWARDED": 1, "FORWARDED_AGAIN": 2},
    },
    {
        "name": "leaf_norm_round",
        "doc": "NORMs: the leaf's maximum goes up as PARTIAL_NORM; the spine's NORM_RESULT comes down.",
        "job": TIER_JOB,
        "steps": [
            {"send": {"type": "NORM", "worker": 0, "slot": 2, "round": 0, "norm": 1.5}, "expect": []},
            {"send": {"type": "NORM", "worker": 1, "slot": 2, "round": 0, "norm": 3.0},
             "expect": [{"to": "parent", "type": "PARTIAL_NORM", "slot": 2, "round": 0, "worker": 0,
                         "contributors": 2, "bitmap": 0b11, "elems": 1, "width": 32, "norm": 3.0}]},
            {"send": {"from": "parent", "type": "NORM_RESULT", "slot": 2, "round": 0, "norm": 4.0,
                      "contributors": 2, "bitmap": 0b11, "worker": 1},
             "expect": [{"to": "all", "type": "NORM_RESULT", "slot": 2, "round": 0, "norm": 4.0,
                         "contributors": 2, "bitmap": 0b11}]},
        ],
        "counters": {"ACCEPTED": 2, "NEW_ROUND": 1, "COMPLETED": 1},
        "tier_counters": {"FORWARDED": 1},
    },
    {
        "name": "leaf_passes_a_spine_straggler_notice_down",
        "doc": "The spine says round 0 of slot 3 is gone (its round is 3; bitmap names the refused round 0): "
               "both workers hear it in a one-tier notice, and a worker's later packet for that round gets "
               "the spine's round back.",
        "job": TIER_JOB,
        "steps": [
            {"send": data(0, 3, 0, A), "expect": []},
            {"send": data(1, 3, 0, B), "expect": [partial(3, 0, A_B)]},
            {"send": {"from": "parent", "type": "STRAGGLER", "slot": 3, "round": 1, "worker": 1, "bitmap": 2},
             "expect": []},  # names round 2, which this leaf never forwarded
            {"send": {"from": "parent", "type": "STRAGGLER", "slot": 3, "round": 3, "worker": 1, "bitmap": 0},
             "expect": [{"to": "all", "type": "STRAGGLER", "slot": 3, "round": 3, "contributors": 0,
                         "bitmap": 0}]},
            {"send": data(1, 3, 0, B),
             "expect": [{"to": "sender", "type": "STRAGGLER", "slot": 3, "round": 3, "worker": 1}]},
        ],
        "counters": {"ACCEPTED": 2, "NEW_ROUND": 1, "STRAGGLER": 2},
        "tier_counters": {"FORWARDED": 1, "STALE_PARENT": 1},
    },
    {
        "name": "leaf_checks_what_comes_from_the_parent",
        "doc": "A RESULT from a worker's address and DATA from the parent are bad_type; a RESULT naming a "
               "third leaf is bad_worker; a truncated one bad_format; one for a round never forwarded is "
               "ignored (stale_parent).",
        "job": TIER_JOB,
        "steps": [
            {"send": {**parent_result(0, 0, SPINE_SUMS), "from": "worker"}, "expect": []},
            {"send": {**data(0, 0, 0, A), "from": "parent"}, "expect": []},
            {"send": parent_result(0, 0, SPINE_SUMS, worker=2), "expect": []},
            {"send": {**parent_result(0, 0, SPINE_SUMS), "truncate": 1}, "expect": []},
            {"send": parent_result(1, 0, SPINE_SUMS), "expect": []},
        ],
        "counters": {"BAD_TYPE": 2, "BAD_WORKER": 1, "BAD_FORMAT": 1, "ACCEPTED": 0},
        "tier_counters": {"STALE_PARENT": 1},
    },
]


def scenario_packet(send: dict, jobs: dict) -> bytes:  # jobs: {job id: worker_lib.job.JobConfig}
    """The THC bytes of a scenario packet, by the rules of this module's docstring: "raw" hex, or the
    fields given (the rest defaulted from the packet's job, else the first job) and a payload of
    "indices", "ints", "norm", a parent's "sums" (at the job's result width) or none (a notice);
    "truncate" bytes cut off, "extra" zero bytes added. "from" (who sends it) is the runner's."""
    import numpy as np

    from worker_lib.wire import Header, PacketType, float_bits, pack_bits

    if "raw" in send:
        return bytes.fromhex(send["raw"])
    fields = {k: v for k, v in send.items() if k not in ("from", "indices", "ints", "norm", "sums", "truncate",
                                                         "extra")}
    typ = fields.pop("type")
    fields["type"] = PacketType[typ] if isinstance(typ, str) else typ
    cfg = jobs.get(fields.get("job", 1), next(iter(jobs.values())))
    fields.setdefault("job", cfg.job)
    fields.setdefault("key", cfg.key)
    fields.setdefault("table_id", cfg.table_id)
    if "norm" in send:
        payload, elems, width = float_bits(send["norm"]).to_bytes(4, "big"), 1, 32
    elif "ints" in send:
        payload, elems, width = np.asarray(send["ints"], ">i4").tobytes(), len(send["ints"]), 32
    elif "sums" in send:
        payload = np.asarray(send["sums"], {8: ">u1", 16: ">u2"}[cfg.result_bits]).tobytes()
        elems, width = len(send["sums"]), cfg.result_bits
    elif "indices" in send:
        payload = pack_bits(np.asarray(send["indices"]), cfg.bits).tobytes()
        elems, width = len(send["indices"]), cfg.bits
    else:
        payload, elems, width = b"", 0, 0
    fields.setdefault("elems", elems)
    fields.setdefault("width", width)
    pkt = Header(**fields).pack(payload)
    pkt = pkt[: len(pkt) - send.get("truncate", 0)]
    return pkt + bytes(send.get("extra", 0))


def check_tier_answer(data: bytes, want: dict, where: str) -> None:
    """An answer's THC header fields and payload ("sums" at the packet's width, or "norm") are the
    scenario's."""
    import numpy as np

    from worker_lib.wire import Header, PacketType, bits_float

    hdr, payload = Header.parse(data)
    assert hdr.type == PacketType[want["type"]], f"{where}: type {hdr.type}"
    for name, value in want.items():
        if name not in ("to", "type", "sums", "norm"):
            assert getattr(hdr, name) == value, f"{where}: {name} = {getattr(hdr, name)}, expected {value}"
    if "sums" in want:
        assert np.frombuffer(payload, {8: ">u1", 16: ">u2"}[hdr.width]).tolist() == want["sums"], f"{where}: sums"
    if "norm" in want:
        assert bits_float(int.from_bytes(payload, "big")) == want["norm"], f"{where}: norm"
    if want["type"] == "STRAGGLER":
        assert payload == b"", f"{where}: a notice has no payload"
