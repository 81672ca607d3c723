"""Unit tests of the batch-send body encoder against a reference parser written here.

The layout is taken from RocketMQ's ``MessageDecoder.encodeMessage`` /
``decodeMessage`` (and the broker's reading of it in
``MessageExtEncoder.encode(MessageExtBatch)``), not from our encoder. Per
message, big-endian, one after the other:

    int32 total size (of this entry)   int32 magic code (0)   int32 body CRC (0)
    int32 flag                         int32 body length + body
    int16 properties length + properties (UTF-8 "name\\x01value\\x02" per property)
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import pytest

from stream_assets.rocketmq.message_codec import (
    encode_batch_body,
    encode_entry,
    encode_message,
    encode_properties,
)


@dataclass
class Entry:
    total: int
    magic: int
    crc: int
    flag: int
    body: bytes
    properties: dict[str, str]


def reference_parse(buf: bytes) -> list[Entry]:
    """Walk the entries field by field, as the broker does, checking each total size."""
    out: list[Entry] = []
    pos = 0
    while pos < len(buf):
        start = pos
        total, magic, crc, flag, body_len = struct.unpack_from(">iiiii", buf, pos)
        pos += 20
        body = buf[pos : pos + body_len]
        pos += body_len
        (props_len,) = struct.unpack_from(">h", buf, pos)  # Java reads a signed short
        pos += 2
        text = buf[pos : pos + props_len].decode("utf-8")
        pos += props_len
        assert total == pos - start, "total size must be the entry's own length"
        props: dict[str, str] = {}
        for pair in text.split("\x02")[:-1]:  # every property ends with \x02
            name, value = pair.split("\x01")
            props[name] = value
        assert text == "" or text.endswith("\x02")
        out.append(Entry(total, magic, crc, flag, body, props))
    assert pos == len(buf), "no trailing bytes"
    return out


def test_single_entry_layout_byte_for_byte() -> None:
    entry = encode_message(b"ab", {"KEYS": "k"}, flag=5)
    props = b"KEYS\x01k\x02"
    expected = (
        struct.pack(">iiiii", 22 + 2 + len(props), 0, 0, 5, 2)
        + b"ab"
        + struct.pack(">h", len(props))
        + props
    )
    assert entry == expected


def test_round_trip_many_messages() -> None:
    rnd = random.Random(7)
    messages: list[tuple[bytes, dict[str, str] | None]] = []
    for i in range(500):
        body = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 300)))
        if i % 3 == 0:
            body = b"\x00" + body + b"\x00\x00"  # zero bytes anywhere
        props: dict[str, str] | None = {
            "KEYS": f"key-{i}",
            "TAGS": "t" if i % 2 else "odd",
            "user": f"välue-{i} ✓",  # non-ASCII: lengths are UTF-8 bytes, not characters
        }
        if i % 7 == 0:
            props = None
        messages.append((body, props))
    parsed = reference_parse(encode_batch_body(messages))
    assert len(parsed) == len(messages)
    for (body, props), entry in zip(messages, parsed, strict=True):
        assert entry.body == body
        assert entry.properties == (props or {})
        assert (entry.magic, entry.crc, entry.flag) == (0, 0, 0)


def test_batch_body_is_concatenation() -> None:
    a = encode_message(b"x")
    b = encode_message(b"yz", {"TAGS": "t"})
    assert encode_batch_body([(b"x", None), (b"yz", {"TAGS": "t"})]) == a + b
    assert encode_batch_body([]) == b""


def test_properties_keep_insertion_order() -> None:
    assert encode_properties({"b": "1", "a": "2"}) == "b\x011\x02a\x012\x02"


@pytest.mark.parametrize(
    "props",
    [{"a\x01b": "v"}, {"a\x02": "v"}, {"": "v"}, {"a": "v\x01w"}, {"a": "v\x02"}],
)
def test_separator_characters_are_refused(props: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        encode_message(b"x", props)


def test_properties_over_the_signed_short_are_refused() -> None:
    encode_entry(b"x", b"p" * 0x7FFF)  # the largest that fits
    with pytest.raises(ValueError, match="at most 32767"):
        encode_entry(b"x", b"p" * 0x8000)
