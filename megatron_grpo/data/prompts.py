"""Turn raw records into tokenized prompts: validate the fields, apply the chat template.

A prompt field is either a plain string or a list of chat messages
(``[{"role": "user", "content": "..."}]``). With ``data.apply_chat_template`` and a tokenizer
that has a template, both are rendered with ``add_generation_prompt=True`` (a string becomes
one user message; ``data.system_prompt`` is prepended unless the prompt already carries a
system message). Without a template a string is tokenized as is and a message list is an
error: guessing a chat format would silently train on a different prompt distribution than
the one the model was tuned for.

The answer may be a string or a finite number (``12`` -> ``"12"``); the reward functions compare
normalised text, so the conversion loses nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_grpo.data.records import DataError, RawRecord
from megatron_grpo.runtime.errors import one_line

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    """One training prompt, ready for the rollout engine and the reward functions."""

    index: int
    """Position in the dataset (0-based, file order)."""

    where: str
    """``path:line`` or ``path: row N``, for error messages about this prompt."""

    text: str
    """The prompt as the model sees it (chat template applied when enabled)."""

    prompt_ids: list[int]
    """Token ids of ``text``, shape [prompt_len]."""

    answer: str
    """Reference answer passed to the reward functions."""

    fields: dict = field(default_factory=dict, compare=False)
    """The dataset row's other fields (a reward function's ``row``)."""

    messages: Optional[list[dict]] = field(default=None, compare=False)
    """The chat messages ``text`` renders (system prompt included), None without a chat
    template: what an agent (``episodes.kind: agent``) sends as its first request's ``messages``."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_messages(value: list, where: str, key: str) -> list[dict]:
    """Validate a chat-message list; returns it as ``[{"role", "content"}]`` dicts."""
    if not value:
        raise DataError(f"{where}: '{key}' is an empty list of messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: '{key}'[{i}] must be an object with string 'role' and 'content', got {str(m)[:80]}"
            )
        if m["role"] not in ROLES:
            raise DataError(f"{where}: '{key}'[{i}] has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def check_record(rec: RawRecord, prompt_key: str, answer_key: str) -> tuple[str | list[dict], str]:
    """The validated (prompt, answer) of a raw record; DataError naming the line otherwise."""
    for present, key in ((rec.has_prompt, prompt_key), (rec.has_answer, answer_key)):
        if not present:
            raise DataError(f"{rec.where}: missing field '{key}'")
    prompt = rec.prompt
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{rec.where}: '{prompt_key}' is an empty string")
    elif isinstance(prompt, list):
        prompt = check_messages(prompt, rec.where, prompt_key)
    else:
        raise DataError(
            f"{rec.where}: '{prompt_key}' must be a string or a list of chat messages, got {_type_name(prompt)}"
        )
    answer = rec.answer
    if isinstance(answer, float) and not math.isfinite(answer):  # 1e999 parses as inf; Parquet holds NaN
        raise DataError(f"{rec.where}: '{answer_key}' must be a finite number or a string, got {answer!r}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DataError(f"{rec.where}: '{answer_key}' must be a string or a number, got {_type_name(rec.answer)}")
    return prompt, answer


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` can render chat messages."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_messages(prompt: str | list[dict], system_prompt: str | None) -> list[dict]:
    """The chat messages of a validated prompt: a string is one user turn; ``system_prompt``
    goes first unless the prompt has its own system turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(prompt: str | list[dict], tokenizer, *, use_template: bool, system_prompt: str | None,
                  where: str) -> tuple[str, list[int]]:
    """(text, ids) of one validated prompt.

    With a template the rendered text already holds any BOS the template wants, so it is
    tokenized with ``add_special_tokens=False`` (otherwise BOS would appear twice).
    """
    if not use_template:
        if isinstance(prompt, list):
            raise DataError(
                f"{where}: the prompt is a list of chat messages but "
                + ("data.apply_chat_template is false" if has_chat_template(tokenizer)
                   else "the tokenizer has no chat template")
                + "; use a plain string prompt"
            )
        return prompt, list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    messages = prompt_messages(prompt, system_prompt)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a Jinja error in a user's template: say which prompt triggered it
        raise DataError(f"{where}: the tokenizer's chat template failed: {one_line(e, None)}") from None
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


CHARS_PER_TOKEN_BOUND = 32
"""A prompt longer than ``data.max_prompt_length`` times this many characters is first
tokenized by a prefix of that length: real tokenizers average 3-5 characters a token, so that
prefix alone is over the limit and a 10 MB line is refused in milliseconds, not tokenized whole."""


def prefix_tokens_over(prompt: str | list[dict], tokenizer, max_prompt_length: int) -> int | None:
    """Tokens in the first ``max_prompt_length * CHARS_PER_TOKEN_BOUND`` characters of a prompt
    (its messages' contents, concatenated) when that prefix alone is over the limit; None when
    the prompt must be tokenized whole to know."""
    text = prompt if isinstance(prompt, str) else "".join(str(m.get("content", "")) for m in prompt)
    limit = max_prompt_length * CHARS_PER_TOKEN_BOUND
    if len(text) <= limit:
        return None
    count = len(tokenizer(text[:limit], add_special_tokens=False)["input_ids"])
    return count if count > max_prompt_length else None


def build_prompts(records: list[RawRecord], tokenizer, *, prompt_key: str, answer_key: str,
                  apply_chat_template: bool, system_prompt: str | None, max_prompt_length: int) -> list[Prompt]:
    """Validate, render and tokenize every record; the first bad one raises DataError."""
    use_template = apply_chat_template and has_chat_template(tokenizer)
    if system_prompt is not None and not use_template:
        reason = "data.apply_chat_template is false" if has_chat_template(tokenizer) else "the tokenizer has no chat template"
        raise DataError(f"data.system_prompt is set but {reason}, so it would be ignored")
    prompts = []
    for index, rec in enumerate(records):
        prompt, answer = check_record(rec, prompt_key, answer_key)
        prefix = prefix_tokens_over(prompt, tokenizer, max_prompt_length)
        if prefix is not None:
            raise DataError(f"{rec.where}: prompt is more than {prefix} tokens (its first "
                            f"{max_prompt_length * CHARS_PER_TOKEN_BOUND} characters), longer than "
                            f"data.max_prompt_length = {max_prompt_length}")
        text, ids = render_prompt(prompt, tokenizer, use_template=use_template, system_prompt=system_prompt,
                                  where=rec.where)
        if len(ids) > max_prompt_length:
            raise DataError(
                f"{rec.where}: prompt is {len(ids)} tokens, longer than data.max_prompt_length = {max_prompt_length}"
            )
        if not ids:
            raise DataError(f"{rec.where}: prompt tokenizes to zero tokens")
        prompts.append(Prompt(index=index, where=rec.where, text=text, prompt_ids=ids, answer=answer,
                              fields=dict(rec.fields),
                              messages=prompt_messages(prompt, system_prompt) if use_template else None))
    return prompts
