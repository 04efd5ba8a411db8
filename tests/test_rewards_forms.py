"""Every form a reward function can take: whole sample / named fields / the original
(response, answer) pair, batch functions, async functions run concurrently (bounded), and
file-path functions loaded without PYTHONPATH. The remote reward is in test_rewards_remote.py."""

import asyncio
import json

import pytest

from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.config.sections import RewardConfig
from megatron_grpo.data import load_prompt_dataset
from megatron_grpo.config.sections import DataConfig
from megatron_grpo.rewards import RewardError, RewardSample, RewardScorer
from megatron_grpo.wire.samples import Sample
from tools.tiny import build_tokenizer
from megatron_grpo.rewards.sample import reward_samples

FORMS = """
import asyncio

def whole(sample):
    # a reward on token ids: no tokenizer copy needed
    return float(len(sample.response_ids)) + (0.5 if sample.finish_reason == "length" else 0.0)

def fields(response_ids, row, answer, *, bonus=0.0):
    return float(row["difficulty"] == "hard") + bonus + (answer == "7")

def legacy(text, ref, scale=1.0):
    return scale * (text.strip() == ref)

def batch(samples, offset=0.0):
    return [offset + i for i, _ in enumerate(samples)]

def short_batch(samples):
    return [1.0]

async def async_batch(samples):
    await asyncio.sleep(0)
    return [float(len(s.prompt_ids)) for s in samples]

def mixes(samples, response):
    return []

class Barrier:
    # each call waits until `parties` calls are inside at once: only concurrent calls pass
    def __init__(self):
        self.reset(2)

    def reset(self, parties):
        self.parties, self.inside, self.peak, self.event = parties, 0, 0, None

    async def __call__(self, sample):
        if self.event is None:
            self.event = asyncio.Event()
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        if self.inside >= self.parties:
            self.event.set()
        try:
            await asyncio.wait_for(self.event.wait(), 2.0)
        finally:
            self.inside -= 1
        return 1.0

barrier = Barrier()

async def peak_probe(sample):
    barrier.inside += 1
    barrier.peak = max(barrier.peak, barrier.inside)
    for _ in range(3):
        await asyncio.sleep(0)
    barrier.inside -= 1
    return 0.0
"""


@pytest.fixture
def forms(python_module):
    import importlib

    name = python_module("reward_forms", FORMS)
    return importlib.import_module(name)


def scorer(*functions):
    return RewardScorer(build_section(RewardConfig, {"functions": list(functions)}, "reward"))


def sample(**kw):
    base = dict(prompt="what is 3 + 4 ?", response="7", answer="7", response_ids=[9, 2],
                prompt_ids=[5, 6, 7], finish_reason="stop", row={"difficulty": "hard"})
    return RewardSample(**{**base, **kw})


def test_whole_sample_named_fields_and_legacy_pair(forms):
    s = scorer({"name": "reward_forms.whole"}, {"name": "reward_forms.fields", "kwargs": {"bonus": 0.25}},
               {"name": "reward_forms.legacy", "kwargs": {"scale": 2.0}})
    out = s.score_samples([sample(), sample(response="8", answer="8", response_ids=[1, 2, 3], finish_reason="length",
                                           row={"difficulty": "easy"})])
    assert out.per_function == {
        "whole": [2.0, 3.5],
        "fields": [2.25, 0.25],
        "legacy": [2.0, 2.0],
    }
    # the text-only entry point still works for (response, answer) functions
    assert scorer({"name": "reward_forms.legacy"}).score(["7 ", "x"], ["7", "7"]).rewards == [1.0, 0.0]


