"""The event envelope on the wire: both framings, evolution, and bytes that are not events."""

from __future__ import annotations

import copy
import io
import json
import random
import struct
from datetime import UTC, datetime, timedelta

import fastavro
import pytest

from vigil.bus.codec import (
    CONFLUENT_MAGIC,
    EVENT_ROW_FIELDS,
    SINGLE_OBJECT_MAGIC,
    AvroCodec,
    DecodeError,
    EventCodec,
    compile_reader,
)
from vigil.envelope import Event
from vigil.paths import schemas_dir

NOW = datetime(2026, 11, 30, 12, 0, 0, 123000, tzinfo=UTC)


def sample(**changes) -> Event:
    fields = dict(
        user_id="user-1",
        source="github",
        source_id="delivery-7",
        kind="github.push",
        payload=json.dumps({"ref": "refs/heads/main", "text": "ünïcødé ✓"}),
        received_at=NOW,
        occurred_at=NOW,
        session_id=None,
        headers={"traceparent": "00-abc-def-01"},
    )
    fields.update(changes)
    return Event(**fields)


def old_writer(*dropped: str) -> tuple[dict, bytes]:
    """An older writer's schema (today's without ``dropped`` fields) and the sample in its bytes."""
    schema = copy.deepcopy(EventCodec().schema_json)
    schema["fields"] = [f for f in schema["fields"] if f["name"] not in dropped]
    record = {k: v for k, v in sample().to_record().items() if k not in dropped}
    return schema, AvroCodec("vigil.v1.Event", reader_schema=schema).encode_record(record)


def crc64_avro(data: bytes) -> int:
    """The Avro spec's reference fingerprint algorithm, written out independently."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def test_round_trip_single_object():
    codec = EventCodec()
    data = codec.encode(sample())
    assert data[:2] == SINGLE_OBJECT_MAGIC
    assert codec.decode(data) == sample()


def test_single_object_header_is_the_spec_fingerprint():
    codec = EventCodec()
    canonical = fastavro.schema.to_parsing_canonical_form(fastavro.parse_schema(codec.schema_json))
    expected = struct.pack("<Q", crc64_avro(canonical.encode()))
    assert codec.encode(sample())[2:10] == expected


def test_optional_fields_absent_round_trip():
    codec = EventCodec()
    event = sample(occurred_at=None, session_id=None, headers={}, payload="{}")
    assert codec.decode(codec.encode(event)) == event


def test_new_reader_reads_old_bytes():
    """An older writer (no session_id, no headers) is read by today's schema with defaults."""
    old, old_bytes = old_writer("session_id", "headers")
    reader = EventCodec(writer_schemas=[old])
    event = reader.decode(old_bytes)
    assert event.session_id is None and event.headers == {}
    assert event.source_id == "delivery-7"


def test_unknown_fingerprint_is_a_decode_error():
    data = bytearray(EventCodec().encode(sample()))
    data[2:10] = b"\x00" * 8
    with pytest.raises(DecodeError, match="unknown schema fingerprint"):
        EventCodec().decode(bytes(data))


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "empty"),
        (None, "empty"),
        (b"hello world", "unknown framing"),
        (b"\xc3\x01\x00", "truncated"),
        (CONFLUENT_MAGIC + b"\x00\x00\x00\x01abc", "no schema registry"),
    ],
)
def test_undecodable_bytes_give_the_typed_error(data, reason):
    with pytest.raises(DecodeError) as caught:
        EventCodec().decode(data)
    assert reason in caught.value.reason


def test_corrupt_body_is_a_decode_error():
    data = EventCodec().encode(sample())
    with pytest.raises(DecodeError, match="corrupt Avro body"):
        EventCodec().decode(data[:14])


def test_semantic_checks_give_the_typed_error():
    codec = EventCodec()
    with pytest.raises(DecodeError, match="payload is not JSON"):
        codec.decode(codec.encode(sample(payload="{not json")))
    with pytest.raises(DecodeError, match="user_id is empty"):
        codec.decode(codec.encode(sample(user_id="")))


def test_confluent_framing_against_mock_registry():
    """With a registry URL the codec writes the Confluent wire format; both framings decode."""
    codec = EventCodec(schema_registry_url="mock://vigil-test")
    data = codec.encode(sample(), topic="vigil.events")
    assert data[:1] == CONFLUENT_MAGIC
    assert codec.decode(data, topic="vigil.events") == sample()
    # A registry-configured reader still reads single-object bytes from a registry-less producer.
    assert codec.decode(EventCodec().encode(sample())) == sample()


def test_schema_file_is_namespaced():
    schema = EventCodec().schema_json
    assert schema["namespace"] == "vigil.v1" and schema["name"] == "Event"
    names = [f["name"] for f in schema["fields"]]
    assert names == [
        "user_id",
        "source",
        "source_id",
        "kind",
        "occurred_at",
        "received_at",
        "payload",
        "session_id",
        "headers",
    ]
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(schema), sample().to_record())


def test_decode_row_gives_the_fields_decode_gives():
    codec = EventCodec()
    for event in (sample(), sample(occurred_at=None, session_id="s-1", headers={})):
        row = codec.decode_row(codec.encode(event))
        assert row == tuple(getattr(event, name) for name in EVENT_ROW_FIELDS)


def test_decode_row_reads_old_bytes_with_defaults():
    old, old_bytes = old_writer("session_id", "headers")
    row = EventCodec(writer_schemas=[old]).decode_row(old_bytes)
    assert dict(zip(EVENT_ROW_FIELDS, row)) == {**sample().to_record(), "session_id": None, "headers": {}}


