"""Spark's logging of an instance: the session conf, and what the log4j2 configuration folds.

The folding rules are checked against log4j itself: a small Java program
(run from source by ``java``, against the log4j and Spark jars PySpark ships)
logs each case as Spark does, with the instance's configuration.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stream_assets.runtime.spark.spark_logging import (
    JAVA_OPTIONS,
    LOG4J2_CONFIG,
    log4j2_option,
    quiet_spark_conf,
)

FOLDED = "stack trace folded"


def test_progress_bar_off_and_log4j2_configured_for_driver_and_executors() -> None:
    conf = quiet_spark_conf({"spark.master": "local[2]"})
    assert conf["spark.master"] == "local[2]"
    assert conf["spark.ui.showConsoleProgress"] == "false"
    for key in JAVA_OPTIONS:
        assert conf[key] == log4j2_option(LOG4J2_CONFIG)
    assert LOG4J2_CONFIG.is_file()


def test_what_the_conf_sets_itself_wins() -> None:
    mine = "-Dlog4j2.configurationFile=/etc/spark/log4j2.properties"
    conf = quiet_spark_conf(
        {
            "spark.ui.showConsoleProgress": "true",
            "spark.driver.extraJavaOptions": mine,
            "spark.executor.extraJavaOptions": "-XX:+UseG1GC",
        }
    )
    assert conf["spark.ui.showConsoleProgress"] == "true"
    assert conf["spark.driver.extraJavaOptions"] == mine
    # Other options stay; the configuration is added after them.
    assert conf["spark.executor.extraJavaOptions"] == (
        f"-XX:+UseG1GC {log4j2_option(LOG4J2_CONFIG)}"
    )


def test_without_the_configuration_file_java_options_are_left_alone(tmp_path: Path) -> None:
    conf = quiet_spark_conf({"spark.master": "local[1]"}, config=tmp_path / "missing.properties")
    assert conf == {"spark.master": "local[1]", "spark.ui.showConsoleProgress": "false"}


# Each case logs as the Spark class named in its logger does; "--- <case>" on
# stderr before each lets the test split the output by case.
_SAMPLE = r"""
import org.apache.logging.log4j.LogManager;
import org.apache.logging.log4j.Logger;
import org.apache.spark.SparkException;

public class Sample {
  static void log(String name, String logger, boolean error, String message, Throwable t) {
    System.err.println("--- " + name);
    System.err.flush();
    Logger log = LogManager.getLogger(logger);
    if (error) log.error(message, t); else log.warn(message, t);
  }

  static String trace(Throwable t) {
    java.io.StringWriter out = new java.io.StringWriter();
    t.printStackTrace(new java.io.PrintWriter(out));
    return out.toString();
  }

