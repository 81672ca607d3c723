"""A base for test senders that store each message as it is sent.

The engine's senders queue until ``flush`` (runtime/core/send_buffer.py); a test
sender that stores at once (to fail or interleave at an exact message) gets the
same interface by implementing ``send_now`` and inheriting ``send``/``flush``.
"""

from __future__ import annotations

from stream_assets.rocketmq.records import SendReceipt


class ImmediateSender:
    """``send`` stores at once through ``send_now``; ``flush`` returns the receipts since."""

    _receipts: list[SendReceipt]

    def send_now(
        self, topic: str, body: bytes, *, key: str | None = None, queue_id: int | None = None
    ) -> SendReceipt:
        raise NotImplementedError

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        key: str | None = None,
        queue_id: int | None = None,
        **_: object,
    ) -> None:
        receipt = self.send_now(topic, body, key=key, queue_id=queue_id)
        self.__dict__.setdefault("_receipts", []).append(receipt)

    def flush(self) -> list[SendReceipt]:
        done = self.__dict__.get("_receipts", [])
        self._receipts = []
        return done
