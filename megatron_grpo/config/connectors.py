"""The connectors' table, one for every kind: ``episodes.source: <prefix>:<target>`` runs an
environment or an agent written for another library (docs/multi_turn.md, "Environments from
skyrl-gym, OpenEnv and TRL-style tool classes"; docs/agents.md, "verifiers environments").

The table lives here, in the config layer, because the config check (``environment_problem``,
``agent_problem``) must know the prefixes, their kind and the libraries they need; the adapters
themselves are in ``megatron_grpo/rollout/episodes/environment/connectors/`` and
``.../agent/connectors/`` and are named by module path only, imported (with ``importlib``) in
the worker process that runs them, so nothing of the rollout layer (nor any of the libraries)
is imported by the config.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_grpo.config.base import missing_file

AGENTS_EXTRA = "pip install 'megatron-grpo[agents]'"
"""How to install every connector's library (setup.py's ``agents`` extra)."""


@dataclass(frozen=True)
class Connector:
    """One ``episodes.source`` prefix."""

    kind: Literal["environment", "agent"]
    """The ``episodes.kind`` it serves."""
    module: str
    """The adapter module, imported (in the worker process that runs the spec) when it is used:
    an environment's has ``environment_class(target)`` (and may have ``prepare``), an agent's
    ``load_agent(file_spec, key)``."""
    library: Optional[str]
    """Import name of the library the adapter needs (None: plain Python)."""
    distribution: Optional[str]
    """The library's package on the index, for messages."""
    targets: tuple[str, ...]
    """What may follow the prefix: ``id`` (a registered name), ``file`` (``path/to/x.py:Name``),
    ``url`` (``http(s)://host:port``)."""
    usage: str
    """The accepted forms, for messages."""


_ENV = "megatron_grpo.rollout.episodes.environment.connectors"
_AGENT = "megatron_grpo.rollout.episodes.agent.connectors"

CONNECTORS: dict[str, Connector] = {
    "skyrl_gym": Connector("environment", f"{_ENV}.skyrl_gym_adapter", "skyrl_gym", "skyrl-gym", ("id", "file"),
                           "skyrl_gym:<env id> or skyrl_gym:path/to/env.py:BaseTextEnvSubclass"),
    "openenv": Connector("environment", f"{_ENV}.openenv_adapter", "openenv", "openenv-core", ("file", "url"),
                         "openenv:path/to/app.py:app or openenv:http://host:port"),
    "tools": Connector("environment", f"{_ENV}.tools_adapter", None, None, ("file",),
                       "tools:path/to/env.py:ClassName"),
    "verifiers": Connector("agent", f"{_AGENT}.verifiers_env", "verifiers", "verifiers", ("file",),
                           "verifiers:path/to/env.py:load_environment"),
}
"""Spec prefix -> connector: the one table of them."""


def connectors_of(kind: str) -> dict[str, Connector]:
    """The connectors of one ``episodes.kind``, in the table's order."""
    return {prefix: c for prefix, c in CONNECTORS.items() if c.kind == kind}


CONNECTOR_SPEC_RE = re.compile(r"^(?P<prefix>[a-z][a-z0-9_]*):(?P<target>.*)$")
FILE_TARGET_RE = re.compile(r"^(?P<path>.+\.py):(?P<attr>[A-Za-z_]\w*)$")
ID_TARGET_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def split_connector_spec(spec: str) -> Optional[tuple[str, str]]:
    """``(prefix, target)`` when ``spec`` is ``<prefix>:<target>`` with a known prefix, or with an
    unknown one that is not a file path (``foo:bar``: refused by ``connector_problem``); None for
    anything else (a built-in name, ``path/to/env.py:Class``)."""
    m = CONNECTOR_SPEC_RE.match(spec)
    if m is None:
        return None
    if m["prefix"] not in CONNECTORS and FILE_TARGET_RE.match(spec):
        return None  # a file path that happens to contain a colon
    return m["prefix"], m["target"]


def target_kind(target: str) -> Optional[str]:
    """``file``, ``url`` or ``id`` (see ``Connector.targets``); None when it is none of them."""
    if FILE_TARGET_RE.match(target):
        return "file"
    if target.startswith(("http://", "https://")):
        return "url"
    return "id" if ID_TARGET_RE.match(target) else None


def connector_problem(prefix: str, target: str) -> Optional[str]:
    """Why ``<prefix>:<target>`` cannot name an environment (None if it can): a known prefix of
    an environment connector, an installed library, a target of an accepted form, an existing
    file. Imports nothing."""
    spec = f"{prefix}:{target}"
    connector = CONNECTORS.get(prefix)
    if connector is not None and connector.kind != "environment":
        return f"{spec!r}: {prefix} is an {connector.kind} connector; set episodes.kind: {connector.kind}"
    if connector is None:
        return (f"{spec!r}: unknown environment connector {prefix!r} "
                f"(known: {', '.join(connectors_of('environment'))})")
    if target_kind(target) not in connector.targets:
        return f"{spec!r} is not of the form {connector.usage}"
    if connector.library is not None and importlib.util.find_spec(connector.library) is None:
        return f"{spec!r} needs the {connector.distribution} library, which is not installed: {AGENTS_EXTRA}"
    m = FILE_TARGET_RE.match(target)
    return None if m is None else missing_file(m["path"], "environment")
