"""The pure per-queue core: what one queue of one stage does with what arrived.

Everything here is the same whichever driver runs it (the Spark micro-batch
adapter in :mod:`stream_assets.runtime.spark`, the test driver in
:mod:`stream_assets.testing`): it reads a :class:`~stream_assets.runtime.core.context.StageContext`,
talks to a :class:`~stream_assets.runtime.core.ports.Sender` and a state store, and
reports :class:`~stream_assets.runtime.core.context.TaskStats`.

- :mod:`~stream_assets.runtime.core.stage0`: stage 0 (and every stage's stateless
  tail): the operator chain, its outputs and the shuffle out.
- :mod:`~stream_assets.runtime.core.keyed`: keyed stages (aggregates, windows, joins,
  processors) over their state.
- :mod:`~stream_assets.runtime.core.shuffle_codec`: the shuffle topic's wire format.

Why a package of its own: the core must never import Spark (``tests/unit/test_code_shape.py``
checks it), so that a second driver, or a reader, can take it without the JVM.
"""
