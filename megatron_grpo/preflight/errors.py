"""The user errors a run can end with, and the one line printed for each (``train``, ``eval``).

Not imported by ``megatron_grpo.preflight`` itself: ``ModelError`` lives in ``models``, whose
package imports megatron-core.
"""

from __future__ import annotations

from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.experiment import error_source
from megatron_grpo.data import DataError
from megatron_grpo.models.errors import CheckpointError, ModelError
from megatron_grpo.rewards import RewardError
from megatron_grpo.rollout.episodes.agent.runner import AgentContractError
from megatron_grpo.rollout.episodes.environment import EnvContractError
from megatron_grpo.rollout.episodes.hang_guard import EpisodesHung
from megatron_grpo.rollout.episodes.function.source import RolloutFunctionError

PLUGIN_ERRORS: tuple[type[BaseException], ...] = (RewardError, EnvContractError, RolloutFunctionError,
                                                  AgentContractError, EpisodesHung)
"""A user's plug-in (reward function, environment, rollout function, agent) broke its contract
or hangs: the message names the plug-in (file and function or class) and what was expected."""

USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DataError, ModelError, CheckpointError,
                                                *PLUGIN_ERRORS)
"""Exception types whose message is a complete one-line user-facing error."""


def describe_user_error(e: BaseException, config_path: str, data_file: str | None = None,
                        overrides: list[str] | None = None) -> str:
    """The one line printed for user error ``e``. It starts with what is wrong: the dataset for
    a bad line (``data.jsonl:17: ...``), the command-line override that set a bad key, else the
    config (``run.yaml: key: ...``)."""
    text = " ".join(str(e).split())
    if isinstance(e, ConfigError):
        return e.one_line() if e.source else e.with_source(
            error_source(e.where, overrides or [], config_path)).one_line()
    if isinstance(e, DataError) and data_file and text.startswith(data_file):
        return text
    if isinstance(e, CheckpointError):  # it names the checkpoint, which is not in the config
        return text
    return f"{config_path}: {text}"
