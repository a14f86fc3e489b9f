"""The event envelope on the wire: Avro, in one of two framings.

- Without a schema registry: Avro *single-object encoding* (Avro spec): ``C3 01``, the
  writer schema's 8-byte little-endian CRC-64-AVRO fingerprint, then the binary body. The
  reader finds the writer schema by fingerprint among the schemas in ``schemas/`` (every
  version kept there), so no server is needed and old bytes stay readable.
- With ``VIGIL_SCHEMA_REGISTRY_URL``: the Confluent wire format (``00``, 4-byte schema id,
  body), through ``confluent_kafka.schema_registry``.

The decoder accepts either framing whatever the configuration, so a topic can move from one
to the other. Anything it cannot read raises :class:`DecodeError` with the reason; callers
send such messages to the dead-letter topic instead of crashing.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import fastavro
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

from vigil.envelope import Event, aware
from vigil.errors import VigilError
from vigil.numbers import event_instant_problem
from vigil.paths import schemas_dir

if TYPE_CHECKING:  # the registry client is imported only where it is used (see _setup_registry)
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
EVENT_SCHEMA_NAME = "vigil.v1.Event"
DELIVERY_SCHEMA_NAME = "vigil.v1.Delivery"


class DecodeError(VigilError):
    """Bytes that are not a readable event. ``reason`` is short and safe to log."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def load_schema_file(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        schema: dict[str, Any] = json.load(handle)
        return schema


def _schema_versions(name: str) -> list[dict[str, Any]]:
    """The current schema of ``name`` first, then every older version kept in history/."""
    namespace, _, short = name.rpartition(".")
    folder = schemas_dir().joinpath(*namespace.split("."))
    versions = [load_schema_file(folder / f"{short}.avsc")]
    history = folder / "history"
    if history.is_dir():
        for old in sorted(history.glob(f"{short}.*.avsc")):
            versions.append(load_schema_file(old))
    return versions


