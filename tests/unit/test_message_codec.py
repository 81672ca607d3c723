"""Unit tests of the stored-message decoder against messages built with ``struct``.

The byte layout is written out here from RocketMQ's commit-log format
(big-endian; as in MessageDecoder / CommitLog), not taken from the decoder:

    int32  total size          int32  magic code        int32  body CRC
    int32  queue id            int32  flag              int64  queue offset
    int64  physical offset     int32  sys flag          int64  born timestamp
    born host  (4-byte IPv4 + int32 port, or 16-byte IPv6 + port if sysFlag & 1<<4)
    int64  store timestamp
    store host (4-byte IPv4 + int32 port, or 16-byte IPv6 + port if sysFlag & 1<<5)
    int32  reconsume times     int64  prepared transaction offset
    int32  body length + body
    topic length (int8 with magic 0xDAA320A7, int16 with 0xDAA320AB) + topic
    int16  properties length + properties ("k\\x01v\\x02" per property)
"""

from __future__ import annotations

import ipaddress
import struct
import zlib
from dataclasses import dataclass, field

import pytest

from stream_assets.rocketmq.message_codec import decode_messages, decode_properties

MAGIC_V1 = 0xDAA320A7
MAGIC_V2 = 0xDAA320AB
SYS_COMPRESSED = 0x1
SYS_MULTI_TAGS = 0x2
SYS_TRANSACTION_PREPARED = 0x1 << 2
SYS_BORNHOST_V6 = 0x1 << 4
SYS_STOREHOST_V6 = 0x1 << 5
COMPRESSION_LZ4 = 0x1 << 8
COMPRESSION_ZSTD = 0x2 << 8
COMPRESSION_ZLIB = 0x3 << 8


@dataclass
class Msg:
    """Inputs of one stored message, with defaults a broker would plausibly write."""

    topic: str = "orders"
    body: bytes = b"hello"
    queue_id: int = 3
    queue_offset: int = 41
    physical_offset: int = 123_456_789_012
    flag: int = 0
    sys_flag: int = 0
    born_ts: int = 1_700_000_000_123
    store_ts: int = 1_700_000_000_456
    born_host: str = "10.1.2.3"
    born_port: int = 53211
    store_host: str = "10.9.8.7"
    store_port: int = 10911
    reconsume_times: int = 0
    prepared_offset: int = 0
    properties: dict[str, str] = field(default_factory=dict)
    v2: bool = False
    compress: bool = False

    def encode(self) -> bytes:
        sys_flag = self.sys_flag
        if ipaddress.ip_address(self.born_host).version == 6:
            sys_flag |= SYS_BORNHOST_V6
        if ipaddress.ip_address(self.store_host).version == 6:
            sys_flag |= SYS_STOREHOST_V6
        stored_body = zlib.compress(self.body) if self.compress else self.body
        # surrogateescape lets a test store bytes that are not UTF-8 ("\udcff" is 0xff).
        props = "".join(f"{k}\x01{v}\x02" for k, v in self.properties.items()).encode(
            "utf-8", "surrogateescape"
        )
        topic = self.topic.encode("utf-8")
        topic_part = (
            struct.pack(">H", len(topic)) if self.v2 else struct.pack(">B", len(topic))
        ) + topic
        rest = (
            struct.pack(">I", MAGIC_V2 if self.v2 else MAGIC_V1)
            + struct.pack(">i", zlib.crc32(stored_body) & 0x7FFFFFFF)
            + struct.pack(">i", self.queue_id)
            + struct.pack(">i", self.flag)
            + struct.pack(">q", self.queue_offset)
            + struct.pack(">q", self.physical_offset)
            + struct.pack(">i", sys_flag)
            + struct.pack(">q", self.born_ts)
            + ipaddress.ip_address(self.born_host).packed
            + struct.pack(">i", self.born_port)
            + struct.pack(">q", self.store_ts)
            + ipaddress.ip_address(self.store_host).packed
            + struct.pack(">i", self.store_port)
            + struct.pack(">i", self.reconsume_times)
            + struct.pack(">q", self.prepared_offset)
            + struct.pack(">i", len(stored_body))
            + stored_body
            + topic_part
            + struct.pack(">H", len(props))
            + props
        )
        return struct.pack(">i", 4 + len(rest)) + rest


