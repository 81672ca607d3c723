"""WordCount, vectorised: each batch of lines is split and lower-cased in Arrow compute.

The same counts as :mod:`~stream_assets.examples.wordcount` on ordinary text
(Arrow splits on Unicode white space, see :mod:`stream_assets.operators.batches`);
the engine counts a whole batch at once
(:mod:`~stream_assets.runtime.core.stage0.batch_count_path`), calling the key function
once per distinct word, not once per word. Its topics are its own: a
source topic read by two topologies would put both in a group of shared
topics in Dagster's lineage::

    >>> t = build()
    >>> t.source_topic, t.sink_topics
    ('wordcount-arrow-in', ('wordcount-arrow-out',))
"""

from __future__ import annotations

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.operators.batches import lower_words
from stream_assets.plan.topology import Topology
from stream_assets.serde import text_deserializer


def build(
    job_id: str = "wordcount-arrow",
    source: str = "wordcount-arrow-in",
    sink: str = "wordcount-arrow-out",
    exactly_once: bool = False,
) -> Topology:
    """The vectorised WordCount topology (``exactly_once``: its sink's)."""
    builder = StreamBuilder(job_id, exactly_once_sinks=exactly_once)
    count_words(builder, source, sink)
    return builder.build()


def count_words(builder: StreamBuilder, source: str, sink: str) -> None:
    """Add the vectorised WordCount of ``source`` into ``sink`` to ``builder`` (beside what
    else it builds).

    >>> b = StreamBuilder("wc")
    >>> count_words(b, "lines", "counts")
    >>> [s.input_topic for s in b.build().stages]
    ['lines', 'wc__shuffle__aggregate']
    """
    (
        builder.source(source, text_deserializer)
        .flat_map_batches(lower_words)
        .key_by()
        .count()
        .to_rstream()
        .sink(sink)
    )
