"""The static decode path (``engine.embedded.decode: static``): decoding without the host in the loop.

The eager scheduler (``scheduler.py``) reads every token on the host as it is drawn (its stop
checks, a ``torch.cat`` of the mask, a growing ``DynamicCache``): on a GPU each decode step then
costs far more host time than device time. Here one decode step -- feed the last tokens, write
their keys/values into a preallocated cache, draw the next tokens on the device -- touches only
buffers whose shapes and addresses are fixed, so on CUDA it is captured once in a
``torch.cuda.CUDAGraph`` and replayed; on the CPU the very same step runs eagerly through the
same buffers (so everything but the capture call is exercised by the CPU tests).

* **Buckets.** Sequences run in a ``StaticBatch`` of ``bucket`` rows, the smallest of 1, 2, 4,
  ... (and ``max_batch_size``) that holds them; unused rows decode padding. The cache holds
  ``length`` columns, a power of two covering the longest prompt plus the most tokens any row
  may still draw. One ``StaticBatch`` (its cache and graph) is kept per (bucket, length,
  sampling kind) and reused by every later batch of that shape; a batch of another length
  frees the others (memory: 2 * layers * bucket * length * kv_heads * head_dim elements).
* **Layout.** The prompts are prefilled eagerly (``scheduler.prefill``: prefix sharing,
  prompt log-probs) and their keys/values copied LEFT-padded into columns ``[0, W)``; every
  row then writes its next token at the same column (transformers' ``StaticCache``), attends
  through a 4-D additive mask built from ``allowed_BL`` (its own columns only) and is fed at its
  own position ids, as in the eager path.
* **Sampling** is ``sampling.draw_on_device`` (the eager path's draw: same rule per row, same
  log-probs, same kept sets), with the uniforms of the next ``k`` tokens drawn beforehand on the
  host from each row's own generator, one per row per token as ``draw_uniforms`` does, so a
  seeded row draws the same tokens as on the eager path.
* **Stops every k tokens.** Tokens, log-probs and kept sets accumulate in device buffers; every
  ``stop_check_every`` tokens the host reads them once, appends each row's tokens up to its
  finish (``generation.finish_reason_for``: EOS, stop ids, max_new_tokens, the context), drops
  the ones drawn past it, and asks the engine's ``control()`` (pause, abort, retract), as the
  eager path does after every token. A row that finished keeps decoding padding until the
  batch ends.
* **Weight updates** copy into the parameters in place (``EmbeddedEngine._load``), so captured
  graphs stay valid; a quantized engine's re-quantization makes new tensors, so the engine
  calls ``StaticDecoder.invalidate`` (graphs recaptured at the next use).

What it does not do (yet):

* **Admission in waves, not continuous.** A batch takes up to ``max_batch_size`` queued
  sequences and runs until all of them finished (or a pause); queued sequences wait for the
  next batch. A long-tailed batch therefore decodes its finished rows as padding until its
  longest row ends -- the cost continuous batching avoids on the eager path.
* **Models it refuses decode on the eager path** (``run_continuous``, batch by batch):
  mixture-of-experts models (transformers' MoE blocks read the routing on the host to dispatch
  the experts, which a graph cannot capture; MoE routing replay records hooks each step),
  models with sliding-window attention layers (another cache layout) and models loaded with an
  attention other than sdpa or eager (the step's 4-D additive mask is theirs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_grpo.engine.batch import RunningBatch
from megatron_grpo.engine.generation import Sequence, finish_reason_for
from megatron_grpo.engine.routing import moe_routers
from megatron_grpo.engine.sampling import TOP_K_ALL, draw_on_device, draw_uniforms, kept_sets
from megatron_grpo.engine.scheduler import StepControl, cache_kwarg, prefill, run_continuous, start

DECODE_MODES = ("eager", "static")


def batch_buckets(max_batch_size: int) -> list[int]:
    """The row counts a static batch may have: powers of two below ``max_batch_size``, then it."""
    buckets, b = [], 1
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch_size]


def bucket_for(num_rows: int, max_batch_size: int) -> int:
    """The smallest bucket that holds ``num_rows`` (<= max_batch_size) rows."""
    assert 1 <= num_rows <= max_batch_size, (num_rows, max_batch_size)
    return next(b for b in batch_buckets(max_batch_size) if b >= num_rows)


def cache_length(num_columns: int) -> int:
    """Columns of a static cache that holds ``num_columns``: the next power of two (at least 16),
    so batches of similar lengths share one cache and one graph."""
    return max(16, 1 << (num_columns - 1).bit_length())


def tokens_left(seq: Sequence, max_context: int) -> int:
    """The most tokens ``seq`` may still draw (its max_new_tokens, or the context, whichever ends first)."""
    so_far = len(seq.output_ids)
    return max(0, min(seq.params.max_new_tokens - so_far, max_context - len(seq.prompt_ids) - so_far))


def serves_statically(model: torch.nn.Module) -> bool:
    """Whether the static path can decode for ``model`` (see the module docstring for what it refuses)."""
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    # the 4-D additive mask is what the sdpa and eager attentions take (flash attention takes none)
    attention = getattr(model.config, "_attn_implementation", "sdpa")
    return (all(t == "full_attention" for t in layer_types) and not moe_routers(model)
            and attention in ("sdpa", "eager"))


def additive_mask(allowed_BL: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] bool -> [B, 1, 1, L] additive attention mask (0 where allowed, the dtype's lowest
    elsewhere: a 4-D mask transformers passes to the attention as it is, for sdpa and eager)."""
    return torch.where(allowed_BL, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]


