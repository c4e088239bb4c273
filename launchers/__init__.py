"""Launchers that need both sides, worker and aggregator: ``thc-allreduce`` and the helper that starts
a ``thc-aggregator`` process and reads its ports. They sit on top of ``worker_lib`` and ``aggregator``."""
