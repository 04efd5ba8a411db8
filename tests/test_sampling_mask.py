"""Top-k/top-p/min-p sampling-mask replay: the engine's kept sets, the trainer's truncated
log-probs, and the run's metrics.

* the vocab-parallel op with ``kept_ids`` against a float64 full-vocabulary reference that
  renormalises over the same sets, at tp = 1 and 2, padded vocabulary, temperature != 1, a
  token whose set lies wholly on one rank, an untruncated token, and gradients;
* the embedded engine's kept set is SGLang's joint top-k/top-p/min-p rule on the
  unrenormalised probabilities, always holds the sampled token, and ties at the threshold are
  cut by the sort order the draw itself used;
* the kept set is the engine's: with the trainer's logits perturbed as bf16 perturbs them, a
  sampled token near the threshold keeps a finite log-prob (a set rebuilt from the trainer's
  own logits would drop it).
"""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.ops import vocab_parallel_log_probs
from megatron_grpo.ops.vocab_parallel import kept_column_mask
from megatron_grpo.inference.sampling import sample_tokens
from tests.support.distributed import run_distributed
from megatron_grpo.config import EngineConfig, RolloutConfig
from tests.support.configs import experiment

PADDED, VOCAB, TEMPERATURE, K = 64, 58, 0.7, 9
NUM_TOKENS = 6


