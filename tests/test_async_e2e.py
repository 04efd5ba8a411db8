"""``rollout.mode: async`` in real runs of `megatron-grpo train` (TP=2 on 2 gloo ranks, the
launched embedded engine, the weight sync retracting sequences in flight): every trained token
within ``max_staleness`` versions (read from the engine's per-token versions, and from the
group log), whole groups, each prompt trained once across a kill -9 and a resume, and multi-turn
episodes under the same scheduler, slow enough that groups go past the bound and are
regenerated. The engine-level exactness of per-token versions and log-probs, and the scheduler
on the launched engine without a trainer (dropped groups, episodes spanning weight updates),
are tests/test_async_rollouts.py."""

import re
import subprocess
from collections import Counter

import pytest

from tests.support.async_checks import B, async_cmd, async_groups, check_bound, run_train
from tests.support.demo_run import ENV, ROOT, kill_engine_after, read_metrics, wait_for_steps
from tests.support.kill_resume import kill_tree
from tests.support.launch_nodes import running_with

@pytest.mark.slow
def test_kill_minus_9_mid_flight_and_resume_trains_each_prompt_once(demo, tmp_path):
    k, steps = 2, 6
    run_dir = tmp_path / "run"
    command = async_cmd(demo, run_dir, steps, k, "checkpoint.save_every=1", "checkpoint.keep_last=2")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
                            start_new_session=True)
    try:
        wait_for_steps(run_dir, 3, proc, poll_s=0.05)  # groups of steps 4 and 5 are in flight by now
    finally:
        kill_tree(proc)
    before, straight = async_groups(run_dir), read_metrics(run_dir)
    # up to the kill, an uninterrupted run: within the bound, and really asynchronous (the
    # engine ran ahead: lag k reached by step 3), the first batch fresh; stale samples show in
    # rho = pi_old / mu (fp32 rounding alone: ~1e-7)
    check_bound(straight, before, k)
    assert straight[0]["rollout/policy_lag"] == 0 and max(r["rollout/policy_lag"] for r in straight) == k
    assert max(abs(r["is_ratio_mean"] - 1) for r in straight if r["rollout/policy_lag"] > 0) > 1e-4
    resumed = run_train(command + ["checkpoint.resume=auto"])
    rows = read_metrics(run_dir)
    resumed_from = int(re.search(r"async resume at step (\d+)", resumed.stdout).group(1))
    # the group log is cut back to the checkpoint, as metrics.jsonl is: the killed run's lines up to
    # it, then the resumed run's (issue 48: groups the killed run trained after the checkpoint were
    # logged as trained twice)
    log = async_groups(run_dir)
    kept = [g for g in before if g["step"] <= resumed_from]
    assert log[:len(kept)] == kept and len(kept) < len(before)
    after = log[len(kept):]
    first_after = min(g["step"] for g in after)
    trained = [g for g in log if g["fate"] == "trained"]
    kept = [g for g in kept if g["fate"] == "trained"]
    ids = Counter(g["gid"] for g in trained)
    assert sorted(ids) == list(range(steps * B)) and max(ids.values()) == 1, ids  # none lost, none twice
    prompt_of = {g["gid"]: g["prompt_index"] for g in before}
    assert all(prompt_of.get(g["gid"], g["prompt_index"]) == g["prompt_index"] for g in after)  # the same draws
    steps_logged = [r["step"] for r in rows]
    assert steps_logged[-1] == steps and first_after >= 3, (steps_logged, first_after)
    check_bound([r for r in rows if r["step"] >= first_after], after, k)
    assert sum(r["async/groups_dropped"] for r in rows) == 0
    # the resumed run says what it restored and what it cannot reproduce, with counts that match
    # the group logs: the oldest draw with a group not trained by the checkpoint, the groups of
    # that draw and later ones already trained (skipped), and those drawn but not yet trained
    # (generated again: exactly the resumed run's trained groups among the draws made)
    note = re.search(r"async resume at step (\d+): data position restored to draw (\d+) \(group ids from (\d+)\); "
                     r"(\d+) groups from there already trained or dropped are skipped; (\d+) groups drawn but not yet "
                     r"trained at the checkpoint .* not reproduced: their responses, which weight version draws which "
                     r"token, and the arrival order from here differ from the uninterrupted run", resumed.stdout)
    assert note, resumed.stdout[-3000:]
    at_step, draw, first_gid, skipped, again = map(int, note.groups())
    kept_ids = {g["gid"] for g in kept}
    assert at_step == first_after - 1 and first_gid == draw * B == min(set(range(steps * B)) - kept_ids) // B * B
    assert skipped == len([i for i in kept_ids if i >= first_gid])
    drawn_end = first_gid + skipped + again  # the first id of the draws not yet made at the checkpoint
    assert again > 0 and again == len([g for g in after if g["fate"] == "trained" and g["gid"] < drawn_end])
    assert running_with(str(tmp_path)) == []


