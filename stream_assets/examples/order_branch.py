"""Orders split by size: each branch to its own topic, large ones also counted per customer.

JSON orders ``{"id", "customer", "amount"}``. ``branch`` sends each order to
the first predicate it satisfies; orders no predicate takes go to the last
(default) branch::

    >>> t = build()
    >>> t.sink_topics
    ('orders-small', 'orders-large', 'orders-invalid', 'orders-large-per-customer')
"""

from __future__ import annotations

from typing import Any

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer


def _small(order: dict[str, Any]) -> bool:
    return bool(0 < order["amount"] < 100)


def _large(order: dict[str, Any]) -> bool:
    return bool(order["amount"] >= 100)


def build(
    job_id: str = "order-branch",
    source: str = "orders",
    prefix: str = "orders",
) -> Topology:
    """The order-branch topology."""
    b = StreamBuilder(job_id)
    small, large, invalid = b.source(source, json_deserializer).branch(_small, _large, default=True)
    small.sink(f"{prefix}-small", key="id")
    large.sink(f"{prefix}-large", key="id", tags=lambda o: "large")
    invalid.sink(f"{prefix}-invalid", key="id")
    large.key_by("customer").count("large_orders").to_rstream().sink(f"{prefix}-large-per-customer")
    return b.build()