  public static void main(String[] args) {
    String spark = "org.apache.spark.";
    String query = spark + "sql.execution.streaming.runtime.MicroBatchExecution";
    String crashed = "Python worker exited unexpectedly (crashed). Consider setting 'x' or 'y'";
    log("daemon_restarted", spark + "api.python.PythonWorkerFactory", false,
        "Failed to open socket to Python daemon:",
        new java.net.ConnectException("Connection refused"));
    log("daemon_restarting", spark + "api.python.PythonWorkerFactory", false,
        "Assuming that daemon unexpectedly quit, attempting to restart", null);
    log("worker_crashed", spark + "executor.Executor", true,
        "Exception in task 0.0 in stage 3.0 (TID 5)",
        new SparkException(crashed, new java.io.IOException("Broken pipe")));
    log("lost_task", spark + "scheduler.TaskSetManager", false,
        "Lost task 0.0 in stage 3.0 (TID 5) (10.0.0.1 executor driver): "
            + trace(new SparkException(crashed, new java.io.EOFException())), null);
    log("job_cancelled", query, true, "Query [id = a, runId = b] terminated with error",
        new SparkException("[SPARK_JOB_CANCELLED] Job 12 cancelled part of cancelled job "
            + "group b SQLSTATE: XXKDA"));
    log("interrupted", "org.apache.hadoop.util.Shell", false,
        "Interrupted while joining on: Thread[Thread-449,5,main]",
        new InterruptedException());
    log("closed_by_interrupt", query, true, "Query [id = a, runId = b] terminated with error",
        new java.nio.channels.ClosedByInterruptException());
    log("context_stopped", query, true, "Query [id = a, runId = b] terminated with error",
        new NullPointerException("Cannot invoke \"org.apache.spark.scheduler.DAGScheduler"
            + ".cleanupQueryJobs(long)\" because the return value of \"org.apache.spark"
            + ".SparkContext.dagScheduler()\" is null"));
    log("batch_cancelled", query, true, "Query [id = a, runId = b] terminated with error",
        new RuntimeException("[FOREACH_BATCH_USER_FUNCTION_ERROR] An error occurred in the "
            + "user provided function in foreach batch sink. Reason: Traceback (most recent "
            + "call last):\n  File \"x.py\", line 1, in run\npy4j.protocol.Py4JJavaError: An "
            + "error occurred while calling o113.collectToPython.\n: org.apache.spark."
            + "SparkException: [SPARK_JOB_CANCELLED] Job 5 cancelled part of cancelled job "
            + "group b"));
    log("worker_late", query, true, "Query [id = a, runId = b] terminated with error",
        new SparkException("Python worker failed to connect back.",
            new java.net.SocketTimeoutException("Accept timed out")));
    log("kill_failed", spark + "sql.execution.python.MapInBatchEvaluatorFactory", true,
        "Exception when trying to kill worker - task 0.0 in stage 2 (TID 2)",
        new java.io.IOException("Broken pipe"));
    log("real_error", spark + "executor.Executor", true, "Exception in task 1.0",
        new IllegalStateException("boom", new InterruptedException()));
    log("real_user_error", query, true, "Query [id = a, runId = b] terminated with error",
        new RuntimeException("[FOREACH_BATCH_USER_FUNCTION_ERROR] An error occurred in the "
            + "user provided function in foreach batch sink. Reason: Traceback (most recent "
            + "call last):\n  File \"x.py\", line 1, in run\nValueError: bad record"));
    log("real_io_error", spark + "sql.execution.python.MapInBatchEvaluatorFactory", true,
        "Exception in task 2.0", new java.io.IOException("Broken pipe"));
    log("plain", query, false, "Current batch is falling behind", null);
    log("native_hadoop", "org.apache.hadoop.util.NativeCodeLoader", false,
        "Unable to load native-hadoop library for your platform", null);
    System.err.println("--- end");
  }
}
"""

#: Per case, the one line it must fold into (a part of it).
_FOLDED = {
    "daemon_restarted": "WARN PythonWorkerFactory: Failed to open socket to Python daemon: "
    "(java.net.ConnectException: Connection refused; stack trace folded)",
    "worker_crashed": "ERROR Executor: Exception in task 0.0 in stage 3.0 (TID 5) "
    "(org.apache.spark.SparkException: Python worker exited unexpectedly (crashed).",
    "lost_task": "WARN TaskSetManager: Lost task 0.0 in stage 3.0 (TID 5) (10.0.0.1 executor "
    "driver): org.apache.spark.SparkException: Python worker exited unexpectedly (crashed).",
    "job_cancelled": "terminated with error (org.apache.spark.SparkException: "
    "[SPARK_JOB_CANCELLED] Job 12 cancelled part of cancelled job group b",
    "interrupted": "WARN Shell: Interrupted while joining on: Thread[Thread-449,5,main] "
    "(java.lang.InterruptedException; stack trace folded)",
    "closed_by_interrupt": "(java.nio.channels.ClosedByInterruptException; stack trace folded)",
    "context_stopped": "(java.lang.NullPointerException: Cannot invoke",
    "batch_cancelled": "(java.lang.RuntimeException: [FOREACH_BATCH_USER_FUNCTION_ERROR]",
    "worker_late": "(org.apache.spark.SparkException: Python worker failed to connect back.; "
    "stack trace folded)",
    "kill_failed": "Exception when trying to kill worker - task 0.0 in stage 2 (TID 2) "
    "(java.io.IOException: Broken pipe; stack trace folded)",
}

#: Cases whose whole stack trace stays: what the rules must not touch.
_KEPT = {
    "real_error": "Caused by: java.lang.InterruptedException",
    "real_user_error": "ValueError: bad record",
    "real_io_error": "java.io.IOException: Broken pipe",
}


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    return shutil.which("java")


def _logged_by_case(tmp_path: Path) -> dict[str, list[str]]:
    """Run the sample with the instance's log4j2 configuration; its lines per case."""
    java = _java()
    if java is None:
        pytest.skip("no java: the log4j2 configuration is only checked with a JVM")
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    wanted = ("log4j-api-", "log4j-core-", "spark-common-utils", "scala-library-")
    classpath = [str(j) for j in sorted(jars.glob("*.jar")) if j.name.startswith(wanted)]
    source = tmp_path / "Sample.java"
    source.write_text(_SAMPLE)
    done = subprocess.run(
        [java, "-cp", os.pathsep.join(classpath), log4j2_option(), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cases: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in done.stderr.splitlines():
        if line.startswith("--- "):
            lines = cases.setdefault(line.removeprefix("--- "), [])
        else:
            lines.append(line)
    return cases


def test_known_harmless_stack_traces_fold_into_one_line_and_others_stay(tmp_path: Path) -> None:
    cases = _logged_by_case(tmp_path)
    for name, expected in _FOLDED.items():
        logged = cases[name]
        assert len(logged) == 1, (name, logged)
        assert expected in logged[0], (name, logged[0])
        assert logged[0].endswith(f"; {FOLDED})") or logged[0].endswith(f" ({FOLDED})"), logged
    for name, expected in _KEPT.items():
        logged = cases[name]
        assert any(line.startswith("\tat ") for line in logged), (name, logged)
        assert any(expected in line for line in logged), (name, logged)
        assert not any(FOLDED in line for line in logged), (name, logged)
    # A message without an exception, and one from a logger quieted to errors.
    assert [line.split(" ", 2)[2] for line in cases["plain"]] == [
        "WARN MicroBatchExecution: Current batch is falling behind"
    ]
    assert cases["daemon_restarting"][0].endswith(
        "WARN PythonWorkerFactory: Assuming that daemon unexpectedly quit, attempting to restart"
    )
    assert cases["native_hadoop"] == []
    assert cases["end"] == []
