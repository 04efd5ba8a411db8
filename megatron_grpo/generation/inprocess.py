"""``InProcessEngine``: the ``RolloutEngine`` of ``engine.kind: inprocess``, the embedded
engine's generation code (``rollout/embedded``: the Hugging Face model, continuous batching,
the same sampling, log-probs, sampling masks, MoE routing and quantization) run inside trainer
rank 0's process, with no server, no HTTP and no JSON.

* Shared with the trainer: the process, its threads and (on a GPU) rank 0's device.
* Copied: the weights. The engine keeps its own full unsharded Hugging Face model in
  ``engine.dtype``, overwritten in place at every sync from the trainer's shards
  (``sync/in_memory.py``, through ``models.iter_hf_weights`` like the HTTP sync). It must be a
  snapshot: with ``rollout.mode: one_step_off_policy`` the optimizer changes the trainer's
  weights while the next batch is generated. A quantized engine rebuilds its quantized copy of
  the decoder projections at every sync.
* Deliberately not Megatron's forward: the engine stays an independent implementation, so the
  train/rollout mismatch metrics and the off-policy corrections keep their meaning.

Generation runs in the engine's scheduler thread; ``generate`` submits its sequences at once (no
batching window) and waits, bounded by ``engine.request_timeout_s``. Several threads may call it
at once (``rollout.mode: async``): their sequences share the continuous batch, and each token
records the weight version that drew it, kept exact by the in-memory sync retracting the running
sequences while it copies. Only rank 0 holds an engine; the other ranks hold the collective half
of the sync (``engine is None``). Details: docs/rollout_engines.md#in-process-engine-enginekind-inprocess.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.ops.quantize import scheme_of
from megatron_grpo.generation.client import parse_sampling_mask
from megatron_grpo.inference.engine import EmbeddedEngine, EngineError
from megatron_grpo.inference.generation import Sequence as EngineSequence
from megatron_grpo.inference.sampling import resolve_sampling_params
from megatron_grpo.generation.protocol import WeightReceiver
from megatron_grpo.wire.samples import RolloutError, Sample, SamplingParams

SERVER = "inprocess"
"""``Sample.server`` of the samples it generates (there is no URL)."""


def start_inprocess(engine_cfg: EngineConfig, *, model_dir: str) -> EmbeddedEngine:
    """Rank 0's engine on ``model_dir``'s weights, as the ``engine:`` section sets it up. No
    batching window: ``generate`` hands the engine whole batches."""
    return EmbeddedEngine(model_dir, dtype=engine_cfg.dtype, max_batch_size=engine_cfg.embedded.max_batch_size,
                          batch_window_s=0.0, device="auto",
                          quantization=scheme_of(engine_cfg.quantization, engine_cfg.fp8_format),
                          decode=engine_cfg.embedded.decode, stop_check_every=engine_cfg.embedded.stop_check_every)


def to_sample(seq: EngineSequence, prompt_index: int, sample_index: int, with_mask: bool,
              with_routing: bool) -> Sample:
    """A finished engine sequence -> Sample (what the HTTP client would parse from its answer,
    checked the same way: each kept set holds its token)."""
    kept = mass = None
    if with_mask:
        try:
            kept, mass = parse_sampling_mask({"sampling_mask": {"kept_ids": seq.output_kept_ids,
                                                                "log_kept_mass": seq.output_log_kept_mass}},
                                             seq.output_ids)
        except ValueError as e:
            raise RolloutError(SERVER, "generate", f"sampling mask malformed: {e}") from None
    routed = None
    if with_routing:
        if not seq.routed_blocks:  # a dense model: nothing was routed
            raise RolloutError(SERVER, "generate", "routed_experts asked for, but the model has no MoE layers")
        # int32 [prompt + response - 1, num_moe_layers * k], as routed_experts.decode gives it
        routed = seq.routed_experts.reshape(len(seq.prompt_ids) + len(seq.output_ids) - 1, -1).clone()
    reason = seq.finish_reason.get("type", "unknown") if isinstance(seq.finish_reason, dict) else "unknown"
    return Sample(prompt_index=prompt_index, sample_index=sample_index, prompt_ids=list(seq.prompt_ids),
                  output_ids=list(seq.output_ids), output_logprobs=[float(x) for x in seq.output_logprobs],
                  finish_reason=reason, weight_version=seq.weight_version, server=SERVER,
                  output_versions=[str(v) for v in seq.output_versions] if seq.output_versions else None,
                  routed_experts=routed, kept_ids=kept, log_kept_mass=mass)


class InProcessEngine:
    """A ``RolloutEngine`` in this process. ``engine``: rank 0's (None elsewhere); ``receiver``:
    every rank's half of the in-memory sync (None: fixed weights, e.g. evaluating a saved model);
    ``timeout_s``: the deadline of one ``generate`` call."""

    def __init__(self, engine: Optional[EmbeddedEngine], receiver: Optional[WeightReceiver], *,
                 timeout_s: float = 600.0):
        self.engine = engine
        self.receiver = receiver
        self.timeout_s = timeout_s

    @classmethod
    def spawn(cls, cfg: ExperimentConfig) -> None:
        """Nothing to start early: the engine is built in the trainer's process."""
        return None

    @classmethod
    def start(cls, cfg: ExperimentConfig, *, owner: bool = True, spawned: None = None) -> "InProcessEngine":
        """Rank 0's (``owner``) engine on the model's weights, built in this process; no weight
        sync yet (``receiver``)."""
        engine = start_inprocess(cfg.engine, model_dir=cfg.model.hf_dir) if owner else None
        return cls(engine, None, timeout_s=cfg.engine.request_timeout_s)

    @property
    def restarts_itself(self) -> bool:
        return False  # it cannot die apart from the trainer

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, *,
                 sampling_seed: Optional[int] = None, return_routed_experts: bool = False) -> list[Sample]:
        """``n`` samples per prompt, prompt-major; with ``sampling_seed`` response k (its index in
        the returned list) is seeded ``sampling_seed + k``, as the HTTP client seeds them."""
        with_mask = sampling.sampling_mask_max_kept > 0
        try:
            shared = resolve_sampling_params(sampling.to_json())
            seqs = []
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    params = shared if sampling_seed is None else resolve_sampling_params(
                        sampling.to_json(sampling_seed=sampling_seed + i * n + j))
                    seqs.append(EngineSequence(rid=f"{i}-{j}", prompt_ids=list(prompt), params=params,
                                               return_logprob=True, return_sampling_mask=with_mask,
                                               max_kept=max(sampling.sampling_mask_max_kept, 1),
                                               return_routed_experts=return_routed_experts))
        except ValueError as e:  # a refused request, as an HTTP engine's 400
            raise RolloutError(SERVER, "generate", str(e), status=400) from None
        self._run(seqs)
        return [to_sample(s, k // n, k % n, with_mask, return_routed_experts) for k, s in enumerate(seqs)]

    def _run(self, seqs: list[EngineSequence]) -> None:
        """Submit ``seqs`` and wait until every one finished, at most ``timeout_s``."""
        remaining = [len(seqs)]
        done = threading.Condition()

        def on_finish(_: EngineSequence) -> None:  # the scheduler thread (or a pause)
            with done:
                remaining[0] -= 1
                done.notify_all()

        for s in seqs:
            s.on_finish = on_finish
        try:
            self.engine.submit(seqs)
        except EngineError as e:  # refused at submission (a prompt past the context): an HTTP engine's 400
            raise RolloutError(SERVER, "generate", str(e), status=400) from None
        deadline = time.monotonic() + self.timeout_s
        with done:
            finished = done.wait_for(lambda: remaining[0] == 0, timeout=max(0.0, deadline - time.monotonic()))
        if not finished:
            self.engine.pause("abort")  # ends what is running or queued, so nothing outlives the call
            self.engine.resume()
            raise RolloutError(SERVER, "generate", f"no answer within {self.timeout_s:.0f}s")

    def abort_generation(self) -> None:
        """Rank 0: end the sequences running or queued (finish_reason abort); new ones are
        accepted. Ends asynchronous rollouts at the end of a run."""
        self.engine.pause("abort")
        self.engine.resume()

    def receive_weights(self, model_chunks: list, step: int) -> Any:
        return self.receiver.sync(model_chunks, step)

    def forget_weights(self) -> None:
        self.receiver.reset()

    def release_memory(self) -> None:
        raise RolloutError(SERVER, "release_memory", "the in-process engine cannot release its memory")

    def resume_memory(self, tags: Optional[list[str]] = None) -> None:
        raise RolloutError(SERVER, "resume_memory", "the in-process engine cannot release its memory")

    def restart_if_dead(self) -> bool:
        return False

    def close(self) -> None:
        """The receiver, then rank 0's engine (its scheduler thread joins)."""
        if self.receiver is not None:
            self.receiver.close()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
