"""A producer process for the multi-process produce/consume test.

Run as ``python -m tests.integration._producer_worker <json spec>``; the spec
names the name server, topic, total message count, how many processes share
the work, this process's index and how many sender threads it uses. Process
``p`` sends every index ``i`` with ``i % processes == p``; thread ``t`` of it
sends those with ``(i // processes) % threads == t``, in increasing order.
Each thread has its own Producer (a Producer is not thread-safe).

It writes one JSON line per sent message to ``spec["out"]``:
``[index, queue_id, queue_offset, msg_id]`` and exits 0, or prints the error
and exits 1. JSON, not blank-separated text, because the C++ client's id can
be malformed and hold blanks or other odd characters (docs/rocketmq-client.md).
The message content is a pure function of the index (:func:`body_for`), so
the test regenerates what was sent independently.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import traceback

DISTINCT_KEYS = 1000


def key_index(i: int) -> int:
    """Which of the DISTINCT_KEYS keys message ``i`` carries.

    Consecutive index pairs share a key, so with two interleaved processes
    every key is sent by both of them.
    """
    return (i // 2) % DISTINCT_KEYS


def key_for(k: int) -> str:
    """Key text of key number ``k``; every tenth key is non-ASCII."""
    return f"clé-{k}-ключ" if k % 10 == 0 else f"key-{k}"


def body_for(i: int) -> bytes:
    """A ~100-byte body derived from ``i``: index prefix, NUL, 0xff, digest bytes.

    The digest bytes are arbitrary (mostly not valid UTF-8) and the length
    varies between 90 and 110 bytes.
    """
    digest = hashlib.sha256(i.to_bytes(8, "big")).digest()
    head = i.to_bytes(4, "big") + b"\x00\xff\xfe\x00"
    size = 90 + i % 21
    return (head + digest * 4)[:size]


def index_of(body: bytes) -> int:
    """The index a body was generated from (its first four bytes)."""
    return int.from_bytes(body[:4], "big")


def extras_for(i: int) -> tuple[str | None, dict[str, str] | None]:
    """Tags and properties: only every 997th message carries them."""
    if i % 997 != 0:
        return None, None
    return f"tag-{i % 7}", {"idx": str(i), "kind": "probe", "ünï": "välüe ✓"}


def _send_share(spec: dict[str, object], thread: int, out: list[str], errors: list[str]) -> None:
    from stream_assets.rocketmq.producer import Producer
    from stream_assets.settings import RocketMQSettings

    total = int(spec["total"])  # type: ignore[call-overload]
    processes = int(spec["processes"])  # type: ignore[call-overload]
    process = int(spec["process"])  # type: ignore[call-overload]
    threads = int(spec["threads"])  # type: ignore[call-overload]
    topic = str(spec["topic"])
    try:
        settings = RocketMQSettings(namesrv_addr=str(spec["namesrv"]))
        with Producer(settings) as producer:
            for i in range(process, total, processes):
                if (i // processes) % threads != thread:
                    continue
                tags, props = extras_for(i)
                receipt = producer.send(
                    topic, body_for(i), key=key_for(key_index(i)), tags=tags, properties=props
                )
                out.append(json.dumps([i, receipt.queue_id, receipt.queue_offset, receipt.msg_id]))
    except BaseException:
        errors.append(traceback.format_exc())


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    threads = int(spec["threads"])
    outs: list[list[str]] = [[] for _ in range(threads)]
    errors: list[str] = []
    workers = [
        threading.Thread(target=_send_share, args=(spec, t, outs[t], errors))
        for t in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    with open(spec["out"], "w") as f:
        for lines in outs:
            f.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
