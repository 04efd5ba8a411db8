"""The causal forward of Megatron chunks: the ONE path the trainer, the conversion self-check
and the equivalence tests run.

``causal_logits(model, tokens)`` is what every forward step calls (the trainer's log-prob
passes and loss step in ``trainer.megatron_step``, and ``forward_logits`` here); so a test of
``forward_logits`` tests the trainer's own inputs: placement (``runtime.device``), position
ids, sequence-parallel padding and the attention mask.

Sequence parallelism splits the sequence dimension over the tp ranks, so with
``sequence_parallel`` on the sequence length must be a multiple of tp: ``causal_logits``
right-pads the tokens to that multiple and ``run_schedule`` tells the pipeline schedule the
padded length. Right padding is invisible to every real position (causal attention never
looks ahead), so callers simply read the first S positions of the logits.

``packed_logits(model, packed)`` is the same forward step for a packed micro-batch
(``models.packing``: rows concatenated into one, ``parallel.pack_sequences``).

Logits of the scored positions only: ``causal_logits(model, tokens, first)`` runs the output
layer (and the log-softmax after it) on positions ``first..`` alone, slicing the hidden states
on their way in, as megatron-core's own inference does for the last token; every position still
runs through the decoder. Not with sequence parallelism (``logits_start`` says 0).
``packed_logits(model, packed, positions)`` does the same at a packed row's scored positions.
Why and how much it saves: docs/design.md#what-one-step-does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_grpo.models.context_parallel import cp_group_info, local_index
from megatron_grpo.models.packing import PackedRows, packed_seq_params
from megatron_grpo.runtime.device import to_device

PAD_ID = 0  # token id of the sequence-parallel padding (never scored: it is past every real position)


def sequence_multiple(model) -> int:
    """The multiple the sequence length must have for ``model`` (a chunk, DDP-wrapped or
    not): tp with sequence parallelism, else 1; times 2 x cp under context parallelism (every
    sequence cut into 2 x cp equal chunks, ``models.context_parallel``)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    cp = config.context_parallel_size
    return multiple * 2 * cp if cp > 1 else multiple


def context_parallel_size(model) -> int:
    """``parallel.cp`` of ``model``'s config (1: no context parallelism)."""
    from megatron.core.utils import get_model_config

    return get_model_config(model).context_parallel_size


def padded_length(seq_len: int, multiple: int) -> int:
    """``seq_len`` rounded up to a multiple of ``multiple``. E.g. (7, 2) -> 8, (8, 2) -> 8."""
    return -(-seq_len // multiple) * multiple


def pad_sequence(tokens_BS: torch.Tensor, multiple: int, pad_id: int = PAD_ID) -> torch.Tensor:
    """``tokens_BS`` [B, S] right-padded with ``pad_id`` to [B, padded_length(S, multiple)]."""
    b, s = tokens_BS.shape
    target = padded_length(s, multiple)
    if target == s:
        return tokens_BS
    pad = torch.full((b, target - s), pad_id, dtype=tokens_BS.dtype, device=tokens_BS.device)
    return torch.cat([tokens_BS, pad], dim=1)


def model_inputs(tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, S] and position_ids [B, S] on the model's device (``runtime.device``)."""
    tokens_BS = to_device(tokens_BS)
    b, s = tokens_BS.shape
    positions = torch.arange(s, device=tokens_BS.device).unsqueeze(0).expand(b, s)
    return tokens_BS, positions


def logits_start(model, first_scored: int) -> int:
    """The first position ``causal_logits`` can give logits from when the caller reads none
    before ``first_scored``: ``first_scored``, or 0 under sequence parallelism (the sequence
    multiple beyond context parallelism's 2 x cp)."""
    cp = context_parallel_size(model)
    beyond_cp = sequence_multiple(model) // (2 * cp if cp > 1 else 1)
    return 0 if beyond_cp > 1 else max(0, first_scored)


def _output_layer(model):
    """The chunk's output layer (unwrapped from DDP and the fp16 wrapper), or None where the
    chunk has none (not the last pipeline stage)."""
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)
    return getattr(inner, "output_layer", None) if getattr(inner, "post_process", False) else None


