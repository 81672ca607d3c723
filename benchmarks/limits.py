"""The baselines engine benchmarks divide by, measured on the WordCount input itself.

On WordCount input (``--lines`` lines of 8 words, ``--lines-per-message``
lines a message, fresh topics of ``--queues`` queues), in one run:

- produce: the project's fastest produce path, one
  :class:`~stream_assets.rocketmq.batch_producer.BatchProducer` ``send_all`` of
  every body (batched, pipelined requests), messages/s and lines/s; and, for
  comparison, the C++-client path (sync sends from ``--threads`` producers);
- produce 100-byte records (batched): ``--records`` keyed 100-byte records
  through ``send_all``, records/s: the per-record produce ceiling that
  per-record engine throughput (``benchmarks/passthrough.py``) is compared with;
- consume: one Python process pulling every message through the project's
  queue reader, messages/s and MiB/s;
- raw read + count: the same pull plus ``collections.Counter`` over the words,
  lines/s: what one plain Python process does with no engine at all. WordCount
  throughput is quoted as a ratio to this (``benchmarks/wordcount.py``).

Spark's own WordCount (:func:`spark_sql_wordcount`), the other baseline
``benchmarks/wordcount.py`` divides by, needs no broker: plain Spark Structured
Streaming over the same lines written to text files. That benchmark runs it in
the same run; this script's ``main`` does not.

Usage::

    python benchmarks/limits.py --lines 200000
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import produce, unique
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer, OutgoingMessage
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.runtime.spark.instance import _quiet as quiet_logger
from stream_assets.runtime.spark.spark_logging import quiet_spark_conf
from stream_assets.settings import RocketMQSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def wordcount_bodies(lines: int, per_message: int, seed: int = 3) -> list[bytes]:
    """``lines`` lines of 8 words from a 2 000-word vocabulary, ``per_message`` a body."""
    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(2_000)]
    text = [" ".join(rnd.choices(vocab, k=8)).encode() for _ in range(lines)]
    return [b"\n".join(text[i : i + per_message]) for i in range(0, len(text), per_message)]


def produce_batched(settings: RocketMQSettings, topic: str, bodies: Sequence[bytes]) -> float:
    """Send ``bodies`` (keyed by index) with one ``send_all``; returns msg/s.

    Timed from building the messages to the last receipt, with a started
    producer (its start is a name-server check, not part of producing).
    """
    with BatchProducer(settings) as producer:
        start = time.perf_counter()
        receipts = producer.send_all(
            [OutgoingMessage(topic, body, key=str(i)) for i, body in enumerate(bodies)]
        )
        seconds = time.perf_counter() - start
    if len(receipts) != len(bodies):
        raise RuntimeError(f"{len(receipts)} receipts for {len(bodies)} messages")
    return len(bodies) / seconds


def record_bodies(count: int, size: int) -> list[bytes]:
    """``count`` distinct bodies of exactly ``size`` bytes."""
    return [f"{i:012d}".encode().ljust(size, b".") for i in range(count)]


def consume(settings: RocketMQSettings, topic: str, count: bool) -> dict[str, float]:
    """Pull every message of ``topic`` (and count its words if ``count``); the rates."""
    words: collections.Counter[bytes] = collections.Counter()
    messages = lines = size = 0
    with RocketMQAdmin(settings) as admin:
        reader = QueueReader(admin, unique("bench-limits"))
        try:
            start = time.perf_counter()
            for queue in admin.queues(topic):
                for record in reader.read(queue, 0):
                    messages += 1
                    size += len(record.body)
                    if count:
                        for line in record.body.split(b"\n"):
                            lines += 1
                            words.update(line.split())
            seconds = time.perf_counter() - start
        finally:
            reader.close()
    return {
        "messages_per_s": messages / seconds,
        "mib_per_s": size / seconds / 2**20,
        "lines_per_s": lines / seconds,
        "distinct_words": float(len(words)),
    }


def wordcount_lines(bodies: Sequence[bytes]) -> list[str]:
    """The lines of ``bodies`` (each body is lines joined by ``\\n``), decoded."""
    return [line for body in bodies for line in body.decode("utf-8").split("\n")]


def wordcount_expected(lines: Sequence[str]) -> collections.Counter[str]:
    """What WordCount must count in ``lines``: lower-cased whitespace-separated words,
    as the engine's WordCount (``stream_assets.examples.wordcount.split_words``)."""
    return collections.Counter(word for line in lines for word in line.lower().split())


