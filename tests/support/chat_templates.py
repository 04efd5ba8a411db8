"""A Qwen2.5-style chat template (ChatML, Hermes tool calls), written for the tests: the
system turn lists ``tools`` in ``<tools>`` and asks for ``<tool_call>{json}</tool_call>``; an
assistant turn's ``tool_calls`` are re-rendered as such blocks with the template's own JSON
spacing; tool results are ``<tool_response>`` blocks inside a user turn. Put on a real BPE
tokenizer (SmolLM2's, which has the ChatML tokens), it gives a second template family next to
the tiny tokenizer's for the token-exactness tests.

transformers renders templates with ``trim_blocks``: a newline right after a ``{% ... %}`` tag
is dropped, so newlines that follow a tag are written as ``{{ NL }}``."""

_NL = "{{ '\\n' }}"

QWEN_STYLE = "".join([
    "{% if tools %}<|im_start|>system", _NL,
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}", _NL, _NL, "{% endif %}",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    "{% for t in tools %}", _NL, "{{ t | tojson }}{% endfor %}", _NL, "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>", _NL,
    "{% elif messages[0].role == 'system' %}<|im_start|>system", _NL, "{{ messages[0].content }}<|im_end|>", _NL,
    "{% else %}<|im_start|>system", _NL, "You are a helpful assistant.<|im_end|>", _NL, "{% endif %}",
    "{% for m in messages %}",
    "{% if m.role == 'system' and loop.first %}",
    "{% elif m.role == 'assistant' %}<|im_start|>assistant", _NL,
    "{% if m.content %}{{ m.content }}{% endif %}",
    "{% for c in m.tool_calls or [] %}{% if m.content or not loop.first %}", _NL, "{% endif %}",
    "<tool_call>", _NL, "{\"name\": \"{{ c.function.name }}\", \"arguments\": ",
    "{% if c.function.arguments is string %}{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson }}"
    "{% endif %}}", _NL, "</tool_call>{% endfor %}<|im_end|>", _NL,
    "{% elif m.role == 'tool' %}",
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user", _NL, "{% endif %}",
    "<tool_response>", _NL, "{{ m.content }}", _NL, "</tool_response>",
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>", _NL, "{% else %}", _NL, "{% endif %}",
    "{% else %}<|im_start|>{{ m.role }}", _NL, "{{ m.content }}<|im_end|>", _NL,
    "{% endif %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}<|im_start|>assistant", _NL, "{% endif %}",
])
