"""Sampling semantics of the embedded engine against hand-computed numbers (SGLang's rules)."""

import math

import pytest
import torch

from megatron_grpo.inference.sampling import (
    TOP_K_ALL,
    filter_sorted_probs,
    inverse_cdf,
    resolve_sampling_params,
    sample_next,
)


def test_greedy_and_defaults_follow_sglang():
    greedy = resolve_sampling_params({"temperature": 0.0})
    assert (greedy.temperature, greedy.top_k) == (1.0, 1)  # SGLang: greedy = top-1 at T=1
    default = resolve_sampling_params({})
    assert (default.temperature, default.top_p, default.top_k, default.max_new_tokens) == (1.0, 1.0, TOP_K_ALL, 128)
    with pytest.raises(ValueError, match="top_p"):
        resolve_sampling_params({"top_p": 0})
    with pytest.raises(ValueError, match="frequency_penalty"):
        resolve_sampling_params({"frequency_penalty": 0.5})
    with pytest.raises(ValueError, match="unknown"):
        resolve_sampling_params({"temprature": 1.0})
    assert resolve_sampling_params({"frequency_penalty": 0.0, "stop": None}).n == 1  # defaults pass


def test_filter_hand_computed():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    top_k = torch.tensor([TOP_K_ALL, 2, TOP_K_ALL, TOP_K_ALL])
    top_p = torch.tensor([0.7, 1.0, 1.0, 0.85])
    min_p = torch.tensor([0.0, 0.0, 0.2, 0.0])
    kept = filter_sorted_probs(probs, top_k, top_p, min_p)
    # exclusive cumsum = [0, .5, .8, .95]: top_p .7 keeps ranks with exclusive mass <= .7
    assert kept[0].tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert kept[1].tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])  # top_k 2
    assert kept[2].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.0])  # min_p .2 * .5 = .1 drops .05
    assert kept[3].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.0])  # .8 <= .85 < .95


def test_inverse_cdf_hand_computed():
    weights = torch.tensor([[0.5, 0.3, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 0.6, 0.7, 0.999999])
    # targets u * 0.8 = [0, .48, .56, ~.8]; cdf = [.5, .8, .8, .8]
    assert inverse_cdf(weights, u).tolist() == [0, 0, 1, 1]


def test_sample_next_logprob_is_temperature_scaled_and_unfiltered():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.1, 3.0, 0.2, 0.3]])
    temperature = torch.tensor([0.5, 1.0])
    tokens, logprobs = sample_next(logits, temperature, torch.tensor([2, 1]), torch.tensor([1.0, 1.0]),
                                   torch.tensor([0.0, 0.0]), torch.tensor([0.9, 0.5]))
    # row 0: softmax(logits/.5) = exp([4,2,1,-2]) / Z; top-2 keeps tokens 0,1; u=.9 picks token 1
    z = math.exp(4) + math.exp(2) + math.exp(1) + math.exp(-2)
    assert tokens.tolist() == [1, 1]  # row 1 is greedy (top_k=1): argmax
    assert logprobs[0].item() == pytest.approx(2 - math.log(z), abs=1e-6)
    z1 = sum(math.exp(x) for x in [0.1, 3.0, 0.2, 0.3])
    assert logprobs[1].item() == pytest.approx(3.0 - math.log(z1), abs=1e-6)


def test_sampling_frequencies_match_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    n = logits.shape[0]
    tokens, _ = sample_next(logits, torch.ones(n), torch.full((n,), TOP_K_ALL), torch.full((n,), 0.85),
                            torch.zeros(n), torch.rand(n, dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=4).double() / n
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert torch.allclose(freq, expected.double(), atol=0.015), freq
