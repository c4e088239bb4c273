"""Generators of the THC P4 programs and their shared header file.

P4 has no loop over header fields or tables, so the per-element parts of both programs (one b-bit
field, one lookup and one sum per element) are rendered from hand-written templates in ``p4src/``:

- ``python -m p4gen.headers``: ``p4src/include/thc_headers.p4`` from the wire layout and the counters;
- ``python -m p4gen.bmv2``: ``p4src/bmv2/thc.p4`` (v1model) for a geometry (K, b, result width, slots);
- ``python -m p4gen.tofino``: ``p4src/tofino/thc.p4`` (TNA) likewise.

Each takes ``--check`` (exit 1 when the checked-in file is stale) and ``--help``. The generators import
the protocol core (``worker_lib.wire``) only, never an aggregator.
"""

from pathlib import Path

#: The P4 sources: templates, generated programs and shared includes. (Not named ``p4``: that would
#: shadow the ``p4`` namespace package of the p4runtime wheels.)
P4SRC = Path(__file__).resolve().parent.parent / "p4src"
