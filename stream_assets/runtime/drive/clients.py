"""RocketMQ clients cached per process, for code that runs inside Spark tasks.

Spark reuses its Python workers across tasks, so a worker keeps one producer
and one reader per configuration instead of connecting per micro-batch.
"""

from __future__ import annotations

import os
import threading

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.settings import RocketMQSettings

_lock = threading.Lock()
_admins: dict[tuple[int, str], RocketMQAdmin] = {}
_producers: dict[tuple[int, str], BatchProducer] = {}
_readers: dict[tuple[int, str, str], QueueReader] = {}


def _ident(settings: RocketMQSettings) -> str:
    # Every field counts (credentials, timeouts): two configurations never share a client.
    return settings.digest()


def admin_for(settings: RocketMQSettings) -> RocketMQAdmin:
    """This process's control-plane client for ``settings``."""
    # The pid guards against a client inherited through fork.
    key = (os.getpid(), _ident(settings))
    with _lock:
        if key not in _admins:
            _admins[key] = RocketMQAdmin(settings)
        return _admins[key]


def producer_for(settings: RocketMQSettings) -> BatchProducer:
    """This process's started batching producer for ``settings``."""
    key = (os.getpid(), _ident(settings))
    with _lock:
        if key not in _producers:
            _producers[key] = BatchProducer(settings, RocketMQAdmin(settings)).start()
        return _producers[key]


def reader_for(settings: RocketMQSettings, group: str) -> QueueReader:
    """This process's queue reader for ``settings`` and ``group``."""
    key = (os.getpid(), _ident(settings), group)
    admin = admin_for(settings)
    with _lock:
        if key not in _readers:
            _readers[key] = QueueReader(admin, group)
        return _readers[key]
