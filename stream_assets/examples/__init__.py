"""Example topologies, by name (``stream-assets run <name>``)."""

from __future__ import annotations

from collections.abc import Callable

from stream_assets.examples import (
    activity_sessions,
    ad_join,
    dedup,
    order_branch,
    seed_article,
    silence_alert,
    top_words,
    windowed_sum,
    word_histogram,
    wordcount,
    wordcount_arrow,
)
from stream_assets.plan.topology import Topology

EXAMPLES: dict[str, Callable[[], Topology]] = {
    "wordcount": wordcount.build,
    "wordcount-arrow": wordcount_arrow.build,
    "windowed-sum": windowed_sum.build,
    "seed-article": seed_article.build,
    "ad-join": ad_join.build,
    "order-branch": order_branch.build,
    "word-histogram": word_histogram.build,
    "dedup": dedup.build,
    "silence-alert": silence_alert.build,
    "activity-sessions": activity_sessions.build,
    "top-words": top_words.build,
}
