"""Rollout functions: what turns a step's prompts into the samples the trainer trains on.

A rollout function is called on rank 0 once per generation round as

    fn(engine, prompts, n, sampling, seed)  ->  n Samples (or Episodes) per prompt, prompt-major

engine: anything with ``RolloutEngine.generate`` (``generation/protocol.py``): token ids in, token
ids and the engine's log-probs out; prompts: ``data.Prompt`` (``prompt_ids``, ``text``,
``answer``, ``fields``); sampling: the run's ``SamplingParams``; seed: the round's sampling
seed (a resumed run passes the same one). A function whose signature has a ``tokenizer``
parameter also gets the run's tokenizer. It may be ``async def``.

Three kinds, one call:

* no ``episodes.kind``: single-turn, the engine's own
  ``generate`` (``rollout/generate.py`` calls it directly, unchanged);
* ``episodes.kind: environment``: the built-in episode loop, ``EpisodeRunner`` (``rollout/episodes/environment/loop.py``),
  which returns ``Episode``s;
* ``episodes.kind: function``, ``episodes.source: path/to/file.py:fn``: the user's function (slime's
  ``--rollout-function-path``), loaded by path like reward files (no ``PYTHONPATH``), run in
  a worker process (``rollout/episodes/function/worker.py``) so that a hung or crashing function is
  killed and reported in one line instead of blocking the trainer.

What a rollout function returns is checked every round (``check_rollout_output``) before the
trainer sees it: count, prompt-major order, the prompt's ids, token ids, log-probs (finite, and
<= 0 on the model's tokens), ``output_mask``, the kept sets of sampling-mask replay. A failure
is one ``RolloutFunctionError`` line naming the file and the function.
"""

from __future__ import annotations

import inspect
import numbers
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.episodes import ENVIRONMENT_FILE_RE
from megatron_grpo.rollout.episodes.environment.loading import finite_real
from megatron_grpo.rollout.episodes.environment.worker import fork_server, kill_worker
from megatron_grpo.rollout.episodes.episode import Episode
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.wire.samples import RolloutError, Sample, SamplingParams

FINISH_REASONS = ("stop", "length", "abort")
EPISODE_ERRORS = (None, "error", "timeout", "observation", "diverged")
_LOGPROB_SLACK = 1e-4  # a log-prob above 0 is not a probability's; float rounding of log(1) is below this
KEY = "episodes.rollout_function"
DEFAULT_TIMEOUT_S = 300.0


class RolloutFunctionError(ValueError):
    """A rollout function returned something the trainer cannot train on (one line)."""