def test_single_v1_ipv4_message_all_fields() -> None:
    msg = Msg(
        properties={"KEYS": "customer-7", "TAGS": "created", "UNIQ_KEY": "AC11000100002A9F"},
    )
    data = msg.encode()
    # Sanity of the builder itself, by CommitLog.calMsgLength: 91 fixed bytes
    # for a V1 message with IPv4 hosts, plus body, topic and properties.
    props_len = len("KEYS\x01customer-7\x02TAGS\x01created\x02UNIQ_KEY\x01AC11000100002A9F\x02")
    assert len(data) == 91 + len(b"hello") + len(b"orders") + props_len
    assert struct.unpack(">i", data[:4]) == (len(data),)
    [record] = decode_messages(data)
    assert record.topic == "orders"
    assert record.queue_id == 3
    assert record.queue_offset == 41
    assert record.body == b"hello"
    assert record.keys == ("customer-7",)
    assert record.key == "customer-7"
    assert record.tags == "created"
    assert record.msg_id == "AC11000100002A9F"
    assert record.born_timestamp == 1_700_000_000_123
    assert record.store_timestamp == 1_700_000_000_456
    assert record.properties == {
        "KEYS": "customer-7",
        "TAGS": "created",
        "UNIQ_KEY": "AC11000100002A9F",
    }


def test_v2_magic_two_byte_topic_length() -> None:
    # A topic longer than 255 bytes only fits the V2 two-byte length.
    long_topic = "t" * 300
    msgs = [Msg(topic="orders", v2=True), Msg(topic=long_topic, v2=True, queue_offset=42)]
    records = decode_messages(b"".join(m.encode() for m in msgs))
    assert [r.topic for r in records] == ["orders", long_topic]
    assert [r.queue_offset for r in records] == [41, 42]
    assert all(r.body == b"hello" for r in records)


@pytest.mark.parametrize(
    ("born", "store"),
    [
        ("10.0.0.1", "10.0.0.2"),
        ("2001:db8::1", "10.0.0.2"),
        ("10.0.0.1", "fe80::1:2:3:4"),
        ("::1", "2001:db8:85a3::8a2e:370:7334"),
    ],
)
@pytest.mark.parametrize("v2", [False, True])
def test_ipv4_and_ipv6_hosts_shift_the_following_fields(born: str, store: str, v2: bool) -> None:
    first = Msg(
        born_host=born,
        store_host=store,
        v2=v2,
        store_ts=1_712_345_678_901,
        body=b"\x00first\x00",
        properties={"KEYS": "a", "UNIQ_KEY": "U1"},
    )
    second = Msg(
        born_host=store,
        store_host=born,
        v2=not v2,
        queue_offset=42,
        store_ts=1_712_345_678_999,
        body=b"second",
        topic="other",
    )
    records = decode_messages(first.encode() + second.encode())
    assert len(records) == 2
    assert (records[0].store_timestamp, records[0].body, records[0].topic) == (
        1_712_345_678_901,
        b"\x00first\x00",
        "orders",
    )
    assert records[0].keys == ("a",)
    assert records[0].msg_id == "U1"
    assert (records[1].store_timestamp, records[1].body, records[1].topic) == (
        1_712_345_678_999,
        b"second",
        "other",
    )
    assert records[1].queue_offset == 42


def test_several_messages_in_stored_order() -> None:
    msgs = [
        Msg(
            queue_id=q,
            queue_offset=1000 + i,
            body=bytes([i]) * i + b"\x00" + bytes(range(256)),
            born_ts=1_000 + i,
            store_ts=2_000 + i,
            v2=i % 2 == 1,
            born_host="2001:db8::5" if i % 3 == 0 else "192.168.0.5",
            properties={"KEYS": f"k{i}", "TAGS": f"tag{i}", "UNIQ_KEY": f"ID{i:04d}"},
        )
        for i, q in enumerate([0, 5, 5, 7, 1, 0, 2])
    ]
    records = decode_messages(b"".join(m.encode() for m in msgs))
    assert len(records) == len(msgs)
    for m, r in zip(msgs, records, strict=True):
        assert (r.queue_id, r.queue_offset, r.body) == (m.queue_id, m.queue_offset, m.body)
        assert (r.born_timestamp, r.store_timestamp) == (m.born_ts, m.store_ts)
        assert r.keys == (m.properties["KEYS"],)
        assert r.tags == m.properties["TAGS"]
        assert r.msg_id == m.properties["UNIQ_KEY"]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00",
        b"\x00\x00\x00\x00",
        b"ab\x00cd\xff",
        b"\xff\xfe\x00\x01" * 300,
        bytes(range(256)) * 8,
    ],
)
def test_bodies_with_nul_bytes_come_back_exactly(body: bytes) -> None:
    records = decode_messages(Msg(body=body).encode() + Msg(body=b"next", queue_offset=42).encode())
    assert [r.body for r in records] == [body, b"next"]


