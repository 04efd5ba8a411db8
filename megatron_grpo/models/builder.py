"""Megatron-core ``GPTModel`` chunks from a Hugging Face config, for the current TP/PP state."""

from __future__ import annotations

import torch

from megatron_grpo.models.architectures import get_architecture
from megatron_grpo.models.architectures.moe import MoEMLP
from megatron_grpo.models.errors import ModelError
from megatron_grpo.runtime import cpu_shim
from megatron_grpo.runtime.device import compute_device, cuda_available


def padded_vocab_size(vocab_size: int, tp: int, divisor: int = 128) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisor * tp`` (megatron's rule, so each TP
    rank holds an equal, ``divisor``-aligned slice). E.g. (255, 1) -> 256, (151936, 2) -> 152064."""
    multiple = divisor * tp
    return -(-vocab_size // multiple) * multiple


def use_transformer_engine() -> bool:
    """The single choice of layer spec: TransformerEngine's when CUDA is available AND
    ``transformer_engine`` imports (a broken install falls back rather than failing at the
    first layer), megatron-core's local spec otherwise (always on CPU: TE needs CUDA).

    Both specs name parameters the same way up to ``architectures.base.TE_ALIASES`` (TE fuses
    the pre-attention and pre-MLP norms into the next linear), which the weight mapping reads.
    The import is deferred to here: TE takes seconds to import and is never used on CPU.
    """
    if not cuda_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(hf_config, *, dtype: torch.dtype = torch.float32, recompute: bool = False,
                       sequence_parallel: bool = False):
    """``TransformerConfig`` = the architecture fields read from config.json + this process's
    parallel sizes (megatron parallel_state) and runtime choices."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    arch = get_architecture(hf_config.model_type)
    on_cpu = not cuda_available()
    runtime = dict(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
    )
    check_moe_parallel(hf_config, arch, runtime)
    check_pipeline_layers(hf_config, runtime["pipeline_model_parallel_size"],
                          runtime["virtual_pipeline_model_parallel_size"])
    if runtime["virtual_pipeline_model_parallel_size"] is not None:
        # Megatron-LM's default for the interleaved schedule. With batched p2p at pp=2 a rank's
        # previous and next stage are the same peer, and the four batched ops (activation and
        # gradient, each way) are matched in posting order: activations land in gradient
        # buffers (same shape, no error; measured: wrong loss from the second micro-batch
        # group on). The overlapped ops put the two directions on two process groups.
        runtime.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if recompute:
        runtime.update(recompute_granularity="full", recompute_method="uniform",
                       recompute_num_layers=1)
    return TransformerConfig(**arch.transformer_config_kwargs(hf_config), **runtime)


def check_moe_parallel(hf_config, arch, runtime: dict) -> None:
    """ModelError (one line, naming the parallel key) for expert-parallel sizes the model
    cannot use: ep > 1 on a dense model, ep not dividing the experts."""
    ep = runtime["expert_model_parallel_size"]
    if not isinstance(arch, MoEMLP):
        if ep > 1:
            raise ModelError(f"parallel.ep={ep} needs a mixture-of-experts model; model_type "
                             f"{hf_config.model_type!r} has no experts (use ep: 1)")
        return
    num_experts = arch.num_experts(hf_config)
    if num_experts % ep:
        raise ModelError(f"parallel.ep={ep} must divide the model's {num_experts} experts")


def check_pipeline_layers(hf_config, pp: int, vpp: int | None) -> None:
    """ModelError (one line, naming config.json's key) unless the layers split evenly over
    the pp stages and, with a virtual pipeline, over the pp * vpp model chunks."""
    num_layers = hf_config.num_hidden_layers
    stages, what = (pp * vpp, f"pp*vpp = {pp}*{vpp}") if vpp else (pp, f"pp = {pp}")
    if num_layers % stages:
        raise ModelError(f"config.json num_hidden_layers={num_layers} is not divisible by parallel "
                         f"{what}: every pipeline chunk must hold the same number of layers")


def check_moe_training(hf_config, tp: int, sequence_parallel: bool) -> None:
    """Training an MoE model at tp > 1 needs sequence parallelism (megatron-core's MoE layer
    raises at the first training forward otherwise; forward-only use is fine without)."""
    if isinstance(get_architecture(hf_config.model_type), MoEMLP) and tp > 1 and not sequence_parallel:
        raise ModelError(f"parallel.sequence_parallel must be true to train the mixture-of-experts "
                         f"model {hf_config.model_type!r} at tp={tp} (megatron-core's MoE layer "
                         "requires it)")


def resolve_attention_backend(attention_backend: str) -> str:
    """``model.attention_backend`` -> the attention that runs: "te" (TransformerEngine's spec,
    what "auto" means where ``use_transformer_engine()``), "sdpa" (the local spec with
    ``models.attention.SDPAttention``; "auto" elsewhere) or "unfused" (the local spec with
    megatron-core's ``DotProductAttention``, kept for comparison)."""
    if attention_backend == "auto":
        return "te" if use_transformer_engine() else "sdpa"
    if attention_backend not in ("sdpa", "unfused"):
        raise ModelError(f"model.attention_backend must be auto, sdpa or unfused, got {attention_backend!r}")
    return attention_backend


