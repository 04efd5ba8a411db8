"""Where each step's rollout batch comes from.

* ``sources``: the ``RolloutSource`` protocol and the sync and one-step-off-policy sources;
  ``async_source``: the async one (groups generated continuously, staleness bounded);
* ``generate``: one step's generation, scoring and advantages into a ``TrainBatch``
  (``batch``), with DAPO's dynamic sampling (``dynamic_sampling``);
* ``supervisor``: every engine call the trainer makes, recovered from when the engine fails;
* ``episode_source``: the one protocol of every producer of episodes (``EpisodeSource``: the
  environment loop, the agent runner, the user's rollout function) and the one place that picks
  the run's;
* episodes: ``multi_turn`` (the runner), ``turns`` (token-exact turn rendering),
  ``environments`` (environment classes, each in its own worker process);
* ``rollout_function`` / ``function_worker``: the user's rollout function and its worker.
"""
