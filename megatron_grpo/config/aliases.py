"""Deprecated config keys: ``DEPRECATED_KEYS``, the one table from each old dotted key to the
key that replaced it, and the renaming the loader (``experiment.load_config``) applies to a
parsed YAML file and to each command-line override before the strict build. The build then
sees only current keys, so an unknown key is refused as before, with its usual one-line error.

An old key keeps working for one release: its value moves to the new key and the loader prints
one line naming the new key (``[megatron-grpo] config: rollout.engine is deprecated; use
engine.kind``). Giving the old and the new key in the same place (the file, or the command
line) is a one-line error naming both; an override on the command line still wins over the
file, whichever spelling either uses. An old ``episodes:`` selector also sets the kind it
implies (``IMPLIED_KIND``: ``episodes.environment: X`` is ``episodes.kind: environment`` with
``episodes.source: X``); a kind given beside it must agree.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import sys
import typing
from typing import Any, Iterator, Optional

from megatron_grpo.config.base import ConfigError, field_types, unknown_key

DEPRECATED_KEYS: dict[str, str] = {
    # Issue 46: the `rollout:` section held the engine, the weight sync and the episodes as well;
    # they are sections of their own now (config/engine.py, sync.py, episodes.py). These
    # entries go one release after the one that made the split (0.1.0 is the current version).
    "rollout.engine": "engine.kind",
    "rollout.urls": "engine.urls",
    "rollout.num_servers": "engine.num_servers",
    "rollout.host": "engine.host",
    "rollout.port": "engine.port",
    "rollout.api_key": "engine.api_key",
    "rollout.sglang": "engine.sglang",  # a section: its keys are unchanged
    "rollout.embedded": "engine.embedded",  # a section: its keys are unchanged
    "rollout.dtype": "engine.dtype",
    "rollout.quantization": "engine.quantization",
    "rollout.fp8_format": "engine.fp8_format",
    "rollout.max_restarts": "engine.max_restarts",
    "rollout.max_inflight_requests": "engine.max_inflight_requests",
    "rollout.launch_timeout_s": "engine.launch_timeout_s",
    "rollout.request_timeout_s": "engine.request_timeout_s",
    "rollout.max_retries": "engine.max_retries",
    "rollout.base_gpu_id": "engine.base_gpu_id",
    "rollout.colocate": "engine.colocate",
    "rollout.weight_sync_transport": "sync.transport",
    "rollout.weight_sync_backend": "sync.backend",
    "rollout.weight_sync_master_address": "sync.master_address",
    "rollout.weight_update_bucket_mb": "sync.bucket_mb",
    "rollout.verify_weights_every": "sync.verify_every",
    "rollout.verify_logprob_tolerance": "sync.verify_logprob_tolerance",
    "rollout.environment": "episodes.source",  # then episodes.environment, now with kind environment
    "rollout.rollout_function": "episodes.source",  # with kind function
    "rollout.rollout_function_timeout_s": "episodes.timeout_s",
    "rollout.multi_turn.observation_role": "episodes.observation_role",
    "rollout.multi_turn.observation_formatter": "episodes.observation_formatter",
    "rollout.multi_turn.max_turns": "episodes.max_turns",
    "rollout.multi_turn.max_episode_tokens": "episodes.max_episode_tokens",
    "rollout.multi_turn.env_timeout_s": "episodes.timeout_s",
    "rollout.multi_turn.on_env_error": "episodes.on_env_error",
    "rollout.multi_turn.env_reward": "episodes.env_reward",
    # Issue 62: one selector (kind, with its source), one deadline and one concurrency for the
    # three producers of episodes; a selector's old name also implies the kind (IMPLIED_KIND).
    "episodes.environment": "episodes.source",
    "episodes.agent": "episodes.source",
    "episodes.rollout_function": "episodes.source",
    "episodes.env_timeout_s": "episodes.timeout_s",
    "episodes.agent_timeout_s": "episodes.timeout_s",
    "episodes.rollout_function_timeout_s": "episodes.timeout_s",
    "episodes.agent_workers": "episodes.concurrency",
}
"""Old dotted key -> its current dotted key. A key naming a section moves with everything
under it (``rollout.sglang.tp`` -> ``engine.sglang.tp``). Several old keys may share a current
key (the three timeouts); two of them in one place are "given twice"."""

KIND_KEY = "episodes.kind"

IMPLIED_KIND: dict[str, str] = {
    "rollout.environment": "environment",
    "rollout.rollout_function": "function",
    "episodes.environment": "environment",
    "episodes.agent": "agent",
    "episodes.rollout_function": "function",
}
"""Old selector -> the ``episodes.kind`` its value implies: ``episodes.environment: X`` is
``episodes.kind: environment`` with ``episodes.source: X``. A null selector sets nothing in a
file (it said "not this kind"); on the command line it clears kind and source when the config's
kind is its own (``implied_settings``)."""

PREFIX = "[megatron-grpo] config:"

Renamed = list[tuple[str, str]]
"""(the deprecated key as given, the key it now is), in the order found."""


def key_type(root: type, dotted: str) -> Optional[Any]:
    """The type of the field at ``dotted`` under dataclass ``root`` (a section's class for a
    section), or None when the schema has no such key."""
    tp: Any = root
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        hints = field_types(tp)
        if part not in hints:
            return None
        tp = hints[part]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):  # an Optional section
            tp = args[0]
    return tp


def removed_sections(root: type) -> list[str]:
    """Parents of old keys that are no section of ``root`` any more (``rollout.multi_turn``): a
    mapping left there after the renaming holds only keys that never existed."""
    parents = {old.rpartition(".")[0] for old in DEPRECATED_KEYS}
    return sorted(p for p in parents if key_type(root, p) is None)


def _conflict(old: str, new: str) -> ConfigError:
    return ConfigError(new, f"is given twice: as {new} and as its deprecated name {old}; keep only {new}")


def _pop(raw: dict, parts: list[str]) -> tuple[bool, Any]:
    node = raw
    for part in parts[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return False, None
    if parts[-1] not in node:
        return False, None
    return True, node.pop(parts[-1])


def parent_section(raw: dict, parts: list[str], what: str) -> dict:
    """The mapping of ``raw`` that holds the key ``parts`` names (``parts[:-1]``, sections made
    when missing); ConfigError naming the first one that is not a section (``what``: the setting,
    for the message)."""
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is not a section, cannot set {what}")
        node = child
    return node


def _put(raw: dict, new: str, value: Any, old: str) -> None:
    """Set ``new`` (dotted) in ``raw`` to ``value``, given as ``old``; a section's value is merged
    key by key into the new section when both are given."""
    parts = new.split(".")
    node = parent_section(raw, parts, f"{new} (given as {old})")
    leaf = parts[-1]
    if leaf not in node:
        node[leaf] = value
        return
    existing = node[leaf]
    if not (isinstance(existing, dict) and isinstance(value, dict)):
        raise _conflict(old, new)
    for key, sub in value.items():
        if key in existing:
            raise _conflict(f"{old}.{key}", f"{new}.{key}")
        existing[key] = sub


def _leftover(root: type, raw: dict) -> None:
    """Refuse what the renaming left in a removed section (a misspelt old key), or drop the
    section when it is empty."""
    for section in removed_sections(root):
        found, value = _pop(raw, section.split("."))
        if not found or value == {}:
            continue
        if not isinstance(value, dict):
            raise ConfigError(section, f"expected a mapping of keys, got {type(value).__name__} {value!r}")
        key = next(iter(value))
        raise misspelt_old_key(section, str(key), []) or unknown_key(f"{section}.{key}", str(key), [])


def misspelt_old_key(section: str, key: str, names: list[str]) -> Optional[ConfigError]:
    """The error of the unknown ``section.key`` when it is closer to a deprecated key of
    ``section`` than to any of its current ``names``: "did you mean" the key it now is
    (``rollout.engien`` -> ``engine.kind``: the old names were in every older doc); else None."""
    old = {o.rpartition(".")[2]: o for o in DEPRECATED_KEYS if o.rpartition(".")[0] == section}
    close = difflib.get_close_matches(key, [*names, *old], n=1, cutoff=0.6)
    if not close or close[0] not in old or close[0] in names:
        return None
    was = old[close[0]]
    return ConfigError(f"{section}.{key}", f"unknown key; did you mean '{replacement(was, DEPRECATED_KEYS[was])}' "
                                           f"(once {was})?")


def _current_names(root: type, section: str) -> Optional[list[str]]:
    """The keys of ``section`` under ``root``, or None when it is no section (any more)."""
    tp = key_type(root, section)
    return list(field_types(tp)) if tp is not None and dataclasses.is_dataclass(tp) else None


def _misspelt(root: type, raw: dict) -> None:
    """Refuse a key of a current section that holds deprecated keys (``rollout``) that is a
    misspelt old key, naming the key it now is (``_leftover`` does so in removed sections)."""
    for section in sorted({old.rpartition(".")[0] for old in DEPRECATED_KEYS}):
        names = _current_names(root, section)
        found, value = _pop(copy.deepcopy(raw), section.split("."))
        if names is None or not found or not isinstance(value, dict):
            continue
        for key in value:
            if isinstance(key, str) and key not in names:
                error = misspelt_old_key(section, key, names)
                if error is not None:
                    raise error


def kind_conflict_message(given: Any, old: str) -> str:
    """The error at ``episodes.kind``, given as ``given``, of the old selector ``old`` implying another kind."""
    return (f"is {given if given is not None else 'null'} but the deprecated {old} implies {IMPLIED_KIND[old]}; "
            f"keep only {KIND_KEY} with episodes.source")


def _imply_kind(raw: dict, old: str) -> None:
    """Set ``episodes.kind`` to what the old selector ``old`` implies; a file's own kind must agree."""
    parts = KIND_KEY.split(".")
    node = parent_section(raw, parts, f"{KIND_KEY} (implied by {old})")
    if parts[-1] in node and node[parts[-1]] != IMPLIED_KIND[old]:
        raise ConfigError(KIND_KEY, kind_conflict_message(node[parts[-1]], old))
    node[parts[-1]] = IMPLIED_KIND[old]