@dataclass(frozen=True)
class Shape:
    """What fixes a static batch's buffers and graph."""

    bucket: int
    length: int
    sorts: bool
    """The draw sorts the probabilities (a row filters, or kept sets are asked for)."""
    kept_width: int
    """Kept ids stored per row and token (0: no kept sets)."""


class StaticBatch:
    """The buffers of one static shape and, on CUDA, the graph of its decode step.

    cache: transformers ``StaticCache``, [bucket, kv_heads, length, head_dim] per layer.
    allowed_BL: bool, the cache columns each row attends to. tokens_B / pos_B: int64, the tokens
    fed at the next step and their position ids. logits_BV: the logits of the last forward.
    temperature_B, top_k_B, top_p_B, min_p_B: each row's sampling parameters.
    uniforms_KB: float64 [k, bucket], the uniforms of the next k draws. slot: int64 [1], the draw
    the next step makes within the interval. out_*_K*: what each draw of the interval produced.
    """

    def __init__(self, model: torch.nn.Module, shape: Shape, *, stop_check_every: int, max_context: int,
                 like: RunningBatch):
        from transformers import StaticCache

        device, b, k = like.last_logits_BV.device, shape.bucket, stop_check_every
        self.model, self.shape, self.max_context = model, shape, max_context
        self.cache = StaticCache(config=model.config, max_cache_len=shape.length)
        layers = like.cache.layers
        self.cache.early_initialization(batch_size=b, num_heads=[layer.keys.shape[1] for layer in layers],
                                        head_dim=[layer.keys.shape[3] for layer in layers],
                                        dtype=layers[0].keys.dtype, device=device)
        self.dtype = layers[0].keys.dtype
        self.allowed_BL = torch.zeros(b, shape.length, dtype=torch.bool, device=device)
        self.tokens_B = torch.zeros(b, dtype=torch.long, device=device)
        self.pos_B = torch.zeros(b, dtype=torch.long, device=device)
        self.logits_BV = torch.zeros(b, like.last_logits_BV.shape[1], dtype=like.last_logits_BV.dtype, device=device)
        self.temperature_B = torch.ones(b, device=device)
        self.top_k_B = torch.full((b,), TOP_K_ALL, dtype=torch.long, device=device)
        self.top_p_B = torch.ones(b, device=device)
        self.min_p_B = torch.zeros(b, device=device)
        self.uniforms_KB = torch.full((k, b), 0.5, dtype=torch.float64, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.out_tokens_KB = torch.zeros(k, b, dtype=torch.long, device=device)
        self.out_logprobs_KB = torch.zeros(k, b, dtype=torch.float32, device=device)
        kept = shape.kept_width
        self.out_num_kept_KB = torch.zeros(k, b, dtype=torch.long, device=device) if kept else None
        self.out_log_mass_KB = torch.zeros(k, b, dtype=torch.float64, device=device) if kept else None
        self.out_kept_KBC = torch.zeros(k, b, kept, dtype=torch.long, device=device) if kept else None
        self.graph: Optional[torch.cuda.CUDAGraph] = None

    # ---- the device work (no host read: captured on CUDA) -----------------------------

    def draw(self) -> None:
        """Draw each row's next token from ``logits_BV`` into draw ``slot`` of the interval; the
        tokens become the next step's input."""
        uniform = self.uniforms_KB.index_select(0, self.slot).squeeze(0)
        d = draw_on_device(self.logits_BV, self.temperature_B, self.top_k_B, self.top_p_B, self.min_p_B,
                           uniform, sorts=self.shape.sorts, kept_width=self.shape.kept_width)
        self.out_tokens_KB.index_copy_(0, self.slot, d.tokens.unsqueeze(0))
        self.out_logprobs_KB.index_copy_(0, self.slot, d.logprobs.unsqueeze(0))
        if self.shape.kept_width:
            self.out_num_kept_KB.index_copy_(0, self.slot, d.num_kept.unsqueeze(0))
            self.out_log_mass_KB.index_copy_(0, self.slot, d.log_kept_mass.unsqueeze(0))
            self.out_kept_KBC.index_copy_(0, self.slot, d.kept_ids[:, : self.shape.kept_width].unsqueeze(0))
        self.tokens_B.copy_(d.tokens)
        self.slot.add_(1)

    def forward(self) -> None:
        """Feed ``tokens_B`` at ``pos_B``: their keys/values go to the cache's next column."""
        column = self.cache.layers[0].cumulative_length.view(1)  # where this step writes
        self.allowed_BL.index_fill_(1, column, True)
        out = self.model(input_ids=self.tokens_B.unsqueeze(1), position_ids=self.pos_B.unsqueeze(1),
                         attention_mask=additive_mask(self.allowed_BL, self.dtype),
                         **{cache_kwarg(type(self.model)): self.cache}, use_cache=True)
        self.logits_BV.copy_(out.logits[:, -1])
        # a finished row keeps decoding padding: keep its positions inside the model's range
        self.pos_B.add_(1).clamp_(max=self.max_context - 1)

    def step(self) -> None:
        """One decode step: feed the last draw, then draw the next tokens."""
        self.forward()
        self.draw()

    def capture(self, pool) -> None:
        """Record ``step`` in a CUDA graph (warm-up on a side stream first, as torch asks), its
        memory from ``pool`` (shared by every shape: their graphs never replay at once). The
        warm-up writes garbage into the buffers: ``load`` resets them all."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.slot.zero_()
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.slot.zero_()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a weight-sync thread's CUDA work during the capture is not an error
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.step()
        self.graph = graph

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()

    # ---- the host side -----------------------------------------------------------------

    def load(self, batch: RunningBatch) -> None:
        """Take a prefilled batch's rows: their keys/values in columns [0, W) of the first rows
        (the rest zeroed), their masks, positions, last logits and sampling parameters."""
        n, width = len(batch), batch.mask_BT.shape[1]
        assert n <= self.shape.bucket and width < self.shape.length, (n, width, self.shape)
        for mine, theirs in zip(self.cache.layers, batch.cache.layers):
            for buf, src in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                buf.zero_()
                buf[:n, :, :width].copy_(src)
            mine.cumulative_length.fill_(width)
        self.allowed_BL.zero_()
        self.allowed_BL[:n, :width].copy_(batch.mask_BT.bool())
        self.pos_B.zero_()
        self.pos_B[:n].copy_(batch.next_pos_B)
        self.logits_BV.zero_()
        self.logits_BV[:n].copy_(batch.last_logits_BV)
        params = [s.params for s in batch.seqs]
        for buf, values, rest in ((self.temperature_B, [p.temperature for p in params], 1.0),
                                  (self.top_k_B, [p.top_k for p in params], TOP_K_ALL),
                                  (self.top_p_B, [p.top_p for p in params], 1.0),
                                  (self.min_p_B, [p.min_p for p in params], 0.0)):
            buf.fill_(rest)
            buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))

    def set_uniforms(self, seqs: list[Sequence], shared: torch.Generator, num_draws: int) -> None:
        """The uniforms of the next ``num_draws`` draws, drawn on the host as the eager path draws
        them: per draw, one per row, from the row's generator when seeded (the finished rows'
        too, as the eager path's batch does until it drops them: their draws are never used)."""
        rows = [draw_uniforms([s.generator for s in seqs], shared) for _ in range(num_draws)]
        self.uniforms_KB[:num_draws, : len(seqs)].copy_(torch.stack(rows))
        self.slot.zero_()


@dataclass
class Interval:
    """What the host reads of one interval's draws: per row of the batch, lists of length m."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    num_kept: Optional[list[list[int]]] = None
    log_kept_mass: Optional[list[list[float]]] = None
    kept_ids: Optional[list[list[list[int]]]] = None


def read_interval(state: StaticBatch, num_rows: int, num_draws: int) -> Interval:
    """The interval's draws of the first ``num_rows`` rows (the one host read of the interval)."""
    def rows(buf_K):  # [K, B, ...] -> per row, its m draws
        return buf_K[:num_draws, :num_rows].transpose(0, 1).tolist()

    out = Interval(rows(state.out_tokens_KB), rows(state.out_logprobs_KB))
    if state.shape.kept_width:
        out.num_kept, out.log_kept_mass = rows(state.out_num_kept_KB), rows(state.out_log_mass_KB)
        out.kept_ids = rows(state.out_kept_KBC)
    return out


def append_interval(seqs: list[Sequence], drawn: Interval, *, eos_ids: frozenset[int], max_context: int,
                    version: str, weight_version: Callable[[], str]) -> None:
    """Append each live row's draws up to its finish (the draws past it are dropped), exactly as
    the eager ``sample_step`` would have, token by token."""
    for row, s in enumerate(seqs):
        for j, token in enumerate(drawn.tokens[row]):
            if s.finished:
                break
            s.output_ids.append(token)
            s.output_logprobs.append(drawn.logprobs[row][j])
            s.output_versions.append(version)
            if s.return_sampling_mask:
                n = drawn.num_kept[row][j]
                s.output_kept_ids.append(kept_sets([n], [drawn.kept_ids[row][j]], s.max_kept)[0])
                s.output_log_kept_mass.append(drawn.log_kept_mass[row][j])
            reason = finish_reason_for(s, token, eos_ids, max_context)
            if reason is not None:
                s.finish(reason, weight_version())


def _once(seqs: list[Sequence]) -> Callable[[int], list[Sequence]]:
    """An ``admit`` that hands ``seqs`` over at its first call (the batch the eager path is
    given), and nothing afterwards."""
    pending = [list(seqs)]

    def admit(_: int) -> list[Sequence]:
        return pending.pop() if pending else []
    return admit


class StaticDecoder:
    """Runs batches on the static path; keeps their ``StaticBatch`` (and graphs) between runs.

    ``use_graphs``: capture each shape's step in a CUDA graph (on a CUDA model only).
    """

    def __init__(self, *, stop_check_every: int, use_graphs: bool):
        assert stop_check_every >= 1
        self.stop_check_every = stop_check_every
        self.use_graphs = use_graphs
        self._states: dict[Shape, StaticBatch] = {}
        self._pool = None  # the CUDA graphs' memory pool, made at the first capture

    def invalidate(self) -> None:
        """Forget the captured graphs (after a weight update that replaced tensors rather than
        copying into them): the next batch of each shape recaptures."""
        for state in self._states.values():
            state.graph = None

    def state_for(self, model: torch.nn.Module, shape: Shape, batch: RunningBatch, max_context: int) -> StaticBatch:
        state = self._states.get(shape)
        if state is None:
            # another length: free the other caches first (a graph's memory goes with its batch)
            self._states = {s: st for s, st in self._states.items() if s.length == shape.length}
            state = self._states[shape] = StaticBatch(model, shape, stop_check_every=self.stop_check_every,
                                                      max_context=max_context, like=batch)
        if self.use_graphs and state.graph is None and batch.last_logits_BV.is_cuda:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            state.capture(self._pool)
        return state

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, admit: Callable[[int], list[Sequence]], *, max_batch_size: int,
            eos_ids: frozenset[int], pad_id: int, shared_generator: torch.Generator, max_context: int,
            control: Callable[[], str], weight_version: Callable[[], str]) -> list[Sequence]:
        """``scheduler.run_continuous``'s contract, on the static path: decode until ``admit``
        has nothing more and every admitted sequence finished; returns the retracted sequences
        when ``control()`` said RETRACT, else []."""
        while True:
            admitted = admit(max_batch_size)
            seqs = start(admitted, weight_version)
            if not seqs:
                if not admitted:
                    return []
                continue
            if not serves_statically(model):
                retracted = run_continuous(model, _once(seqs), max_batch_size=max_batch_size, eos_ids=eos_ids,
                                           pad_id=pad_id, shared_generator=shared_generator,
                                           max_context=max_context, control=control, weight_version=weight_version)
            else:
                retracted = self._run_batch(model, seqs, max_batch_size=max_batch_size, eos_ids=eos_ids, pad_id=pad_id,
                                            shared_generator=shared_generator, max_context=max_context,
                                            control=control, weight_version=weight_version)
            if retracted is not None:
                return retracted

    def _run_batch(self, model: torch.nn.Module, seqs: list[Sequence], *, max_batch_size: int,
                   eos_ids: frozenset[int], pad_id: int,
                   shared_generator: torch.Generator, max_context: int, control: Callable[[], str],
                   weight_version: Callable[[], str]) -> Optional[list[Sequence]]:
        """Prefill ``seqs`` and decode them to the end. Returns None when they all finished,
        else what the engine's control asked for (``run``'s return)."""
        batch = prefill(model, seqs, pad_id=pad_id, recorder=None)
        for s in seqs:  # prompt log-probs only: the prefill was all they needed
            if s.params.max_new_tokens == 0:
                s.finish({"type": "length", "length": 0}, weight_version())
        live = [s for s in seqs if not s.finished]
        if not live:
            return None
        # at least one draw, as the eager path makes (a row at the context's end finishes on it)
        budget = max(1, max(tokens_left(s, max_context) for s in live))
        vocab_size = batch.last_logits_BV.shape[-1]
        with_kept = any(s.return_sampling_mask for s in seqs)
        shape = Shape(bucket=bucket_for(len(seqs), max(max_batch_size, len(seqs))),
                      length=cache_length(batch.mask_BT.shape[1] + budget),
                      sorts=with_kept or any(s.params.top_k < vocab_size or s.params.top_p < 1.0 or s.params.min_p > 0
                                             for s in seqs),
                      kept_width=min(max(max(s.max_kept for s in seqs), 1), vocab_size) if with_kept else 0)
        state = self.state_for(model, shape, batch, max_context)
        state.load(batch)
        batch = None  # the prefill's cache is in the static one now: let it go
        drawn_so_far, first = 0, True
        while drawn_so_far < budget:
            num_draws = min(self.stop_check_every, budget - drawn_so_far)
            version = weight_version()  # no update runs inside an interval (the engine's lock)
            state.set_uniforms(seqs, shared_generator, num_draws)
            if first:  # the prefill's logits are drawn from before the first step
                state.draw()
            for _ in range(num_draws - 1 if first else num_draws):
                state.replay()
            first = False
            drawn_so_far += num_draws
            append_interval(seqs, read_interval(state, len(seqs), num_draws), eos_ids=eos_ids,
                            max_context=max_context, version=version, weight_version=weight_version)
            action = control()
            if action == StepControl.ABORT:
                for s in seqs:
                    if not s.finished:
                        s.finish({"type": "abort", "message": "generation paused (mode=abort)"}, weight_version())
                return []
            if action == StepControl.RETRACT:
                return [s for s in seqs if not s.finished]
            if all(s.finished for s in seqs):
                break
        return None