def _inputs(seed: int = 0):
    """Full logits [N, PADDED] (padded columns junk), targets [N], kept ids [N, K] (-1 pads)
    and loss weights: token 0 is untruncated, token 1 keeps only ids of the first half (tp=2:
    rank 1 holds none of its set), token 2 keeps the target alone."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(NUM_TOKENS, PADDED, generator=gen) * 3.0
    targets = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=gen)
    targets[1] = 5
    kept = torch.full((NUM_TOKENS, K), -1, dtype=torch.long)
    for t in range(2, NUM_TOKENS):
        others = torch.randperm(VOCAB, generator=gen)[: K - 1 - t % 3]
        ids = torch.unique(torch.cat([others, targets[t : t + 1]]))
        kept[t, : len(ids)] = ids
    kept[1, :4] = torch.tensor([0, 5, 17, 30])
    kept[2] = -1
    kept[2, 0] = targets[2]
    w_lp, w_h = torch.randn(2, NUM_TOKENS, generator=gen, dtype=torch.float64)
    return logits, targets, kept, w_lp, w_h


def _reference():
    """float64 log q(target), H(q) with q renormalised over each kept set, and the gradient of
    sum(w_lp * log q + w_h * H) w.r.t. the full logits [N, PADDED]."""
    logits, targets, kept, w_lp, w_h = _inputs()
    full = logits.double().requires_grad_()
    lps, entropies = [], []
    for t in range(NUM_TOKENS):
        ids = kept[t][kept[t] >= 0]
        ids = torch.arange(VOCAB) if len(ids) == 0 else ids
        log_q = torch.log_softmax(full[t, ids] / TEMPERATURE, dim=-1)
        lps.append(log_q[(ids == targets[t]).nonzero()[0, 0]])
        entropies.append(-(log_q.exp() * log_q).sum())
    lp, entropy = torch.stack(lps), torch.stack(entropies)
    (w_lp * lp + w_h * entropy).sum().backward()
    return lp.detach(), entropy.detach(), full.grad


def _worker(rank: int, tp: int):
    logits, targets, kept, w_lp, w_h = _inputs()
    shard = PADDED // tp
    mine = logits[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()
    lp, entropy = vocab_parallel_log_probs(mine, targets, temperature=TEMPERATURE, vocab_size=VOCAB,
                                           chunk_size=2, kept_ids=kept)
    (w_lp * lp.double() + w_h * entropy.double()).sum().backward()
    return lp.detach(), entropy.detach(), mine.grad


@pytest.mark.parametrize("tp", [1, 2])
def test_truncated_log_probs_match_full_vocab_reference(tp):
    per_rank = run_distributed(_worker, tp, tp=tp, timeout_s=300)
    ref_lp, ref_h, ref_grad = _reference()
    for lp, entropy, _ in per_rank:
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(entropy.double(), ref_h, rtol=1e-6, atol=1e-7)
    grad = torch.cat([g for _, _, g in per_rank], dim=-1).double()
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    _, _, kept, _, _ = _inputs()
    outside = ~kept_column_mask(kept, 0, PADDED)
    assert (grad[outside] == 0).all(), "columns outside the kept set got gradient"
    assert ref_lp[2] == 0 and ref_h[2] == 0  # a set of one token: certain


def test_kept_column_mask_per_rank():
    kept = torch.tensor([[3, 9, -1], [-1, -1, -1], [12, 0, 5]])
    assert kept_column_mask(kept, 0, 8).tolist() == [
        [c in (3,) for c in range(8)], [True] * 8, [c in (0, 5) for c in range(8)]]
    assert kept_column_mask(kept, 8, 8).tolist() == [
        [c + 8 in (9,) for c in range(8)], [True] * 8, [c + 8 in (12,) for c in range(8)]]


def _kept_by_rule(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """SGLang's joint rule written out per token: rank < top_k, exclusive cumulative mass <=
    top_p, prob >= min_p * max, in descending order (stable sort: ties by id)."""
    order = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    kept, mass = set(), 0.0
    for rank, i in enumerate(order):
        p = float(probs[i])
        if rank < top_k and mass <= top_p and p >= min_p * float(probs[order[0]]) and p > 0:
            kept.add(i)
        mass += p
    return kept


@pytest.mark.parametrize("top_k, top_p, min_p", [(5, 1.0, 0.0), (1 << 30, 0.7, 0.0), (1 << 30, 1.0, 0.2),
                                                 (4, 0.8, 0.05)])
def test_engine_kept_set_is_sglangs_joint_rule_and_holds_the_sampled_token(top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 40, generator=gen) * 2.0
    temperature = torch.full((16,), 0.8)
    args = (torch.full((16,), top_k), torch.full((16,), top_p), torch.full((16,), min_p))
    draw = sample_tokens(logits, temperature, *args, torch.rand(16, generator=gen), with_kept=True, max_kept=64)
    tokens, truncation = draw.tokens, draw.truncation
    probs = torch.softmax(logits / 0.8, dim=-1)
    for row in range(16):
        kept = truncation.kept_ids[row]
        assert set(kept) == _kept_by_rule(probs[row], top_k, top_p, min_p)
        assert int(tokens[row]) in kept
        mass = float(probs[row, kept].double().sum())
        assert truncation.log_kept_mass[row] == pytest.approx(torch.tensor(mass).log().item(), abs=1e-6)


def test_ties_at_the_top_k_threshold_are_cut_by_the_draws_own_order():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])  # ids 1, 2, 3 tie for ranks 1-3; top_k = 2
    truncation = sample_tokens(logits, torch.ones(1), torch.tensor([2]), torch.ones(1), torch.zeros(1),
                                   torch.tensor([0.99]), with_kept=True, max_kept=8).truncation
    (kept,) = truncation.kept_ids
    assert len(kept) == 2 and 0 in kept and kept[1] in (1, 2, 3)


def test_a_set_over_the_budget_is_not_sent_and_counted():
    logits = torch.zeros(2, 50)  # uniform: top_p 0.9 keeps 45 tokens
    truncation = sample_tokens(logits, torch.ones(2), torch.full((2,), 1 << 30), torch.full((2,), 0.9),
                                   torch.zeros(2), torch.rand(2), with_kept=True, max_kept=10).truncation
    assert truncation.kept_ids == [None, None]
    assert truncation.log_kept_mass == pytest.approx([torch.tensor(0.9).log().item()] * 2, abs=0.03)


def test_the_engines_set_keeps_a_sampled_token_the_trainers_logits_would_cut():
    # Token 2 is just inside top_p = 0.6 on the engine's logits. bf16-like noise on the
    # trainer's side pushes it just outside: a set rebuilt from the trainer's logits drops it
    # (log-prob -inf); the engine's set keeps it and the log-prob is finite.
    engine_logits = torch.tensor([[2.0, 1.0, 0.75, 0.0, -1.0]])
    probs = torch.softmax(engine_logits, dim=-1)[0]
    top_p = float(probs[:2].sum()) + 1e-4  # token 2's exclusive mass is just <= top_p
    truncation = sample_tokens(engine_logits, torch.ones(1), torch.tensor([1 << 30]), torch.tensor([top_p]),
                                   torch.zeros(1), torch.tensor([0.999]), with_kept=True, max_kept=8).truncation
    assert 2 in truncation.kept_ids[0]
    trainer_logits = engine_logits + torch.tensor([[0.0, 0.004, -0.004, 0.0, 0.0]])  # bf16-sized
    rebuilt = sample_tokens(trainer_logits, torch.ones(1), torch.tensor([1 << 30]), torch.tensor([top_p]),
                            torch.zeros(1), torch.tensor([0.5]), with_kept=True, max_kept=8).truncation.kept_ids[0]
    assert 2 not in rebuilt  # the failure the engine's set avoids
    kept = torch.tensor([truncation.kept_ids[0] + [-1] * (8 - len(truncation.kept_ids[0]))])
    lp, _ = vocab_parallel_log_probs(trainer_logits, torch.tensor([2]), kept_ids=kept)
    assert torch.isfinite(lp).all() and float(lp) > -3


# ---- through the real embedded server, the client and the trainer's batch --------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model_dir, client, hf_model) of a launched embedded engine on a tiny Llama."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.generation.client import RolloutClient
    from megatron_grpo.generation.manager import RolloutServerManager
    from tools.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5))
    cfg = experiment(engine=EngineConfig(kind="embedded", dtype="float32", launch_timeout_s=600, request_timeout_s=120))
    manager = RolloutServerManager(cfg, model_dir=model_dir, run_dir=tmp_path_factory.mktemp("run"))
    try:
        (url,) = manager.start()
        client = RolloutClient([url], request_timeout_s=120, max_retries=2)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        yield model_dir, client, hf
        client.close()
    finally:
        manager.stop()


@pytest.mark.slow
def test_engine_and_trainer_both_score_the_truncated_distribution(served):
    from megatron_grpo.wire.samples import SamplingParams

    _, client, hf = served
    temperature = 0.8
    sampling = SamplingParams(temperature=temperature, top_p=0.7, top_k=20, max_new_tokens=10,
                              sampling_mask_max_kept=64)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    samples = client.generate(prompts, 4, sampling, sampling_seed=11)
    assert all(s.finish_reason in ("stop", "length") for s in samples), [s.finish_reason for s in samples]
    assert max(len(s.output_ids) for s in samples) == 10
    assert _sets_off_the_rule(samples, hf, temperature, 20, 0.7, tolerance=1e-5) == 0


def _sets_off_the_rule(samples, hf, temperature: float, top_k: int, top_p: float, tolerance: float) -> int:
    """Checks the engine's truncated log-probs of ``samples`` against the trainer's op over the
    same kept sets on ``hf``'s logits (within ``tolerance``; the full-distribution ones differ),
    and returns how many kept sets differ from SGLang's joint rule on those logits."""
    from megatron_grpo.rollout.batch import build_train_batch, pad_kept_ids, truncated_log_probs

    masses = [m for s in samples for m in s.log_kept_mass]
    assert max(masses) <= 1e-6 and sum(masses) / len(masses) < -0.05, masses  # top_p cuts real mass
    rollout_lp = [truncated_log_probs(s.output_logprobs, s.kept_ids, s.log_kept_mass) for s in samples]
    batch = build_train_batch([s.prompt_ids for s in samples], [s.output_ids for s in samples], rollout_lp,
                              torch.zeros(len(samples)), pad_id=0)
    batch.kept_ids = pad_kept_ids([len(s.prompt_ids) for s in samples], [s.kept_ids for s in samples],
                                  batch.seq_length)
    with torch.no_grad():
        logits = hf(batch.tokens).logits[:, :-1]
    trainer_lp, _ = vocab_parallel_log_probs(logits, batch.tokens[:, 1:], temperature=temperature,
                                             kept_ids=batch.kept_ids)
    mask = batch.loss_mask.bool()
    diff = (trainer_lp - batch.rollout_log_probs)[mask].abs()
    assert diff.max() < tolerance, diff.max()  # fp32 agreement, both of the truncated distribution
    full_lp, _ = vocab_parallel_log_probs(logits, batch.tokens[:, 1:], temperature=temperature)
    assert (full_lp - batch.rollout_log_probs)[mask].abs().mean() > 0.05  # what no replay would log
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return sum(set(ids) != _kept_by_rule(probs[i, len(s.prompt_ids) - 1 + j], top_k, top_p, 0.0)
               for i, s in enumerate(samples) for j, ids in enumerate(s.kept_ids))


