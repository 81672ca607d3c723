"""Live input for a deployment: text lines into a topic at a steady rate, until stopped.

Run as a service of the deployment (``python -m stream_assets.deploy.feeder
sourceTopic --lines-per-s 200``), with the RocketMQ settings of the environment
(``STREAM_ASSETS_ROCKETMQ_*``, credentials included). Lines are words from a fixed
vocabulary, ten lines a message, so a WordCount's output can be checked against
``collections.Counter`` of what the topic holds. Every 10 s it says how much it sent.

Example::

    >>> lines = text_lines(random.Random(1), 2, words_per_line=3)
    >>> len(lines), all(len(line.split()) == 3 for line in lines)
    (2, True)
"""

from __future__ import annotations

import argparse
import random
import signal
import threading
import time
from collections.abc import Sequence

from stream_assets.rocketmq.errors import SendError
from stream_assets.rocketmq.producer import Producer
from stream_assets.settings import RocketMQSettings

VOCABULARY = tuple(f"w{i:03d}" for i in range(500))
LINES_PER_MESSAGE = 10


def text_lines(rnd: random.Random, count: int, words_per_line: int = 8) -> list[str]:
    """``count`` lines of ``words_per_line`` words drawn from :data:`VOCABULARY`."""
    return [" ".join(rnd.choices(VOCABULARY, k=words_per_line)) for _ in range(count)]


def feed(
    settings: RocketMQSettings,
    topic: str,
    lines_per_s: float,
    stop: threading.Event,
    seed: int = 0,
) -> int:
    """Send to ``topic`` every half second until ``stop``; the number of lines sent.

    Example::

        >>> feed(RocketMQSettings(), "sourceTopic", 200, threading.Event())  # doctest: +SKIP
    """
    rnd = random.Random(seed or time.time_ns())
    sent, said_at, tick = 0, time.monotonic(), 0.5
    per_tick = max(1, round(lines_per_s * tick / LINES_PER_MESSAGE)) * LINES_PER_MESSAGE
    with Producer(settings) as producer:
        while not stop.wait(tick):
            lines = text_lines(rnd, per_tick)
            for i in range(0, len(lines), LINES_PER_MESSAGE):
                body = "\n".join(lines[i : i + LINES_PER_MESSAGE]).encode()
                if not _send_until_stored(producer, topic, body, f"feed-{sent + i}", stop):
                    break
            sent += len(lines)
            if time.monotonic() - said_at >= 10:
                print(f"fed {sent} lines into {topic}", flush=True)
                said_at = time.monotonic()
    print(f"stopped: fed {sent} lines into {topic}", flush=True)
    return sent


def _send_until_stored(
    producer: Producer, topic: str, body: bytes, key: str, stop: threading.Event
) -> bool:
    """Send one message, again after a failed send (a broker restarting, a master being
    replaced), as a live source would; False if stopped first. A failed send may have
    been stored, so a message can be stored twice: a count reference reads the topic."""
    while True:
        try:
            producer.send(topic, body, key=key)
            return True
        except SendError as exc:
            print(f"send failed, trying again: {exc}", flush=True)
            if stop.wait(1.0):
                return False


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("topic")
    parser.add_argument("--lines-per-s", type=float, default=200.0)
    args = parser.parse_args(argv)
    stop = threading.Event()
    # SIGTERM (the deployment's `down`) ends the current send and exits cleanly.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    feed(RocketMQSettings(), args.topic, args.lines_per_s, stop)


if __name__ == "__main__":
    main()