def rename_file(raw: dict, root: type) -> tuple[dict, Renamed]:
    """A copy of the parsed YAML ``raw`` with every deprecated key moved to its current key (an
    old selector's kind set with it; a null one dropped, announced last)."""
    raw = copy.deepcopy(raw)
    renamed: Renamed = []
    dropped: Renamed = []
    given_as: dict[str, str] = {}  # current key -> the deprecated key that set it
    for old, new in DEPRECATED_KEYS.items():
        found, value = _pop(raw, old.split("."))
        if not found:
            continue
        if old in IMPLIED_KIND and value is None:  # "not this kind": nothing to set
            dropped.append((old, new))
            continue
        if new in given_as:
            raise ConfigError(new, f"is given twice: as its deprecated names {given_as[new]} and {old}; "
                                   f"keep only {new}")
        _put(raw, new, value, old)
        given_as[new] = old
        renamed.append((old, new))
        if old in IMPLIED_KIND:
            _imply_kind(raw, old)
    _leftover(root, raw)
    _misspelt(root, raw)
    return raw, renamed + dropped


ANNOUNCE_ONLY = object()
"""The value of a renamed override that sets nothing (a null old selector in a whole section)."""


def selector_settings(old: str, new: str, value: Any, raw: dict) -> list[tuple[str, Any]]:
    """(current dotted key, value) pairs an override of the old selector ``old`` sets in ``raw``:
    its source and the kind it implies; a null one clears both when ``raw``'s kind is its own
    (``episodes.environment=null`` turned the environment off), else sets nothing."""
    if value is not None:
        return [(new, value), (KIND_KEY, IMPLIED_KIND[old])]
    found, kind = _pop(copy.deepcopy(raw), KIND_KEY.split("."))
    return [(new, None), (KIND_KEY, None)] if found and kind == IMPLIED_KIND[old] else []


