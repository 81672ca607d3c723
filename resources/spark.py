"""``SparkResource``: the Spark master and configuration instances run on.

``local[*]``-style masters run Spark inside the instance's run process; point
``master`` at a cluster (``spark://...``, ``yarn``, ``k8s://...``) when one
machine is no longer enough. Unset fields fall back to the engine's settings
(``STREAM_ASSETS_ENGINE_SPARK_MASTER``, ``STREAM_ASSETS_ENGINE_SPARK_CONF``);
``conf`` entries override the environment's entry by entry. Instances run
Spark quietly unless ``conf`` says otherwise: no console progress bar, known
harmless Java stack traces folded into one line
(:mod:`stream_assets.runtime.spark.spark_logging`).

Example::

    >>> spark = SparkResource(master="local[4]", conf={"spark.driver.memory": "2g"})
    >>> engine = spark.engine_settings()
    >>> engine.spark_master, engine.spark_conf["spark.driver.memory"]
    ('local[4]', '2g')
"""

from pathlib import Path

import dagster as dg
from pydantic import Field

from stream_assets.settings import EngineSettings


class SparkResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Spark master URL and extra Spark configuration."""

    master: str | None = Field(
        default=None,
        description="Spark master URL; unset = STREAM_ASSETS_ENGINE_SPARK_MASTER, else local[2].",
    )
    conf: dict[str, str] = Field(
        default_factory=dict,
        description="Extra Spark conf, merged over STREAM_ASSETS_ENGINE_SPARK_CONF.",
    )

    def engine_settings(self, state_dir: str | Path | None = None) -> EngineSettings:
        """The engine's settings from the environment, with this resource's master and conf.

        ``state_dir`` overrides the state root too (see
        ``RocksDBStateStoreResource.with_state_dir`` for the resource way).
        """
        base = EngineSettings()
        update: dict[str, object] = {"spark_conf": {**base.spark_conf, **self.conf}}
        if self.master:
            update["spark_master"] = self.master
        if state_dir is not None:
            update["state_dir"] = Path(state_dir)
        return base.model_copy(update=update)
