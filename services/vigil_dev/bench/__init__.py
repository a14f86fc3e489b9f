"""Benchmarks: how fast vigil is, measured against the raw limits of the same machine.

``python -m vigil_dev.bench`` (``make bench``) starts its own Kafka broker and PostgreSQL server
(or uses the stack that ``VIGIL_KAFKA_BOOTSTRAP`` and ``VIGIL_DATABASE_URL`` name), runs every
workload as real processes (``python -m vigil worker``, ``python -m vigil ingest``) and
prints one ``name: value`` line per figure, the median of several rounds with min and max
beside it, then the ratios against the targets. ``--quick`` is the smoke mode of
``make test``: the same workloads, tiny, asserting nothing about speed.

docs/performance.md says what each figure measures and how, and what the latest full run
read; docs/bench/ keeps each full run's figures.
"""
