"""What every driver of the core needs around it, none of it Spark.

- :mod:`~stream_assets.runtime.drive.clients`: one set of broker clients per process.
- :mod:`~stream_assets.runtime.drive.outage`: riding out a restarting broker.
- :mod:`~stream_assets.runtime.drive.store_handles`: state stores kept open across batches.
- :mod:`~stream_assets.runtime.drive.warm_up`: the stores of queues an instance gains,
  brought up to date before the handover.
- :mod:`~stream_assets.runtime.drive.prometheus`: an instance's ``/metrics``.
- :mod:`~stream_assets.runtime.drive.user_code`: the topology's modules shipped to workers.
"""
