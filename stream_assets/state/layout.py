"""Where each kind of keyed state lives in a queue's RocksDB: one prefix byte per kind.

The state layer owns this layout, so the keyed core (:mod:`stream_assets.runtime.core.keyed`)
and state queries (:mod:`stream_assets.control.state_query`) read a key the
same way without importing each other. The prefixes are part of the state
topic's wire format (a changelog replays these bytes): a new kind gets a new
prefix, an existing one never changes meaning.

Times are stored big-endian with a bias (:data:`BIAS`), so byte order is time
order and a scan by prefix meets the earliest first: firing windows, due
timers and expired keys all read a prefix up to a bound and stop.

>>> raw = window_key(Window(0, 10), b"k")
>>> parse_window_key(raw)
(Window(start=0, end=10), b'k')
>>> time_of(timer_key(EVENT_TIMERS, 5, b"k")), key_of_timed(timer_key(EVENT_TIMERS, 5, b"k"))
(5, b'k')
"""

from __future__ import annotations

import struct

from stream_assets.windows import Window

PLAIN = b"k"  # unwindowed aggregate: key -> acc
WINDOWED = b"w"  # end, start, key -> acc (ordered by end, so firing scans a prefix)
SESSION = b"s"  # key -> [[start, end, acc], ...]
FIRED = b"f"  # key -> end of its latest fired session
TABLE = b"t"  # key -> [[ts, value], ...]: a table's versions, oldest first
PENDING = b"p"  # ts, src, off, sub, key -> [key, value, ts]: stream records awaiting the watermark
USER = b"u"  # len(key), key, state name, 0, item -> value: a processor's own state
EVENT_TIMERS = b"E"  # ts, key -> True: a processor's event-time timers, earliest first
KEY_TIMERS = b"e"  # key -> [ts, ...]: the same timers by key (those due before its next record)
PROCESSING_TIMERS = b"P"  # ts, key -> True: its processing-time timers
EXPIRY = b"X"  # expires at, key -> True: keys with a TTL, earliest expiry first
EXPIRES = b"x"  # key -> when it expires (the EXPIRY entry to move when the key is touched)
OUTBOX = b"\x00outbox"  # [seq, [[exit, queue, packed entry], ...], progress]
#: Signed milliseconds -> unsigned, so byte order is time order.
BIAS = 2**63
_TIME = struct.Struct(">Q")
_WINDOW = struct.Struct(">QQ")
_PENDING_AT = struct.Struct(">QQQQ")
_KEY_LEN = struct.Struct(">I")


def window_key(window: Window, key_bytes: bytes) -> bytes:
    """A fixed window's accumulator: ordered by window end, then start."""
    return WINDOWED + _WINDOW.pack(window.end + BIAS, window.start + BIAS) + key_bytes


def parse_window_key(raw: bytes) -> tuple[Window, bytes]:
    """The window and key bytes of a :func:`window_key`."""
    end, start = _WINDOW.unpack_from(raw, 1)
    return Window(start - BIAS, end - BIAS), raw[1 + _WINDOW.size :]


def pending_key(ts: int, src: int, off: int, sub: int, key_bytes: bytes) -> bytes:
    """A stream record waiting for the watermark: ordered by event time, then origin."""
    return PENDING + _PENDING_AT.pack(ts + BIAS, src, off, sub) + key_bytes


def parse_pending_key(raw: bytes) -> tuple[int, tuple[int, int, int], bytes]:
    """Event time, origin (src, off, sub) and key bytes of a :func:`pending_key`."""
    ts, src, off, sub = _PENDING_AT.unpack_from(raw, 1)
    return ts - BIAS, (src, off, sub), raw[1 + _PENDING_AT.size :]


def timer_key(prefix: bytes, ts: int, key_bytes: bytes) -> bytes:
    """A timer (or an expiry) at ``ts`` for a key: ``prefix`` is
    :data:`EVENT_TIMERS`, :data:`PROCESSING_TIMERS` or :data:`EXPIRY`."""
    return prefix + _TIME.pack(ts + BIAS) + key_bytes


def time_of(raw: bytes) -> int:
    """The time of a :func:`timer_key` or :func:`pending_key` (they lead with it)."""
    return int(_TIME.unpack_from(raw, 1)[0]) - BIAS


def key_of_timed(raw: bytes) -> bytes:
    """The key bytes of a :func:`timer_key`."""
    return raw[1 + _TIME.size :]


def user_prefix(key_bytes: bytes, name: str | None = None) -> bytes:
    """All of a key's processor state, or with ``name`` one state of it.

    The key's length leads, so one key's prefix is never another key's.
    """
    head = USER + _KEY_LEN.pack(len(key_bytes)) + key_bytes
    return head if name is None else head + name.encode() + b"\x00"


def user_key(key_bytes: bytes, name: str, item: bytes = b"") -> bytes:
    """One value of a processor's state ``name`` for a key (``item``: a map's entry)."""
    return user_prefix(key_bytes, name) + item


def parse_user_key(raw: bytes) -> tuple[bytes, str, bytes]:
    """Key bytes, state name and item of a :func:`user_key`."""
    (length,) = _KEY_LEN.unpack_from(raw, 1)
    start = 1 + _KEY_LEN.size
    key_bytes = raw[start : start + length]
    name, _, item = raw[start + length :].partition(b"\x00")
    return key_bytes, name.decode(), item


def upper_bound(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (for range ends)."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b"\xff" * (len(prefix) + 1)
