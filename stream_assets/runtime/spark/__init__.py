"""The Spark adapter: the core run as Spark Structured Streaming micro-batches.

- :mod:`~stream_assets.runtime.spark.instance`: one SparkSession, one query per stage.
- :mod:`~stream_assets.runtime.spark.source`: the ``rocketmq`` streaming source and its
  planner (which queue ranges a batch reads).
- :mod:`~stream_assets.runtime.spark.task`: the Spark task around the core (settings
  from the driver, state on the executor's disk, proved current).
- :mod:`.task_stdout`, :mod:`.spark_logging`, :mod:`.query_restart`,
  :mod:`.worker_launcher`, :mod:`.class_archive`: Spark's processes, logs and restarts.
"""
