"""Shared by the tests/test_models_*.py modules: tiny HF models whose every tensor matters.

HF initialises norm weights to 1 and biases to 0, so with the plain tiny models a swapped
q/k norm, a norm mapped to the wrong layer, or a dropped QKV bias would not change a single
logit. ``make_hf_model`` re-saves the tiny model with norms ~ 1 + 0.3 N(0, 1) and biases
~ 0.3 N(0, 1), and scales the other weights up so logits are O(1) (a 1e-5 tolerance then
means something).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools.tiny import save_tiny_model

PROBE_IDS = torch.tensor([[3, 17, 200, 45, 9, 254, 0, 88, 120, 31, 7, 64],
                          [250, 1, 2, 99, 100, 101, 13, 5, 77, 160, 42, 11]])


def make_hf_model(out_dir: str | Path, model_type: str, tied: bool, seed: int = 0, **config) -> Path:
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(out_dir, model_type, tie_word_embeddings=tied, seed=seed, **config)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            else:
                p.mul_(4.0)
    model.save_pretrained(str(path))
    return path


def hf_reference_logits(hf_dir: str | Path, input_ids: torch.Tensor = PROBE_IDS) -> torch.Tensor:
    """fp32 logits [B, S, V] of the HF model: the independent reference."""
    from megatron_grpo.models.self_check import hf_logits

    return hf_logits(hf_dir, input_ids)


def hf_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor stored in the HF directory's safetensors, by name."""
    from megatron_grpo.models.weights import SafetensorsReader

    reader = SafetensorsReader(hf_dir)
    return {name: reader.get(name) for name in reader.weight_map}
