"""The environment fork server's live worker processes, for tests that check none outlives a step."""

from __future__ import annotations

import time

import psutil

from megatron_grpo.rollout.episodes.environment.worker import fork_server


def live_workers(wait_s: float) -> list[int]:
    """Pids of the fork server's children that are not zombies, waited for (at most ``wait_s``)
    until there are none: a killed process still needs the CPU to exit on a loaded machine."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [p.pid for p in psutil.Process(fork_server().proc.pid).children() if p.status() != "zombie"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