#: Runtime SQL conf of a :func:`spark_sql_wordcount` run, besides the shuffle partitions.
#: ``openCostInBytes`` as large as a read partition may get (Spark's 128 MiB default
#: ``maxPartitionBytes``): the text source packs no two files into one read partition,
#: so the query reads its ``queues`` files in ``queues`` tasks, as the engine reads
#: ``queues`` queues. Streaming queries cannot use AQE (left on, Spark warns), as in
#: ``Instance._session``.
SPARK_SQL_RUN_CONF = {
    "spark.sql.files.openCostInBytes": str(128 * 2**20),
    "spark.sql.files.maxPartitionBytes": str(128 * 2**20),
    "spark.sql.adaptive.enabled": "false",
}

#: What Spark (4.x) logs at the start of every stateful query, whatever the conf says:
#: harmless here, dropped in a session of :func:`spark_sql_wordcount`'s own.
AQE_OFF_WARNING = "Disabling AQE since AQE is not supported in stateful workloads.*"
MICRO_BATCH_EXECUTION = "org.apache.spark.sql.execution.streaming.runtime.MicroBatchExecution"


def spark_sql_wordcount(
    bodies: Sequence[bytes],
    queues: int = 8,
    shuffle_partitions: int = 8,
    master: str = "local[2]",
    conf: Mapping[str, str] | None = None,
    spark: SparkSession | None = None,
    warm_up: bool = True,
) -> dict[str, float]:
    """Spark's own WordCount over the lines of ``bodies``: plain, JVM-native Structured
    Streaming; its lines/s. Raises ``RuntimeError`` unless its counts are exact.

    The lines of ``bodies`` (the WordCount input, body ``i`` to file ``i % queues``)
    are written to ``queues`` text files in a temporary directory, which Spark's
    text file source reads in ``queues`` tasks (:data:`SPARK_SQL_RUN_CONF`). The
    query is Spark's ``StructuredNetworkWordCount`` (lower-cased, as the engine's
    WordCount): ``explode(split(lower(value), "\\s+"))``, ``groupBy("word").count()``
    (Spark always counts partially before the shuffle: the engine's ``pre_combine``), with
    ``spark.sql.shuffle.partitions`` = ``shuffle_partitions`` and Spark's default
    state store, into the memory sink in complete mode, ``trigger(availableNow=True)``:
    it reads every file, then stops. No Python runs in its tasks.

    The figure, ``lines_per_s``, is lines / ``seconds``; ``seconds`` runs from
    defining the streaming DataFrame to ``awaitTermination`` returning: query
    start, file listing, reading, splitting, the shuffle, the aggregation and its
    state store commit, the sink, the offset and commit logs. Left out, like the
    engine's start-up before its figures: the JVM and SparkSession start, one
    untimed warm-up run of the same query on a tiny input (the engine's
    ``warm_spark``; ``warm_up=False`` skips it, for checks of the result only),
    writing the files, and the check of the result against
    :func:`wordcount_expected` (a ``collections.Counter`` over the same lines).

    ``spark``: run in this session (its runtime SQL conf is put back after);
    None: in a SparkSession of its own on ``master`` with ``conf`` (e.g.
    ``spark.driver.memory``), stopped after; then no SparkSession may be active
    in this process. The files are local: a master whose executors do not share
    this machine's disk cannot read them.

    Other figures: ``seconds``, ``lines``, ``batches``, ``input_rows`` (the rows
    the query read: its lines), ``input_partitions``, ``shuffle_partitions``,
    ``distinct_words``.

    Example (starts Spark: ``python benchmarks/wordcount.py`` runs it in a process of
    its own)::

        >>> bodies = wordcount_bodies(20_000, 20)  # doctest: +SKIP
        >>> figures = spark_sql_wordcount(bodies, queues=8, shuffle_partitions=8)  # doctest: +SKIP
        >>> figures["lines"], figures["batches"], figures["input_partitions"]  # doctest: +SKIP
        (20000.0, 1.0, 8.0)
        >>> print(f"{figures['lines_per_s']:.0f} lines/s")  # doctest: +SKIP
        ... lines/s
    """
    from pyspark.sql import SparkSession

    lines = wordcount_lines(bodies)
    expected = wordcount_expected(lines)
    own = spark is None
    if spark is None:
        if SparkSession.getActiveSession() is not None:
            raise RuntimeError(
                "a SparkSession is active in this process: pass it as spark=, or run "
                "spark_sql_wordcount in a fresh process"
            )
        builder = SparkSession.builder
        settings = quiet_spark_conf(
            {
                "spark.master": master,
                "spark.app.name": "spark-sql-wordcount",
                "spark.ui.enabled": "false",
                **(conf or {}),
            }
        )
        for key, value in settings.items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        # The instance's filter: drops this one message of this one logger.
        quiet_logger(spark, MICRO_BATCH_EXECUTION, AQE_OFF_WARNING)
    run_conf = {**SPARK_SQL_RUN_CONF, "spark.sql.shuffle.partitions": str(shuffle_partitions)}
    before = {key: spark.conf.get(key, None) for key in run_conf}
    try:
        for key, value in run_conf.items():
            spark.conf.set(key, value)
        with tempfile.TemporaryDirectory(prefix="spark-sql-wordcount-") as tmp:
            root = Path(tmp)
            if warm_up:  # untimed: classes loaded, code generated, as warm_spark does
                warm = _write_files(root / "warm", [b"warm up the query"] * 40, queues)
                with _memory_table(spark) as name:
                    _run(spark, warm, name, root / "warm-checkpoint")
            data = _write_files(root / "in", bodies, queues)
            with _memory_table(spark) as name:
                seconds, batches, rows = _run(spark, data, name, root / "checkpoint")
                counts = {r["word"]: r["count"] for r in spark.table(name).collect()}
            partitions = spark.read.text(str(data)).rdd.getNumPartitions()
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)
        if own:
            spark.stop()
    _check_counts(counts, expected, rows, len(lines))
    return {
        "lines_per_s": len(lines) / seconds,
        "seconds": seconds,
        "lines": float(len(lines)),
        "batches": float(batches),
        "input_rows": float(rows),
        "input_partitions": float(partitions),
        "shuffle_partitions": float(shuffle_partitions),
        "distinct_words": float(len(counts)),
    }


