"""The tool demo's calculator, written as an agent against the OpenAI SDK (docs/agents.md).

``episodes: {kind: agent, source: examples/agents/calculator_sdk.py:run}`` trains the tool
demo's model through this function instead of the built-in ``calculator`` environment. It asks
the model with ``tools=[compute]``; the run's front finds the call in the model's own format
(``tool_call_format: compute``: the demo vocabulary writes ``compute 12 + 30``), this function
runs the tool and sends its result back as a ``tool`` message, and the model's next answer is
graded. With the same model and seeds the episodes are the built-in environment's, token for
token (tests/test_agents.py).
"""

import json
import re

from megatron_grpo.rollout.episodes.environment.builtin import evaluate, format_number

TOOLS = [{"type": "function", "function": {
    "name": "compute", "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TURNS = 2
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def compute(expression: str) -> str:
    try:
        return f"result {format_number(evaluate(expression))}"
    except ValueError:
        return "result ?"


async def run(client, row) -> float:
    """One episode: the reward is 1.0 when the final answer's last number is the row's answer."""
    messages = list(row["messages"])  # the dataset prompt as chat messages (data.apply_chat_template)
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            numbers = NUMBER.findall(message.content or "")
            return float(bool(numbers) and float(numbers[-1]) == float(row["answer"]))
        messages.append(message)
        for call in message.tool_calls:
            result = compute(json.loads(call.function.arguments).get("expression", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
