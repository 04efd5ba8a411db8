"""`megatron-grpo train` with `episodes.kind: agent`: an OpenAI-SDK agent (the real `openai` client in
a worker process) trains the demo model for two steps on TP=2 (2 gloo ranks + the in-process
engine); the same shape of episodes as tests/test_multi_turn_e2e.py's environment run (the
agent asks what the Nudge environment would), the agent's own numbers in metrics.jsonl, the
held-out evaluation through the agent too (set by the deprecated episodes.agent, still taken with
one announcement), and a bad agent file refused in one line."""

import subprocess

import pytest

from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd

NUDGE_AGENT = '''
def run(client, row):
    messages = list(row["messages"])
    first = client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "please reply with only a number"}]
    second = client.chat.completions.create(model="policy", messages=messages)
    words = (second.choices[0].message.content or "").split()
    return {"reward": float(bool(words) and words[-1] == row["answer"]),
            "first_len": float(len(first.choices[0].token_ids))}
'''


@pytest.mark.slow
def test_two_steps_with_an_sdk_agent(demo, tmp_path):
    agent_file = tmp_path / "nudge_agent.py"
    agent_file.write_text(NUDGE_AGENT)
    run_dir = tmp_path / "run"
    heldout = demo / "arithmetic_heldout.jsonl"
    # the agent and its workers set by their deprecated keys (issue 62): still run, announced once
    cmd = train_cmd(demo, run_dir, 2, "engine.kind=inprocess", f"episodes.agent={agent_file}:run",
                    "episodes.observation_role=user", "episodes.max_turns=3", "episodes.max_episode_tokens=64",
                    "episodes.agent_workers=2",
                    "rollout.prompts_per_step=4", "rollout.num_generations=4", "parallel.global_batch_size=16",
                    "parallel.micro_batch_size=8", "eval.every_n_steps=0", "logging.plot=false",
                    f"eval.sets=[{{name: heldout, path: {heldout}, n: 2, temperature: 1.0}}]", "eval.pass_k=[1, 2]")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    for line in ["episodes.agent is deprecated; use episodes.kind: agent with episodes.source",
                 "episodes.agent_workers is deprecated; use episodes.concurrency"]:
        assert out.stderr.count(line) == 1, out.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["multi_turn/turns_mean"] == 2 and r["multi_turn/diverged"] == 0
        assert r["multi_turn/env_errors"] == 0 and r["multi_turn/env_timeouts"] == 0
        # the nudge between the two model turns (8-9 tokens, as the environment's), never trained
        assert 8 <= r["multi_turn/observation_tokens_mean"] <= 9
        assert r["multi_turn/model_tokens_mean"] == 2 and r["num_valid_tokens"] == 32
        assert r["agent/first_len_mean"] == 1.0  # the demo model answers one token
    last = rows[-1]
    assert last["eval/heldout/turns_mean"] == 2 and last["eval/heldout/env_failures"] == 0


@pytest.mark.slow
def test_a_broken_agent_file_is_one_line_before_the_run(demo, tmp_path):
    agent_file = tmp_path / "broken.py"
    agent_file.write_text("import no_such_module_here\n")
    cmd = train_cmd(demo, tmp_path / "run", 1, "engine.kind=inprocess", "episodes.kind=agent",
                    f"episodes.source={agent_file}:run",
                    "episodes.max_episode_tokens=64")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if "episodes.agent" in line]
    assert lines and "no_such_module_here" in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()




@pytest.mark.slow
def test_two_steps_of_a_verifiers_taskset(demo, tmp_path):
    """A verifiers 0.4 taskset (examples/agents/verifiers_taskset.py), unchanged, trains the demo
    model through the connector: the run's data rows carry its questions; its task's reward
    reaches metrics.jsonl."""
    import json

    env_file = ROOT / "examples" / "agents" / "verifiers_taskset.py"  # the documented example
    data = tmp_path / "questions.jsonl"
    rows = [(f"what is {a} plus {b}", str(a + b)) for a, b in [(3, 4), (9, 9), (2, 6), (10, 5)]]
    data.write_text("".join(json.dumps({"prompt": q, "question": q, "answer": a}) + "\n" for q, a in rows))
    run_dir = tmp_path / "run"
    cmd = train_cmd(demo, run_dir, 2, "engine.kind=inprocess", "episodes.kind=agent",
                    f"episodes.source=verifiers:{env_file}:load_environment",
                    "episodes.max_turns=1", "episodes.max_episode_tokens=48", "episodes.env_reward=replace",
                    "episodes.concurrency=2", f"data.train_file={data}", "rollout.prompts_per_step=2",
                    "rollout.num_generations=4", "parallel.global_batch_size=8", "parallel.micro_batch_size=4",
                    "eval.every_n_steps=0", "eval.sets=[]", "logging.plot=false")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = read_metrics(run_dir)
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:
        assert r["multi_turn/diverged"] == 0 and r["multi_turn/env_errors"] == 0
        assert r["multi_turn/turns_mean"] == 1 and r["num_valid_tokens"] > 0
        assert r["agent/correct_mean"] == pytest.approx(r["reward_mean"])  # the task's one reward, weight 1


@pytest.mark.slow
def test_an_agent_that_breaks_its_contract_stops_the_run_in_one_line(demo, tmp_path):
    """An agent returning something other than a reward: one line naming the file, the function
    and the step, exit 2, no traceback (a plug-in error, docs/fault_tolerance.md)."""
    agent_file = tmp_path / "says_yes.py"
    agent_file.write_text('def run(client, row):\n'
                          '    client.chat.completions.create(model="policy", messages=list(row["messages"]))\n'
                          '    return "yes"\n')
    cmd = train_cmd(demo, tmp_path / "run", 2, "engine.kind=inprocess", "episodes.kind=agent",
                    f"episodes.source={agent_file}:run",
                    "episodes.max_episode_tokens=64", "episodes.concurrency=1", "eval.every_n_steps=0",
                    "rollout.prompts_per_step=2", "rollout.num_generations=2", "parallel.global_batch_size=4",
                    "parallel.micro_batch_size=2")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "says_yes.py:run returned str" in line]
    assert len(lines) == 1 and "step 1" in lines[0], out.stderr[-3000:]