def _write_files(directory: Path, bodies: Sequence[bytes], files: int) -> Path:
    """Body ``i`` of ``bodies`` into text file ``i % files`` of ``directory``, a line each."""
    directory.mkdir(parents=True)
    for f in range(files):
        part = bodies[f::files]
        (directory / f"part-{f:05d}.txt").write_bytes(b"".join(body + b"\n" for body in part))
    return directory


@contextlib.contextmanager
def _memory_table(spark: SparkSession) -> Iterator[str]:
    """A fresh query (and memory-sink table) name, its table dropped after."""
    name = f"spark_sql_wordcount_{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        spark.catalog.dropTempView(name)


def _wordcount(spark: SparkSession, directory: Path) -> DataFrame:
    """Spark's StructuredNetworkWordCount over the text files of ``directory``."""
    from pyspark.sql import functions as F

    lines = spark.readStream.text(str(directory))
    words = lines.select(F.explode(F.split(F.lower(lines.value), "\\s+")).alias("word"))
    return words.where(words.word != "").groupBy("word").count()


def _run(
    spark: SparkSession, directory: Path, name: str, checkpoint: Path
) -> tuple[float, int, int]:
    """Run WordCount over ``directory`` into memory table ``name`` until it has read
    every file; (seconds, batches, input rows)."""
    start = time.perf_counter()
    query = (
        _wordcount(spark, directory)
        .writeStream.format("memory")
        .queryName(name)
        .outputMode("complete")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    if not query.awaitTermination(1800):
        query.stop()
        raise RuntimeError(f"Spark SQL WordCount over {directory} still running after 1800 s")
    seconds = time.perf_counter() - start
    progress = query.recentProgress
    return seconds, len(progress), sum(p.numInputRows for p in progress)


def _check_counts(
    counts: Mapping[str, int], expected: Mapping[str, int], rows: int, lines: int
) -> None:
    """Raise unless Spark counted exactly ``expected`` over all ``lines`` input lines."""
    if rows != lines:
        raise RuntimeError(f"Spark SQL WordCount read {rows} rows of {lines} lines")
    if counts != expected:
        wrong = sorted(
            w for w in counts.keys() | expected.keys() if counts.get(w) != expected.get(w)
        )
        sample = ", ".join(f"{w!r}: {counts.get(w)} != {expected.get(w)}" for w in wrong[:5])
        raise RuntimeError(
            f"Spark SQL WordCount is not exact: {len(wrong)} words differ from Counter "
            f"(Spark != Counter: {sample})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--lines-per-message", type=int, default=20)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4, help="sync producers (comparison)")
    parser.add_argument("--records", type=int, default=200_000, help="100-byte records")
    parser.add_argument("--record-size", type=int, default=100)
    parser.add_argument("--json", action="store_true", help="one JSON object of the figures")
    args = parser.parse_args()
    settings = RocketMQSettings()
    bodies = wordcount_bodies(args.lines, args.lines_per_message)
    records = record_bodies(args.records, args.record_size)
    topic, sync_topic, records_topic = (
        unique("bench-limits"),
        unique("bench-limits-sync"),
        unique("bench-limits-records"),
    )
    with RocketMQAdmin(settings) as admin:
        for name in (topic, sync_topic, records_topic):
            admin.create_topic(name, args.queues)
    produced = produce_batched(settings, topic, bodies)
    produced_sync = produce(settings, sync_topic, bodies, threads=args.threads)
    records_rate = produce_batched(settings, records_topic, records)
    plain = consume(settings, topic, count=False)
    counted = consume(settings, topic, count=True)
    figures = {
        "produce_msgs_per_s": produced,
        "produce_lines_per_s": produced * args.lines_per_message,
        "produce_sync_msgs_per_s": produced_sync,
        "produce_sync_lines_per_s": produced_sync * args.lines_per_message,
        "produce_records_per_s": records_rate,
        "consume_msgs_per_s": plain["messages_per_s"],
        "consume_mib_per_s": plain["mib_per_s"],
        "raw_read_count_lines_per_s": counted["lines_per_s"],
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"produce (batched, BatchProducer.send_all): {produced:.0f} msg/s = "
        f"{figures['produce_lines_per_s']:.0f} lines/s"
    )
    print(
        f"produce ({args.threads} sync C++-client producers, for comparison): "
        f"{produced_sync:.0f} msg/s = {figures['produce_sync_lines_per_s']:.0f} lines/s "
        f"(batched is {produced / produced_sync:.0f}x)"
    )
    print(f"produce {args.record_size}-byte records (batched): {records_rate:.0f} records/s")
    print(
        f"consume (queue reader, one process): {plain['messages_per_s']:.0f} msg/s, "
        f"{plain['mib_per_s']:.1f} MiB/s"
    )
    print(f"raw read + count (Counter, one process): {counted['lines_per_s']:.0f} lines/s")


if __name__ == "__main__":
    main()
