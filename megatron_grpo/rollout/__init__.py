"""Where each step's rollout batch comes from.

* ``sources``: the ``RolloutSource`` protocol and the sync and one-step-off-policy sources;
  ``async_source``: the async one (groups generated continuously, staleness bounded);
* ``generate``: one step's generation, scoring and advantages into a ``TrainBatch``
  (``batch``), with DAPO's dynamic sampling (``dynamic_sampling``);
* ``supervisor``: every engine call the trainer makes, recovered from when the engine fails;
* ``episodes/``: everything that produces episodes (multi-turn environments, agents, the user's
  rollout function) behind one protocol, ``EpisodeSource``.
"""
