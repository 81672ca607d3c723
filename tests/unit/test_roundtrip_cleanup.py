"""The round-trip check deletes its scratch topic and group, and a broker that cannot
delete them now does not turn the check's verdict into an error (roundtrip.py)."""

from __future__ import annotations

import logging

import pytest

from stream_assets import roundtrip
from stream_assets.rocketmq.errors import BrokerUnreachableError


class Admin:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.deleted: list[tuple[str, str]] = []

    def delete_group(self, group: str) -> None:
        if self.fail:
            raise BrokerUnreachableError("broker-a", "127.0.0.1:10911", "connection refused")
        self.deleted.append(("group", group))

    def delete_topic(self, topic: str) -> None:
        self.deleted.append(("topic", topic))


def test_the_scratch_topic_and_its_reader_group_are_deleted() -> None:
    admin = Admin(fail=False)
    roundtrip._delete_scratch(admin, "roundtrip-abc")  # type: ignore[arg-type]
    assert admin.deleted == [("group", "roundtrip-abc-reader"), ("topic", "roundtrip-abc")]


def test_a_failed_deletion_is_a_warning_naming_what_to_delete(
    caplog: pytest.LogCaptureFixture,
) -> None:
    admin = Admin(fail=True)
    with caplog.at_level(logging.WARNING, logger="stream_assets.roundtrip"):
        roundtrip._delete_scratch(admin, "roundtrip-abc")  # type: ignore[arg-type]
    (record,) = caplog.records
    assert "roundtrip-abc" in record.getMessage()
    assert "roundtrip-abc-reader" in record.getMessage()
    assert "connection refused" in record.getMessage()
