"""The switch control plane, target-neutral: the entries a job needs (``entries``), the errors a user can
act on (``errors``) and ``thc-switch`` (``cli``). The writers that spell the entries for a target are
``aggregator.p4rt`` (P4Runtime, BMv2) and ``aggregator.bfrt`` (bfrt_python scripts, Tofino)."""
