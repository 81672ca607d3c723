"""Running topologies: a pure per-queue core and its Spark adapter.

- :mod:`~stream_assets.runtime.stateless` (and, for keyed stages,
  :mod:`stream_assets.keyed`): the core for one queue of one stage (apply, fire,
  emit, checkpoint), talking to a :class:`~stream_assets.runtime.ports.Sender`
  and a state store only.
- :mod:`~stream_assets.runtime.chain`: ``OperatorGraph``, a stage's stateless
  operators run over one input at a time.
- :mod:`~stream_assets.runtime.context`: what the core reads (``StageContext``)
  and reports (``TaskStats``).
- :mod:`~stream_assets.runtime.spark_task`: the Spark task around the core
  (settings from the driver, state on the executor's disk, proved current).
- :mod:`~stream_assets.runtime.source`: the ``rocketmq`` Spark streaming source.
- :mod:`~stream_assets.runtime.instance`: one SparkSession, one query per stage.
- :mod:`~stream_assets.runtime.warm_up`: the stores of queues an instance gains,
  brought up to date before the handover.
- :mod:`~stream_assets.runtime.user_code`: the topology's modules shipped to executors.
- :mod:`~stream_assets.runtime.task_stdout`: what tasks print, to the instance's stdout.
- :mod:`~stream_assets.runtime.outage`: riding out a restarting broker.

The same core runs in :mod:`stream_assets.testing`, without Spark or a broker.
"""