@pytest.mark.slow
def test_sglang_and_trainer_both_score_the_truncated_distribution(demo, sglang_servers):
    """The same check against the real SGLang (the session's shared server, the demo model):
    its support sets and renormalised log-probs, through the client, are what the trainer's op
    scores with the sets, to fp32 level."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.generation.client import RolloutClient
    from megatron_grpo.wire.samples import SamplingParams
    from tests.support.sglang_shared import API_KEY

    model_dir = demo / "model"
    url = sglang_servers.serve(model_dir)
    client = RolloutClient([url], api_key=API_KEY, request_timeout_s=120, max_retries=2,
                           mask_budget_per_request=False)  # as start_servers builds it for SGLang
    temperature, top_k, top_p = 1.3, 20, 0.7  # hot enough that the demo model's sets hold several ids
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=10,
                              ignore_eos=True, sampling_mask_max_kept=64)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    try:
        samples = client.generate(prompts, 4, sampling, sampling_seed=11)
    finally:
        client.close()
    assert all(len(s.output_ids) == 10 for s in samples), [s.finish_reason for s in samples]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    # SGLang's sets are its joint rule on its own logits: the same as on transformers' logits but
    # where a probability sits within rounding of the cut
    assert _sets_off_the_rule(samples, hf, temperature, top_k, top_p, tolerance=1e-4) <= 1


def test_a_kept_set_without_its_token_is_refused():
    from megatron_grpo.generation.client import parse_sampling_mask

    meta = {"sampling_mask": {"kept_ids": [[3, 4], [7]], "log_kept_mass": [-0.1, -0.2]}}
    assert parse_sampling_mask(meta, [4, 7]) == ([[3, 4], [7]], [-0.1, -0.2])
    with pytest.raises(ValueError, match="token 1 .* not in its own kept set"):
        parse_sampling_mask(meta, [4, 8])
    with pytest.raises(ValueError, match="3 tokens"):
        parse_sampling_mask(meta, [4, 7, 9])


# ---- the run ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_with_top_p_logs_the_kept_mass_and_an_fp32_mismatch(demo, tmp_path):
    """The real `megatron-grpo train` (TP=2, the in-process engine) at top_p 0.7: both sides
    describe the truncated distribution, so the logged mismatch stays at fp32 level while the
    kept mass shows the truncation. The kept sets over HTTP are the launched embedded engine's
    test above (``served``) and, in a training run, the real SGLang's below."""
    _train_truncated(demo, tmp_path / "run", 4, "rollout.top_p=0.7", "engine.kind=inprocess")