def test_own_schema_bytes_are_read_directly_and_others_resolved(monkeypatch):
    """fastavro, with resolution, is for other writers' schemas; our own bytes skip both."""
    calls = []
    real = fastavro.schemaless_reader
    monkeypatch.setattr(
        fastavro, "schemaless_reader", lambda fo, writer, reader: calls.append(reader) or real(fo, writer, reader)
    )
    old, old_bytes = old_writer("headers")
    codec = EventCodec(writer_schemas=[old])
    assert codec.decode(codec.encode(sample())) == sample()
    assert calls == []
    codec.decode(old_bytes)
    assert len(calls) == 1 and calls[0] is not None


def random_event(rng: random.Random) -> Event:
    def text() -> str:
        return "".join(rng.choice(["a", "é", "✓", "\U0001f600", "\x00", "z" * 70]) for _ in range(rng.randint(0, 5)))

    return Event(
        user_id=text(),
        source=text(),
        source_id=text(),
        kind=text(),
        payload=text(),
        received_at=datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=rng.randint(-(10**13), 10**13)),
        occurred_at=rng.choice([None, NOW + timedelta(milliseconds=rng.randint(0, 10**6))]),
        session_id=rng.choice([None, text()]),
        headers={text(): text() for _ in range(rng.randint(0, 3))},
    )


def corrupted(rng: random.Random, body: bytes) -> bytes:
    out = bytearray(body)
    roll = rng.random()
    if roll < 0.3:
        return bytes(out[: rng.randint(0, len(out))])
    at = rng.randrange(len(out))
    if roll < 0.8:
        out[at] = rng.randrange(256)
    else:
        out[at : at + 1] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 12)))
    return bytes(out)


def test_direct_reader_reads_what_fastavro_reads():
    """On valid bodies the same records; on corrupted ones it never accepts what fastavro
    rejects or reads differently (it may reject more: a union branch of -1, which fastavro
    takes as the last branch)."""
    codec = EventCodec()
    read = compile_reader(codec.schema_json)
    schema = fastavro.parse_schema(codec.schema_json)
    rng = random.Random(7)
    accepted = 0
    for _ in range(500):
        body = codec.encode(random_event(rng))[10:]
        assert read(body, 0) == fastavro.schemaless_reader(io.BytesIO(body), schema, None)
        for _ in range(10):
            bad = corrupted(rng, body)
            try:
                ours = read(bad, 0)
            except (IndexError, ValueError, OverflowError):
                continue
            assert ours == fastavro.schemaless_reader(io.BytesIO(bad), schema, None)
            accepted += 1
    assert accepted > 100  # the corruptions left some bodies readable, so both sides were compared


def test_direct_reader_refuses_what_it_does_not_know():
    assert compile_reader(fastavro.schema.load_schema(str(schemas_dir() / "vigil" / "v1" / "Delivery.avsc"))) is None
    uuid_field = {
        "type": "record",
        "name": "R",
        "fields": [{"name": "id", "type": {"type": "string", "logicalType": "uuid"}}],
    }
    assert compile_reader(uuid_field) is None
    data = EventCodec().encode(sample(session_id=None, headers={}))
    assert data[-2:] == b"\x00\x00"  # session_id's null branch, the empty map
    bad = data[:-2] + b"\x01\x00\x00"  # branch -1, an empty string, the empty map
    schema = fastavro.parse_schema(EventCodec().schema_json)
    assert fastavro.schemaless_reader(io.BytesIO(bad[10:]), schema, None)["session_id"] == ""
    with pytest.raises(DecodeError, match="union branch -1"):
        EventCodec().decode(bad)


@pytest.mark.parametrize(
    "payload",
    [
        '{"a": 1}',
        '  {"a": 1}\n',
        "[]",
        '"text"',
        "3",
        "NaN",
        "null",
        '{"a": [1, 2, {"b": null}]}',
        '"\\ud800"',
        "",
        " ",
        "{",
        '{"a": 1} x',
        "{} {}",
        "\ufeff{}",
        "{'a': 1}",
        "[1,]",
        '{"a" 1}',
        "tru",
        "0x10",
    ],
)
def test_payload_check_agrees_with_json_loads(payload):
    try:
        json.loads(payload)
        valid = True
    except ValueError:
        valid = False
    codec = EventCodec()
    data = codec.encode(sample(payload=payload))
    if valid:
        assert codec.decode_row(data)[4] == payload and codec.decode(data).payload == payload
    else:
        for decode in (codec.decode, codec.decode_row):
            with pytest.raises(DecodeError, match="payload is not JSON"):
                decode(data)


@pytest.mark.parametrize(
    "changes", [dict(user_id="a\x00b"), dict(source_id="\x00"), dict(session_id="s\x00"), dict(headers={"k": "v\x00"})]
)
def test_nul_the_ledger_cannot_store_is_a_decode_error(changes):
    codec = EventCodec()
    data = codec.encode(sample(**changes))
    for decode in (codec.decode, codec.decode_row):
        with pytest.raises(DecodeError, match="NUL"):
            decode(data)


def test_payload_nested_past_the_recursion_limit_is_a_decode_error():
    """json.loads raises RecursionError here, which once escaped the codec and stopped the consumer."""
    codec = EventCodec()
    data = codec.encode(sample(payload="[" * 100_000 + "]" * 100_000))
    for decode in (codec.decode, codec.decode_row):
        with pytest.raises(DecodeError, match="payload is not JSON"):
            decode(data)
