"""`make chaos`: the project's own nemesis, against the dev stack as `vigil-dev up` starts it.

Dev tooling, like the demo and the benchmarks: the product never imports it.

A seeded run starts a fresh stack in its own folder (``.run/chaos`` by default, free ports)
with a second worker in the same consumer group, sends chat messages through ingest from many
users (each message retried with its Idempotency-Key until acknowledged, as a client would),
and every few seconds injects one fault: SIGKILL of one of the workers, ingest, the scheduler,
the dispatcher, the Kafka broker or PostgreSQL (its whole process group, as a crash), or
SIGSTOP of one of the workers past its session timeout. After each kill the stack is brought
back with ``vigil-dev up`` (and the second worker by the chaos stack), so the partitions move
between the workers under load: lost to a crash or a freeze, handed over when one rejoins. When the faults are
done the load stops, the stack is given time to settle, and the invariants are checked
against the ledger and the dispatcher's delivery log (:mod:`vigil_dev.chaos.checks`).

- :mod:`vigil_dev.chaos.stack`: the stack's processes, faults and restarts.
- :mod:`vigil_dev.chaos.load`: the clients and what they were acknowledged.
- :mod:`vigil_dev.chaos.checks`: the invariants and the recovery times.
- :mod:`vigil_dev.chaos.__main__`: the run, its fault log and its summary line.
"""
