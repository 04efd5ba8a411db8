"""Kill -9 the CPU demo run at random moments (some in the middle of a checkpoint save),
resume it with `checkpoint.resume: auto` each time, and check that

* every resume starts from the newest COMPLETE checkpoint that existed at the kill (never a
  partial one, never an older one: "checkpoints lost" counts the times the newest complete
  checkpoint went backwards across a kill),
* the finished run's metrics equal an uninterrupted run with the same seed, and every step drew
  the same prompts (``rollout/prompt_indices``: no prompt lost or repeated across a kill).

With ``--extra KEY=VALUE`` (repeatable) both runs get more overrides: an environment
(``episodes.kind=environment``) makes every response a multi-turn episode whose environment
workers die with the run (tests/test_kill_resume.py).

    python tests/support/kill_resume.py --kills 20          # the full version (several minutes)
    python tests/support/kill_resume.py --kills 1 --steps 6 # what CI runs (tests/test_kill_resume.py, with
                                                            # --demo: the session's shared demo model)

Prints `kills: K, resumes: R, checkpoints lost: L, metrics equal: yes|no` and exits non-zero
on any violation.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, its own folder (tests/support/, whose sglang.py would shadow the real package)
# is sys.path[0]: the repository root takes its place.
_REPO = str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = _REPO
elif _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from megatron_grpo.trainer.checkpoint import complete_checkpoints  # noqa: E402
from tests.support.demo_run import ENV, ROOT, make_demo, read_metrics, train_cmd  # noqa: E402

COMPARED = ("reward_mean", "reward_std", "loss", "ppo_kl", "clip_ratio", "entropy", "grad_norm",
            "rollout_train_logprobs_abs_diff_mean", "is_ratio_mean", "response_length_mean", "lr")


def run_cmd(demo: Path, run_dir: Path, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    # shuffled mini-batches (4 per step in the demo): a resumed step must cut its batch the same way
    return train_cmd(demo, run_dir, steps, "checkpoint.save_every=1", "checkpoint.keep_last=2", "logging.plot=false",
                     "algorithm.shuffle_mini_batches=true", *extra)


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=ENV)


def running(pid: int) -> bool:
    """True while ``pid`` runs: a zombie (exited, its parent not having reaped it yet; init
    reaps an orphan's) counts as gone, as does a pid that no longer exists."""
    import psutil

    from megatron_grpo.runtime.process import alive

    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def rank_processes(run_dir: Path) -> list:
    """The training ranks (psutil processes) of the run writing ``run_dir``: the
    ``python -m megatron_grpo.train`` processes naming it, without a torchrun started as a
    command (whose command line names that module too; the launcher's forked agent has the
    launcher's, ``megatron_grpo.cli train``)."""
    import psutil

    def cmdline(p) -> str:
        try:
            return " ".join(p.cmdline())
        except psutil.Error:
            return ""

    return [p for p in psutil.process_iter() if "megatron_grpo.train" in (c := cmdline(p))
            and str(run_dir) in c and "torch.distributed.run" not in c]


GRACE_S = 15.0
"""Seconds a killed launcher's processes may take to go (the kernel's parent-death signals are
immediate; this covers a loaded machine)."""


def process_tree(pid: int) -> list:
    """``pid``'s process and every descendant (psutil processes; empty once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def survivors(tree: list, grace_s: float = GRACE_S) -> list[str]:
    """Command lines (first 120 characters) of the processes of ``tree`` still running, zombies
    aside, ``grace_s`` seconds from now at the latest (it returns once all are gone)."""
    import psutil

    from megatron_grpo.runtime.process import alive

    _, left = psutil.wait_procs(tree, timeout=grace_s)
    found = []
    for p in left:
        try:
            if alive(p):
                found.append(" ".join(p.cmdline())[:120])
        except psutil.Error:  # gone since
            pass
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every descendant at once (torchrun starts its workers in
    their own sessions, so a process-group kill would miss the ranks): a node dying."""
    import psutil

    family = process_tree(proc.pid)
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def newest_complete(run_dir: Path) -> int:
    found = complete_checkpoints(run_dir)
    return found[-1][0] if found else 0


def trained_since(run_dir: Path, started: float, resumed_step: int) -> bool:
    """This process has logged a step past ``resumed_step`` (the killed run's stale lines
    beyond the checkpoint are cut by the resumed run before it logs anything new)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file() or path.stat().st_mtime < started:
        return False
    rows = read_metrics(run_dir)
    return bool(rows) and rows[-1]["step"] > resumed_step


def saving_now(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any(p.name.startswith(".step_") for p in root.iterdir())


def resumed_from(log_path: Path) -> list[int]:
    """Steps the trainer reported resuming from, in order (driver prints 'resumed from step N')."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if "resumed from checkpoint step " in line:
            out.append(int(line.rsplit(" ", 1)[-1]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    parser.add_argument("--max-seconds", type=float, default=3600)
    parser.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both runs (repeatable)")
    parser.add_argument("--straight", default=None,
                        help="the run directory of an uninterrupted run of the same command to compare with "
                             "(only read); default: run one in the work directory")
    parser.add_argument("--demo", default=None,
                        help="an existing tools/make_demo_model.py output to use (only read); default: build one "
                             "with 50 warm-up steps in the work directory")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kill_resume_"))
    demo = Path(args.demo) if args.demo else make_demo(work / "demo", warmup_steps=50)
    deadline = time.monotonic() + args.max_seconds

    straight = Path(args.straight) if args.straight else work / "straight"
    if not args.straight:
        ref = start(run_cmd(demo, straight, args.steps, tuple(args.extra)), work / "straight.log")
        if ref.wait() != 0:
            print(f"the uninterrupted run failed; see {work / 'straight.log'}")
            return 1

    run_dir, log_path = work / "killed", work / "killed.log"
    cmd = run_cmd(demo, run_dir, args.steps, tuple(args.extra))
    kills = resumes = lost = 0
    expected_resumes: list[int] = []
    while True:
        if time.monotonic() > deadline:
            print(f"gave up after {args.max_seconds:.0f}s")
            return 1
        before = newest_complete(run_dir)
        if before > 0:
            resumes += 1
            expected_resumes.append(before)
        started = time.time()
        proc = start(cmd, log_path)
        if kills >= args.kills:
            break
        # Kill only once this run has trained past where it resumed (so every cycle makes
        # progress, however slow start-up is), then either while a checkpoint is being
        # written (half of the kills) or after a random delay.
        while proc.poll() is None and not trained_since(run_dir, started, before):
            time.sleep(0.05)
        targeted = rng.random() < 0.5
        delay = rng.uniform(0.0, 8.0)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < (60 if targeted else delay):
            if targeted and saving_now(run_dir):
                break
            time.sleep(0.01)
        if proc.poll() is not None:  # finished before the kill: done early
            break
        kill_tree(proc)
        kills += 1
        after = newest_complete(run_dir)
        lost += after < before
        print(f"kill {kills}: {'during a save' if targeted else f'after {delay:.1f}s'}; newest complete "
              f"checkpoint {before} -> {after}", flush=True)
    code = proc.wait()
    if code != 0:
        print(f"the final resume failed (exit {code}); see {log_path}")
        return 1

    reported = resumed_from(log_path)
    a, b = read_metrics(straight), read_metrics(run_dir)
    equal = [r["step"] for r in a] == [r["step"] for r in b] and all(
        abs(ra[k] - rb[k]) <= 1e-6 * max(1.0, abs(ra[k])) for ra, rb in zip(a, b) for k in COMPARED)
    # each step's prompts, as drawn: none lost or repeated across the kills
    same_prompts = [r["rollout/prompt_indices"] for r in a] == [r["rollout/prompt_indices"] for r in b]
    ok = equal and same_prompts and lost == 0 and reported == expected_resumes
    print(f"kills: {kills}, resumes: {resumes}, checkpoints lost: {lost}, "
          f"resumes from the newest complete checkpoint: {'yes' if reported == expected_resumes else 'no'}, "
          f"metrics equal: {'yes' if equal else 'no'}, prompts equal: {'yes' if same_prompts else 'no'}")
    if reported != expected_resumes:
        print(f"resumed from {reported}, expected {expected_resumes}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
