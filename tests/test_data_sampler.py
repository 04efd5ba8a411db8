"""PromptSampler order/resume and the synthetic arithmetic task."""

import json
from collections import Counter

import pytest

from megatron_grpo.config.sections import DataConfig
from megatron_grpo.data import DataError, Prompt, PromptDataset, PromptSampler, load_prompt_dataset
from megatron_grpo.data.synthetic import all_problems, chance_reward, generate, main as synthetic_main
from tools.tiny import MAX_NUMBER, build_tokenizer, vocab


def toy_dataset(n, answer_offset=0):
    return PromptDataset([Prompt(index=i, where=f"t:{i + 1}", text=str(i), prompt_ids=[i],
                                 answer=str(i + answer_offset)) for i in range(n)], "toy.jsonl")


def test_each_epoch_is_a_permutation_and_batches_cross_epochs():
    s = PromptSampler(toy_dataset(5), prompts_per_step=2, seed=3)
    batches = [s.next_indices() for _ in range(5)]  # 10 prompts = 2 epochs of 5
    flat = [i for b in batches for i in b]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:]) == list(range(5))
    assert flat[:5] != flat[5:]  # reshuffled per epoch (seed 3: two different orders)
    assert batches[2][0] in flat[:5] and batches[2][1] in flat[5:]  # batch 3 straddles the boundary
    assert (s.epoch, s.position) == (1, 5)
    ordered = PromptSampler(toy_dataset(5), prompts_per_step=2, seed=3, shuffle=False)
    assert [ordered.next_indices() for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]


def test_same_seed_same_order_other_seed_other_order():
    a = [PromptSampler(toy_dataset(50), 7, seed=1).next_indices() for _ in range(2)]
    assert a[0] == a[1]
    assert PromptSampler(toy_dataset(50), 7, seed=2).next_indices() != a[0]


def test_resume_continues_with_exactly_the_same_prompts():
    ref = PromptSampler(toy_dataset(7), 3, seed=11)
    expected = [ref.next_indices() for _ in range(10)]
    first = PromptSampler(toy_dataset(7), 3, seed=11)
    got = [first.next_indices() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # must survive serialisation
    resumed = PromptSampler(toy_dataset(7), 3, seed=11)
    resumed.load_state_dict(state)
    got += [resumed.next_indices() for _ in range(6)]
    assert got == expected
    assert [p.index for p in resumed.next_batch()] == ref.next_indices()


def test_resume_rejects_changed_dataset_or_seed():
    state = PromptSampler(toy_dataset(7), 3, seed=11).state_dict()
    with pytest.raises(DataError, match=r"^toy.jsonl: the checkpoint's data position is for a different dataset"):
        PromptSampler(toy_dataset(8), 3, seed=11).load_state_dict(state)
    with pytest.raises(DataError, match="different dataset"):  # same size, other answers
        PromptSampler(toy_dataset(7, answer_offset=1), 3, seed=11).load_state_dict(state)
    with pytest.raises(DataError, match=r"trainer.seed=11, data.shuffle=True but the config has 12, True"):
        PromptSampler(toy_dataset(7), 3, seed=12).load_state_dict(state)


def test_synthetic_task_is_single_token_and_hard_enough():
    problems = all_problems(9, ["+"])
    assert len(problems) == 100 and ("what is 7 + 5 ?", 12) in problems
    # Sum of two digits: 9 is the commonest answer, 10 of the 100 problems (a=0..9, b=9-a).
    assert chance_reward([a for _, a in problems]) == 0.10
    mixed = all_problems(14, ["+", "-", "*"])
    assert max(a for _, a in mixed) <= MAX_NUMBER and min(a for _, a in mixed) >= 0
    assert generate(20, seed=5) == generate(20, seed=5) != generate(20, seed=6)
    with pytest.raises(ValueError, match="too easy: always answering the most common answer scores 0.50"):
        generate(10, seed=0, max_operand=1)


def test_synthetic_cli_writes_a_loadable_dataset_with_one_token_answers(tmp_path, capsys):
    out = tmp_path / "arith.jsonl"
    assert synthetic_main(["--out", str(out), "--num", "64", "--seed", "1", "--ops", "+,-"]) == 0
    assert "wrote 64 problems" in capsys.readouterr().out
    tok = build_tokenizer()
    ds = load_prompt_dataset(DataConfig(train_file=str(out)), tok)
    assert len(ds) == 64
    v = vocab()
    for p in ds.prompts:
        assert tok(p.answer, add_special_tokens=False)["input_ids"] == [v[p.answer]]
        assert v["<unk>"] not in p.prompt_ids
    assert max(Counter(p.answer for p in ds.prompts).values()) < 64
    assert synthetic_main(["--out", str(out), "--num", "5", "--ops", "^"]) == 2
