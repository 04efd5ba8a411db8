"""Tiny Hugging Face models and a tokenizer built in code (no downloads).

Used by the tests, the benchmarks and the CPU demo. ``save_tiny_model(out_dir, "qwen2")``
writes a complete HF directory (config.json, model.safetensors, tokenizer files with a chat
template) that ``transformers.AutoModelForCausalLM.from_pretrained`` and the rollout engine
load like any downloaded checkpoint.

The tokenizer is a word-level vocabulary in which every integer 0..199 is ONE token, so an
arithmetic answer is a single token (the demo task's chance reward is 1/200).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_grpo.data.synthetic import MAX_NUMBER  # the demo task's answers, one token each

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = (
    "what is the answer to question solve compute plus minus times equals please reply with "
    "only a number final boxed result sum of and add subtract multiply"
).split()
SYMBOLS = list("+-*/=?.,:;()[]{}#\\$") + ["####", "\\boxed"]

# A minimal chat template: enough for `apply_chat_template(..., add_generation_prompt=True)`.
# A tool result is written as a user turn: the word-level vocabulary has no tool header, and
# the tool demo's built-in loop (observation_role: user) and its OpenAI-SDK agent then see the
# same tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|> {{ m['content'] }} "
    "{% elif m['role'] in ('user', 'tool') %}<|user|> {{ m['content'] }} "
    "{% else %}<|assistant|> {{ m['content'] }} <eos> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocab() -> dict[str, int]:
    """Token -> id of the tiny tokenizer (specials first, then numbers, words, symbols)."""
    tokens = SPECIAL_TOKENS + [str(i) for i in range(MAX_NUMBER + 1)] + WORDS + SYMBOLS
    seen: dict[str, int] = {}
    for t in tokens:
        seen.setdefault(t, len(seen))
    return seen


def build_tokenizer(num_tokens: int | None = None):
    """A ``PreTrainedTokenizerFast`` over ``vocab()`` with pad/bos/eos/unk and a chat template.
    ``num_tokens``: pad the vocabulary with filler tokens ``<t0>``, ``<t1>``, ... to this many
    (a tokenizer of a real model's size, e.g. Qwen2.5's 151665, for full-size shapes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = vocab()
    base = len(words)
    for i in range((num_tokens or base) - base):
        words[f"<t{i}>"] = base + i
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split("####", "isolated"),
         pre_tokenizers.Punctuation("isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


ARCH_CONFIGS = {
    # model_type -> (transformers config class name, extra kwargs)
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    # 4 experts, 2 per token; experts narrower than the dense MLP, as in the real models
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


DEMO_ARCH = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
"""The size of the demo models (tools/make_demo_model.py, tools/make_tool_demo_model.py), a
Qwen2: ``tiny_config("qwen2", **DEMO_ARCH)``. Tests that serve a model of this size share one
SGLang server (tests/support/sglang_shared.py)."""


def tiny_config(model_type: str = "qwen2", *, tie_word_embeddings: bool = False, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128, vocab_size: int | None = None, **arch_kwargs):
    """A small transformers config of ``model_type`` matching the tiny tokenizer.
    ``arch_kwargs``: architecture-specific keys, over ``ARCH_CONFIGS``' (e.g. norm_topk_prob)."""
    import transformers

    cls_name, extra = ARCH_CONFIGS[model_type]
    cls = getattr(transformers, cls_name)
    v = vocab()
    return cls(
        vocab_size=vocab_size or len(v),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=v["<pad>"],
        bos_token_id=v["<bos>"],
        eos_token_id=v["<eos>"],
        torch_dtype="float32",
        **(extra | arch_kwargs),
    )


def save_tiny_model(out_dir: str | Path, model_type: str = "qwen2", *, seed: int = 0,
                    tie_word_embeddings: bool = False, **config_kwargs) -> Path:
    """Build a random tiny HF model + tokenizer and save them to ``out_dir``; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(model_type, tie_word_embeddings=tie_word_embeddings, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    (out / "tiny_model.json").write_text(json.dumps({"model_type": model_type, "seed": seed}))
    return out


# ---- the format warm-up ----
def supervised_step(model, opt: torch.optim.Optimizer, rows: list[tuple[list[int], list[int]]],
                    pad_id: int) -> torch.Tensor:
    """One optimizer step of next-token loss on the response tokens of ``rows``.

    rows: N (prompt ids, response ids) pairs; each row is right-padded with ``pad_id`` to the
    longest prompt + response, ids/labels [N, W], labels -100 outside the response. Returns
    the (detached) loss.
    """
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
    loss = model(input_ids=ids, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()