class RolloutFunction:
    """``episodes.kind: function`` running in its own worker process
    (``rollout/episodes/function/worker.py``): ``fn(engine, prompts, n, sampling, seed)`` whose output is
    validated on every call. The engine stays here; the worker's ``engine.generate`` calls are
    answered by this process. Each wait on the worker (for the file to load, or for the function
    to call the engine or return) has a deadline, ``timeout_s``: past it the worker is killed and
    the call raises RolloutFunctionError (one line naming the file and the function)."""

    def __init__(self, conn, pid: int, where: str, *, vocab_size: Optional[int], timeout_s: float):
        self._conn = conn
        self.pid = pid
        self.where = where
        """``<absolute file>:<fn>`` for errors."""
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one round at a time through the worker's connection
        self._closed = False

    @classmethod
    def load(cls, spec: str, tokenizer: Any = None, *, vocab_size: Optional[int] = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> "RolloutFunction":
        """Start the worker and load ``path/to/file.py:fn`` there (pre-flight: the file loads,
        ``fn`` takes the five arguments); ConfigError naming ``episodes.kind: function`` otherwise."""
        m = ENVIRONMENT_FILE_RE.match(spec)
        if m is None:
            raise ConfigError("episodes.source", f"{spec!r} is not a file path path/to/file.py:fn")
        path = Path(m["path"]).expanduser().resolve()
        where = f"{path}:{m['attr']}"
        conn, pid = fork_server().connect(("run", "rollout_function",
                                            (f"{path}:{m['attr']}", where, tokenizer)))
        made = cls(conn, pid, where, vocab_size=vocab_size, timeout_s=timeout_s)
        try:
            kind, payload = made._receive("loading the file took longer than")
        except RolloutFunctionError as e:
            raise ConfigError(KEY, str(e)[len(KEY) + 1:]) from None  # "<where>: ..."
        if kind == "problem":
            made.close()
            raise ConfigError(KEY, payload)
        return made

    def __call__(self, engine, prompts: Sequence, n: int, sampling: SamplingParams,
                 sampling_seed: Optional[int] = None) -> list:
        with self._lock:
            out = self._call(engine, prompts, n, sampling, sampling_seed)
        try:
            check_rollout_output(out, prompts, n, sampling, f"{KEY} {self.where}", vocab_size=self.vocab_size)
        except RolloutFunctionError:
            self.close()  # the run stops: its worker with it
            raise
        return list(out)

    def _call(self, engine, prompts, n, sampling, sampling_seed) -> Any:
        """One round in the worker; the engine calls it asks for are made here."""
        if self._closed:
            raise RolloutFunctionError(f"{KEY} {self.where}: its worker process was closed")
        self._send(("call", (list(prompts), n, sampling, sampling_seed)))
        while True:
            kind, payload = self._receive("the function ran, without returning or calling engine.generate, "
                                          "longer than")
            if kind == "done":
                return payload
            if kind == "error":
                self.close()
                raise RolloutFunctionError(f"{KEY} {self.where}: {payload['message']} (at {payload['where']})")
            try:  # "generate": the function's call, checked here (a bad one escaped the engine as a traceback)
                args, kwargs = generate_call(*payload)
            except ValueError as e:
                self.close()
                raise RolloutFunctionError(f"{KEY} {self.where}: engine.generate was called with {e}") from None
            try:
                samples = engine.generate(*args, **kwargs)
            except RolloutError as e:
                self.close()
                if e.status in REFUSED:  # the engine refused this request (a prompt past its context)
                    raise RolloutFunctionError(f"{KEY} {self.where}: engine.generate was refused: {e}") from None
                raise  # the engine's own failure is the run's (restarted), as without a rollout function
            except BaseException:
                self.close()
                raise
            self._send(("generated", samples))

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):
            self.close()
            raise RolloutFunctionError(f"{KEY} {self.where}: its worker process is gone") from None

    def _receive(self, late: str) -> tuple:
        """The worker's next message within ``timeout_s``; RolloutFunctionError (worker killed)
        otherwise, ``late`` saying what took too long."""
        if not self._conn.poll(self.timeout_s):
            self.close()
            raise RolloutFunctionError(f"{KEY} {self.where}: {late} {self.timeout_s:g}s "
                                       "(episodes.timeout_s); its worker process was killed")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self.close()
            raise RolloutFunctionError(f"{KEY} {self.where}: its worker process died (the function crashed it "
                                       "or it was killed)") from None

    def episodes(self, engine, prompts: Sequence, n: int, sampling: SamplingParams,
                 sampling_seed: Optional[int] = None) -> tuple[list[Sample], Optional[list[Episode]]]:
        """``EpisodeSource`` (rollout/episodes/source.py): the checked output's samples, and its
        episodes when the function returned Episodes."""
        return samples_of(self(engine, prompts, n, sampling, sampling_seed))

    def close(self) -> None:
        """``EpisodeSource``: end the worker (SIGKILL: it may be stuck in the user's code). The
        run closes its source; a process that ends without closing it ends the fork server, which
        ends its workers."""
        if self._closed:
            return
        self._closed = True
        kill_worker(self.pid)
        self._conn.close()


REFUSED = (400, 413)
"""HTTP statuses (and the in-process engine's equivalent) of a request the engine refused."""


def _generate(prompts, n, sampling, *, sampling_seed=None, return_routed_experts=False):
    """``RolloutEngine.generate``'s signature (generation/protocol.py), to bind a function's call to."""


def generate_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A rollout function's ``engine.generate(*args, **kwargs)``, checked and as plain Python
    values (numpy ids become ints: an HTTP engine's JSON would not take them); ValueError naming
    the argument otherwise (a bad one escaped the engine as a traceback). Ids past the
    vocabulary are the engine's to refuse (a 400: ``RolloutFunction._call``)."""
    try:
        call = inspect.signature(_generate).bind(*args, **kwargs).arguments
    except TypeError as e:
        raise ValueError(f"arguments that do not fit generate(prompts, n, sampling, *, sampling_seed=None): "
                         f"{e}") from None
    prompts, n, sampling = call["prompts"], call["n"], call["sampling"]
    seed = call.get("sampling_seed")
    if not isinstance(prompts, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and p and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                       and t >= 0 for t in p) for p in prompts):
        raise ValueError("prompts that are not lists of token ids (one non-empty list of integers >= 0 per prompt, "
                         "e.g. [p.prompt_ids for p in prompts])")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n={n!r}; expected an int >= 1")
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling of type {type(sampling).__name__}; expected the SamplingParams it was given "
                         "(change it with dataclasses.replace)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise ValueError(f"sampling_seed={seed!r}; expected an int or None")
    return (([[int(t) for t in p] for p in prompts], int(n), sampling),
            {"sampling_seed": None if seed is None else int(seed),
             "return_routed_experts": bool(call.get("return_routed_experts", False))})


