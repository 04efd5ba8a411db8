"""The turn boundary of a multi-turn episode: which token ids follow a model turn
(docs/multi_turn.md, "The turn boundary, exactly").

A model turn's tokens are exactly what the engine generated (its end-of-turn or EOS token
included when it stopped on it), never re-rendered or re-tokenized. Everything the chat
template adds around an observation belongs to the observation side (masked out of the loss):
the rest of the template's end of the assistant turn, the observation turn and the next
assistant header.

The observation turn is a **delta render** on a fixed one-turn conversation ``[user u,
assistant a]`` (one placeholder token each):

    ids(render([u, a, observation], add_generation_prompt=True))  minus  ids(render([u, a]))

checked prefix-stable. At pre-flight the chain of renders up to two observation turns must be
prefix-stable: a template that rewrites earlier turns is refused in one line, unless
``episodes.observation_formatter`` supplies the ids instead.

An observation holding the tokenizer's unknown token is refused (``ObservationError``: the
episode ends, counted, never trained on). An observation is cut before it is rendered or
tokenized (``observation_char_limit``): no vocabulary entry covers more than
``max_chars_per_token`` characters, so a longer text could not fit the budget anyway, and a
100 MB observation never reaches the template and the tokenizer (16.5 GB, issue 48).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from megatron_grpo.config.base import ConfigError
from megatron_grpo.data.prompts import has_chat_template
from megatron_grpo.runtime.errors import one_line

PLACEHOLDER = "1"
"""Content of the placeholder turns: one token in every vocabulary we know (a digit)."""

Formatter = Callable[[str, object], Sequence[int]]
"""``fn(observation, tokenizer) -> token ids`` following a model turn."""


def max_chars_per_token(tokenizer) -> int:
    """The most characters of text one token of ``tokenizer`` covers: its longest vocabulary
    entry (byte-level BPE writes a byte as one character, SentencePiece a character as one, and
    a byte-fallback token ``<0x0A>`` is longer than the byte it stands for), at least 1."""
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))


class ObservationError(ValueError):
    """An observation that cannot be trained on as context (unknown tokens)."""


def _is_prefix(short: Sequence[int], long: Sequence[int]) -> bool:
    return len(long) >= len(short) and list(long[: len(short)]) == list(short)


class TurnRenderer:
    """``observation_ids(model_ids, text)``: the ids after a model turn (see the module docstring).

    tokenizer: a transformers tokenizer; role: ``episodes.observation_role``;
    formatter: the loaded ``observation_formatter`` (None: the chat template's delta render);
    use_template: whether prompts are rendered with the chat template (data.apply_chat_template
    and a tokenizer with one). ConfigError at construction when the template cannot be used.
    """

    KEY = "episodes.observation_formatter"

    def __init__(self, tokenizer, role: str, *, formatter: Optional[Formatter] = None, use_template: bool = True):
        self.tokenizer = tokenizer
        self.role = role
        self.formatter = formatter
        self.unk_id = getattr(tokenizer, "unk_token_id", None)
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self.closing: list[int] = []
        self._base: list[int] = []
        if formatter is None:
            if not (use_template and has_chat_template(tokenizer)):
                raise ConfigError(self.KEY, "is needed: episodes.kind environment renders observations with the chat "
                                            "template, and " + ("data.apply_chat_template is false"
                                                                if has_chat_template(tokenizer)
                                                                else "the tokenizer has no chat template"))
            self._preflight()

    def _ids(self, messages: list[dict], generation_prompt: bool, tools: Optional[Sequence[dict]] = None) -> list[int]:
        kwargs = {"tools": list(tools)} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _preflight(self) -> None:
        u, a = {"role": "user", "content": PLACEHOLDER}, {"role": "assistant", "content": PLACEHOLDER}
        o = {"role": self.role, "content": PLACEHOLDER}
        chain = [([u], True), ([u, a], False), ([u, a, o], True), ([u, a, o, a], False), ([u, a, o, a, o], True)]
        try:
            renders = [self._ids(m, g) for m, g in chain]
        except Exception as e:  # a Jinja error of the template (e.g. a role it refuses)
            raise ConfigError("episodes.observation_role",
                              f"the chat template cannot render a {self.role!r} turn after an assistant turn: "
                              f"{one_line(e, 200)}") from None
        for (m_short, _), (m_long, _), short, long in zip(chain, chain[1:], renders, renders[1:]):
            if not _is_prefix(short, long):
                roles = "/".join(x["role"] for x in m_long)
                raise ConfigError(self.KEY, f"is needed: the chat template is not prefix-stable (rendering "
                                            f"{roles} changes the tokens of the earlier turns), so observations "
                                            "cannot be appended as a delta render")
        content = list(self.tokenizer(PLACEHOLDER, add_special_tokens=False)["input_ids"])
        body = renders[1][len(renders[0]):]
        if not _is_prefix(content, body):
            raise ConfigError(self.KEY, "is needed: the chat template's assistant turn does not start right "
                                        "after its generation prompt")
        self.closing = body[len(content):]
        self._base = renders[1]

    def observation_char_limit(self, budget_tokens: int) -> int:
        """Characters of an observation kept when at most ``budget_tokens`` tokens of it can be
        used: a longer text would tokenize to more (module docstring), so it is cut there first."""
        return max(0, budget_tokens) * self.max_chars_per_token

    def observation_ids(self, model_ids: Sequence[int], text: str) -> list[int]:
        """Token ids after the model turn ``model_ids`` (the engine's tokens) that add the
        observation ``text`` and open the next assistant turn. ObservationError on unknown tokens."""
        if self.formatter is not None:
            ids = [int(t) for t in self.formatter(text, self.tokenizer)]
            self._check_known(ids, text)
            return ids
        return self.messages_ids(model_ids, [{"role": self.role, "content": text}])

    def messages_ids(self, model_ids: Sequence[int], messages: Sequence[dict],
                     tools: Optional[Sequence[dict]] = None) -> list[int]:
        """Token ids after the model turn ``model_ids`` that add ``messages`` (any roles: tool
        results, a user turn) and open the next assistant turn: the delta render of the module
        docstring, ``tools`` handed to the template in both renders. ObservationError when the
        template rewrites the earlier turns for them, or on unknown tokens."""
        u, a = {"role": "user", "content": PLACEHOLDER}, {"role": "assistant", "content": PLACEHOLDER}
        base = self._base if not tools else self._ids([u, a], False, tools)
        full = self._ids([u, a, *messages], True, tools)
        if not _is_prefix(base, full):
            raise ObservationError("the chat template rewrote the earlier turns for this observation")
        turn = full[len(base):]
        self._check_known(turn, " ".join(str(m.get("content")) for m in messages))
        # the template's end of the assistant turn, less what the engine generated of it
        closed = bool(self.closing) and bool(model_ids) and model_ids[-1] == self.closing[0]
        return (self.closing[1:] if closed else self.closing) + turn

    def _check_known(self, ids: Sequence[int], text: str) -> None:
        if self.unk_id is not None and self.unk_id in ids:
            raise ObservationError(f"the observation {text[:60]!r} tokenizes to the unknown token "
                                   f"{self.tokenizer.convert_ids_to_tokens(self.unk_id)!r}")
