"""Errors of the RocketMQ client layer: each says what was wrong and what to do."""

from __future__ import annotations


class RocketMQError(Exception):
    """Base class of every error raised by :mod:`stream_assets.rocketmq`."""


class BrokerUnreachableError(RocketMQError):
    """A name server or broker did not answer within the configured bound."""

    def __init__(self, role: str, addr: str, reason: str) -> None:
        self.addr = addr
        super().__init__(
            f"cannot reach RocketMQ {role} at {addr}: {reason}. Is it running? "
            "(`stream-assets broker status`; set STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR "
            "if it lives elsewhere)"
        )


class TopicNotFoundError(RocketMQError):
    """The topic has no route: it was never created and auto-create is off."""

    def __init__(self, topic: str, namesrv: str) -> None:
        self.topic = topic
        super().__init__(
            f"topic {topic!r} does not exist on the name server {namesrv} and the broker "
            "does not auto-create topics; create it first (RocketMQAdmin.create_topic or "
            "`stream-assets topic create`)"
        )


class MessageTooLargeError(RocketMQError):
    """A message body is larger than the configured limit."""

    def __init__(self, topic: str, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"message for topic {topic!r} has a {size}-byte body, over the limit of "
            f"{limit} bytes (STREAM_ASSETS_ROCKETMQ_MAX_MESSAGE_SIZE, which must not exceed "
            "the broker's maxMessageSize)"
        )


class SendError(RocketMQError):
    """A send failed after every retry."""


class RemotingError(RocketMQError):
    """The broker or name server answered a request with an error code."""

    def __init__(self, what: str, code: int, remark: str | None) -> None:
        self.code = code
        self.remark = remark
        super().__init__(f"{what} failed: code {code}: {remark or 'no remark'}")
