"""`rollout:` section: what each step generates: the group size, prompts per step, sampling,
the rollout schedule (sync, one step off-policy, async) and DAPO's batch shaping. The engine
that generates is `engine:` (config/engine.py), the weight sync `sync:` (config/sync.py), and
multi-turn episodes or a custom rollout function `episodes:` (config/episodes.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_grpo.config.base import check
from megatron_grpo.config.dapo import DynamicSamplingConfig, OverlongConfig


@dataclass(kw_only=True)
class RolloutConfig:
    """`rollout:` the rollout batch, its sampling and schedule."""

    num_generations: int = 8
    """Responses sampled per prompt (the GRPO group size)."""

    prompts_per_step: int = 4
    """Prompts per rollout batch; the batch holds prompts_per_step * num_generations sequences."""

    max_new_tokens: int = 64
    """Maximum response length in tokens."""

    temperature: float = 1.0
    """Sampling temperature; the trainer scores log_softmax(logits / temperature) to match."""

    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""

    top_k: int = -1
    """Top-k sampling (-1 = off)."""

    min_p: float = 0.0
    """Min-p sampling: tokens below min_p times the most likely token's probability are cut (0 = off)."""

    sampling_mask_replay: bool = True
    """With truncated sampling (top_p < 1, top_k > 0 or min_p > 0): the engine reports the set of
    tokens each draw could pick and the trainer scores the same renormalised, truncated
    distribution (the log-probs, ratios, KL and entropy of the policy that generated the data;
    docs/loss_spec.md). false: both sides report the full distribution (the ratios are then
    computed against a distribution the engine did not sample from). SGLang reports its sets
    only with 1 < top_k <= sampling_mask_max_kept (docs/off_policy.md)."""

    sampling_mask_max_kept: int = 1024
    """Most kept-set ids the engine sends per sampled token. Embedded engine: a larger set is not
    sent and that token is scored on the full distribution (counted in
    rollout/sampling_mask_unsent_frac). SGLang: its --sampling-mask-max-tokens; a larger support
    aborts the request."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (the tokenizer's EOS always does)."""

    mode: Literal["sync", "one_step_off_policy", "async"] = "sync"
    """sync: every step generates with the weights trained so far, then trains (policy lag 0).
    one_step_off_policy: the engine generates step k+1's batch while the trainer trains on step
    k, so every batch after the first is sampled by weights one step old (policy lag 1); the
    loss's pi_old is the trainer's recomputed log-probs and the engine's log-probs are the
    behaviour policy (turn on algorithm.off_policy_correction). Not with engine.colocate.
    async: rank 0 keeps the engine generating groups continuously; each step trains on the
    first prompts_per_step whole groups to finish, none started more than max_staleness
    versions before the trained one; a weight sync retracts the sequences in flight, which
    resume with the new weights, each token recording its version and log-prob
    (docs/off_policy.md, "Asynchronous rollouts"). The embedded, in-process or SGLang engine;
    not with engine.colocate or dynamic_sampling."""

    max_staleness: int = 1
    """rollout.mode async: the largest policy lag of a trained token (step s trains only samples
    whose first token was drawn by weights of version >= s - max_staleness). >= 1."""

    stale_groups: Literal["regenerate", "drop"] = "regenerate"
    """rollout.mode async: what happens to a finished group over max_staleness: regenerate its
    prompt with the current weights, or drop it (the prompt is skipped). Counted either way."""

    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling: drop zero-variance groups, sample until the batch is full."""

    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO soft overlong punishment and overlong filter."""

    def __post_init__(self):
        bl = self.overlong.buffer_length
        check(bl is None or bl <= self.max_new_tokens, "overlong.buffer_length",
              f"{bl} exceeds max_new_tokens = {self.max_new_tokens}")
        check(not self.dynamic_sampling.enabled or self.num_generations > 1, "dynamic_sampling.enabled",
              "needs num_generations > 1 (a group of one has no reward variance)")
        for key in ("num_generations", "prompts_per_step", "max_new_tokens"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 or >= 1, got {self.top_k}")
        check(0 <= self.min_p < 1, "min_p", f"must be in [0, 1), got {self.min_p}")
        check(self.sampling_mask_max_kept >= 1, "sampling_mask_max_kept",
              f"must be >= 1, got {self.sampling_mask_max_kept}")
        check(self.max_staleness >= 1, "max_staleness", f"must be >= 1, got {self.max_staleness}")
        check(self.mode != "async" or not self.dynamic_sampling.enabled, "mode",
              "async cannot be combined with dynamic_sampling.enabled (a group is trained as it finishes; "
              "there are no extra rounds); set one of them off")
        # the checks against the other sections (episodes, engine) are ExperimentConfig's and the
        # pre-flight's (preflight/rules.py)

    @property
    def truncates(self) -> bool:
        """The engine samples from a truncated distribution (top-k, top-p or min-p)."""
        return self.top_p < 1 or self.top_k != -1 or self.min_p > 0

    @property
    def batch_size(self) -> int:
        """Sequences per rollout batch."""
        return self.prompts_per_step * self.num_generations
