"""Errors of the RocketMQ client layer: each says what was wrong and what to do."""

from __future__ import annotations

import re


class RocketMQError(Exception):
    """Base class of every error raised by :mod:`stream_assets.rocketmq`."""


class BrokerUnreachableError(RocketMQError):
    """A name server or broker did not answer within the configured bound."""

    def __init__(self, role: str, addr: str, reason: str) -> None:
        self.addr = addr
        where = f" at {addr}" if addr not in ("", "-") else ""
        super().__init__(
            f"cannot reach RocketMQ {role}{where}: {reason}. Is it running? (its status: "
            "`stream-assets broker status`, `cluster status` or `deploy status`, whichever "
            "started it; set STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR if it lives elsewhere)"
        )


class BrokerOutageError(RocketMQError):
    """A broker stayed unreachable past the outage budget an instance was given.

    Only with ``EngineSettings.broker_outage_s`` set: by default an instance
    waits as long as an outage lasts.

    Example::

        >>> e = BrokerOutageError("stage 0 queue 3", 131.0, 120.0, "broker unavailable (x)",
        ...                       "stream-assets cluster status")
        >>> str(e).split(";")[0]
        'stage 0 queue 3: the broker was unavailable for 131 s, past the outage budget of 120 s'
    """

    def __init__(
        self, what: str, waited_s: float, budget_s: float, cause: str, status_command: str
    ) -> None:
        self.waited_s, self.budget_s = waited_s, budget_s
        super().__init__(
            f"{what}: the broker was unavailable for {waited_s:.0f} s, past the outage budget "
            f"of {budget_s:.0f} s; raise STREAM_ASSETS_ENGINE_BROKER_OUTAGE_S, or unset it to "
            f"wait as long as an outage lasts. Check the brokers with `{status_command}`. "
            f"Last: {cause}"
        )


class TopicNotFoundError(RocketMQError):
    """The name server has no route for the topic.

    Its answer (``TOPIC_NOT_EXIST``) does not say why: the topic was never
    created (this project's brokers do not auto-create topics), or no broker
    group serving it is registered with the name server right now -- a broker
    that is down or restarting drops out of the routes until it registers
    again. The message says both. (A running instance, whose topics existed
    when it started, waits for such a route and says it waits for a broker:
    :mod:`stream_assets.runtime.drive.outage`.)

    Example::

        >>> e = TopicNotFoundError("orders", "127.0.0.1:9876")
        >>> "create it" in str(e), "registered with the name server" in str(e)
        (True, True)
    """

    def __init__(self, topic: str, namesrv: str) -> None:
        self.topic = topic
        self.namesrv = namesrv
        super().__init__(
            f"the name server {namesrv} has no route for topic {topic!r}: either "
            "it does not exist (the broker does not auto-create topics; create it with "
            "`stream-assets topic create` or RocketMQAdmin.create_topic), or no broker "
            "group serving it is registered with the name server now (down or "
            "restarting? `stream-assets broker status`)"
        )


class MessageTooLargeError(RocketMQError):
    """A message body is larger than the configured limit, the broker's maxMessageSize.

    ``limit`` is the one enforced: ``RocketMQSettings.max_message_size``
    (STREAM_ASSETS_ROCKETMQ_MAX_MESSAGE_SIZE). Every body up to it is sent.

    Example::

        >>> print(MessageTooLargeError("t", 4194305, 4194304))  # doctest: +ELLIPSIS
        message for topic 't' has a 4194305-byte body, over the limit of 4194304 bytes ...
    """

    def __init__(self, topic: str, size: int, limit: int) -> None:
        self.topic = topic
        self.size = size
        self.limit = limit
        super().__init__(
            f"message for topic {topic!r} has a {size}-byte body, over the limit of "
            f"{limit} bytes set by STREAM_ASSETS_ROCKETMQ_MAX_MESSAGE_SIZE (bodies up to it are "
            "sent; it must equal the broker's maxMessageSize, which is what the broker "
            "checks a body against)"
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
