"""Running topologies: a pure per-queue core, what drives it, and its Spark adapter.

Three layers, each a package, imported only downwards (``spark`` -> ``drive`` ->
``core``; ``tests/unit/test_code_shape.py`` checks it):

- :mod:`stream_assets.runtime.core`: one queue of one stage (apply, fire, emit,
  checkpoint), talking to a :class:`~stream_assets.runtime.core.ports.Sender` and a
  state store only. Imports nothing of Spark.
- :mod:`stream_assets.runtime.drive`: broker clients, outages, open stores, warm-up,
  metrics, shipped user code: what any driver of the core needs. Imports nothing of Spark.
- :mod:`stream_assets.runtime.spark`: the Spark adapter (one SparkSession, one query
  per stage, the ``rocketmq`` source, the task around the core).

The same core runs in :mod:`stream_assets.testing`, without Spark or a broker.
"""
