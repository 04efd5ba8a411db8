"""Loading a model directory's tokenizer exactly as its files describe it."""

from __future__ import annotations

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(hf_dir: str):
    """The tokenizer of ``hf_dir`` exactly as its files describe it.

    transformers 5's AutoTokenizer replaces a directory's generic ``tokenizer.json`` pipeline by
    the one registered for config.json's ``model_type`` (e.g. Qwen2's byte-level regex) even
    when tokenizer_config.json declares the generic class; for such directories the declared
    class is loaded directly, so the trainer tokenizes what the model was trained on.
    """
    import json
    from pathlib import Path

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_path = Path(hf_dir) / "tokenizer_config.json"
    declared = json.loads(cfg_path.read_text()).get("tokenizer_class") if cfg_path.is_file() else None
    if declared in GENERIC_TOKENIZER_CLASSES and (Path(hf_dir) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(hf_dir)
    return AutoTokenizer.from_pretrained(hf_dir)