def check_packing(hf_config, attention_backend: str) -> None:
    """ModelError (one line) where ``parallel.pack_sequences`` cannot run: packed rows need
    the sdpa core attention (TransformerEngine's thd path is not tested here, megatron-core's
    unfused attention has none), and a dense model (MoE metrics and routing replay lay tokens
    out per padded row; packing an MoE model is untested)."""
    backend = resolve_attention_backend(attention_backend)
    if backend != "sdpa":
        raise ModelError(f"parallel.pack_sequences needs model.attention_backend sdpa; {attention_backend!r} "
                         f"runs {backend} attention here (set model.attention_backend: sdpa)")
    if isinstance(get_architecture(hf_config.model_type), MoEMLP):
        raise ModelError(f"parallel.pack_sequences is not supported for the mixture-of-experts model "
                         f"{hf_config.model_type!r} yet (set it false)")


def check_context_parallel(hf_config, attention_backend: str, cp: int) -> None:
    """ModelError (one line) where ``parallel.cp`` > 1 cannot run: the sdpa core attention does
    context parallelism (``models.context_parallel``), TransformerEngine's spec does it its own
    way (megatron-core's ring attention: a GPU path not run here), megatron-core's unfused
    attention has none; mixture-of-experts models are refused (routing replay and the MoE
    metrics lay tokens out per whole row: not split yet)."""
    if cp == 1:
        return
    backend = resolve_attention_backend(attention_backend)
    if backend == "unfused":
        raise ModelError(f"parallel.cp={cp} needs model.attention_backend sdpa or te; megatron-core's unfused "
                         "attention has no context parallelism (set model.attention_backend: sdpa)")
    if isinstance(get_architecture(hf_config.model_type), MoEMLP):
        raise ModelError(f"parallel.cp={cp} is not supported for the mixture-of-experts model "
                         f"{hf_config.model_type!r} yet (set parallel.cp: 1)")


def layer_spec(hf_config, config, attention_backend: str = "auto"):
    """The transformer-layer spec of ``resolve_attention_backend(attention_backend)``: TE's
    spec, or megatron-core's local spec whose core attention is SDPA or the unfused one."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_grpo.models.attention import SDPAttention  # imports megatron-core: deferred like it

    backend = resolve_attention_backend(attention_backend)
    if backend == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm, normalization=config.normalization
    )
    if backend == "sdpa":  # a fresh spec per call: replacing its submodule touches no shared state
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_model(hf_config, *, dtype: torch.dtype = torch.float32,
                make_vocab_size_divisible_by: int = 128, recompute: bool = False,
                sequence_parallel: bool = False, init_weights: bool = True,
                attention_backend: str = "auto") -> list:
    """GPTModel chunks of this rank's PP stage: one, or one per virtual stage (``vpp``).

    With a virtual pipeline (megatron's interleaved schedule) chunk ``i`` of PP rank ``r``
    holds the layers of virtual stage ``i * pp + r`` (``vp_stage=i``: megatron computes the
    layer offset, so ``layer.layer_number`` is the global 1-based index). The embedding lives
    in chunk 0 of the first PP rank, the output layer in the last chunk of the last one.

    ``attention_backend``: ``model.attention_backend`` (``resolve_attention_backend``).
    Weights are randomly initialised unless ``init_weights=False`` (faster when a checkpoint is
    loaded right after). Each chunk gets a ``hf_config`` attribute, which checkpoint saving reads.
    """
    from megatron.core import parallel_state

    config = transformer_config(hf_config, dtype=dtype, recompute=recompute,
                                sequence_parallel=sequence_parallel)
    config.perform_initialization = init_weights
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is None:
        stages = [dict(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
                       post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True))]
    else:
        stages = [dict(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                       post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                       vp_stage=i) for i in range(vpp)]
    return [_build_chunk(hf_config, config, attention_backend, dtype, make_vocab_size_divisible_by, init_weights,
                         **stage) for stage in stages]


def _build_chunk(hf_config, config, attention_backend: str, dtype: torch.dtype, make_vocab_size_divisible_by: int,
                 init_weights: bool, **stage_kwargs):
    """One GPTModel chunk; ``stage_kwargs``: pre_process, post_process and (VPP) vp_stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    arch = get_architecture(hf_config.model_type)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    with cpu_shim.tensor_cuda_is_identity():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(hf_config, config, attention_backend),
            vocab_size=padded_vocab_size(hf_config.vocab_size, tp, make_vocab_size_divisible_by),
            parallel_output=True,
            **stage_kwargs,
            **arch.gpt_model_kwargs(hf_config),
        )
    if not init_weights:
        mark_tensor_parallel_params(model)
    if dtype != torch.float32:
        # The local spec's torch RMSNorm ignores params_dtype and stays fp32; TE's norms and
        # Megatron-LM's Float16Module make every parameter `dtype`. Do the same so the model
        # (and its checkpoints) are in one dtype on CPU and GPU.
        for param in model.parameters():
            param.data = param.data.to(dtype)
    model.to(compute_device())
    model.hf_config = hf_config
    return model


def mark_tensor_parallel_params(model) -> None:
    """Set the ``tensor_model_parallel`` / ``partition_dim`` attributes megatron-core only sets
    inside its weight initialisers (skipped with ``perform_initialization=False``).

    Without them every TP shard of an embedding or linear weight looks like a TP *duplicate*,
    so the gradient norm (and clipping) silently counts only TP rank 0's shard.
    """
    from megatron.core import tensor_parallel as tpl

    partition_dims = ((tpl.ColumnParallelLinear, 0), (tpl.RowParallelLinear, 1), (tpl.VocabParallelEmbedding, 0))
    for module in model.modules():
        for cls, dim in partition_dims:
            weight = getattr(module, "weight", None)
            if isinstance(module, cls) and weight is not None and not getattr(weight, "tensor_model_parallel", False):
                tpl.set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