def check_rollout_output(out: Any, prompts: Sequence, n: int, sampling: SamplingParams, where: str, *,
                         vocab_size: Optional[int] = None) -> None:
    """RolloutFunctionError (one line, starting with ``where``) unless ``out`` is ``n`` Samples,
    or ``n`` Episodes, per prompt of ``prompts``, prompt-major, each trainable as it stands."""
    def fail(msg: str):
        raise RolloutFunctionError(f"{where}: {msg}")

    if not isinstance(out, (list, tuple)):
        fail(f"returned a {type(out).__name__}; expected a list of Sample (wire/samples.py) or Episode")
    expected = len(prompts) * n
    if len(out) != expected:
        fail(f"returned {len(out)} items; expected {expected} (n={n} per prompt for {len(prompts)} prompts, "
             "prompt-major)")
    kinds = {type(x) for x in out}
    if not (kinds <= {Sample} or kinds <= {Episode}):
        names = sorted(k.__name__ for k in kinds)
        fail(f"returned items of type {', '.join(names)}; expected all Sample (wire/samples.py) or all Episode "
             "(rollout/episodes/environment/loop.py)")
    replay = sampling.sampling_mask_max_kept > 0
    for i, item in enumerate(out):
        try:
            _check_item(item, i, prompts, n, replay, vocab_size, fail)
        except RolloutFunctionError:
            raise
        except (TypeError, ValueError, OverflowError) as e:
            # a field of the wrong type (None where a list belongs): ``len(None)`` escaped as a traceback
            fail(f"item {i}: a field has the wrong type ({one_line(e, 120)}); "
                 "see Sample in wire/samples.py")


def _check_item(item: Any, i: int, prompts: Sequence, n: int, replay: bool, vocab_size: Optional[int],
                fail: Callable[[str], None]) -> None:
    """``check_rollout_output``'s checks of ``out[i]``; ``fail(message)`` raises."""
    at = f"item {i}"
    if isinstance(item, Episode):
        if not isinstance(item.num_turns, int) or item.num_turns < 0:
            fail(f"{at}: Episode.num_turns={item.num_turns!r}; expected an int >= 0")
        if not _finite(item.env_reward):
            fail(f"{at}: Episode.env_reward={item.env_reward!r}; expected a finite number")
        if item.error not in EPISODE_ERRORS:
            fail(f"{at}: Episode.error={item.error!r}; expected one of {EPISODE_ERRORS}")
        item = item.sample
        if not isinstance(item, Sample):
            fail(f"{at}: Episode.sample is a {type(item).__name__}; expected a Sample")
    if (item.prompt_index, item.sample_index) != (i // n, i % n):
        fail(f"{at} has prompt_index={item.prompt_index}, sample_index={item.sample_index}; expected "
             f"{i // n}, {i % n} (prompt-major: the n samples of prompt 0 first, then prompt 1's, ...)")
    if list(item.prompt_ids) != list(prompts[i // n].prompt_ids):
        fail(f"{at}: prompt_ids differ from prompts[{i // n}].prompt_ids (the trainer scores the dataset's "
             "prompt; put anything added after it in output_ids with output_mask 0)")
    num = len(item.output_ids)
    for k, t in enumerate(item.output_ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 or \
                (vocab_size is not None and t >= vocab_size):
            fail(f"{at}: output_ids[{k}]={t!r}; expected a token id in [0, {vocab_size or 'vocab size'})")
    if len(item.output_logprobs) != num:
        fail(f"{at}: {len(item.output_logprobs)} output_logprobs for {num} output_ids; expected one per token")
    mask = item.output_mask
    if mask is not None:
        if len(mask) != num:
            fail(f"{at}: {len(mask)} output_mask entries for {num} output_ids; expected one per token")
        bad = [m for m in mask if m not in (0, 1)]
        if bad:
            fail(f"{at}: output_mask holds {bad[0]!r}; expected 1 (a model token) or 0 (an observation token)")
    for k, lp in enumerate(item.output_logprobs):
        if not _finite(lp):
            fail(f"{at}: output_logprobs[{k}]={lp!r}; expected a finite number (the engine's log-prob; "
                 "0 on observation tokens)")
        if (mask is None or mask[k]) and lp > _LOGPROB_SLACK:
            fail(f"{at}: output_logprobs[{k}]={lp!r} on a model token; a log-prob is <= 0")
    if item.finish_reason not in FINISH_REASONS:
        fail(f"{at}: finish_reason={item.finish_reason!r}; expected one of {', '.join(FINISH_REASONS)}")
    if replay:
        if item.kept_ids is None or item.log_kept_mass is None:
            fail(f"{at}: no kept_ids / log_kept_mass, but sampling-mask replay is on (rollout.sampling_mask_replay "
                 "with top_p/top_k/min_p): pass the engine's, as engine.generate returns them (None and 0.0 on "
                 "observation tokens), or set rollout.sampling_mask_replay: false")
        if len(item.kept_ids) != num or len(item.log_kept_mass) != num:
            fail(f"{at}: {len(item.kept_ids)} kept_ids and {len(item.log_kept_mass)} log_kept_mass for {num} "
                 "output_ids; expected one each per token")


def samples_of(out: Sequence) -> tuple[list[Sample], Optional[list[Episode]]]:
    """(the samples, the episodes or None) of a checked rollout function's output."""
    if out and isinstance(out[0], Episode):
        return [e.sample for e in out], list(out)
    return list(out), None


def _finite(x: Any) -> bool:
    return not isinstance(x, bool) and finite_real(x)
