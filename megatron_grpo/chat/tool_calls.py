"""Tool calls in the model's own format: completion text -> OpenAI ``tool_calls``.

A model calls tools in the syntax its chat template taught it, not in JSON fields; the server
that answers ``/v1/chat/completions`` with ``tools=`` must find the calls in the completion's
text. One parser per convention, in one registry (``TOOL_CALL_FORMATS``):

* ``hermes``: Hermes / Qwen2.5 / Qwen3 (their templates' ``tools`` section asks for it)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  any number of calls; the text outside them is the message's ``content``;
* ``compute``: the CPU tool demo's model (``tools/tiny.py``'s word-level vocabulary has no
  braces-and-quotes JSON): ``compute <expression>`` calls the function ``compute`` with
  ``{"expression": "<expression>"}`` (as the built-in calculator environment reads it, an
  empty or bad expression included: the tool answers it); the text before it is the content.

A malformed call (no closing tag, JSON that does not parse, no ``name``, ``arguments`` not an
object) never raises: it is left out of ``tool_calls``, its text stays in the content, and
``ParsedTurn.errors`` says what was wrong in one line each, so the caller can count it and the
agent sees a visible failure (the text it can answer to) rather than a crash.

Arguments are returned as OpenAI's JSON string (``json.dumps`` of the parsed object); the token
ids the model sampled are kept apart by the caller, so this re-serialization never reaches training.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

MAX_CALLS = 64
"""Calls parsed from one completion at most; further ones are errors (bounded work per answer)."""


@dataclass
class ParsedTurn:
    """What a completion's text says: ``content`` (None when nothing but calls), the OpenAI
    ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments": str}}``) and
    one line per malformed call."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _call(name: str, arguments: dict, call_id: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


_HERMES_RE = re.compile(r"<tool_call>(?P<body>.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, id_prefix: str = "call") -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks of ``text`` (module docstring)."""
    calls: list[dict] = []
    errors: list[str] = []
    kept: list[str] = []  # the content: text outside well-formed calls
    end = 0
    for m in _HERMES_RE.finditer(text):
        kept.append(text[end:m.start()])
        end = m.end()
        problem = None
        if not m.group(0).endswith("</tool_call>"):
            problem = "a <tool_call> without its closing </tool_call>"
        elif len(calls) >= MAX_CALLS:
            problem = f"more than {MAX_CALLS} tool calls in one completion"
        else:
            try:
                obj = json.loads(m["body"])
            except ValueError as e:
                obj, problem = None, f"a <tool_call> whose body is not JSON ({e.msg} at character {e.pos})"
            if problem is None:
                if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
                    problem = 'a <tool_call> without a "name" string'
                else:
                    args = obj.get("arguments", obj.get("parameters", {}))
                    if isinstance(args, str):  # some models write the arguments as a JSON string
                        try:
                            args = json.loads(args)
                        except ValueError:
                            pass
                    if not isinstance(args, dict):
                        problem = f'a <tool_call> of {obj["name"]!r} whose "arguments" is not an object'
                    else:
                        calls.append(_call(obj["name"], args, f"{id_prefix}_{len(calls)}"))
        if problem is not None:
            errors.append(problem)
            kept.append(m.group(0))
    kept.append(text[end:])
    content = "".join(kept).strip()
    return ParsedTurn(content or None, calls, errors)


_COMPUTE_RE = re.compile(r"\bcompute\b(?P<expr>[^\n]*)")


def parse_compute(text: str, id_prefix: str = "call") -> ParsedTurn:
    """``compute <expression>`` (module docstring): at most one call per completion."""
    m = _COMPUTE_RE.search(text)
    if m is None:
        return ParsedTurn(text.strip() or None)
    expression = m["expr"].strip()  # may be empty: the tool answers it (the calculator: "result ?")
    content = text[:m.start()].strip()
    return ParsedTurn(content or None, [_call("compute", {"expression": expression}, f"{id_prefix}_0")])


TOOL_CALL_FORMATS: dict[str, Callable[..., ParsedTurn]] = {"hermes": parse_hermes, "compute": parse_compute}
"""Tool-call format name -> parser ``fn(text, id_prefix) -> ParsedTurn``."""


def parse_tool_calls(text: str, fmt: str = "hermes", id_prefix: str = "call") -> ParsedTurn:
    """The tool calls of ``text`` in format ``fmt`` (a ``TOOL_CALL_FORMATS`` name); call ids are
    ``<id_prefix>_<i>``. KeyError names the known formats for an unknown one."""
    try:
        parser = TOOL_CALL_FORMATS[fmt]
    except KeyError:
        raise KeyError(f"unknown tool-call format {fmt!r} (known: {', '.join(TOOL_CALL_FORMATS)})") from None
    return parser(text, id_prefix)