# Nudge, but the first episode to reach a prompt whose answer is a multiple of 5 waits 3 s in
# its first environment step (a slow tool call; about 3 demo steps): its group is overtaken by
# later ones and arrives past a bound of 1. The marker files beside this file make a
# regeneration of that prompt fast, so it comes back fresh.
DAWDLE = '''
import hashlib
import os
import time
from pathlib import Path


class Dawdle:
    def __init__(self, row):
        self.answer, self.prompt, self.turn = str(row["answer"]), row["prompt"], 0

    def step(self, response):
        self.turn += 1
        if self.turn == 1:
            if int(self.answer) % 5 == 0:
                marker = Path(__file__).parent / ("slow_" + hashlib.sha1(self.prompt.encode()).hexdigest()[:12])
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                    time.sleep(3.0)
                except FileExistsError:
                    pass
            return {"observation": "please reply with only a number", "done": False}
        words = response.split()
        return {"observation": None, "done": True, "reward": float(bool(words) and words[-1] == self.answer)}
'''


@pytest.mark.slow
def test_multi_turn_groups_past_the_bound_are_regenerated_and_never_trained(demo, tmp_path):
    """Multi-turn episodes under the async scheduler, with slow episodes (``DAWDLE``): groups
    really go past the bound (k=1) and are regenerated; no trained token is older than k."""
    env_file = tmp_path / "dawdle.py"
    env_file.write_text(DAWDLE)
    k, steps, b = 1, 4, 4
    run_dir = tmp_path / "run"
    run_train(async_cmd(demo, run_dir, steps, k, "episodes.kind=environment",
                        f"episodes.source={env_file}:Dawdle",
                        "episodes.observation_role=user", "episodes.max_episode_tokens=64", b=b, n=4))
    rows, log = read_metrics(run_dir), async_groups(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    check_bound(rows, log, k, b=b)
    assert max(r["rollout/policy_lag"] for r in rows) == k
    assert all(r["multi_turn/turns_mean"] > 1 for r in rows)
    stale = [g for g in log if g["fate"].startswith("stale")]
    assert stale and all(g["fate"] == "stale_regenerate" for g in stale), log
    assert all(g["step"] - 1 - g["start_version"] > k for g in stale), stale  # really past the bound
    assert sum(r["async/groups_stale"] for r in rows) == sum(r["async/groups_regenerated"] for r in rows) == len(stale)
    assert sum(r["async/groups_dropped"] for r in rows) == 0
    # a stale group is generated again (a later attempt) and trained once; no prompt is lost
    trained = {g["gid"]: g for g in log if g["fate"] == "trained"}
    assert sorted(trained) == list(range(steps * b)) and len(trained) == steps * b
    assert all(trained[g["gid"]]["attempt"] > g["attempt"] for g in stale), (stale, trained)


@pytest.mark.slow
def test_engine_killed_mid_flight_is_restarted_and_its_groups_regenerated(demo, tmp_path):
    k, steps = 2, 5
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(async_cmd(demo, run_dir, steps, k, "engine.request_timeout_s=20", "engine.max_retries=2"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    err = kill_engine_after(proc, run_dir, 2)
    assert proc.returncode == 0, err[-3000:]
    rows, log = read_metrics(run_dir), async_groups(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["engine_restarts"] == 1
    check_bound(rows, log, k)
    # groups cut by the death were generated again, never trained half-done: each id once
    trained = [g["gid"] for g in log if g["fate"] == "trained"]
    assert sorted(trained) == list(range(steps * B))


@pytest.mark.slow
def test_async_on_the_real_sglang_keeps_the_bound_with_its_token_versions(demo, tmp_path, sglang_servers):
    """The same scheduler against the real SGLang (the session's shared server): the sync
    retracts its sequences in flight and the bound is read from SGLang's own per-token
    weight_versions spans."""
    k, steps = 1, 3
    run_dir = tmp_path / "run"
    url = sglang_servers.serve(demo / "model")
    run_train(async_cmd(demo, run_dir, steps, k, *sglang_servers.train_overrides(url), b=4, n=4))
    rows, log = read_metrics(run_dir), async_groups(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    check_bound(rows, log, k, b=4)
    assert max(r["rollout/policy_lag"] for r in rows) == k  # really asynchronous
