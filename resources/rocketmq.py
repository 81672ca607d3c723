"""``RocketMQResource``: the client layer as a Dagster ConfigurableResource.

Every field is optional: an unset field falls back to the environment
(``STREAM_ASSETS_ROCKETMQ_*``, read by :class:`~stream_assets.settings.RocketMQSettings`),
so the CLI, the tests and Dagster share one configuration story. Pass secrets
as ``dg.EnvVar`` so Dagster never displays them; inside, they become
``SecretStr`` and are never logged.

Example::

    >>> import dagster as dg
    >>> rmq = RocketMQResource(namesrv_addr="127.0.0.1:9876",
    ...                        access_key=dg.EnvVar("RMQ_AK"), secret_key=dg.EnvVar("RMQ_SK"))
    >>> with rmq.admin() as admin:  # doctest: +SKIP
    ...     admin.create_topic("orders", queues=8)
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
from pydantic import Field, SecretStr

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.settings import RocketMQSettings


class RocketMQResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Name server, credentials and client tuning for RocketMQ."""

    namesrv_addr: str | None = Field(default=None, description="'host:port[;host:port]'.")
    access_key: str | None = Field(default=None, description="ACL access key (use EnvVar).")
    secret_key: str | None = Field(default=None, description="ACL secret key (use EnvVar).")
    request_timeout_s: float | None = Field(default=None, description="Remoting call bound.")
    send_retries: int | None = Field(default=None, description="Retries of a failed send.")
    max_message_size: int | None = Field(default=None, description="Largest body accepted.")

    def settings(self) -> RocketMQSettings:
        """Environment settings overridden by the fields set on this resource."""
        overrides: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("namesrv_addr", "request_timeout_s", "send_retries", "max_message_size")
            if getattr(self, name) is not None
        }
        for name in ("access_key", "secret_key"):
            value = getattr(self, name)
            if value is not None:
                overrides[name] = SecretStr(value)
        return RocketMQSettings(**overrides)

    @contextmanager
    def admin(self) -> Iterator[RocketMQAdmin]:
        """A control-plane client, closed on exit."""
        with RocketMQAdmin(self.settings()) as admin:
            yield admin

    @contextmanager
    def producer(self) -> Iterator[Producer]:
        """A started producer, shut down on exit."""
        with Producer(self.settings()) as producer:
            yield producer

    @contextmanager
    def reader(self, group: str) -> Iterator[QueueReader]:
        """A queue reader named ``group``, closed on exit."""
        with self.admin() as admin:
            reader = QueueReader(admin, group)
            try:
                yield reader
            finally:
                reader.close()
