"""The worker process of a custom rollout function (``episodes.kind: function``): the user's
function runs here, never in the trainer's process, so a hung or crashing one is killed alone.

The worker is forked by the environments' fork server (``rollout/episodes/environment/worker.py``, a
``run`` request), so it does not carry the trainer's torch, megatron or engine state. It loads
the file, answers whether the function can be called, then serves calls:

    trainer -> worker   ("call", (prompts, n, sampling, seed))      one generation round
    worker  -> trainer  ("generate", (args, kwargs))                the function called engine.generate
    trainer -> worker   ("generated", samples)                      ... and here is what the engine returned
    worker  -> trainer  ("done", output) | ("error", {message, where})

The engine stays in the trainer's process (its servers, weight versions and retries are the
trainer's); the function gets ``EngineProxy``, whose ``generate`` forwards each call. The
trainer's side, with the deadline, is ``RolloutFunction`` (``rollout/episodes/function/source.py``).
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

from megatron_grpo.config.base import ConfigError
from megatron_grpo.rewards.registry import load_file
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.rollout.episodes.environment.worker import raise_site

KEY = "episodes.rollout_function"


class EngineProxy:
    """What the function gets as ``engine``: ``generate`` runs on the trainer's engine."""

    def __init__(self, conn):
        self._conn = conn

    def generate(self, *args, **kwargs) -> list:
        """``RolloutEngine.generate`` (generation/protocol.py), forwarded; blocks until the trainer answers."""
        self._conn.send(("generate", (args, kwargs)))
        kind, payload = self._conn.recv()  # EOFError when the trainer is gone: the worker ends
        assert kind == "generated", kind
        return payload


def takes_tokenizer(fn) -> bool:
    """The function's signature has a ``tokenizer`` parameter (or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # no signature (a builtin): called with the five arguments
        return False
    return "tokenizer" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _load(spec: str, where: str, tokenizer: Any) -> tuple[Any, dict]:
    """(fn, its extra keyword arguments); ConfigError naming ``episodes.kind: function`` otherwise."""
    fn = load_file(spec, KEY)
    extra = {"tokenizer": tokenizer} if takes_tokenizer(fn) else {}
    try:
        inspect.signature(fn).bind(None, [], 1, None, 0, **extra)
    except TypeError as e:
        raise ConfigError(KEY, f"{where} must take (engine, prompts, n, sampling, seed) and optionally "
                               f"tokenizer: {e}") from None
    except ValueError:
        pass  # no signature (a builtin): the first call tells
    return fn, extra


def serve(conn, spec: str, where: str, tokenizer: Any) -> None:
    """The worker's life: load ``spec`` (``("loaded", None)`` or ``("problem", one line)``), then
    answer ``call`` requests until ``close`` or the connection ends."""
    try:
        fn, extra = _load(spec, where, tokenizer)
    except ConfigError as e:
        conn.send(("problem", e.message))
        return
    conn.send(("loaded", None))
    fn_file = str(Path(where.rsplit(":", 1)[0]))
    engine = EngineProxy(conn)
    while True:
        try:
            op, arg = conn.recv()
        except EOFError:
            return
        if op == "close":
            return
        prompts, n, sampling, seed = arg
        try:
            out = fn(engine, prompts, n, sampling, seed, **extra)
            if inspect.iscoroutine(out):
                out = asyncio.run(out)
        except Exception as e:  # the user's code: reported to the trainer, which stops the run (if the
            # trainer is gone, this send fails too and the worker ends)
            conn.send(("error", {"message": f"raised {one_line(e)}", "where": raise_site(e, fn_file)}))
            continue
        try:
            conn.send(("done", out))
        except Exception as e:  # pickling failed before anything was sent
            conn.send(("error", {"message": f"returned something that cannot be sent to the trainer's process "
                                            f"({one_line(e)})", "where": where}))
