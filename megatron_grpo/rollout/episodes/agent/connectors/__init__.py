"""Agent connectors: a ``episodes.kind: agent`` spec that names an environment written for another
library, run as an agent through the front like the user's own agent function.

    path/to/agent.py:fn                           the user's ``fn(client, row)`` (``worker.py``)
    <prefix>:path/to/file.py:attr                 the prefix's module builds the agent function
    verifiers:path/to/env.py:load_environment     a verifiers environment (``verifiers_env.py``)

The prefixes are the agent entries of the one connectors' table, ``config/connectors.py``; each
names its module here by path, imported on first use. A connector runs inside the agent's worker process (never in the trainer's): given the
resolved ``<absolute path>:<attr>`` it loads the user's file and returns ``(fn, source_file)``,
``fn`` an agent function ``(client, row) -> float | dict`` and ``source_file`` the file whose
frames name the site of a failure (the user's file, not the connector's). A connector's load
failure is a ``ConfigError`` (one line; the run does not start).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable, Optional

from megatron_grpo.config.connectors import connectors_of
from megatron_grpo.rewards.registry import load_file


def split_spec(spec: str) -> tuple[Optional[str], str]:
    """``(prefix, file spec)`` of ``<prefix>:path.py:attr`` for a known prefix, else ``(None, spec)``."""
    prefix, sep, rest = spec.partition(":")
    return (prefix, rest) if sep and prefix in connectors_of("agent") else (None, spec)


def load_agent(spec: str, key: str) -> tuple[Callable, str]:
    """The agent function a resolved ``spec`` names and the file that locates its failures;
    ConfigError (naming ``key``) when it cannot be loaded."""
    prefix, file_spec = split_spec(spec)
    if prefix is not None:  # the module's load_agent(file_spec, key) -> (agent fn, source file)
        return importlib.import_module(connectors_of("agent")[prefix].module).load_agent(file_spec, key)
    fn = load_file(spec, key)
    try:
        return fn, inspect.getsourcefile(fn) or spec
    except TypeError:  # a builtin or a C callable: no source file
        return fn, spec
