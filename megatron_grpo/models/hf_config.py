"""Reading a Hugging Face model directory: its config and the files that travel with it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_grpo.models.architectures import get_architecture
from megatron_grpo.models.errors import ModelError

# Files copied along with the weights (into Megatron checkpoints and back into HF exports):
# everything a tokenizer / generation config / chat template may be made of.
SIDECAR_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
    "*.model", "*.tiktoken", "chat_template.*", "generation_config.json",
    "preprocessor_config.json",
)


class _DuplicateKey(ValueError):
    """A key given twice in one object of config.json."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` of config.json (at every nesting level)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def load_hf_config(hf_dir: str | Path):
    """``transformers.PretrainedConfig`` of ``hf_dir``; ModelError (one line) if the directory
    or its config.json is missing or unreadable, holds a key twice, or the model_type is not
    supported."""
    from transformers import AutoConfig

    path = Path(hf_dir)
    config_file = path / "config.json"
    if not path.is_dir():
        raise ModelError(f"{path}: Hugging Face model directory not found")
    if not config_file.is_file():
        raise ModelError(f"{config_file}: not found (a Hugging Face model directory needs one)")
    try:
        raw = json.loads(config_file.read_text(), object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ModelError(f"{config_file}:{e.lineno}: invalid JSON ({e.msg})") from None
    except _DuplicateKey as e:
        raise ModelError(f"{config_file}: duplicate key {e.key!r} (a JSON parser keeps the last "
                         "one silently; which value was meant is unknown)") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{config_file}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    get_architecture(model_type, where=str(config_file))  # before transformers sees it
    return AutoConfig.from_pretrained(str(path))


def sidecar_files(hf_dir: str | Path) -> list[Path]:
    """Tokenizer / generation / chat-template files of ``hf_dir`` (sorted, no duplicates)."""
    path = Path(hf_dir)
    found = {p for pattern in SIDECAR_PATTERNS for p in path.glob(pattern) if p.is_file()}
    return sorted(found)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_problem(hf_config, tp: int, pp: int) -> tuple[str, str] | None:
    """Why the model of ``hf_config`` cannot be split at ``tp`` x ``pp``, as (``"tp"`` or
    ``"pp"``, one line naming the config.json field and the sizes that work), or None.

    Megatron splits the attention heads and the key/value heads over TP ranks and the layers
    over PP stages, so each must be divisible: SmolLM2-135M (9 heads, 3 KV heads) takes TP 1 or
    3, never 2."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    for count, name in ((heads, "num_attention_heads"), (kv_heads, "num_key_value_heads")):
        if count % tp:
            works = ", ".join(str(d) for d in _divisors(math.gcd(heads, kv_heads)))
            return "tp", (f"{tp} does not divide the model's {name} = {count} (config.json); "
                          f"tensor-parallel sizes that work: {works}")
    layers = hf_config.num_hidden_layers
    if layers % pp:
        works = ", ".join(str(d) for d in _divisors(layers))
        return "pp", (f"{pp} does not divide the model's num_hidden_layers = {layers} (config.json); "
                      f"pipeline-parallel sizes that work: {works}")
    return None
