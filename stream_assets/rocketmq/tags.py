"""Tag expressions: which messages of a topic a source reads, filtered by the broker.

RocketMQ's TAG expressions are ``*`` (every message) or tags joined by
``||`` (``"A || B"``). The expression travels with each pull: the broker
skips messages whose tag's hash is not among the wanted ones, without
sending them, and the reader checks the tag itself too, since two tags can
share a hash. Offsets stay the topic's own, so a filtered source commits,
lags and restarts like any other (a skipped message counts as read).

Example::

    >>> f = TagFilter.parse("A || B")
    >>> f.expression, f.matches("A"), f.matches("C"), f.matches(None)
    ('A || B', True, False, False)
    >>> TagFilter.parse("*").matches(None)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every message: what a source without tags pulls with.
ALL = "*"


@dataclass(frozen=True)
class TagFilter:
    """A parsed tag expression; ``tags`` None means every message."""

    tags: frozenset[str] | None

    @classmethod
    def parse(cls, expression: str | None) -> TagFilter:
        """Parse ``"A || B"``, ``"*"`` or None (every message); raise ValueError saying
        what is wrong with anything else."""
        if expression is None:
            return cls(None)
        if not isinstance(expression, str):
            raise TypeError(f"a tag expression is a str like 'A || B', got {expression!r}")
        if expression.strip() in ("", ALL):
            return cls(None)
        parts = [p.strip() for p in expression.split("||")]
        if any(not p for p in parts):
            raise ValueError(
                f"tag expression {expression!r} has an empty tag; write tags joined by "
                "'||', e.g. 'TagA || TagB', or '*' for every message"
            )
        if ALL in parts:
            return cls(None)
        for p in parts:
            if any(c.isspace() for c in p) or "|" in p:
                raise ValueError(
                    f"tag {p!r} in {expression!r} holds a space or '|'; tags are joined by "
                    "'||', e.g. 'TagA || TagB'"
                )
        return cls(frozenset(parts))

    @property
    def expression(self) -> str:
        """The expression as the broker takes it (tags sorted: one spelling per filter)."""
        return ALL if self.tags is None else " || ".join(sorted(self.tags))

    def matches(self, tag: str | None) -> bool:
        """Whether a message with ``tag`` (None: untagged) is read."""
        return self.tags is None or tag in self.tags