@pytest.mark.parametrize("ctype", [COMPRESSION_ZLIB, 0])
def test_zlib_compressed_body_is_inflated(ctype: int) -> None:
    original = b"\x00compress me \xff" * 200
    msg = Msg(body=original, compress=True, sys_flag=SYS_COMPRESSED | ctype)
    data = msg.encode()
    assert original not in data  # it really is stored compressed
    records = decode_messages(data + Msg(body=b"plain", queue_offset=42).encode())
    assert [r.body for r in records] == [original, b"plain"]


@pytest.mark.parametrize("ctype", [COMPRESSION_LZ4, COMPRESSION_ZSTD])
def test_unsupported_compression_type_raises(ctype: int) -> None:
    msg = Msg(body=b"x" * 50, compress=True, sys_flag=SYS_COMPRESSED | ctype)
    with pytest.raises(ValueError, match="compression type"):
        decode_messages(msg.encode())


def test_compression_bits_without_compressed_flag_are_ignored() -> None:
    msg = Msg(body=b"raw", sys_flag=COMPRESSION_ZLIB | SYS_MULTI_TAGS | SYS_TRANSACTION_PREPARED)
    [record] = decode_messages(msg.encode())
    assert record.body == b"raw"


def test_properties_multiple_keys_tags_and_uniq_key() -> None:
    props = {
        "KEYS": "order-1 customer-7 region-eu",
        "TAGS": "created",
        "UNIQ_KEY": "7F0000010F8A18B4AAC25A1B9E8D0000",
        "CUSTOM": "välue with spaces",
        "EMPTY": "",
    }
    [record] = decode_messages(Msg(properties=props, v2=True).encode())
    assert record.keys == ("order-1", "customer-7", "region-eu")
    assert record.key == "order-1"
    assert record.tags == "created"
    assert record.msg_id == "7F0000010F8A18B4AAC25A1B9E8D0000"
    assert record.properties == props


def test_no_properties() -> None:
    [record] = decode_messages(Msg(properties={}).encode())
    assert record.keys == ()
    assert record.key is None
    assert record.tags is None
    assert record.msg_id == ""
    assert record.properties == {}


def test_decode_properties_direct() -> None:
    assert decode_properties("") == {}
    assert decode_properties("A\x011\x02B\x012\x02") == {"A": "1", "B": "2"}
    assert decode_properties("A\x011\x02B\x012") == {"A": "1", "B": "2"}  # no trailing sep
    assert decode_properties("X\x01a\x01b\x02") == {"X": "a\x01b"}


def test_empty_buffer_decodes_to_nothing() -> None:
    assert decode_messages(b"") == []


def test_bad_magic_raises_value_error() -> None:
    data = bytearray(Msg().encode())
    struct.pack_into(">I", data, 4, 0xCAFEBABE)
    with pytest.raises(ValueError, match="magic"):
        decode_messages(bytes(data))


def test_bad_magic_in_a_later_message_raises() -> None:
    first = Msg().encode()
    second = bytearray(Msg(queue_offset=42).encode())
    struct.pack_into(">I", second, 4, 0xDAA320AA)  # neither V1 nor V2
    with pytest.raises(ValueError, match=f"byte {len(first)}"):
        decode_messages(first + bytes(second))


def test_malformed_client_ids_are_cut_like_the_send_result() -> None:
    from stream_assets.rocketmq.message_codec import normalize_msg_id

    assert normalize_msg_id("0100007F00007F6D00008E \x00E16C9800") == "0100007F00007F6D00008E"
    assert normalize_msg_id("0100007F00005977000031 ") == "0100007F00005977000031"
    assert (
        normalize_msg_id("0100007F000038C400001143896C1400") == "0100007F000038C400001143896C1400"
    )


def test_a_malformed_id_with_bytes_that_are_not_utf8_does_not_stop_the_reader() -> None:
    props = {"UNIQ_KEY": "0100007F 0000\udcff\x00A1\udcfe", "k": "v"}
    (record,) = decode_messages(Msg(properties=props).encode())
    assert record.msg_id == "0100007F 0000\ufffd"
    assert record.properties["k"] == "v"
    assert record.body == b"hello"
