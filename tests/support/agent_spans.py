"""The agent connectors' token checks (tests/test_agents_verifiers*.py): the engine's calls
recorded, and every trained span of an episode matched to one call."""


class Recorder:
    """The engine, recording each call's prompt ids, output ids and log-probs."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, n, sampling, **kw):
        out = self.engine.generate(prompts, n, sampling, **kw)
        self.calls.append((list(prompts[0]), list(out[0].output_ids), list(out[0].output_logprobs)))
        return out


def model_spans(sample):
    """``(context ids, output ids, log-probs)`` of each run of trained tokens; every other token
    must have log-prob 0."""
    spans, i, ids = [], 0, sample.output_ids
    assert len(ids) == len(sample.output_mask) == len(sample.output_logprobs)
    while i < len(ids):
        j = i
        while j < len(ids) and sample.output_mask[j] == sample.output_mask[i]:
            j += 1
        if sample.output_mask[i]:
            spans.append((sample.prompt_ids + ids[:i], ids[i:j], sample.output_logprobs[i:j]))
        else:
            assert all(lp == 0.0 for lp in sample.output_logprobs[i:j])
        i = j
    return spans


def check_tokens(episodes, calls):
    """Every trained span is one engine call (its prompt, its tokens, its log-probs) and every
    engine call is one span: nothing re-tokenized, nothing lost."""
    key = lambda c: (tuple(c[0]), tuple(c[1]), tuple(c[2]))  # noqa: E731
    spans = [s for e in episodes for s in model_spans(e.sample)]
    assert sorted(map(key, spans)) == sorted(map(key, calls))
    assert all(e.error != "diverged" for e in episodes)


def texts(tok, sample):
    """The model's messages' texts, as the front decoded them."""
    return [tok.decode(out, skip_special_tokens=True) for _, out, _ in model_spans(sample)]
