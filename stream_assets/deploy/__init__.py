"""A production-shaped deployment on one machine: each component as it runs on a host.

One module per host kind (:mod:`.postgres`, :mod:`.spark_standalone`,
:mod:`.dagster_host`; the RocketMQ cluster is :mod:`stream_assets.broker.cluster`),
the services they run (:mod:`.daemons`), what each host is given
(:mod:`.env_files`, reading ``infra/deploy/``), live input (:mod:`.feeder`), and
the whole deployment (:mod:`.prod_like`). docs/deployment.md maps it onto real
machines.
"""
