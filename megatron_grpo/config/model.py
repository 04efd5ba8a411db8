"""`model:` and `parallel:` sections: which network, in which precision, split how."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from megatron_grpo.config.base import check


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "all-linear")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on the trainer's linears (docs/lora.md); the base weights are frozen."""

    rank: int = 16
    """Rank r of each adapter (A is [r, in], B is [out, r])."""

    alpha: float = 32.0
    """Scale numerator: the adapter adds (alpha / rank) * B @ A to each adapted weight (peft's
    lora_alpha)."""

    dropout: float = 0.0
    """Dropout on the adapter's input in the update's forward (not in the log-prob passes, so
    it perturbs the importance ratio); tp=1 only."""

    target_modules: list[str] | str = field(default_factory=lambda: ["all-linear"])
    """Megatron-core linears to adapt: linear_qkv (q, k, v), linear_proj (o), linear_fc1 (gate,
    up), linear_fc2 (down), or all-linear for all four. Mixture-of-experts experts are not
    adapted (refused). One name may be written alone, as PEFT takes it (`all-linear`); it is
    kept as a list of that name."""

    init_seed: int = 0
    """Seed of the A matrices (the same adapters at every tp/pp)."""

    def __post_init__(self):
        if isinstance(self.target_modules, str):  # PEFT's string form: `target_modules: all-linear`
            self.target_modules = [self.target_modules]
        check(self.rank >= 1, "rank", f"must be >= 1, got {self.rank}")
        check(self.alpha > 0 and math.isfinite(self.alpha), "alpha", f"must be > 0, got {self.alpha}")
        check(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        check(bool(self.target_modules), "target_modules", f"must name at least one of {', '.join(LORA_TARGETS)}")
        for t in self.target_modules:
            check(t in LORA_TARGETS, "target_modules",
                  f"{t!r} is not a LoRA target; accepted: {', '.join(LORA_TARGETS)} (megatron-core's names: "
                  "q/k/v_proj -> linear_qkv, o_proj -> linear_proj, gate/up_proj -> linear_fc1, down_proj -> linear_fc2)")
        check(len(set(self.target_modules)) == len(self.target_modules), "target_modules",
              f"lists a target twice: {self.target_modules}")
        check(self.init_seed >= 0, "init_seed", f"must be >= 0, got {self.init_seed}")


@dataclass(kw_only=True)
class ModelConfig:
    hf_dir: str
    """Hugging Face model directory (config.json, *.safetensors, tokenizer files). The
    architecture is read from its config.json; the rollout engine serves it."""

    megatron_ckpt: Optional[str] = None
    """Megatron distributed checkpoint converted from `hf_dir` (tools/convert_hf_to_megatron.py).
    null: the trainer converts the HF weights in memory at start-up."""

    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter and compute dtype of the trainer's model. bfloat16 (CPU and GPU) trains with
    megatron-core's mixed-precision optimizer: bf16 parameters and activations, fp32 main
    weights, gradient buffers and Adam state; checkpoints hold the fp32 main weights and the
    weight sync sends them, cast once to the engine's `engine.dtype`. float16 is refused:
    megatron-core's fp16 optimizer divides the gradients by a loss scale (2^32 at the start)
    that only megatron's own training loop multiplies into the loss, so every update would
    be ~2^32 times too small."""

    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times tp; padded rows are masked to
    probability 0 when scoring tokens."""

    logprob_chunk_size: Optional[int] = None
    """Tokens per chunk in the vocab-parallel log-prob/entropy op (bounds its work buffers on
    long sequences); null = automatic (cache-sized chunks)."""

    logprob_kernel: Literal["auto", "torch", "triton"] = "auto"
    """Implementation of the log-prob/entropy op's per-rank passes: torch (chunked torch ops,
    any device), triton (fused one-pass Triton kernels, ops/triton_logprobs.py; needs CUDA,
    refused at pre-flight without) or auto (triton for CUDA logits when triton is installed,
    else torch). Same values and gradients; the collectives are the same two all-reduces.
    The speed of each on a GPU: docs/gpu.md."""

    recompute_activations: bool = False
    """Full activation recomputation of each transformer layer (saves memory, costs a forward)."""

    attention_backend: Literal["auto", "sdpa", "unfused"] = "auto"
    """Core attention of the trainer's model. auto: TransformerEngine's layer spec where CUDA
    and transformer_engine are available, else sdpa. sdpa: megatron-core's local spec with
    torch's scaled_dot_product_attention (flash / memory-efficient kernels on GPU, the math
    kernel on CPU; packed sequences). unfused: megatron-core's local spec as shipped (batched
    matmul + softmax, memory quadratic in the length), kept for comparison. sdpa and unfused
    cannot run parallel.sequence_parallel (the local spec has no sequence-parallel norm)."""

    lora: Optional[LoraConfig] = None
    """LoRA: train low-rank adapters on the frozen model instead of all its weights
    (docs/lora.md). null: full fine-tuning."""

    def __post_init__(self):
        check(bool(self.hf_dir), "hf_dir", "must name a Hugging Face model directory")
        check(
            self.dtype != "float16",
            "dtype",
            "float16 training is not supported (megatron-core's fp16 optimizer needs a loss scale "
            "this trainer does not apply); use bfloat16 (mixed precision with fp32 main weights) or float32",
        )
        check(self.make_vocab_size_divisible_by >= 1, "make_vocab_size_divisible_by", "must be >= 1")
        check(
            self.logprob_chunk_size is None or self.logprob_chunk_size >= 1,
            "logprob_chunk_size",
            f"must be >= 1 or null, got {self.logprob_chunk_size}",
        )


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    cp: int = 1
    """Context-parallel size: each sequence of a micro-batch is split over `cp` ranks
    (megatron's load-balanced layout: 2 x cp chunks, rank r keeps chunks r and 2cp-1-r), so a
    rank holds 1/cp of every long sequence's activations and logits. Exact: attention gathers
    the whole sequence's keys and values, and the loss is computed on the whole sequence's
    token log-probs on every CP rank (docs/models.md#context-parallelism-parallelcp). dp =
    world_size / (tp * pp * cp). Needs model.attention_backend sdpa (or te on a GPU with
    TransformerEngine); not with share_prefix, nor a mixture-of-experts model."""

    vpp: Optional[int] = None
    """Virtual pipeline stages per PP rank (megatron's interleaved 1F1B schedule): each rank
    holds `vpp` model chunks of num_layers / (pp * vpp) layers, which shrinks the pipeline
    bubble. null or 1: off. Needs pp >= 2, num_hidden_layers divisible by pp * vpp (checked
    when the model is built) and a number of micro-batches per optimizer step,
    global_batch_size / (micro_batch_size * dp), that is a multiple of pp."""

    ep: int = 1
    """Expert-parallel size (mixture-of-experts models only): the experts of every MoE layer
    are split over `ep` of the dp ranks. Must divide dp and the model's number of experts;
    experts are tensor-parallel over `etp` (default: `tp`, like the rest of the model)."""

    etp: Optional[int] = None
    """Expert tensor-parallel size (mixture-of-experts models only): each expert's weights are
    split over `etp` ranks instead of `tp` (megatron-core's expert_tensor_parallel_size).
    null: tp. world_size / pp must be divisible by etp * ep."""

    world_size: Optional[int] = None
    """Total trainer ranks. null: taken from the launcher (torchrun's WORLD_SIZE); when set,
    it must match the launcher, and `megatron-grpo train` starts this many ranks. dp is
    derived: world_size / (tp * pp * cp)."""

    micro_batch_size: int = 1
    """Sequences per micro-batch on one rank (one forward/backward)."""

    max_tokens_per_microbatch: Optional[int] = None
    """Token budget of one micro-batch on one rank. null: micro-batches of micro_batch_size
    rows, each padded to the step's longest sequence. Set: each mini-batch's rows are sorted
    by length and grouped into micro-batches whose padded size (rows x their longest
    prompt+response) stays within this budget, each cut to its own longest row, so a
    long-tailed length mix wastes far less compute on padding (micro_batch_size is then not
    used to split; the loss is the same for any split). A sequence longer than the budget
    gets a micro-batch of its own. Applies to the log-prob passes and the update."""

    global_batch_size: int = 8
    """Sequences per optimizer step over all dp ranks (a mini-batch). Must be a multiple of
    micro_batch_size * dp and divide the rollout batch."""

    use_distributed_optimizer: Union[Literal["auto"], bool] = False
    """Shard optimizer state over dp ranks (megatron-core DistributedOptimizer, saved in its
    sharded checkpoint format). It needs CUDA: true is an error at start-up on a machine
    without a usable GPU; auto uses it where CUDA is available and the plain megatron
    optimizer elsewhere; false never uses it."""

    pack_sequences: bool = False
    """Concatenate each micro-batch's rows into one row without padding (megatron's packed
    `thd` layout: RoPE positions restart at every row, attention stays inside each row), so
    long-tailed responses stop paying for padding. Needs max_tokens_per_microbatch (the budget
    then counts real tokens: rows are packed while their summed lengths fit) and
    model.attention_backend sdpa (auto on a machine without TransformerEngine); not with
    sequence_parallel, nor (refused when the model is built) a mixture-of-experts model."""

    share_prefix: bool = False
    """With pack_sequences: the rows of a micro-batch that start with the same prompt (a GRPO
    group) run it once, each row's response attending to the one copy (the shared-prefix
    forward, Prefix Grouper; verl's use_prefix_grouper). The same log-probs, loss and
    gradients as without it, on fewer tokens: a group of G rows with a P-token prompt runs
    P + G x (response) tokens instead of G x (P + response). The token budget keeps each group
    in one micro-batch where it fits. Worth it when prompts are long next to responses."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1): activations outside the attention and
    MLP blocks are split over the tp ranks along the sequence; sequences are right-padded to
    a multiple of tp (the padding is never scored)."""

    distributed_timeout_s: float = 600.0
    """Seconds a rank waits for the others, at every collective and when the ranks of a
    multi-node launch meet (rendezvous), before the run stops with an error. A node that
    dies without closing its connections is noticed after this long; it must exceed the
    longest phase one rank runs while the others wait (rank 0's rollout, a checkpoint save)."""

    def __post_init__(self):
        for key in ("tp", "pp", "cp", "ep", "micro_batch_size", "global_batch_size"):
            value = getattr(self, key)
            check(value >= 1, key, f"must be >= 1, got {value}")
        check(self.max_tokens_per_microbatch is None or self.max_tokens_per_microbatch >= 2,
              "max_tokens_per_microbatch", f"must be >= 2 (a prompt token and a response token) or null, "
              f"got {self.max_tokens_per_microbatch}")
        check(not self.pack_sequences or self.max_tokens_per_microbatch is not None, "pack_sequences",
              "needs max_tokens_per_microbatch (the token budget of a packed row); set it or pack_sequences: false")
        check(not self.share_prefix or self.pack_sequences, "share_prefix",
              "needs pack_sequences: true (a shared prompt is one packed segment)")
        check(not (self.share_prefix and self.cp > 1), "share_prefix",
              f"cannot be combined with cp={self.cp} (a shared prompt's branches are not split over CP ranks); "
              "set share_prefix: false or cp: 1")
        check(not (self.pack_sequences and self.sequence_parallel), "pack_sequences",
              "cannot be combined with sequence_parallel (a packed row is not padded to a multiple of tp)")
        check(self.etp is None or self.etp >= 1, "etp", f"must be >= 1 or null, got {self.etp}")
        check(self.vpp is None or self.vpp >= 1, "vpp", f"must be >= 1 or null, got {self.vpp}")
        check(not self.virtual_pipeline or self.pp >= 2, "vpp",
              f"{self.vpp} needs pp >= 2 (virtual stages interleave several pipeline ranks), got pp={self.pp}")
        # the interleaved schedule needs a multiple of pp micro-batches of one shape per step;
        # a token budget makes both vary (not supported together yet)
        check(not (self.virtual_pipeline and self.max_tokens_per_microbatch), "max_tokens_per_microbatch",
              f"cannot be combined with vpp={self.vpp} yet; use micro_batch_size with virtual pipeline stages")
        if self.world_size is not None:
            check(self.world_size >= 1, "world_size", f"must be >= 1, got {self.world_size}")
            check(
                self.world_size % (self.tp * self.pp * self.cp) == 0,
                "world_size",
                f"{self.world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp}",
            )
            dp = self.dp(self.world_size)
            check(dp % self.ep == 0, "ep", f"{self.ep} does not divide dp = world_size/(tp*pp*cp) = {dp}")
            self.check_expert_layout(self.world_size)
            check(
                self.global_batch_size % (self.micro_batch_size * dp) == 0,
                "global_batch_size",
                f"{self.global_batch_size} is not a multiple of micro_batch_size*dp = "
                f"{self.micro_batch_size}*{dp}",
            )
            self.check_vpp_microbatches(dp)
        check(not self.sequence_parallel or self.tp > 1, "sequence_parallel", "needs tp > 1")
        check(self.distributed_timeout_s > 0, "distributed_timeout_s", f"must be > 0, got {self.distributed_timeout_s}")

    def check_expert_layout(self, world_size: int) -> None:
        """megatron-core lays the experts out as etp x ep blocks inside each pipeline stage."""
        etp = self.tp if self.etp is None else self.etp
        check((world_size // self.pp) % (etp * self.ep) == 0, "etp",
              f"etp*ep = {etp}*{self.ep} does not divide world_size/pp = {world_size}/{self.pp}")

    @property
    def virtual_pipeline(self) -> bool:
        """Whether the interleaved (virtual) pipeline schedule is on (vpp > 1)."""
        return self.vpp is not None and self.vpp > 1

    def check_vpp_microbatches(self, dp: int) -> None:
        """megatron-core's interleaved schedule runs groups of pp micro-batches per chunk: the
        micro-batches of one optimizer step must be a multiple of pp."""
        if not self.virtual_pipeline:
            return
        num_microbatches = self.global_batch_size // (self.micro_batch_size * dp)
        check(num_microbatches % self.pp == 0, "vpp",
              f"{self.vpp} needs micro-batches per step = global_batch_size/(micro_batch_size*dp) = "
              f"{self.global_batch_size}/({self.micro_batch_size}*{dp}) = {num_microbatches} to be a "
              f"multiple of pp={self.pp}")

    def dp(self, world_size: int) -> int:
        """Data-parallel size for a given world size (context-parallel ranks share their data)."""
        return world_size // (self.tp * self.pp * self.cp)
