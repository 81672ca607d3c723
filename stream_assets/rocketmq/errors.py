"""Errors of the RocketMQ client layer: each says what was wrong and what to do."""

from __future__ import annotations

import re


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


class CredentialsRefusedError(RocketMQError):
    """A broker refused this client's ACL credentials, or the user lacks a grant.

    The message names the user (the access key, never the secret), the
    operation and the resource refused, and where the credentials come from.
    ``missing_grant`` tells a known user without a permission from a user the
    broker does not accept at all (unknown, disabled, wrong secret, no key).
    """

    def __init__(
        self,
        access_key: str | None,
        operation: str,
        resource: str,
        reason: str | None,
        missing_grant: bool = False,
    ) -> None:
        self.access_key = access_key
        self.operation = operation
        self.resource = resource
        self.reason = reason
        self.missing_grant = missing_grant
        who = (
            f"user {access_key!r}"
            if access_key
            else "a client without credentials (STREAM_ASSETS_ROCKETMQ_ACCESS_KEY is not set)"
        )
        if missing_grant:
            advice = (
                "an admin must grant it (docs/acl.md lists what a topology needs); or check "
                "that STREAM_ASSETS_ROCKETMQ_ACCESS_KEY / STREAM_ASSETS_ROCKETMQ_SECRET_KEY "
                "name the intended user"
            )
        else:
            advice = (
                "check STREAM_ASSETS_ROCKETMQ_ACCESS_KEY / STREAM_ASSETS_ROCKETMQ_SECRET_KEY "
                "(a rotated secret?) and that the user exists on every broker (docs/acl.md)"
            )
        super().__init__(
            f"RocketMQ refused {who}: {operation} on {resource} was denied "
            f"({reason or 'no reason given'}); {advice}"
        )

    @classmethod
    def from_reply(
        cls, code: int, remark: str | None, access_key: str | None, operation: str, resource: str
    ) -> CredentialsRefusedError | None:
        """The error for a broker answer that is an ACL 2.0 refusal, else None.

        Only ``NO_PERMISSION`` (16) answers whose remark is one of ACL 2.0's
        count; the broker's other code-16 answers (a topic or broker that is
        not writable) are not credential problems. For a missing grant the
        resource is the one the broker names.

        >>> e = CredentialsRefusedError.from_reply(16, "check signature failed.", "app",
        ...                                        "pull", "Topic:t")
        >>> e is not None and not e.missing_grant and "SECRET_KEY" in str(e)
        True
        >>> CredentialsRefusedError.from_reply(16, "User:app has no permission to access "
        ...     "Group:g from 10.0.0.1, no matched policies.", "app", "pull", "?").resource
        'Group:g'
        >>> CredentialsRefusedError.from_reply(17, "topic not exist", "app", "pull", "t") is None
        True
        """
        if code != _NO_PERMISSION:
            return None
        text = remark or ""
        if any(s in text for s in _NOT_GRANTED):
            found = _REFUSED_RESOURCE.search(text)
            return cls(access_key, operation, found.group(1) if found else resource, text, True)
        if any(s in text for s in _NOT_ACCEPTED):
            return cls(access_key, operation, resource, text)
        return None


#: ResponseCode.NO_PERMISSION: every ACL 2.0 refusal (and a few answers that are not ACL's).
_NO_PERMISSION = 16
#: Remarks of a broker that does not accept the user at all (authentication).
_NOT_ACCEPTED = (
    "check signature failed",
    "not found",
    "is disabled",
    "username cannot be null",
    "Authentication failed",
    "MetadataProvider is not configured",
)
#: Remarks of a broker that accepts the user but not the operation (authorization).
_NOT_GRANTED = ("has no permission to access", "Authorization failed")
_REFUSED_RESOURCE = re.compile(r"has no permission to access (\S+) from")