def _rename_section_value(parts: list[str], value: dict, root: type) -> Iterator[tuple[list[str], Any, Optional[str]]]:
    """The override of a whole section (``rollout={engine: inprocess, max_new_tokens: 64}``) whose
    mapping holds deprecated keys: the section's value without them (it still replaces the
    section), then each of them as its current key, renamed as in a file (issue 64: they were
    "unknown key" without the new name)."""
    wrapped: dict = {}
    node = wrapped
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    renamed_raw, renamed = rename_file(wrapped, root)
    moved = []
    for old, new in renamed:
        found, sub = _pop(renamed_raw, new.split("."))
        if found:  # a section given under both names was merged into one value: taken once
            moved.append((new.split("."), sub, old))
        elif old in IMPLIED_KIND:  # a null selector: announced, sets nothing
            moved.append((new.split("."), ANNOUNCE_ONLY, old))
    found, rest = _pop(renamed_raw, parts)
    yield parts, rest if found else {}, None
    yield from moved


def rename_override(parts: list[str], value: Any, root: type) -> Iterator[tuple[list[str], Any, Optional[str]]]:
    """(current key parts, value, the deprecated key as given or None) of the override
    ``parts=value``: one, or one per key of a removed section given as a mapping."""
    dotted = ".".join(parts)
    for old, new in DEPRECATED_KEYS.items():
        if dotted == old or dotted.startswith(old + "."):
            yield [*new.split("."), *parts[len(old.split(".")):]], value, dotted
            return
    if isinstance(value, dict) and any(old.startswith(dotted + ".") for old in DEPRECATED_KEYS) \
            and dotted not in removed_sections(root):
        yield from _rename_section_value(parts, value, root)
        return
    for section in removed_sections(root):
        if dotted == section:  # rollout.multi_turn={max_turns: 3}
            if not isinstance(value, dict):
                raise ConfigError(section, f"expected a mapping of keys, got {type(value).__name__} {value!r}")
            for key, sub in value.items():
                yield from rename_override([*parts, str(key)], sub, root)
            return
        if dotted.startswith(section + "."):
            key = parts[len(section.split("."))]
            raise misspelt_old_key(section, key, []) or unknown_key(dotted, key, [])
    section, _, key = dotted.rpartition(".")
    names = _current_names(root, section) if section else None
    if names is not None and key not in names:
        error = misspelt_old_key(section, key, names)
        if error is not None:
            raise error
    yield parts, value, None


def current_key(dotted: str) -> str:
    """``dotted`` with a deprecated prefix replaced by its current key (``rollout.sglang.tp``
    -> ``engine.sglang.tp``); other keys unchanged."""
    for old, new in DEPRECATED_KEYS.items():
        if dotted == old or dotted.startswith(old + "."):
            return new + dotted[len(old):]
    return dotted


_announced: set[str] = set()  # lines this process printed: a command loads its config more than once


def replacement(old: str, new: str) -> str:
    """What a deprecated key's line (and the reference) says to use instead of ``old``."""
    kind = IMPLIED_KIND.get(old)
    return f"{KIND_KEY}: {kind} with {new}" if kind else new


def announce(renamed: Renamed) -> None:
    """Print one line per deprecated key to stderr, once per process."""
    for old, new in renamed:
        line = f"{PREFIX} {old} is deprecated; use {replacement(old, new)}"
        if line not in _announced:
            _announced.add(line)
            print(line, file=sys.stderr, flush=True)
