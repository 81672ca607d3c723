"""An instance's Spark driver JVM loads its classes from the machine's class-data archive.

``stream-assets jvm-archive`` (run by the setup) writes the archive; here a
fresh process starts an instance's SparkSession, as :meth:`Instance.start`
does, with the JVM logging where each class came from, and Spark's own
classes must come from the archive's dynamic layer (``shared objects file
(top)``), not from the jars.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stream_assets.runtime.spark import class_archive

pytestmark = pytest.mark.integration

_SESSION = textwrap.dedent(
    """
    import sys
    from stream_assets.examples import wordcount
    from stream_assets.runtime.spark.instance import Instance
    from stream_assets.settings import EngineSettings, RocketMQSettings

    log = sys.argv[1]
    engine = EngineSettings(
        spark_conf={"spark.driver.extraJavaOptions": f"-Xlog:class+load=info:file={log}"},
        metrics_port=0,
    )
    instance = Instance(wordcount.build("cds", "cds-in", "cds-out"), rocketmq=RocketMQSettings(),
                        engine=engine, progress=lambda _line: None)
    spark = instance._session()
    assert spark.range(100).count() == 100
    spark.stop()
    """
)


def test_an_instance_jvm_maps_spark_from_the_archive(tmp_path: Path) -> None:
    archive = class_archive.build(print)  # written by the setup already: found, not redone
    assert archive is not None and archive.is_file(), "this JDK could not write an archive"
    log = tmp_path / "classes.log"
    subprocess.run([sys.executable, "-c", _SESSION, str(log)], check=True, timeout=300)
    shared = [line for line in log.read_text().splitlines() if "shared objects file (top)" in line]
    loaded = {line.split()[1] for line in shared}
    assert "org.apache.spark.SparkContext" in loaded
    assert "org.apache.spark.sql.SparkSession" in loaded
    assert len(loaded) > 2_000, f"only {len(loaded)} classes came from the archive"
