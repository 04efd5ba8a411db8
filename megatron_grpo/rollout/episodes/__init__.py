"""Episodes: what produces a step's responses besides one engine call (docs/multi_turn.md,
docs/agents.md). One protocol, three sources, picked in one place (``source.py``):

* ``source``: ``EpisodeSource`` (episodes for these prompts and sampling settings, and
  ``close()``) and ``build_episode_source``, by ``episodes:``;
* ``environment/``: the built-in loop (``loop.py``), the model and an environment taking turns,
  each environment in its own worker process (``worker.py``), with the connectors to other
  libraries' environments (``connectors/``);
* ``agent/``: the user's agent written against the OpenAI SDK, trained on the exact tokens of
  its calls through a loopback front (``front.py``), with the verifiers connector;
* ``function/``: the user's rollout function in its worker process;
* shared: ``episode`` (one finished episode, its rewards and metrics), ``turns`` (token-exact
  turn rendering), ``hang_guard`` (a step's deadline expiries).

Nothing is imported here: an environment's worker process imports its own module only.
"""
