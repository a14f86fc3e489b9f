"""The raw Kafka limit's reader: one plain consumer in its own process.

Started by :func:`vigil_dev.bench.raw.raw_kafka` before the producer, it reads every partition
of the topic from the beginning (assigned, no group: no rebalance to wait for), touches
each message's value, and prints the wall-clock time at which it had read ``--count``
messages. Its own process, like a worker's consumer, so it does not share an interpreter
lock with the producer.

    python -m vigil_dev.bench.rawconsume BOOTSTRAP TOPIC PARTITIONS COUNT
"""

from __future__ import annotations

import sys
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from vigil.settings import CommonSettings

# The same fetch sizes a vigil worker's consumer has (librdkafka defaults), and the
# worker's poll batch.
BATCH = 1000
TIMEOUT_S = 120.0
READY_TIMEOUT_S = 60.0


def main(bootstrap: str, topic: str, partitions: int, count: int) -> int:
    # VIGIL_KAFKA_OPT_* (SASL, TLS) as every vigil client takes them: the bench runs on a secure stack too.
    options = CommonSettings(kafka_bootstrap=bootstrap).kafka_client_options()
    consumer = Consumer({**options, "group.id": f"{topic}.raw", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    # Connect to the leader before the clock starts. A broker that has just started may not
    # answer for its new topic yet: ask again until it does.
    deadline = time.monotonic() + READY_TIMEOUT_S
    for p in range(partitions):
        while True:
            try:
                consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5)
                break
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    print("ready", flush=True)
    seen = 0
    size = 0
    deadline = time.monotonic() + TIMEOUT_S
    while seen < count and time.monotonic() < deadline:
        for message in consumer.consume(num_messages=BATCH, timeout=0.1):
            if message.error() is None:
                seen += 1
                size += len(message.value())
    finished = time.time()
    consumer.close()
    print(f"done {seen} {size} {finished:.6f}", flush=True)
    return 0 if seen >= count else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