def _train_truncated(demo, run_dir, steps: int, *overrides: str) -> None:
    """A demo run with truncated sampling: every step logs the kept mass of a real cut, every
    set sent, and a train/rollout mismatch at fp32 level."""
    import subprocess

    from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd

    proc = subprocess.run(train_cmd(demo, run_dir, steps, "eval.every_n_steps=0", *overrides), cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(run_dir)
    assert len(records) == steps
    for r in records:
        assert r["rollout/log_kept_mass_mean"] < -0.05
        assert r["rollout/sampling_mask_unsent_frac"] == 0.0
        assert r["rollout_train_logprobs_abs_diff_mean"] < 1e-5


@pytest.mark.slow
def test_demo_on_the_real_sglang_with_top_k_and_top_p_replays_its_sets(demo, tmp_path, sglang_servers):
    """The same run against the real SGLang (the shared server): its sets reach the trainer,
    which scores the truncated distribution too."""
    url = sglang_servers.serve(demo / "model")
    _train_truncated(demo, tmp_path / "run", 3, "rollout.top_p=0.7", "rollout.top_k=20", "rollout.temperature=1.3",
                     *sglang_servers.train_overrides(url))


def test_sglang_replays_the_mask_only_with_a_bounded_top_k():
    from megatron_grpo.config.base import ConfigError
    from megatron_grpo.preflight.rules import check_engine

    sglang = EngineConfig(kind="sglang", urls=["http://127.0.0.1:1"])
    for bad in ({"top_p": 0.8}, {"top_p": 0.8, "top_k": 2000}, {"min_p": 0.1, "top_k": 1}):
        with pytest.raises(ConfigError, match="rollout.top_k.*replays the sampling mask only with 1 < top_k <= "
                                              r"rollout.sampling_mask_max_kept \(1024\)"):
            check_engine(experiment(rollout=RolloutConfig(**bad), engine=sglang))
    check_engine(experiment(rollout=RolloutConfig(top_p=0.8, top_k=100), engine=sglang))
    check_engine(experiment(rollout=RolloutConfig(top_p=0.8, sampling_mask_replay=False), engine=sglang))
    check_engine(experiment(engine=sglang))  # no truncation: nothing to replay
    # the embedded engine sends any set
    check_engine(experiment(rollout=RolloutConfig(top_p=0.8), engine=EngineConfig(kind="embedded")))


def test_sglang_sampling_mask_answer_gives_kept_sets_and_masses():
    from megatron_grpo.generation.client import parse_sampling_mask

    meta = {"output_token_sampling_mask": [[4, 3], [7]], "output_token_sampling_logprobs": [-0.25, 0.0]}
    kept, mass = parse_sampling_mask(meta, [4, 7], [-0.75, -1.5])
    assert kept == [[4, 3], [7]] and mass == [-0.5, -1.5]  # log p(x) - log q(x) = log kept mass
    with pytest.raises(ValueError, match="token 1 .* not in its own kept set"):
        parse_sampling_mask(meta, [4, 8], [-0.75, -1.5])
    with pytest.raises(ValueError, match="2 sampling log-probs for 3 output log-probs"):
        parse_sampling_mask(meta, [4, 7, 9], [-0.75, -1.5, -1.0])


def test_multi_turn_observation_tokens_carry_no_set_and_no_mass():
    """An episode's observation tokens (output_mask 0) are context: no kept set (scored on the
    full distribution, with no loss), log-prob 0, and out of the kept-mass metrics."""
    from megatron_grpo.wire.samples import Sample
    from megatron_grpo.rollout.batch import pad_kept_ids, truncated_log_probs
    from megatron_grpo.rollout.generate import _mask_stats

    episode = Sample(prompt_index=0, sample_index=0, prompt_ids=[1, 2], output_ids=[5, 9, 9, 6],
                     output_logprobs=[-1.0, 0.0, 0.0, -2.0], finish_reason="stop", weight_version="0",
                     output_mask=[1, 0, 0, 1], kept_ids=[[5, 7], None, None, [6]], log_kept_mass=[-0.5, 0.0, 0.0, -0.25])
    assert truncated_log_probs(episode.output_logprobs, episode.kept_ids, episode.log_kept_mass) == [-0.5, 0.0, 0.0, -1.75]
    assert _mask_stats([episode]) == {"rollout/log_kept_mass_mean": -0.375, "rollout/sampling_mask_unsent_frac": 0.0}
    kept = pad_kept_ids([2], [episode.kept_ids], 6)
    assert kept[0, :, 0].tolist() == [-1, 5, -1, -1, 6] and kept[0, 1].tolist() == [5, 7]
