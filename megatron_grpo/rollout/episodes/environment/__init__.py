"""Environments of multi-turn episodes (``episodes.kind: environment``, docs/multi_turn.md).

* ``loading``: how ``episodes.kind: environment`` becomes a class (a built-in or ``path.py:Class``)
  and what a ``step`` must return;
* ``worker``: every environment instance lives in its own worker process, so a hung or
  crashing environment is killed without touching the trainer;
* ``builtin``: the calculator and guess-the-number environments.
"""

from megatron_grpo.rollout.episodes.environment.worker import EnvCallError, EnvContractError, EnvProcess, check_environment

__all__ = ["EnvCallError", "EnvContractError", "EnvProcess", "check_environment"]
