"""A short `megatron-grpo train` run with multi-turn episodes (TP=2 on 2 gloo ranks + the
in-process engine; the launched engines' episodes are tests/test_multi_turn_engines.py's): the
environment's observations are in the trained sequences, the
multi_turn/* metrics reach metrics.jsonl, and the held-out evaluation's responses are episodes
with the environment too (a `single_turn` set's are not)."""

import json
import subprocess

import pytest

from tests.support.demo_run import ENV, NUDGE, ROOT, read_metrics, train_cmd

@pytest.mark.slow
def test_two_steps_with_an_environment_log_the_multi_turn_metrics(demo, tmp_path):
    env_file = tmp_path / "nudge.py"
    env_file.write_text(NUDGE)
    run_dir = tmp_path / "run"
    heldout = demo / "arithmetic_heldout.jsonl"
    cmd = train_cmd(demo, run_dir, 2, "engine.kind=inprocess", "episodes.kind=environment",
                    f"episodes.source={env_file}:Nudge",
                    "episodes.observation_role=user", "episodes.max_turns=3",
                    "episodes.max_episode_tokens=64",
                    "rollout.prompts_per_step=4", "rollout.num_generations=4", "parallel.global_batch_size=16",
                    "parallel.micro_batch_size=8", "eval.every_n_steps=0", "logging.plot=false",
                    f"eval.sets=[{{name: heldout, path: {heldout}, n: 4, temperature: 1.0}}, "
                    f"{{name: plain, path: {heldout}, max_samples: 4, single_turn: true}}]", "eval.pass_k=[1, 4]")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["multi_turn/turns_mean"] == 2 and r["multi_turn/turns_max"] == 2
        # "<|user|> please reply with only a number <|assistant|>" after each first turn, plus the
        # template's <eos> when the turn was cut for length (max_new_tokens 1) rather than ended by it
        assert 8 <= r["multi_turn/observation_tokens_mean"] <= 9
        assert r["multi_turn/model_tokens_mean"] == 2
        assert r["multi_turn/env_errors"] == 0 and r["multi_turn/env_timeouts"] == 0
        assert r["multi_turn/env_s"] > 0 and r["multi_turn/generate_s"] > 0
        # only the model's tokens are trained: 2 per sequence, 16 sequences
        assert r["num_valid_tokens"] == 32
    # the end-of-run evaluation: episodes through the same loop (a single_turn set: one engine call)
    last = rows[-1]
    assert last["eval/heldout/turns_mean"] == 2 and last["eval/heldout/env_failures"] == 0
    num_heldout = len(heldout.read_text().splitlines())
    assert last["eval/heldout/num_prompts"] == num_heldout and last["eval/plain/num_prompts"] == min(4, num_heldout)
    assert "eval/plain/turns_mean" not in last and last["eval/plain/response_len_mean"] == 1
    episodes = [json.loads(line) for line in (run_dir / "eval" / "heldout" / "step_000002.jsonl").read_text().splitlines()]
    assert len(episodes) == 4 * num_heldout
    for e in episodes:
        assert e["turns"] == 2 and e["env_error"] is None
        assert "please reply with only a number" in e["response"]  # the observation, between the model's turns
        assert 10 <= e["length"] <= 11  # 2 model tokens + the observation's 8-9 (as in training)
        assert e["correct"] == (e["rewards"]["math_exact_match"] >= 1.0)  # eval.correct_function: the first
        assert e["rewards"]["environment"] in (0.0, 1.0)  # Nudge's reward, which correct_function may name
        assert e["reward"] == pytest.approx(sum(e["rewards"].values()))  # env_reward: add
    assert last["eval/heldout/pass@1"] == pytest.approx(sum(e["correct"] for e in episodes) / len(episodes))