class AvroCodec:
    """Encode and decode one record type in either framing.

    ``writer_schemas`` are extra schemas this reader accepts (older or newer compatible
    versions); the files under ``schemas/`` are always known.
    """

    def __init__(
        self,
        name: str = EVENT_SCHEMA_NAME,
        *,
        schema_registry_url: str | None = None,
        reader_schema: dict[str, Any] | None = None,
        writer_schemas: list[dict[str, Any]] | None = None,
        subject: str | None = None,
    ):
        versions = _schema_versions(name)
        self.schema_json = reader_schema or versions[0]
        self._schema = parse_schema(self.schema_json)
        self._fingerprint = self.fingerprint_of(self.schema_json)
        # The reader's own fingerprint maps to the reader's schema object itself: decode_record
        # tells by identity that such bytes need no schema resolution.
        self._by_fingerprint: dict[bytes, Any] = {self._fingerprint: self._schema}
        for raw in [*versions, *(writer_schemas or [])]:
            self.add_writer_schema(raw)
        self._read_own = compile_reader(self.schema_json)
        self._registry: SchemaRegistryClient | None = None
        self._serializer: AvroSerializer | None = None
        self._deserializer: AvroDeserializer | None = None
        if schema_registry_url:
            self._setup_registry(schema_registry_url, subject or f"{name}-value")

    @staticmethod
    def fingerprint_of(schema_json: dict[str, Any]) -> bytes:
        canonical = to_parsing_canonical_form(parse_schema(schema_json))
        # fastavro renders the CRC-64-AVRO value as the hex of its little-endian bytes,
        # which is exactly the byte order single-object encoding puts on the wire.
        return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))

    def add_writer_schema(self, schema_json: dict[str, Any]) -> None:
        # setdefault: a schema with the reader's fingerprint (the same binary layout) never
        # displaces the reader's own.
        self._by_fingerprint.setdefault(self.fingerprint_of(schema_json), parse_schema(schema_json))

    def _setup_registry(self, url: str, subject: str) -> None:
        # Imported here on purpose: the registry client (and its HTTP and Avro stack) takes
        # about half a second to import, and only a deployment with VIGIL_SCHEMA_REGISTRY_URL
        # uses it.
        from confluent_kafka.schema_registry import SchemaRegistryClient
        from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer

        # new_client() also understands mock:// URLs (an in-process registry for tests).
        self._registry = SchemaRegistryClient.new_client({"url": url})
        schema_str = json.dumps(self.schema_json)
        self._serializer = AvroSerializer(
            self._registry,
            schema_str,
            conf={"auto.register.schemas": True, "subject.name.strategy": lambda *_: subject},
        )
        self._deserializer = AvroDeserializer(self._registry, schema_str)

    # -- encode -------------------------------------------------------------------------

    def encode_record(self, record: dict[str, Any], topic: str = "") -> bytes:
        if self._serializer is not None:
            # bytes for any record (the stub's None is for a None record)
            return cast(bytes, self._serializer(record, SerializationContext(topic, MessageField.VALUE)))
        body = io.BytesIO()
        body.write(SINGLE_OBJECT_MAGIC)
        body.write(self._fingerprint)
        fastavro.schemaless_writer(body, self._schema, record)
        return body.getvalue()

    # -- decode -------------------------------------------------------------------------

    def decode_record(self, data: bytes | None, topic: str = "") -> dict[str, Any]:
        if not data:
            raise DecodeError("empty message")
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < 10:
                raise DecodeError("truncated single-object header")
            writer = self._by_fingerprint.get(bytes(data[2:10]))
            if writer is None:
                raise DecodeError(f"unknown schema fingerprint {bytes(data[2:10]).hex()}")
            try:
                if writer is self._schema:
                    # Written with the reader's own schema (nearly every message): no
                    # resolution, and no generic reader set up per message where ours can.
                    if self._read_own is not None:
                        return self._read_own(data, 10)
                    return cast(dict[str, Any], fastavro.schemaless_reader(io.BytesIO(data[10:]), writer, None))
                return cast(dict[str, Any], fastavro.schemaless_reader(io.BytesIO(data[10:]), writer, self._schema))
            except Exception as exc:  # fastavro (and ours) raise many types on corrupt bodies
                raise DecodeError(f"corrupt Avro body: {type(exc).__name__}: {exc}") from None
        if data[:1] == CONFLUENT_MAGIC and len(data) >= 5:
            if self._deserializer is None:
                raise DecodeError(
                    "Confluent-framed message but no schema registry configured (set VIGIL_SCHEMA_REGISTRY_URL)"
                )
            try:
                record = self._deserializer(data, SerializationContext(topic, MessageField.VALUE))
            except Exception as exc:
                raise DecodeError(f"schema registry decode failed: {type(exc).__name__}: {exc}") from None
            if record is None:
                raise DecodeError("schema registry decode returned nothing")
            return cast(dict[str, Any], record)  # an Avro record decodes to a dict
        raise DecodeError(f"unknown framing (first bytes {bytes(data[:2]).hex()})")


# -- a direct reader for the types the envelopes use ----------------------------------------
#
# fastavro's schemaless_reader is generic: per message it builds a decoder, an options dict
# and named-schema tables, then walks the parsed schema, which costs more than reading a
# 130-byte envelope (8 us against 5 us, CPU time). compile_reader() builds a reader for a
# record whose fields are strings, longs, timestamp-millis, ["null", T] and maps of those;
# for any other schema it returns None and fastavro reads. Corrupt bodies raise (IndexError,
# ValueError, UnicodeDecodeError, OverflowError), which decode_record turns into DecodeError;
# bytes after the record are ignored, as fastavro ignores them. tests/test_codec.py checks
# it against fastavro on valid and on corrupted bodies.

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_VARINT_SHIFT = 63  # a long is at most 10 bytes of 7 bits
# A reader of one value: the value at a position in the bytes, and the position after it.
Reader = Callable[[bytes, int], tuple[Any, int]]


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    """The zig-zag varint at ``pos``, and the position after it."""
    byte = data[pos]
    if byte < 0x80:
        return (byte >> 1) ^ -(byte & 1), pos + 1
    value, shift = byte & 0x7F, 7
    while True:
        pos += 1
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value >> 1) ^ -(value & 1), pos + 1
        shift += 7
        if shift > _MAX_VARINT_SHIFT:
            raise ValueError("varint longer than a long")


