"""What Spark writes to an instance's stderr: no progress bars, harmless stack traces folded.

An instance run's Dagster log is its process's stderr, and so is ``dg dev``'s
terminal. Two things Spark writes there drown the instance's own lines:

- the console progress bar (``[Stage 3:====>   (2 + 1) / 4]``), which PySpark
  turns on for every session it launches (``spark.ui.showConsoleProgress``,
  set as for an interactive shell). :func:`quiet_spark_conf` turns it off
  unless the configuration asks for it;
- Java stack traces of things known to be harmless: a Python daemon restarted,
  a Python worker killed, a job cancelled or a thread interrupted by a query's
  stop. The log4j2 configuration :data:`LOG4J2_CONFIG` (Spark's own defaults
  otherwise) folds each into the line that logged it, e.g.
  ``WARN PythonWorkerFactory: Failed to open socket to Python daemon:
  (java.net.ConnectException: Connection refused; stack trace folded)``;
  any other exception keeps its whole stack trace.

The configuration applies to a JVM this process launches (as
``spark.driver.memory`` does): ``-Dlog4j2.configurationFile`` is added to the
driver's and the executors' Java options, unless they already name a
configuration (a deployment's own wins). Executors on other machines find the
file at the same path, as they find the workers' Python
(:mod:`~stream_assets.runtime.spark.worker_launcher`).

Example::

    >>> conf = quiet_spark_conf({"spark.master": "local[2]"})
    >>> conf["spark.ui.showConsoleProgress"]
    'false'
    >>> "-Dlog4j2.configurationFile=file:" in conf["spark.driver.extraJavaOptions"]
    True
    >>> quiet_spark_conf({"spark.ui.showConsoleProgress": "true"})["spark.ui.showConsoleProgress"]
    'true'
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

#: The log4j2 configuration instances run Spark with (package data beside this module).
LOG4J2_CONFIG = Path(__file__).with_name("log4j2.properties")

#: Java options of the JVMs that log: the driver (the instance's own process in
#: local mode, where the tasks run too) and, on a cluster, every executor.
JAVA_OPTIONS = ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions")


def log4j2_option(config: Path = LOG4J2_CONFIG) -> str:
    """The JVM option that makes log4j2 read ``config``.

    A file URI: a path with spaces needs no quoting in Spark's Java options.

    >>> log4j2_option(Path("/opt/my app/log4j2.properties"))
    '-Dlog4j2.configurationFile=file:///opt/my%20app/log4j2.properties'
    """
    return f"-Dlog4j2.configurationFile={config.as_uri()}"


def with_java_option(options: str | None, option: str) -> str:
    """``options`` (a JVM's Java options) with ``option`` appended, unless they
    already name a log4j configuration file (``log4j2.configurationFile``, or
    the older ``log4j.configurationFile``).

    >>> with_java_option("-XX:+UseG1GC", "-Dlog4j2.configurationFile=file:///q")
    '-XX:+UseG1GC -Dlog4j2.configurationFile=file:///q'
    >>> with_java_option("-Dlog4j.configurationFile=mine.xml", "-Dlog4j2.configurationFile=x")
    '-Dlog4j.configurationFile=mine.xml'
    """
    present = (options or "").strip()
    if ".configurationFile=" in present:
        return present
    return f"{present} {option}".strip()


def quiet_spark_conf(conf: Mapping[str, str], config: Path = LOG4J2_CONFIG) -> dict[str, str]:
    """``conf`` with Spark's console progress bar off and log4j2 reading ``config``.

    What ``conf`` sets itself wins: ``spark.ui.showConsoleProgress``, and a log4j
    configuration named in its Java options. Without ``config`` on disk (a
    package built without its data) the Java options are left alone: Spark then
    logs with its own defaults.
    """
    out = {"spark.ui.showConsoleProgress": "false", **conf}
    if not config.is_file():
        return out
    option = log4j2_option(config)
    for key in JAVA_OPTIONS:
        out[key] = with_java_option(out.get(key), option)
    return out
