"""Two key_by stages: count words per window, then how many words had each count.

Stage 1 counts each word in tumbling windows; its results feed a second
``key_by`` (on the count) through the outbox, exactly once, and stage 2
counts, per count value, the (word, window) pairs that had it::

    >>> [s.input_topic for s in build().stages][1:]
    ['word-histogram__shuffle__aggregate', 'word-histogram__shuffle__aggregate_2']
"""

from __future__ import annotations

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import text_deserializer
from stream_assets.windows import Time, TumblingWindow


def _word(word: str) -> str:
    return word


def build(
    job_id: str = "word-histogram",
    source: str = "word-histogram-in",
    sink: str = "word-histogram-out",
    window_s: int = 60,
    idle_timeout_s: float = 5,
) -> Topology:
    """The word-histogram topology."""
    b = StreamBuilder(job_id)
    (
        b.source(source, text_deserializer)
        .flat_map(str.split)
        .key_by(_word)
        .window(TumblingWindow.of(Time.seconds(window_s)))
        .count()
        .idle_timeout(idle_timeout_s)
        .to_rstream()
        .key_by("count")
        .count("words")
        .to_rstream()
        .sink(sink)
    )
    return b.build()
