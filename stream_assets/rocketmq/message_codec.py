"""The stored-message format a pull returns (decoded), and batch-send bodies (encoded).

Written by hand (no Python library decodes it). Layout per message, big-endian,
as in the broker's commit log: total size, magic code, body CRC, queue id,
flag, queue offset, physical offset, sys flag, born timestamp, born host,
store timestamp, store host, reconsume times, prepared transaction offset,
body length + body, topic length (1 byte, or 2 with the V2 magic) + topic,
properties length (2 bytes) + properties (``k\\x01v\\x02`` pairs).

It also encodes the other direction, the body of a batch send
(``SEND_BATCH_MESSAGE``): the concatenation of one short entry per message,
as RocketMQ's ``MessageDecoder.encodeMessage`` lays it out::

    int32 total size | int32 magic (0) | int32 body CRC (0) | int32 flag
    | int32 body length + body | int16 properties length + properties

The broker ignores the magic and CRC fields of an entry (it computes the CRC
itself) and stores each entry's properties verbatim, so what
:func:`decode_messages` reads back is exactly what was encoded here.

Example::

    >>> entry = encode_message(b"a\\x00b", {"KEYS": "k"})
    >>> len(entry), entry[:4] == len(entry).to_bytes(4, "big")
    (32, True)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Mapping

from stream_assets.rocketmq.records import Record

_MAGIC_V1 = -626843481  # 0xDAA320A7: topic length is one byte
_MAGIC_V2 = -626843477  # 0xDAA320AB: topic length is two bytes
_FLAG_COMPRESSED = 0x1
_FLAG_BORNHOST_V6 = 0x1 << 4
_FLAG_STOREHOST_V6 = 0x1 << 5
_COMPRESSION_TYPE_MASK = 0x7 << 8  # 5.x: 0 / zlib=3<<8 (lz4 and zstd are not decoded here)
_COMPRESSION_ZLIB = 0x3 << 8

_HEAD = struct.Struct(">iiiiiqqiq")  # size .. born timestamp
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_U16 = struct.Struct(">H")

NAME_VALUE_SEPARATOR = "\x01"
PROPERTY_SEPARATOR = "\x02"
PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_UNIQ_KEY = "UNIQ_KEY"

#: The properties length of a batch entry (and of a stored message) is a signed
#: 16-bit field; longer property strings would wrap and corrupt the batch.
MAX_PROPERTIES_BYTES = 0x7FFF
#: Bytes of a batch entry besides its body and properties.
BATCH_ENTRY_OVERHEAD = 4 * 5 + 2

_ENTRY_HEAD = struct.Struct(">iiiii")  # total size, magic, body CRC, flag, body length


def normalize_msg_id(raw: str) -> str:
    """The message id as the C++ client's send result reports it.

    That client's id maker is not thread-safe: with producers sending from
    several threads it now and then stores a malformed unique id, cut short,
    with blanks, or with a zero byte and more (a few in 100k sends). Its send
    result is the C string, cut at the zero byte; read ids are cut the same way.
    """
    return raw.split("\x00", 1)[0].strip()


def decode_properties(text: str) -> dict[str, str]:
    """Parse the ``k\\x01v\\x02`` property string."""
    props: dict[str, str] = {}
    for item in text.split(PROPERTY_SEPARATOR):
        if item:
            name, _, value = item.partition(NAME_VALUE_SEPARATOR)
            props[name] = value
    return props


def encode_properties(properties: Mapping[str, str]) -> str:
    """The ``k\\x01v\\x02`` property string of ``properties`` (insertion order).

    Refuses names and values holding a separator character: the broker would
    split them into other properties. Names must not be empty.
    """
    parts: list[str] = []
    for name, value in properties.items():
        if not name or NAME_VALUE_SEPARATOR in name or PROPERTY_SEPARATOR in name:
            raise ValueError(f"invalid message property name {name!r}")
        if NAME_VALUE_SEPARATOR in value or PROPERTY_SEPARATOR in value:
            raise ValueError(
                f"message property {name!r}: the value must not contain \\x01 or \\x02"
            )
        parts.append(f"{name}{NAME_VALUE_SEPARATOR}{value}{PROPERTY_SEPARATOR}")
    return "".join(parts)


def encode_message(
    body: bytes, properties: Mapping[str, str] | None = None, flag: int = 0
) -> bytes:
    """One batch entry: ``body`` with ``properties``, in the layout of the module docstring."""
    props = encode_properties(properties).encode("utf-8") if properties else b""
    return encode_entry(body, props, flag)


def encode_entry(body: bytes, properties: bytes, flag: int = 0) -> bytes:
    """One batch entry from an already encoded property string (``k\\x01v\\x02...``)."""
    if len(properties) > MAX_PROPERTIES_BYTES:
        raise ValueError(
            f"message properties take {len(properties)} bytes encoded; RocketMQ allows at most "
            f"{MAX_PROPERTIES_BYTES}"
        )
    head = _ENTRY_HEAD.pack(
        BATCH_ENTRY_OVERHEAD + len(body) + len(properties), 0, 0, flag, len(body)
    )
    return b"".join((head, body, _U16.pack(len(properties)), properties))


def encode_batch_body(messages: Iterable[tuple[bytes, Mapping[str, str] | None]]) -> bytes:
    """The body of one ``SEND_BATCH_MESSAGE`` request: each ``(body, properties)``, in order.

    Example::

        >>> body = encode_batch_body([(b"x", None), (b"yz", {"TAGS": "t"})])
        >>> body == encode_message(b"x") + encode_message(b"yz", {"TAGS": "t"})
        True
    """
    return b"".join(encode_message(body, props) for body, props in messages)


def decode_messages(buf: bytes) -> list[Record]:
    """Decode every message in a pull response body, in stored order."""
    records: list[Record] = []
    pos, end = 0, len(buf)
    while pos < end:
        (
            total,
            magic,
            _crc,
            queue_id,
            _flag,
            queue_offset,
            _phys,
            sys_flag,
            born_ts,
        ) = _HEAD.unpack_from(buf, pos)
        if magic not in (_MAGIC_V1, _MAGIC_V2):
            raise ValueError(f"bad message magic code {magic & 0xFFFFFFFF:#010x} at byte {pos}")
        if total <= 0 or pos + total > end:
            raise ValueError(f"bad message size {total} at byte {pos} of {end}")
        p = pos + _HEAD.size
        p += 20 if sys_flag & _FLAG_BORNHOST_V6 else 8
        (store_ts,) = _I64.unpack_from(buf, p)
        p += 8
        p += 20 if sys_flag & _FLAG_STOREHOST_V6 else 8
        p += 4 + 8  # reconsume times, prepared transaction offset
        (body_len,) = _I32.unpack_from(buf, p)
        p += 4
        body = bytes(buf[p : p + body_len])
        p += body_len
        if sys_flag & _FLAG_COMPRESSED:
            ctype = sys_flag & _COMPRESSION_TYPE_MASK
            if ctype not in (0, _COMPRESSION_ZLIB):
                raise ValueError(f"message compression type {ctype >> 8} is not supported")
            body = zlib.decompress(body)
        if magic == _MAGIC_V2:
            (topic_len,) = _U16.unpack_from(buf, p)
            p += 2
        else:
            topic_len = buf[p]
            p += 1
        topic = buf[p : p + topic_len].decode("utf-8")
        p += topic_len
        (props_len,) = _U16.unpack_from(buf, p)
        p += 2
        # Not strict: the C++ client's malformed unique ids (see normalize_msg_id)
        # may hold any bytes, and one such message must not stop the reader.
        props_text = buf[p : p + props_len].decode("utf-8", errors="replace")
        props = decode_properties(props_text) if props_len else {}
        keys_text = props.get(PROPERTY_KEYS, "")
        records.append(
            Record(
                topic=topic,
                queue_id=queue_id,
                queue_offset=queue_offset,
                body=body,
                keys=tuple(keys_text.split(" ")) if keys_text else (),
                tags=props.get(PROPERTY_TAGS),
                properties=props,
                born_timestamp=born_ts,
                store_timestamp=store_ts,
                msg_id=normalize_msg_id(props.get(PROPERTY_UNIQ_KEY, "")),
            )
        )
        pos += total
    return records
