"""What a reward function can be given: one ``RewardSample`` per response.

The rollout step builds one per generated response; a reward function asks for the parts it
needs by naming them as parameters (``rewards/calling.py`` has the rules), or takes the
whole ``sample`` (or, as a batch function, the list ``samples``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True, kw_only=True)
class RewardSample:
    """One response to score, with everything the trainer knows about it."""

    prompt: str
    """The prompt text as the model saw it (chat template applied when enabled)."""

    response: str
    """The response decoded to text, special tokens dropped."""

    answer: str
    """The dataset row's reference answer (``data.answer_key``)."""

    response_ids: list[int] = field(default_factory=list)
    """Token ids of the response, shape [response_len] (EOS included when it stopped on it)."""

    prompt_ids: list[int] = field(default_factory=list)
    """Token ids of the prompt, shape [prompt_len]."""

    finish_reason: str = "stop"
    """``stop`` (EOS or a stop token), ``length`` (hit max_new_tokens) or ``abort``."""

    row: dict[str, Any] = field(default_factory=dict)
    """The dataset row's other fields (everything but the prompt and the answer)."""

    def to_json(self) -> dict[str, Any]:
        """The sample as plain JSON (what a remote reward server receives)."""
        return asdict(self)


SAMPLE_FIELDS: tuple[str, ...] = ("prompt", "response", "answer", "response_ids", "prompt_ids", "finish_reason", "row")
"""Parameter names a reward function can use to receive one field of the sample."""


def reward_samples(prompts: Sequence, samples: Sequence, tokenizer) -> list[RewardSample]:
    """What the reward functions see of each generated sample: the one builder of
    ``RewardSample``s (training and evaluation alike).

    prompts: the ``data.Prompt``s of one generate call (``text``, ``answer``, ``fields``);
    samples: the engine's ``wire.samples.Sample``s of them (``prompt_index``, ``output_ids``,
    ``prompt_ids``, ``finish_reason``); tokenizer: decodes the response, special tokens dropped."""
    out = []
    for s in samples:
        p = prompts[s.prompt_index]
        out.append(RewardSample(prompt=p.text, response=tokenizer.decode(s.output_ids, skip_special_tokens=True), answer=p.answer,
                                response_ids=list(s.output_ids), prompt_ids=list(s.prompt_ids),
                                finish_reason=s.finish_reason, row=p.fields))
    return out
