"""An agent episode's sample, built from the engine calls the front recorded (``front.py``).

    calls:   prompt_0 -> out_0,   prompt_1 -> out_1,   ...    (each prompt_k+1 extends prompt_k + out_k)
    sample:  prompt_ids = prompt_0
             output_ids = out_0 | ctx_1 | out_1 | ctx_2 | out_2 ...   ctx_k = prompt_k[len(prompt_k-1 + out_k-1):]
             output_mask:  1 on out_k (the engine's tokens and log-probs), 0 on ctx_k (tool results,
                           the template's turn headers: log-prob 0, no loss), as the built-in loop's

A prompt that does not extend the tokens before it is ``NotAnExtension``: the front marks such
episodes ``diverged`` before this is called, so it is the last check, not the first.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_grpo.wire.samples import Sample


class NotAnExtension(ValueError):
    """A call's prompt does not start with the episode's tokens before it."""


def oldest_version(versions: Sequence[str]) -> str:
    """The oldest weight version that sampled any call (numeric versions compared as numbers)."""
    if versions and all(str(v).isdigit() for v in versions):
        return str(min(int(v) for v in versions))
    return versions[0] if versions else ""


def sample_from_calls(prompt_calls: Sequence[tuple[Sequence[int], Sample]], *, prompt_index: int,
                      sample_index: int, with_kept: bool) -> Sample:
    """One ``Sample`` (module docstring) from ``(prompt_ids, engine sample)`` per call, in order
    (at least one). ``with_kept``: carry the engine's kept sets (sampling-mask replay)."""
    first_prompt = list(prompt_calls[0][0])
    out: list[int] = []
    lps: list[float] = []
    mask: list[int] = []
    kept: list[Optional[list[int]]] = []
    masses: list[float] = []
    token_versions: list[Optional[str]] = []
    context = list(first_prompt)
    for k, (prompt_ids, s) in enumerate(prompt_calls):
        prompt_ids = list(prompt_ids)
        if prompt_ids[:len(context)] != context:
            raise NotAnExtension(f"call {k}'s prompt does not extend the episode's {len(context)} tokens before it")
        ctx = prompt_ids[len(context):]
        out += ctx + list(s.output_ids)
        lps += [0.0] * len(ctx) + [float(x) for x in s.output_logprobs]
        mask += [0] * len(ctx) + [1] * len(s.output_ids)
        token_versions += [None] * len(ctx) + list(s.output_versions or [None] * len(s.output_ids))
        if with_kept:
            kept += [None] * len(ctx) + list(s.kept_ids or [None] * len(s.output_ids))
            masses += [0.0] * len(ctx) + list(s.log_kept_mass or [0.0] * len(s.output_ids))
        context = prompt_ids + list(s.output_ids)
    last = prompt_calls[-1][1]
    return Sample(prompt_index=prompt_index, sample_index=sample_index, prompt_ids=first_prompt, output_ids=out,
                  output_logprobs=lps, finish_reason=last.finish_reason,
                  weight_version=oldest_version([s.weight_version for _, s in prompt_calls]), server=last.server,
                  output_mask=mask,
                  output_versions=token_versions if any(v is not None for v in token_versions) else None,
                  kept_ids=kept if with_kept else None, log_kept_mass=masses if with_kept else None)
