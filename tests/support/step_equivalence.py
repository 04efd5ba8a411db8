"""One GRPO optimizer step on every rank, through the real Megatron schedule, DDP, optimizer and
loss (tests/test_trainer_step_equivalence.py compares layouts with it; test_vpp.py and
test_moe_trainer.py compare VPP and EP steps): ``one_step`` runs it on a fixed random batch
(``step_batch``) and returns the metrics, the updated HF weights and the old-policy log-probs."""

import torch

N_SEQ, GLOBAL_BATCH, MICRO = 8, 8, 2


def step_batch(groups: bool = False):
    """The step's rows: random prompts, or (``groups``) two GRPO groups of four rows sharing
    their prompt (``parallel.share_prefix``)."""
    from tests.support.batches import grouped_train_batch, random_train_batch

    return grouped_train_batch(2, N_SEQ // 2) if groups else random_train_batch(N_SEQ)


REGULARIZED = {"entropy_coef": 0.05, "kl_loss_coef": 0.05}
"""The CPU demo's entropy bonus (yaml_configs/demo_cpu.yaml) and its KL arm's weight (docs/history/benchmarks.md)."""


def one_step(rank, world, hf_dir, budget=None, skip_old=False, regularized=False, pack=False, full_logits=False,
             share=False, groups=False):
    """``full_logits``: the output layer runs on every position (as before the trainer cut its
    logits to the scored positions, ``megatron_step.first_scored``), for comparison. ``groups``:
    the grouped batch (``step_batch``); ``share``: packed rows share their prompts. The result's
    ``logit_positions``: the positions the output layer ran on, summed over this rank's forward
    steps (0 off the last stage)."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.trainer import megatron_step

    positions = []
    names = ("causal_logits", "packed_logits", "first_scored", "packed_scored")
    saved = {name: getattr(megatron_step, name) for name in names}

    def counting(forward):
        def counted(model, *args):
            out = forward(model, *args)
            if ps.is_pipeline_last_stage(ignore_virtual=False):
                positions.append(out.shape[1])
            return out
        return counted

    megatron_step.causal_logits = counting(saved["causal_logits"])
    megatron_step.packed_logits = counting(saved["packed_logits"])
    if full_logits:
        megatron_step.first_scored = lambda mask: 0
        megatron_step.packed_scored = lambda mb, packed: None
    try:
        result = _one_step(hf_dir, budget, skip_old, regularized, pack, share, groups)
    finally:
        for name, fn in saved.items():
            setattr(megatron_step, name, fn)
    return {**result, "logit_positions": sum(positions)}


def _one_step(hf_dir, budget, skip_old, regularized, pack, share=False, groups=False):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from megatron_grpo.models import iter_hf_weights
    from megatron_grpo.rollout.batch import dp_shard
    from tests.support.policy import build_test_policy
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch
    from megatron_grpo.trainer.microbatch import MicroBatching

    # SGD: the update is proportional to the gradient, so any gradient difference shows
    # (Adam's first step is ~lr*sign(g) and would hide a wrongly scaled gradient).
    policy = build_test_policy(ModelConfig(hf_dir=hf_dir, dtype="float32"),
                               OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0))
    algo = AlgorithmConfig(eps_clip_high=0.28, off_policy_correction={"tis_ratio_type": "token"},
                           **(REGULARIZED if regularized else {}))
    spec = ScoringSpec(temperature=0.7, vocab_size=policy.hf_config.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = step_batch(groups)
    local = dp_shard(full, dp_rank, dp, GLOBAL_BATCH)
    if regularized:  # a stand-in reference whose log-probs differ from the policy's: the KL has a gradient
        local.ref_log_probs = local.rollout_log_probs.clone()
    batching = MicroBatching(MICRO, budget, pack, share)
    old_lp = compute_log_probs(policy.chunks, local, batching, spec)
    if not skip_old:
        local.old_log_probs = old_lp
        if local.old_log_probs is None:  # not the last stage: the loss is computed elsewhere
            local.old_log_probs = torch.zeros_like(local.rollout_log_probs)
    metrics, applied, grad_norm = train_mini_batch(
        policy.chunks, policy.optimizer, local, algo, spec, batching, int(full.loss_mask.sum()),
        full.num_sequences, dp, ps.get_data_parallel_group())
    weights = {k: v.clone() for k, v in iter_hf_weights(policy.modules, policy.hf_config)}
    return {"metrics": metrics, "applied": applied, "grad_norm": grad_norm, "weights": weights,
            "old_lp": old_lp, "pp_rank": ps.get_pipeline_model_parallel_rank()}


def merged_weights(results):
    """The HF weights of all ranks' ``one_step`` results in one dict."""
    merged = {}
    for r in results:
        merged.update(r["weights"])
    return merged


def initial_weights(hf_dir):
    """The HF directory's weights before any step."""
    from safetensors.torch import load_file

    return load_file(f"{hf_dir}/model.safetensors")


def policy_step(policy):
    """One optimizer step of the corrected loss on ``step_batch()``'s rows of this DP rank, with
    ``policy``'s own optimizer (tests that need real optimizer state: bf16 main weights, a
    checkpoint holding Adam's moments). Returns ``train_mini_batch``'s result."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig
    from megatron_grpo.rollout.batch import dp_shard
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch

    algo = AlgorithmConfig(eps_clip_high=0.28, off_policy_correction={"tis_ratio_type": "token"})
    spec = ScoringSpec(temperature=0.7, vocab_size=policy.hf_config.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = step_batch()
    local = dp_shard(full, dp_rank, dp, GLOBAL_BATCH)
    local.old_log_probs = compute_log_probs(policy.chunks, local, MICRO, spec)
    if local.old_log_probs is None:  # not the last stage
        local.old_log_probs = torch.zeros_like(local.rollout_log_probs)
    return train_mini_batch(policy.chunks, policy.optimizer, local, algo, spec, MICRO,
                            int(full.loss_mask.sum()), full.num_sequences, dp, ps.get_data_parallel_group())

