"""The tool demo's warm-up (tools/make_tool_demo_model.py, yaml_configs/demo_cpu_tools.yaml) teaches
the call syntax, not the answers: a tool row is the exact token sequence the episode loop builds
(the call, the calculator's observation as the delta render gives it, untrained, then the
result copied), and a guess row never holds the question's answer except by chance."""

import importlib.util
import random
from pathlib import Path

from megatron_grpo.rollout.environments.builtin import Calculator
from megatron_grpo.rollout.turns import TurnRenderer
from megatron_grpo.testing.tiny_models import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _tool_module():
    spec = importlib.util.spec_from_file_location("make_tool_demo_model", ROOT / "tools" / "make_tool_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_warmup_rows_are_the_episode_loops_tokens_and_never_the_answer_without_the_tool():
    tool, tok = _tool_module(), build_tokenizer()
    renderer = TurnRenderer(tok, "user")
    rng = random.Random(0)
    tool_rows = guess_rows = right_guesses = 0
    for _ in range(200):
        state = rng.getstate()
        ids, labels = tool.warmup_row(tok, renderer, rng, 0.3)
        rng_copy = random.Random()
        rng_copy.setstate(state)
        prompt, a, b = tool.problem(rng_copy)
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        p = len(tok(text, add_special_tokens=False)["input_ids"])
        response = tok.decode(ids[p:], skip_special_tokens=True).split()
        if response[0] == "compute":
            tool_rows += 1
            call = tok(f"compute {a} + {b}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            env = Calculator({"answer": str(a + b)})
            observation = env.step(tok.decode(call, skip_special_tokens=True))["observation"]
            obs_ids = renderer.observation_ids(call, observation)
            assert ids[p:] == call + obs_ids + tok(str(a + b), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert labels[p + len(call): p + len(call) + len(obs_ids)] == [-100] * len(obs_ids)
        else:
            guess_rows += 1
            right_guesses += response == [str(a + b)]
        assert labels[:p] == [-100] * p
    assert 40 <= tool_rows <= 80 and right_guesses <= 3
