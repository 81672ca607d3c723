"""A class-data archive for the Spark driver JVM (AppCDS): the JVM starts in ~2 s less.

A fresh Spark driver JVM loads and verifies some 18 000 classes before its
first job: on the 2-core machine, ~5.3 s to a SparkSession and ~2.5 s more for
a first job. The JVM can map the classes of an earlier run from an archive
(HotSpot's dynamic class-data sharing, ``-XX:SharedArchiveFile``): 3.4 s and
1.5 s there. The archive is written once per machine, JDK and Spark version
(``stream-assets jvm-archive``, which the setup in ``infra/dev.sh`` runs) by
a short training run that exits its JVM with ``-XX:ArchiveClassesAtExit``; an
instance uses it when it is there (``EngineSettings.jvm_class_archive``). A
JVM that finds an archive it cannot use (another build, another class path)
starts without it, as before, and says nothing. No library does this for
PySpark; the JVM options are HotSpot's own (JDK 13+).

Example::

    >>> archive = archive_path()  # doctest: +SKIP
    >>> java_options(archive)  # doctest: +SKIP
    '-XX:SharedArchiveFile=/.../.local/jvm/spark-4.3.0-0c1f....jsa -Xshare:auto -Xlog:cds=off ...'
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stream_assets.settings import local_dir

#: Silences the JVM's CDS warnings: an archive it cannot use is simply not used.
_QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"


def archive_path() -> Path:
    """Where this machine's archive for this JDK and this Spark lives (it may not exist).

    Named by the Spark version and a digest of the JDK (the real path of
    ``java`` under JAVA_HOME, its size and time), so another JDK or Spark
    finds no archive rather than a stale one.
    """
    import pyspark

    java = _java()
    stat = java.stat()
    digest = hashlib.sha256(f"{java}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return local_dir() / "jvm" / f"spark-{pyspark.__version__}-{digest[:16]}.jsa"


def java_options(archive: Path) -> str:
    """The driver's JVM options that start it from ``archive``."""
    return f"-XX:SharedArchiveFile={archive} {_QUIET}"


def with_archive(conf: dict[str, str], archive: Path | None) -> dict[str, str]:
    """``conf`` with the options that start the driver JVM from ``archive`` (if it exists)
    after any ``spark.driver.extraJavaOptions`` it has, unless those choose a class-data
    archive themselves.

    >>> with_archive({"spark.driver.extraJavaOptions": "-Dx=1"}, None)
    {'spark.driver.extraJavaOptions': '-Dx=1'}
    """
    key = "spark.driver.extraJavaOptions"
    present = conf.get(key, "")
    if archive is None or not archive.is_file() or "-Xshare" in present or "Archive" in present:
        return conf
    return {**conf, key: f"{present} {java_options(archive)}".strip()}


def build(say: Callable[[str], None], force: bool = False) -> Path | None:
    """Write the archive (unless it exists and not ``force``): a training run in a child
    process whose JVM writes it at exit. Returns its path, or None (said why) where this
    JDK cannot write one; an instance then starts its JVM as before."""
    archive = archive_path()
    if archive.is_file() and not force:
        say(f"JVM class archive: {archive} (exists)")
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    # Written beside, then moved: an instance never maps a half-written archive.
    fd, partial = tempfile.mkstemp(suffix=".jsa.partial", dir=archive.parent)
    os.close(fd)
    os.unlink(partial)
    started = time.monotonic()
    say("JVM class archive: training run (a SparkSession and a few jobs, once per JDK/Spark)")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "stream_assets.runtime.spark.class_archive", partial],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0 or not Path(partial).is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            say(f"JVM class archive: not written ({' | '.join(tail)}); JVMs start without one")
            return None
        os.replace(partial, archive)
    finally:
        Path(partial).unlink(missing_ok=True)
    size = archive.stat().st_size / 2**20
    say(f"JVM class archive: {archive} ({size:.0f} MiB) in {time.monotonic() - started:.0f} s")
    return archive


def _java() -> Path:
    home = os.environ.get("JAVA_HOME")
    java = Path(home) / "bin" / "java" if home else None
    if java is None or not java.exists():
        found = shutil.which("java")
        if found is None:
            raise FileNotFoundError("no java: set JAVA_HOME or put java on the PATH")
        java = Path(found)
    return java.resolve()


def _train(partial: str) -> None:
    """The training run: the classes an instance's start and first batches load."""
    from pyspark.sql import SparkSession

    from stream_assets.runtime.spark.source import RocketMQDataSource

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "512m")
        .config("spark.driver.extraJavaOptions", f"-XX:ArchiveClassesAtExit={partial} {_QUIET}")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(RocketMQDataSource)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "in").mkdir()
        Path(tmp, "in", "a.txt").write_text("to be or not to be\n")
        lines = spark.readStream.format("text").load(str(Path(tmp, "in")))
        query = (
            lines.writeStream.foreachBatch(_batch)
            .option("checkpointLocation", str(Path(tmp, "cp")))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
    gateway_jvm = spark.sparkContext._gateway.proc  # type: ignore[union-attr]
    spark.stop()
    # The JVM writes the archive as it exits, which it does at the end of its stdin.
    gateway_jvm.stdin.close()
    gateway_jvm.wait(timeout=300)


def _batch(df: object, _batch_id: int) -> None:
    df.mapInArrow(_same, "value string").collect()  # type: ignore[attr-defined]


def _same(batches: object) -> object:
    return batches


if __name__ == "__main__":
    _train(sys.argv[1])
