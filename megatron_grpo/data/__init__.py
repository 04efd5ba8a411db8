"""Prompt data: read JSONL/Parquet, apply the chat template, tokenize, sample resumably.

    dataset = load_prompt_dataset(config.data, tokenizer)          # DataError on a bad record
    sampler = PromptSampler(dataset, config.rollout.prompts_per_step, config.trainer.seed,
                            shuffle=config.data.shuffle)
    batch = sampler.next_batch()                                     # list[Prompt]
    checkpoint["data"] = sampler.state_dict()                        # ... load_state_dict on resume
"""

from megatron_grpo.data.dataset import PromptDataset, PromptSampler, epoch_order, load_prompt_dataset
from megatron_grpo.data.prompts import Prompt, build_prompts
from megatron_grpo.data.records import DataError, RawRecord, read_records

__all__ = [
    "DataError",
    "Prompt",
    "PromptDataset",
    "PromptSampler",
    "RawRecord",
    "build_prompts",
    "epoch_order",
    "load_prompt_dataset",
    "read_records",
]