def _read_string(data: bytes, pos: int) -> tuple[str, int]:
    size = data[pos]
    if size < 0x80:  # a length under 64: one byte, read here (a call less for most strings)
        size, pos = (size >> 1) ^ -(size & 1), pos + 1
    else:
        size, pos = _read_long(data, pos)
    end = pos + size
    if size < 0 or end > len(data):  # a slice would silently come back short
        raise ValueError(f"string of {size} bytes at {pos} runs past the body")
    return data[pos:end].decode(), end


def _read_timestamp_millis(data: bytes, pos: int) -> tuple[datetime, int]:
    millis, pos = _read_long(data, pos)
    return _EPOCH + timedelta(milliseconds=millis), pos


def _read_optional(read: Reader, data: bytes, pos: int) -> tuple[Any, int]:
    branch, pos = _read_long(data, pos)
    if branch == 0:
        return None, pos
    if branch == 1:
        return read(data, pos)
    raise ValueError(f"union branch {branch} of a two-branch union")


def _read_map(read: Reader, data: bytes, pos: int) -> tuple[dict[str, Any], int]:
    items: dict[str, Any] = {}
    while True:
        count, pos = _read_long(data, pos)
        if count == 0:
            return items, pos
        if count < 0:  # a block that also gives its size in bytes
            count = -count
            _, pos = _read_long(data, pos)
        for _ in range(count):
            key, pos = _read_string(data, pos)
            items[key], pos = read(data, pos)


def _type_reader(avro_type: Any) -> Reader | None:
    if avro_type == "string":
        return _read_string
    if avro_type == "long":
        return _read_long
    if isinstance(avro_type, list):
        if len(avro_type) == 2 and avro_type[0] == "null" and (read := _type_reader(avro_type[1])):
            return partial(_read_optional, read)
        return None
    if not isinstance(avro_type, dict):
        return None
    logical = avro_type.get("logicalType")
    if avro_type.get("type") == "long" and logical == "timestamp-millis":
        return _read_timestamp_millis
    if logical is not None:  # fastavro gives other logical types their Python types
        return None
    if avro_type.get("type") == "map" and (read := _type_reader(avro_type.get("values"))):
        return partial(_read_map, read)
    if avro_type.get("type") in ("string", "long"):
        return _type_reader(avro_type["type"])
    return None


