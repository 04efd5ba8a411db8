"""A custom rollout function (episodes.rollout_function: docs/examples/retry_rollout.py:retry_once).

Two attempts per response: when the model's first reply holds no digit, a fixed user turn
asks again and the model answers once more. The sample is the whole exchange, token-in /
token-out: the first reply as the engine generated it, the nudge's ids (output_mask 0,
log-prob 0: never trained), the second reply as the engine generated it (output_mask 1, the
engine's log-probs). Both rounds are batched: one generate call for every first reply, one
for every retry.
"""

from megatron_grpo.wire.samples import Sample


def retry_once(engine, prompts, n, sampling, seed, tokenizer):
    first = engine.generate([p.prompt_ids for p in prompts], n, sampling, sampling_seed=seed)
    nudge = tokenizer(" please reply with only a number ", add_special_tokens=False)["input_ids"]
    retry = [i for i, s in enumerate(first)
             if s.finish_reason != "abort" and not any(c.isdigit() for c in tokenizer.decode(s.output_ids))]
    again = engine.generate([first[i].prompt_ids + first[i].output_ids + nudge for i in retry], 1, sampling,
                            sampling_seed=None if seed is None else seed + 1) if retry else []
    out = list(first)
    for i, second in zip(retry, again):
        s = first[i]
        replay = s.kept_ids is not None  # sampling-mask replay is on: carry the engine's kept sets
        out[i] = Sample(
            prompt_index=s.prompt_index, sample_index=s.sample_index, prompt_ids=s.prompt_ids,
            output_ids=s.output_ids + nudge + second.output_ids,
            output_logprobs=s.output_logprobs + [0.0] * len(nudge) + second.output_logprobs,
            output_mask=[1] * len(s.output_ids) + [0] * len(nudge) + [1] * len(second.output_ids),
            finish_reason=second.finish_reason, weight_version=s.weight_version,  # the older of the two
            server=second.server,
            kept_ids=s.kept_ids + [None] * len(nudge) + second.kept_ids if replay else None,
            log_kept_mass=s.log_kept_mass + [0.0] * len(nudge) + second.log_kept_mass if replay else None)
    return out
