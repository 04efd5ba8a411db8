"""The pre-flight layer: every rule that crosses config sections or packages, each written once.

``config/`` checks what one section can see (and the relations between sections that need no
other package: batch-size divisibility, ...); the rules here need what other packages know:
the engine adapters' capabilities (``generation/adapters``), the reward registry's names, the GPU
layout (``runtime/placement``) and, for a run, the machine, the model directory, the
checkpoints, the dataset and the reward functions.

Two entry points, used by every command line:

* ``load_experiment(path, overrides, world_size=...)``: the config loaded (``config.load_config``)
  and then checked by the rules that need no machine (``check_experiment``); the same
  one-line ``ConfigError``s, naming the file or the override and the dotted key;
* ``check_run(cfg, ranks_on_node)`` in ``preflight.run``: everything a run reads at start-up,
  on this machine. It imports the model and data code (torch, transformers), which this
  package's ``__init__`` does not, so ``megatron-grpo validate-config`` stays fast.
"""

from megatron_grpo.preflight.layout import layout_problem
from megatron_grpo.preflight.load import build_experiment, load_experiment
from megatron_grpo.preflight.rules import (
    check_experiment,
    check_reward,
    check_engine,
    colocate_problem,
    remote_engine_problem,
)

__all__ = [
    "build_experiment",
    "check_experiment",
    "check_reward",
    "check_engine",
    "colocate_problem",
    "layout_problem",
    "load_experiment",
    "remote_engine_problem",
]