def compile_reader(schema: dict[str, Any]) -> Callable[[bytes, int], dict[str, Any]] | None:
    """A reader of ``schema``'s records from a position in the bytes, or None if it has a type
    the direct reader does not know."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        return None
    readers = [(field["name"], _type_reader(field["type"])) for field in schema["fields"]]
    fields = [(name, read) for name, read in readers if read is not None]
    if len(fields) < len(readers):
        return None

    def read_record(data: bytes, pos: int) -> dict[str, Any]:
        record = {}
        for name, read in fields:
            record[name], pos = read(data, pos)
        return record

    return read_record


class EventCodec(AvroCodec):
    """:class:`AvroCodec` for ``vigil.v1.Event`` with :class:`Event` objects."""

    def __init__(self, schema_registry_url: str | None = None, **kwargs: Any):
        super().__init__(EVENT_SCHEMA_NAME, schema_registry_url=schema_registry_url, **kwargs)

    def encode(self, event: Event, topic: str = "") -> bytes:
        return self.encode_record(event.to_record(), topic)

    def decode(self, data: bytes | None, topic: str = "") -> Event:
        record = self.decode_record(data, topic)
        try:
            event = Event.from_record(record)
        except (KeyError, TypeError, AttributeError) as exc:
            raise DecodeError(f"record is not an event: missing or bad field {exc}") from None
        _check(event.user_id, event.source, event.source_id, event.kind, event.payload, event.session_id, event.headers)
        return event

    def decode_row(self, data: bytes | None, topic: str = "", now: datetime | None = None) -> tuple[Any, ...]:
        """The event's fields in :data:`EVENT_ROW_FIELDS` order, checked as :meth:`decode` does,
        and with ``now``, its instants inside the event window too (the worker's rule for
        events produced straight to Kafka: :func:`vigil.numbers.event_instant_problem`).

        The worker's consumer writes them straight into its COPY: building an :class:`Event`
        it would take apart again cost as much as reading the Avro body.
        """
        record = self.decode_record(data, topic)
        try:
            row: tuple[Any, ...] = _event_row(record)
            occurred_at, received_at = row[7], row[8]
            if received_at.tzinfo is None or (occurred_at is not None and occurred_at.tzinfo is None):
                row = (*row[:7], aware(occurred_at), aware(received_at))
        except (KeyError, TypeError, AttributeError) as exc:
            raise DecodeError(f"record is not an event: missing or bad field {exc}") from None
        _check(*row[:7])
        if now is not None:
            _check_instants(row[7], row[8], now)
        return row


# What the ledger stores of an event, in the order of the consumer's staging table.
EVENT_ROW_FIELDS = (
    "user_id",
    "source",
    "source_id",
    "kind",
    "payload",
    "session_id",
    "headers",
    "occurred_at",
    "received_at",
)
_event_row = itemgetter(*EVENT_ROW_FIELDS)


def _check(
    user_id: str, source: str, source_id: str, kind: str, payload: str, session_id: str | None, headers: dict[str, str]
) -> None:
    """Checks Avro cannot express: the ledger relies on these to key, route and store the event."""
    if not user_id:
        raise DecodeError("user_id is empty")
    if not source or not source_id:
        raise DecodeError("source and source_id must be non-empty (they are the dedup key)")
    if not kind:
        raise DecodeError("kind is empty")
    # PostgreSQL's text and jsonb cannot hold U+0000: one such event failed its whole batch's
    # COPY, which stopped the worker, and again after every restart. (The payload needs no
    # look: JSON text has no raw NUL, and an escaped one is plain text to the ledger.)
    for text in (user_id, source, source_id, kind, session_id or "", *headers, *headers.values()):
        if "\x00" in text:
            raise DecodeError("a field holds U+0000 (NUL), which the ledger cannot store")
    if not _scans_as_json(payload):
        try:
            json.loads(payload)
        # RecursionError: nested deeper than the interpreter's recursion limit; TypeError: not text.
        except (ValueError, TypeError, RecursionError) as exc:
            raise DecodeError(f"payload is not JSON: {exc}") from None


def _check_instants(occurred_at: datetime | None, received_at: datetime, now: datetime) -> None:
    """An event stamped in the year 1 or 9999 would sort first or last in every timeline
    ordered by its instants: ingest refuses one with a 400, the worker dead-letters it."""
    for name, value in (("occurred_at", occurred_at), ("received_at", received_at)):
        problem = None if value is None else event_instant_problem(value, now)
        if problem is not None:
            raise DecodeError(f"{name} {problem}")


# The C scanner json.loads runs (JSONDecoder sets it; typeshed does not declare it).
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _scans_as_json(text: str) -> bool:
    """True if the C scanner reads ``text`` as one JSON value from its first character to its last.

    Such text is JSON to json.loads too, at a fraction of its cost (most of json.loads is the
    Python around the scanner). False is no verdict: the caller asks json.loads, which also
    accepts surrounding whitespace and says what is wrong.
    """
    try:
        return _scan_json(text, 0)[1] == len(text)
    except (StopIteration, ValueError, TypeError, RecursionError):
        return False
