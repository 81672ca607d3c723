"""Stage 0, and every stage's stateless tail: records through the operator chain.

- :mod:`~stream_assets.runtime.core.stage0.stateless`: :func:`run_source_batch`, one
  batch of one source queue (``run_source_batches``: a real-time step of several,
  their counts merged by :mod:`~stream_assets.runtime.core.stage0.across_queues`).
- :mod:`~stream_assets.runtime.core.stage0.chain`: ``OperatorGraph``, the stateless
  operators over one input at a time; :mod:`~stream_assets.runtime.core.stage0.count_path`
  and :mod:`~stream_assets.runtime.core.stage0.batch_count_path` its fast paths.
- :mod:`~stream_assets.runtime.core.stage0.outputs`: sinks and dead letters;
  :mod:`~stream_assets.runtime.core.stage0.shuffle_out`: records to the next stage.
"""
