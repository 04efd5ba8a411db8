"""Forward-only logits through megatron's pipeline schedule (any TP/PP), for checks and tools.

The trainer has its own step functions; this is the minimal causal forward used by the
conversion self-check and the equivalence tests.
"""

from __future__ import annotations

import torch


def forward_logits(model_chunks: list, input_ids_BS: torch.Tensor) -> torch.Tensor | None:
    """Causal forward of one micro-batch. Returns the vocab-parallel logits [B, S, V_pad/tp] on
    the last PP stage and None on the others. Collective over the model-parallel group."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model_chunks[0].parameters()).device
    B, S = input_ids_BS.shape
    batch = {
        "input_ids": input_ids_BS.to(device),
        "position_ids": torch.arange(S, device=device).unsqueeze(0).expand(B, S),
    }

    def step(data_iterator, model):
        b = next(data_iterator)
        # attention_mask=None: the causal mask comes from the layer spec (AttnMaskType.causal)
        return model(b["input_ids"], b["position_ids"], attention_mask=None), None

    was_training = [c.training for c in model_chunks]
    for c in model_chunks:
        c.eval()
    try:
        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter([batch]),
                model=model_chunks,
                num_microbatches=1,
                seq_length=S,
                micro_batch_size=B,
                forward_only=True,
            )
    finally:
        for c, training in zip(model_chunks, was_training):
            c.train(training)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return outputs[0]


def gather_vocab(logits_BSv: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-parallel logits [B, S, V_pad/tp] -> full logits [B, S, vocab_size] (padding
    columns dropped). Collective over the TP group."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits_BSv)[..., :vocab_size]
