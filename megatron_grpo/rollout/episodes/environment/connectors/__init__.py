"""Adapters that run environments written for other libraries through the episode loop,
one module per library, each selected by its prefix in ``episodes.source`` (with ``episodes.kind:
environment``) in the one table ``config/connectors.py:CONNECTORS`` (docs/multi_turn.md, "Environments from
skyrl-gym, OpenEnv and TRL-style tool classes"):

* ``skyrl_gym_adapter``: ``skyrl_gym:<env id>`` / ``skyrl_gym:path/to/env.py:Class``;
* ``openenv_adapter``: ``openenv:path/to/app.py:app`` / ``openenv:http://host:port``;
* ``tools_adapter``: ``tools:path/to/env.py:Class`` (TRL's ``environment_factory`` style).

Each module has ``environment_class(target) -> type``: a class constructed with the dataset row
whose ``step(response)`` answers as any environment (``loading.check_step_result``), and may
have ``prepare(target)``, run by the fork server before it forks a worker (a shared server, a
preloaded library). They run inside environment worker processes, like any environment, and
import their library there, on first use: nothing here is imported by the trainer.
"""