def test_fields_come_from_the_dataset_row_and_the_engine_sample(forms, tmp_path):
    """The rollout step's samples: prompt text and ids from the dataset (extra columns kept),
    response ids and finish reason from the engine, the text decoded without special tokens."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "what is 3 + 4 ?", "answer": "7", "difficulty": "hard", "id": 17}) + "\n")
    tok = build_tokenizer()
    prompts = load_prompt_dataset(DataConfig(train_file=str(data)), tok).prompts
    out_ids = tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    engine = [Sample(prompt_index=0, sample_index=0, prompt_ids=prompts[0].prompt_ids, output_ids=out_ids,
                     output_logprobs=[0.0] * len(out_ids), finish_reason="stop", weight_version="0")]
    (got,) = reward_samples(prompts, engine, tok)
    assert got.response == "7" and got.response_ids == out_ids and got.finish_reason == "stop"
    assert got.prompt == prompts[0].text and got.prompt_ids == prompts[0].prompt_ids
    assert got.row == {"difficulty": "hard", "id": 17}
    assert scorer({"name": "reward_forms.fields"}).score_samples([got]).rewards == [2.0]


def test_batch_functions_sync_and_async(forms):
    s = scorer({"name": "reward_forms.batch", "kwargs": {"offset": 10.0}}, {"name": "reward_forms.async_batch"})
    out = s.score_samples([sample(), sample(prompt_ids=[1]), sample(prompt_ids=[])])
    assert out.per_function == {"batch": [10.0, 11.0, 12.0], "async_batch": [3.0, 1.0, 0.0]}
    with pytest.raises(RewardError) as e:
        scorer({"name": "reward_forms.short_batch"}).score_samples([sample(), sample()])
    assert str(e.value) == ("reward.functions[0] (reward_forms.short_batch) returned 1 values for 2 samples; "
                            "a batch function returns one number per sample")


def test_async_calls_overlap(forms):
    """Both calls must be inside the function at once to pass its barrier: a sequential scorer
    would time out in the first call."""
    forms.barrier.reset(parties=4)
    out = scorer({"name": "reward_forms.barrier"}).score_samples([sample()] * 4)
    assert out.rewards == [1.0] * 4 and forms.barrier.peak == 4


def test_async_concurrency_is_bounded(forms):
    forms.barrier.reset(parties=3)
    with pytest.raises(RewardError, match=r"^reward.functions\[0\] \(reward_forms.barrier\) raised on sample 0: "
                                          r"TimeoutError"):
        scorer({"name": "reward_forms.barrier", "max_concurrency": 2}).score_samples([sample()] * 3)
    assert forms.barrier.peak == 2
    forms.barrier.reset(parties=1)
    scorer({"name": "reward_forms.peak_probe", "max_concurrency": 3}).score_samples([sample()] * 10)
    assert forms.barrier.peak == 3


def test_file_path_reward_needs_no_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_reward.py").write_text("def ids_len(response_ids):\n    return len(response_ids)\n")
    monkeypatch.chdir(tmp_path)
    absolute = scorer({"name": f"{tmp_path}/sub/my_reward.py:ids_len"})
    relative = scorer({"name": "sub/my_reward.py:ids_len"})  # against the current directory
    assert absolute.score_samples([sample()]).rewards == relative.score_samples([sample()]).rewards == [2.0]
    assert absolute.functions[0].call.fn is relative.functions[0].call.fn  # loaded once per process


@pytest.mark.parametrize("name, source, expected", [
    ("nope/missing.py:fn", None, "reward.functions[0].name: reward file {d}/nope/missing.py not found (a relative "
                                 "path is resolved against the current directory {d})"),
    ("bad.py:fn", "raise RuntimeError('no\\nway')", "reward.functions[0].name: cannot load reward file {d}/bad.py: "
                                                   "RuntimeError: no way"),
    ("attr.py:fn", "x = 1", "reward.functions[0].name: reward file {d}/attr.py has no attribute 'fn'"),
    ("attr2.py:x", "x = 1", "reward.functions[0].name: 'attr2.py:x' is a int, not a function"),
])
def test_file_path_errors_name_the_key(tmp_path, monkeypatch, name, source, expected):
    if source is not None:
        (tmp_path / name.split(":")[0]).write_text(source + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        scorer({"name": name})
    assert str(e.value) == expected.format(d=tmp_path)


@pytest.mark.parametrize("functions, expected", [
    ([{"name": "reward_forms.fields", "kwargs": {"row": {}}}],
     "reward.functions[0].kwargs: 'row' is a sample field the trainer passes; rename the function's parameter"),
    ([{"name": "reward_forms.mixes"}],
     "reward.functions[0].name: a batch function (with a 'samples' parameter) takes the samples only, not also "
     "'response'"),
    ([{"name": "reward_forms.legacy", "kwargs": {"scal": 1}}],
     "reward.functions[0].kwargs: do not fit legacy(text, ref, scale=1.0): got an unexpected keyword argument "
     "'scal' (it names no sample field, so it is called as fn(response, answer, **kwargs))"),
])
def test_signature_problems_are_config_errors(forms, functions, expected):
    with pytest.raises(ConfigError) as e:
        scorer(*functions)
    assert str(e.value) == expected
