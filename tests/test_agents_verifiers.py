"""verifiers 0.4 tasksets (``verifiers.v1``) as agents (``episodes.agent:
verifiers:env.py:load_environment``; docs/agents.md, "verifiers environments"): the real
``verifiers`` release the ``agents`` extra installs (its absence fails these tests), a taskset
of the test's own, each task answered in one chat turn through the run's front on the
in-process engine (tiny model), scored by the task's own ``@vf.reward`` / ``@vf.metric``.

References: the engine's calls (every trained token is one call's output), the chat template
(the prompt is the task's, rendered by it) and the rewards written out by hand on the text the
front returned. The classic API (verifiers < 0.4): tests/test_agents_verifiers_classic.py.
"""

import asyncio
from importlib.metadata import version

import pytest
import verifiers  # the agents extra: a missing library fails here, it is never skipped
import verifiers.v1 as vf  # noqa: F401 (0.4's API: its absence fails here too)

from megatron_grpo.chat.openai_api import render_chat
from megatron_grpo.config.base import ConfigError
from megatron_grpo.data.prompts import Prompt, render_prompt
from megatron_grpo.rollout.episodes.agent.connectors import load_agent
from megatron_grpo.rollout.episodes.agent.runner import AgentRunner
from megatron_grpo.rollout.episodes.turns import TurnRenderer
from megatron_grpo.wire.samples import SamplingParams
from tests.support.agent_spans import Recorder, check_tokens, texts
from tools.tiny import build_tokenizer

TASKSETS = r'''
import verifiers.v1 as vf

QUESTIONS = [("what is 3 plus 4", "7"), ("what is 9 plus 9", "18"), ("what is 2 times 3", "6")]


class Sum(vf.TaskData):
    answer: str
    boom: bool = False


class SumTask(vf.Task[Sum]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        words = trace.last_reply.split()
        return float(bool(words) and words[-1] == task.answer)

    @vf.reward(weight=0.25)
    async def words(self, trace) -> float:
        return float(len(trace.last_reply.split()))

    @vf.metric
    async def checked(self, task) -> float:
        if task.boom:
            raise ZeroDivisionError("the task's own bug")
        return 1.0


class Sums(vf.Taskset[SumTask]):
    def load(self):
        for q, a in QUESTIONS:
            yield SumTask(Sum(prompt=q, answer=a), self.config.task)


def sums():
    return Sums(vf.TasksetConfig())


class SandboxTask(SumTask):
    @vf.reward
    async def ran(self, runtime) -> float:
        return 1.0


class Sandboxed(vf.Taskset[SandboxTask]):
    def load(self):
        return []


class Unscored(vf.Taskset[vf.Task]):
    def load(self):
        return []


def sandboxed():
    return Sandboxed(vf.TasksetConfig())


def unscored():
    return Unscored(vf.TasksetConfig())


def not_a_taskset():
    return 42
'''

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[3])  # 3: <eos>


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tasksets_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf1") / "tasksets.py"
    path.write_text(TASKSETS)
    return path


def make_prompt(tok, index, text, answer, **fields):
    rendered, prompt_ids = render_prompt(text, tok, use_template=True, system_prompt=None, where="test")
    return Prompt(index=index, where="test", text=rendered, prompt_ids=prompt_ids, answer=answer, fields=fields)


def test_the_agents_extra_installs_the_current_verifiers():
    """CI runs these tests on what ``pip install -e .[agents]`` resolves: the current release."""
    assert int(version("verifiers").split(".")[1]) >= 4 and verifiers.__version__ == version("verifiers")


def test_a_v1_taskset_trains_through_the_connector(tok, tasksets_file, inprocess_engine, capfd):
    """Rows named by a question (a task built from the row) and by example_id (the taskset's
    own task): one call each, the tokens the engine's, the reward the task's rewards' weighted
    sum; a metric that raises fails its episodes, counted, printed once with the file's site."""
    prompts = [make_prompt(tok, 0, "what is 3 plus 4", "7", question="what is 3 plus 4"),
               make_prompt(tok, 1, "what is 9 plus 9", "18", example_id=1),
               make_prompt(tok, 2, "what is 2 times 3", "6", question="what is 2 times 3", boom=True)]
    runner = AgentRunner(f"verifiers:{tasksets_file}:sums", tok, TurnRenderer(tok, "user"), max_turns=2,
                         max_episode_tokens=48, timeout_s=60.0, workers=1, tool_call_format="compute")
    try:
        recorder = Recorder(inprocess_engine)
        episodes = runner(recorder, prompts, 3, SAMPLING, 5)
    finally:
        runner.close()
    check_tokens(episodes, recorder.calls)
    for k, e in enumerate(episodes[:6]):
        question, answer = [("what is 3 plus 4", "7"), ("what is 9 plus 9", "18")][k // 3]
        assert e.sample.prompt_ids == render_chat(tok, [{"role": "user", "content": question}])
        assert e.num_turns == 1 and e.sample.output_mask == [1] * len(e.sample.output_ids)
        (text,) = texts(tok, e.sample)
        words = text.split()
        correct = float(bool(words) and words[-1] == answer)
        assert e.error is None
        assert e.env_reward == pytest.approx(correct + 0.25 * len(words))
        assert e.metrics == pytest.approx({"correct": correct, "words": float(len(words)), "checked": 1.0})
    assert [e.error for e in episodes[6:]] == ["error"] * 3 and all(e.sample.output_ids for e in episodes[6:])
    err = capfd.readouterr().err
    assert err.count("episodes.agent error at") == 1 and "the task's scoring raised ZeroDivisionError" in err
    assert f"{tasksets_file}:" in err


@pytest.mark.parametrize("fn, line", [
    ("sandboxed", r"SandboxTask.ran reads the runtime \(a sandbox\)"),
    ("unscored", r"its task Task has no @vf.reward method"),
    ("not_a_taskset", r"has not the classic environment API .*: return a verifiers.v1 Taskset"),
])
def test_what_one_chat_turn_cannot_score_is_refused_at_load(tasksets_file, fn, line):
    with pytest.raises(ConfigError, match=line):
        load_agent(f"verifiers:{tasksets_file}:{fn}", "episodes.agent")
    agent, where = load_agent(f"verifiers:{tasksets_file}:sums", "episodes.agent")
    assert asyncio.iscoroutinefunction(agent) and where == str(tasksets_file)
