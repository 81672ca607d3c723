"""WordCount: text lines from ``sourceTopic``, counts per word to ``wordcount-out``.

The mirror of RocketMQ Streams' WordCount example::

    >>> t = build()
    >>> t.source_topic, t.sink_topics
    ('sourceTopic', ('wordcount-out',))
"""

from __future__ import annotations

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import text_deserializer


def split_words(line: str) -> list[str]:
    """Lower-cased words of a line (whitespace-separated)."""
    return line.lower().split()


def build(
    job_id: str = "wordcount",
    source: str = "sourceTopic",
    sink: str = "wordcount-out",
    exactly_once: bool = False,
) -> Topology:
    """The WordCount topology (``exactly_once``: its sink's, docs/guarantees.md)."""
    builder = StreamBuilder(job_id, exactly_once_sinks=exactly_once)
    (
        builder.source(source, text_deserializer)
        .flat_map(split_words)
        .key_by()  # the word itself
        .count()
        .to_rstream()
        .sink(sink)
    )
    return builder.build()