@contextlib.contextmanager
def _output_from(model, positions: "int | torch.Tensor"):
    """Within the block, the chunk's output layer sees its input hidden states [S, B, H] only
    at ``positions``: from that index on (an int), or at those indices (long [R]); the hook is
    gone after the block (the backward needs none)."""
    whole = isinstance(positions, int) and positions == 0
    layer = None if whole else _output_layer(model)
    if layer is None:
        yield
        return

    def only_positions(module, args, kwargs):
        hidden = args[0]
        picked = hidden[positions:] if isinstance(positions, int) else hidden.index_select(0, positions)
        return (picked, *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(only_positions, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def causal_logits(model, tokens_BS: torch.Tensor, start: int = 0) -> torch.Tensor:
    """One forward step of a chunk: vocab-parallel logits [B, S_pad - start, V_pad/tp] on the
    last PP stage (the hidden states elsewhere). S_pad = S padded to
    ``sequence_multiple(model)``; logits position j is that of token position ``start + j``.
    ``start``: from ``logits_start`` (0 under sequence parallelism)."""
    assert start == 0 or sequence_multiple(model) == 1, "no logits slice with sequence or context parallelism"
    tokens_BS = pad_sequence(tokens_BS, sequence_multiple(model))
    # attention_mask=None: the causal mask comes from the layer spec (AttnMaskType.causal)
    with _output_from(model, start):
        return model(*model_inputs(tokens_BS), attention_mask=None)


def context_parallel_logits(model, tokens_BS: torch.Tensor, columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``causal_logits`` under context parallelism: the chunk runs this CP rank's tokens of every
    row (``models.context_parallel``: ``tokens_BS`` padded to ``sequence_multiple(model)``, this
    rank's chunks at their true positions). Vocab-parallel logits [B, R, V_pad/tp] of the local
    token indices ``columns`` (long [R]; None: every local token) on the last PP stage, the
    hidden states elsewhere. Collective over the CP group (attention gathers keys and values)."""
    cp, rank, _ = cp_group_info()
    tokens_BS = to_device(pad_sequence(tokens_BS, sequence_multiple(model)))
    index = local_index([tokens_BS.shape[1]], cp, rank).to(tokens_BS.device)
    local = tokens_BS.index_select(1, index)
    positions = index.unsqueeze(0).expand_as(local)  # RoPE slices its own angles; learned embeddings read these
    with _output_from(model, 0 if columns is None else to_device(columns)):
        return model(local, positions, attention_mask=None)


@contextlib.contextmanager
def _rope_at(model, position_ids_T: torch.Tensor):
    """Within the block, the chunk's rotary embedding gives the angles of ``position_ids_T``
    (long [T]: each packed token's position in its own row) instead of those of 0..max_seqlen:
    [T, 1, 1, dim], which megatron's thd RoPE applies token by token (its "freqs for every
    packed position" case). So a shared-prefix row's own tokens, which follow the other rows'
    in the pack, still rotate by their positions in that row. No-op for a model without RoPE
    (its position embedding reads the ids itself)."""
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)
    rope = getattr(inner, "rotary_pos_emb", None) if getattr(inner, "position_embedding_type", "") == "rope" else None
    if rope is None:
        yield
        return
    assert not inner.config.apply_rope_fusion, "packed rows take their RoPE angles from the position ids (unfused)"

    def at_positions(module, args, output):
        return output.index_select(0, position_ids_T)

    handle = rope.register_forward_hook(at_positions)
    try:
        yield
    finally:
        handle.remove()


def packed_logits(model, packed: PackedRows, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``causal_logits`` of a packed micro-batch (``models.packing``): vocab-parallel logits
    [1, T, V_pad/tp] on the last PP stage (the hidden states elsewhere), packed index p that of
    packed token p in its own row; with ``positions`` (long [R], packed indices, repeats allowed:
    rows sharing a prefix read its last token) [1, R, V_pad/tp], those indices' only. Needs the
    sdpa core attention (the packed mask comes from ``cu_seqlens`` and the branches) and no
    sequence parallelism (T is not padded to a multiple of tp). Under context parallelism
    ``packed`` is this CP rank's share (``models.context_parallel.split_packed``): megatron's CP
    RoPE places its tokens from the padded ``cu_seqlens``."""
    from megatron.core.utils import get_model_config

    assert not get_model_config(model).sequence_parallel, "packed sequences do not support sequence parallelism"
    tokens, position_ids = to_device(packed.tokens), to_device(packed.position_ids)
    rope = _rope_at(model, position_ids[0]) if context_parallel_size(model) == 1 else contextlib.nullcontext()
    with _output_from(model, 0 if positions is None else to_device(positions)), rope:
        return model(tokens, position_ids, attention_mask=None, packed_seq_params=packed_seq_params(packed))


def run_schedule(model_chunks: list, items: Iterable[Any], forward_step: Callable, *, forward_only: bool,
                 num_microbatches: int, seq_length: int, micro_batch_size: int,
                 variable_seq_lengths: bool = False):
    """megatron-core's forward(-backward) schedule over ``items`` (one per micro-batch), told
    the sequence length the chunks really see (``seq_length`` padded as ``causal_logits`` does).

    With several chunks (virtual pipeline) megatron runs its interleaved 1F1B schedule, which
    reads one data iterator per chunk: each gets its own pass over ``items``. That schedule
    takes a number of micro-batches that is a multiple of pp (``interleaved_microbatches``);
    a forward-only pass with another number repeats its last item up to one and drops the
    repeats' outputs (a training pass must already have a valid number: the loss scaling
    counts micro-batches, so the trainer's config validation guarantees it).

    variable_seq_lengths: the micro-batches differ in shape (token-budget micro-batching).
    Pipeline stages then send each activation's shape before it (megatron's
    ``variable_seq_lengths``, read from the chunks' config by the p2p code of this call);
    otherwise every stage assumes [seq_length, micro_batch_size, hidden]."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    for chunk in model_chunks:
        get_model_config(chunk).variable_seq_lengths = variable_seq_lengths

    items = list(items)
    data_iterator: Any = iter(items)
    num_run = num_microbatches
    if len(model_chunks) > 1:
        num_run = interleaved_microbatches(num_microbatches, forward_only)
        items = items + items[-1:] * (num_run - num_microbatches)
        data_iterator = [iter(items) for _ in model_chunks]
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model_chunks,
        num_microbatches=num_run, micro_batch_size=micro_batch_size, forward_only=forward_only,
        seq_length=padded_length(seq_length, sequence_multiple(model_chunks[0])),
    )
    return outputs[:num_microbatches] if isinstance(outputs, list) else outputs


def interleaved_microbatches(num_microbatches: int, forward_only: bool) -> int:
    """The number of micro-batches megatron's interleaved schedule runs for ``num_microbatches``:
    itself when it is a multiple of pp (megatron-core 0.16 requires that, with its default
    ``microbatch_group_size_per_vp_stage = pp``), else, forward-only, the next multiple of pp.
    ValueError for a training pass with another number."""
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if num_microbatches % pp == 0:
        return num_microbatches
    if not forward_only:
        raise ValueError(f"the interleaved pipeline schedule (parallel.vpp) needs a number of "
                         f"micro-batches per step that is a multiple of pp={pp}, got {num_microbatches}")
    return padded_length(num_microbatches, pp)


def forward_logits(model_chunks: list, input_ids_BS: torch.Tensor) -> torch.Tensor | None:
    """Causal forward of one micro-batch. Returns the vocab-parallel logits [B, S, V_pad/tp] on
    the last PP stage and None on the others. Collective over the model-parallel group."""
    from megatron.core import parallel_state

    B, S = input_ids_BS.shape

    def step(data_iterator, model):
        return causal_logits(model, next(data_iterator)), None

    was_training = [c.training for c in model_chunks]
    for c in model_chunks:
        c.eval()
    try:
        with torch.no_grad():
            outputs = run_schedule(model_chunks, [input_ids_BS], step, forward_only=True, num_microbatches=1,
                                   seq_length=S, micro_batch_size=B)
    finally:
        for c, training in zip(model_chunks, was_training):
            c.train(training)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return outputs[0][:, :S]


def gather_vocab(logits_BSv: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-parallel logits [B, S, V_pad/tp] -> full logits [B, S, vocab_size] (padding
    columns dropped). Collective over the TP group."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits_BSv)[..., :vocab_size]
