"""The driver JVM's class-data archive: where it lives and how it joins the Spark conf."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_assets.runtime.spark import class_archive


def _fake_java(home: Path, body: bytes) -> Path:
    java = home / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_bytes(body)
    return home


def test_the_archive_is_named_by_spark_and_the_jdk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAM_ASSETS_LOCAL_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path / "jdk-a", b"a")))
    first = class_archive.archive_path()
    assert first == class_archive.archive_path()  # stable
    assert first.parent == tmp_path / "local" / "jvm"
    import pyspark

    assert first.name.startswith(f"spark-{pyspark.__version__}-")
    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path / "jdk-b", b"bb")))
    assert class_archive.archive_path() != first  # another JDK finds no stale archive


def test_the_options_join_the_drivers_own_only_when_the_archive_exists(tmp_path: Path) -> None:
    key = "spark.driver.extraJavaOptions"
    archive = tmp_path / "spark.jsa"
    conf = {key: "-Dmine=1", "spark.master": "local[2]"}
    assert class_archive.with_archive(conf, archive) == conf  # not written yet
    archive.write_bytes(b"x")
    joined = class_archive.with_archive(conf, archive)
    assert joined[key].startswith("-Dmine=1 -XX:SharedArchiveFile=")
    assert str(archive) in joined[key] and joined["spark.master"] == "local[2]"
    assert class_archive.with_archive({}, archive)[key].startswith("-XX:SharedArchiveFile=")
    # Options that choose sharing themselves win.
    for own in ("-Xshare:off", "-XX:SharedArchiveFile=/other.jsa"):
        assert class_archive.with_archive({key: own}, archive) == {key: own}
