"""Functions that tests/test_rewards_graders.py runs in an ``IsolatedFunction`` worker: the worker
imports this module by name, so it stays free of test-only imports."""

import os
import time


def echo(*args):
    return args


def sleepy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def noisy(value):
    print("this goes to stderr, not into the answers")  # the worker's fd 1 is its stderr
    os.write(1, b"and so does this\n")
    return value


def raises(message: str):
    raise KeyError(message)


def dies(code: int):
    os._exit(code)


def pid() -> int:
    return os.getpid()


def reads_stdin() -> str:
    return os.read(0, 100).decode()  # /dev/null in the worker: the requests stay out of reach


def spawns(marker: str) -> int:
    import subprocess

    return subprocess.Popen(["sleep", marker]).pid  # a grader's child: dies with the worker
