"""How a run reports a user error: shared by the launcher (``launcher/``), which prints it,
and each rank (``trainer/rank.py``), which records it for the launcher.

User mistakes (config, data, model directory, reward functions) end with ONE line naming the
file and key/line on stderr and exit code 2. Pre-flight catches them before anything is
written to the run directory; the few that only show during training (a reward function
that raises on a real response) are recorded by the rank that hit them in ``ERROR_FILE_ENV``'s
file, and ``megatron-grpo train`` prints that one line instead of torchrun's failure report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
from typing import Iterator

from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.preflight.errors import USER_ERRORS

EXIT_USER_ERROR = 2
EXIT_RUN_ABORTED = 1
ERROR_FILE_ENV = "MEGATRON_GRPO_USER_ERROR_FILE"  # where a rank records its user error for `train`
PEER_SUFFIX = ".lost_peer"  # where lost-peer lines are recorded, so a cause on another rank wins


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is a complete one-line user-facing error."""
    return USER_ERRORS


def run_parser(prog: str) -> argparse.ArgumentParser:
    """``--config FILE [section.key=value ...]``: what the launcher and each rank both take."""
    parser = argparse.ArgumentParser(prog=prog, description="Run a GRPO experiment.")
    parser.add_argument("--config", required=True, help="experiment YAML (yaml_configs/...)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.num_steps=10")
    return parser


def fail(message: str, code: int = EXIT_USER_ERROR) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


@contextlib.contextmanager
def user_error_deadline(timeout_s: float, line: str) -> Iterator[None]:
    """Run the block under a deadline: past ``timeout_s`` seconds, end this process with the user
    error ``line`` and exit code 2, recorded for ``megatron-grpo train`` in a rank (as ``_report``
    does) or printed in the launcher. For what no exception can interrupt: a plug-in module's
    top-level code that never returns (a watchdog thread cannot stop it; it can end the process).
    The process is ended with ``os._exit``: the block's own thread is stuck in the user's code."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_s):
            return
        path = os.environ.get(ERROR_FILE_ENV)
        with contextlib.suppress(OSError):
            if path:  # a rank under megatron-grpo train, which prints it
                record_user_error(f"{EXIT_USER_ERROR} {line}", path)
            elif int(os.environ.get("LOCAL_RANK", "0")) == 0:  # the launcher, or a bare torchrun's first rank
                print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(EXIT_USER_ERROR)

    threading.Thread(target=watch, daemon=True, name="user-error-deadline").start()
    try:
        yield
    finally:
        done.set()


def reward_build_deadline(reward_cfg) -> contextlib.AbstractContextManager:
    """``user_error_deadline`` over building ``reward_cfg``'s functions (``RewardScorer``)."""
    names = ", ".join(f.name for f in reward_cfg.functions)
    return user_error_deadline(reward_cfg.import_timeout_s, (
        f"reward.import_timeout_s: building the reward functions ({names}) took longer than "
        f"{reward_cfg.import_timeout_s:g}s; a module whose top-level code never returns? (raise the key if it is "
        "only slow)"))


def record_user_error(line: str, path: str) -> None:
    """Write ``line`` to ``path`` unless a rank already did (first error wins, atomically)."""
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(line + "\n")
    try:
        os.link(tmp, path)  # fails if another rank recorded its error first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def data_file(config_path: str, overrides: list[str]) -> str | None:
    """``data.train_file`` of a config that may not validate (to recognise dataset errors)."""
    try:
        # quiet: the load that reported the error announced any deprecated key already
        return load_config(config_path, overrides, announce_deprecated=False).data.train_file
    except ConfigError:
        return None
