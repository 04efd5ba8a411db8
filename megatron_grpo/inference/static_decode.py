"""The static decode path (``engine.embedded.decode: static``): decoding without the host in the loop.

The eager scheduler (``scheduler.py``) reads every token on the host as it is drawn. Here one
decode step -- feed the last tokens, write their keys/values into a preallocated cache, draw the
next tokens on the device (``sampling.draw_on_device``) -- touches only buffers of fixed shapes
and addresses, so on CUDA it is captured once in a ``torch.cuda.CUDAGraph`` and replayed; on the
CPU the same step runs eagerly through the same buffers (the CPU tests exercise all but the capture).

* A ``StaticBatch`` has ``bucket`` rows (1, 2, 4, ... or ``max_batch_size``) and a cache of
  ``length`` columns (a power of two). One is kept per (bucket, length, sampling kind) and reused;
  a batch of another length frees the others. Bucket and sampling kind are fixed when it starts.
* Sequences are prefilled eagerly (``scheduler.prefill``), draw their first token there, and are
  copied into rows RIGHT-aligned to one shared write column (transformers' ``StaticCache``).
* A seeded row draws the same tokens as on the eager path (uniforms from its own generator).
* The host reads tokens, applies stops and asks ``control()`` (pause, abort, retract) every
  ``stop_check_every`` tokens, so these land up to k - 1 tokens later than on the eager path;
  queued sequences are admitted only at those check points.
* Weight updates must copy into the parameters in place (captured graphs keep addresses); a
  quantized engine's re-quantization makes new tensors, so it calls ``StaticDecoder.invalidate``.

Refused, left to the eager path: mixture-of-experts models (host-side expert dispatch; routing
replay hooks), sliding-window attention, attention implementations other than sdpa/eager.
Layout, admission, costs and tests: docs/rollout_engines.md#static-decode-engineembeddeddecode-static.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_grpo.inference.batch import RunningBatch
from megatron_grpo.inference.generation import Sequence, finish_reason_for
from megatron_grpo.inference.routing import moe_routers
from megatron_grpo.inference.sampling import TOP_K_ALL, draw_on_device, draw_uniforms, filtering_rows, kept_set_width
from megatron_grpo.inference.scheduler import StepControl, cache_kwarg, prefill, run_continuous, sample_step, start

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


@dataclass(eq=False)
class Fresh:
    """Sequences prefilled (``scheduler.prefill``) and given their first token on the host
    (``scheduler.sample_step``, the eager path's draw), ready to take rows of a static batch.

    batch: their ``RunningBatch`` (left-padded cache, mask, positions), live rows only.
    tokens_B: int64 [B], each row's first token (fed at its first static step).
    """

    batch: RunningBatch
    tokens_B: torch.Tensor

    @property
    def width(self) -> int:
        return self.batch.mask_BT.shape[1]

    def budget(self, max_context: int) -> int:
        """The most tokens a row may still draw (one static step each)."""
        return max(tokens_left(s, max_context) for s in self.batch.seqs)


class StaticBatch:
    """The buffers of one static shape and, on CUDA, the graph of its decode step.

    cache: transformers ``StaticCache``, [bucket, kv_heads, length, head_dim] per layer; every
    row writes its next token at the same column (``column``, a host mirror of the cache's
    write index). allowed_BL: bool, the cache columns each row attends to. tokens_B / pos_B:
    int64, the tokens fed at the next step and their position ids. logits_BV: the logits of
    the last forward. temperature_B, top_k_B, top_p_B, min_p_B: each row's sampling parameters.
    uniforms_KB: float64 [k, bucket], the uniforms of the next k draws. slot: int64 [1], the draw
    the next step makes within the interval. out_*_K*: what each draw of the interval produced.
    rows: the sequence of each row (None: free); starts: the first cache column each row uses.
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
        self.rows: list[Optional[Sequence]] = [None] * b
        self.starts = [0] * b
        self.column = 0

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
        warm-up writes into the buffers: call it before ``reset``."""
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

    def replay(self, num_steps: int) -> None:
        for _ in range(num_steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()

    # ---- the host side -----------------------------------------------------------------

    def reset(self, column: int) -> None:
        """Every row free, attending to nothing; the next step writes column ``column``."""
        self.allowed_BL.zero_()
        self._set_column(column)
        self.rows = [None] * self.shape.bucket
        self.starts = [0] * self.shape.bucket

    def _set_column(self, column: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(column)
        self.column = column

    def live_rows(self) -> list[int]:
        return [i for i, s in enumerate(self.rows) if s is not None and not s.finished]

    def free_rows(self) -> list[int]:
        return [i for i, s in enumerate(self.rows) if s is None or s.finished]

    def accepts(self, fresh: Fresh) -> bool:
        """Whether ``fresh``'s sampling fits this shape's draw (sorting, kept-set width)."""
        seqs = fresh.batch.seqs
        vocab_size = self.logits_BV.shape[1]
        if any(s.return_sampling_mask and kept_set_width(s.max_kept, vocab_size) > self.shape.kept_width for s in seqs):
            return False
        return self.shape.sorts or not any(filters(s, vocab_size) for s in seqs)

    def make_room(self, fresh: Fresh) -> bool:
        """Make ``fresh`` fit, right-aligned before the write column (its prefixes end where the
        live rows' next token goes) with room for all its draws: shift the cache left over
        columns no live row uses if needed (or start afresh when no row is live). False when it
        cannot fit now (too few free rows, or the live rows still use those columns)."""
        if not self.accepts(fresh) or len(fresh.batch) > len(self.free_rows()):
            return False
        budget, live = fresh.budget(self.max_context), self.live_rows()
        if not live:  # nothing to keep: the whole cache is free
            if fresh.width + budget > self.shape.length:
                return False
            self.reset(fresh.width)
            return True
        shift = max(0, self.column + budget - self.shape.length)
        unused = min(self.starts[i] for i in live)  # leading columns no live row uses
        if self.column - shift < fresh.width or shift > unused:
            return False
        self.shift_left(shift)
        return True

    def shift_left(self, columns: int) -> None:
        """Drop the first ``columns`` cache columns of every row (unused: ``make_room``);
        positions are explicit, so nothing else changes. A copy of the whole cache."""
        if columns == 0:
            return
        keep = self.shape.length - columns
        for layer in self.cache.layers:
            for buf in (layer.keys, layer.values):
                buf[:, :, :keep] = buf[:, :, columns:].clone()
        self.allowed_BL[:, :keep] = self.allowed_BL[:, columns:].clone()
        self.allowed_BL[:, keep:] = False
        self._set_column(self.column - columns)
        self.starts = [max(0, start - columns) for start in self.starts]

    def place(self, fresh: Fresh) -> None:
        """Copy ``fresh``'s rows into free rows, right-aligned so that their prefixes end just
        before the write column (``make_room`` said they fit)."""
        rows = self.free_rows()[: len(fresh.batch)]
        start = self.column - fresh.width
        index = torch.tensor(rows, dtype=torch.long, device=self.tokens_B.device)
        for mine, theirs in zip(self.cache.layers, fresh.batch.cache.layers):
            for buf, src in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                buf[index, :, start:self.column] = src
        self.allowed_BL[index] = False
        self.allowed_BL[index, start:self.column] = fresh.batch.mask_BT.bool()
        self.pos_B[index] = fresh.batch.next_pos_B
        self.tokens_B[index] = fresh.tokens_B
        params = [s.params for s in fresh.batch.seqs]
        for buf, values in ((self.temperature_B, [p.temperature for p in params]),
                            (self.top_k_B, [p.top_k for p in params]),
                            (self.top_p_B, [p.top_p for p in params]),
                            (self.min_p_B, [p.min_p for p in params])):
            buf[index] = torch.tensor(values, dtype=buf.dtype, device=buf.device)
        for row, seq in zip(rows, fresh.batch.seqs):
            self.rows[row], self.starts[row] = seq, start

    def set_uniforms(self, shared: torch.Generator, num_draws: int) -> None:
        """The uniforms of the next ``num_draws`` draws, drawn on the host as the eager path draws
        them: per draw, one per live row from the row's generator when seeded (``draw_uniforms``)."""
        live = self.live_rows()
        uniforms = torch.full((num_draws, self.shape.bucket), 0.5, dtype=torch.float64)
        for j in range(num_draws):
            uniforms[j, live] = draw_uniforms([self.rows[i].generator for i in live], shared)
        self.uniforms_KB[:num_draws].copy_(uniforms)
        self.slot.zero_()

    def run_interval(self, shared: torch.Generator, num_draws: int) -> None:
        """``num_draws`` decode steps with no host read."""
        self.set_uniforms(shared, num_draws)
        self.replay(num_draws)
        self.column += num_draws


def filters(seq: Sequence, vocab_size: int) -> bool:
    """Whether ``seq``'s draws go through the sorted order (``sampling.filtering_rows`` on its parameters)."""
    p = seq.params
    return bool(filtering_rows(p.top_k, p.top_p, p.min_p, vocab_size))


@dataclass
class Interval:
    """What the host reads of one interval's draws: per row of the batch, lists of length m."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    num_kept: Optional[list[list[int]]] = None
    log_kept_mass: Optional[list[list[float]]] = None
    kept_ids: Optional[torch.Tensor] = None
    """int64 [B, m, kept_width] on the host (a row's set is the first ``num_kept`` of its draw's
    ids: only those of rows that asked, within their budget, become lists)."""


def read_interval(state: StaticBatch, num_draws: int) -> Interval:
    """The interval's draws of every row (the one host read of the interval)."""
    def rows(buf_K):  # [K, B, ...] -> per row, its m draws
        return buf_K[:num_draws].transpose(0, 1).tolist()

    out = Interval(rows(state.out_tokens_KB), rows(state.out_logprobs_KB))
    if state.shape.kept_width:
        out.num_kept, out.log_kept_mass = rows(state.out_num_kept_KB), rows(state.out_log_mass_KB)
        out.kept_ids = state.out_kept_KBC[:num_draws].transpose(0, 1).cpu()
    return out


def append_interval(seqs: list[Optional[Sequence]], drawn: Interval, *, eos_ids: frozenset[int],
                    max_context: int, version: str, weight_version: Callable[[], str]) -> None:
    """Append each live row's draws up to its finish (the draws past it are dropped), exactly as
    the eager ``sample_step`` would have, token by token."""
    for row, s in enumerate(seqs):
        if s is None:
            continue
        for j, token in enumerate(drawn.tokens[row]):
            if s.finished:
                break
            s.output_ids.append(token)
            s.output_logprobs.append(drawn.logprobs[row][j])
            s.output_versions.append(version)
            if s.return_sampling_mask:
                n = drawn.num_kept[row][j]
                s.output_kept_ids.append(drawn.kept_ids[row, j, :n].tolist() if n <= s.max_kept else None)
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


@dataclass
class DecodeRun:
    """One ``StaticDecoder.run``'s fixed arguments (``scheduler.run_continuous``'s)."""

    model: torch.nn.Module
    admit: Callable[[int], list[Sequence]]
    max_batch_size: int
    eos_ids: frozenset[int]
    pad_id: int
    shared_generator: torch.Generator
    max_context: int
    control: Callable[[], str]
    weight_version: Callable[[], str]

    def prefill(self, seqs: list[Sequence]) -> Optional[Fresh]:
        """Prefill ``seqs`` and draw their first tokens (the eager path's first step); None when
        none is left to decode."""
        batch = prefill(self.model, seqs, pad_id=self.pad_id, recorder=None)
        for s in seqs:  # prompt log-probs only: the prefill was all they needed
            if s.params.max_new_tokens == 0:
                s.finish({"type": "length", "length": 0}, self.weight_version())
        if batch.num_live == 0:
            return None
        tokens = sample_step(batch, shared_generator=self.shared_generator, eos_ids=self.eos_ids,
                             max_context=self.max_context, weight_version=self.weight_version)
        if batch.num_live == 0:
            return None
        keep = batch.drop_finished()
        return Fresh(batch, tokens[keep])

    def admit_fresh(self, num_rows: int) -> tuple[bool, Optional[Fresh]]:
        """Up to ``num_rows`` queued sequences, prefilled: (whether any was admitted, the fresh rows)."""
        admitted = self.admit(num_rows)
        seqs = start(admitted, self.weight_version)
        return bool(admitted), (self.prefill(seqs) if seqs else None)


class StaticDecoder:
    """Runs sequences on the static path; keeps each shape's ``StaticBatch`` (and graph) between runs.

    ``use_graphs``: capture each shape's step in a CUDA graph (on a CUDA model only).
    """

    def __init__(self, *, stop_check_every: int, use_graphs: bool):
        assert stop_check_every >= 1
        self.stop_check_every = stop_check_every
        self.use_graphs = use_graphs
        self._states: dict[Shape, StaticBatch] = {}
        self._pool = None  # the CUDA graphs' memory pool, made at the first capture
        # what ran where, for the server's /get_server_info: a user (and a test) can see that
        # the static path, and on a GPU its graphs, served the run rather than the eager fallback
        self.counts = {"static_batches": 0, "static_sequences": 0, "graph_captures": 0, "eager_sequences": 0}

    def invalidate(self) -> None:
        """Forget the captured graphs (after a weight update that replaced tensors rather than
        copying into them): each shape recaptures at its next batch."""
        for state in self._states.values():
            state.graph = None

    def shape_for(self, fresh: Fresh, max_batch_size: int, max_context: int) -> Shape:
        seqs, vocab_size = fresh.batch.seqs, fresh.batch.last_logits_BV.shape[-1]
        with_kept = any(s.return_sampling_mask for s in seqs)
        return Shape(bucket=bucket_for(len(seqs), max(max_batch_size, len(seqs))),
                     length=cache_length(fresh.width + fresh.budget(max_context)),
                     sorts=with_kept or any(filters(s, vocab_size) for s in seqs),
                     kept_width=kept_set_width(max(s.max_kept for s in seqs), vocab_size) if with_kept else 0)

    def state_for(self, model: torch.nn.Module, shape: Shape, fresh: Fresh, max_context: int) -> StaticBatch:
        state = self._states.get(shape)
        if state is None:
            # another length: free the other caches first (a graph's memory goes with its batch)
            self._states = {s: st for s, st in self._states.items() if s.length == shape.length}
            state = self._states[shape] = StaticBatch(model, shape, stop_check_every=self.stop_check_every,
                                                      max_context=max_context, like=fresh.batch)
        if self.use_graphs and state.graph is None and fresh.batch.last_logits_BV.is_cuda:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            state.reset(0)  # the warm-up steps write the first columns
            state.capture(self._pool)
            self.counts["graph_captures"] += 1
        return state

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, admit: Callable[[int], list[Sequence]], *, max_batch_size: int,
            eos_ids: frozenset[int], pad_id: int, shared_generator: torch.Generator, max_context: int,
            control: Callable[[], str], weight_version: Callable[[], str]) -> list[Sequence]:
        """``scheduler.run_continuous``'s contract, on the static path: decode until ``admit``
        has nothing more and every admitted sequence finished; returns the retracted sequences
        when ``control()`` said RETRACT, else []."""
        run = DecodeRun(model, admit, max_batch_size, eos_ids, pad_id, shared_generator, max_context, control,
                  weight_version)
        pending: Optional[Fresh] = None
        while True:
            if pending is None:
                admitted = admit(max_batch_size)
                seqs = start(admitted, weight_version)
                if not seqs:
                    if not admitted:
                        return []
                    continue
                if not serves_statically(model):
                    self.counts["eager_sequences"] += len(seqs)
                    retracted = run_continuous(model, _once(seqs), max_batch_size=max_batch_size, eos_ids=eos_ids,
                                               pad_id=pad_id, shared_generator=shared_generator,
                                               max_context=max_context, control=control, weight_version=weight_version)
                    if retracted:
                        return retracted
                    continue
                pending = run.prefill(seqs)
                if pending is None:
                    continue
            retracted, pending = self._run_batch(run, pending)
            if retracted is not None:
                return retracted

    def _run_batch(self, run: DecodeRun, first: Fresh) -> tuple[Optional[list[Sequence]], Optional[Fresh]]:
        """Decode ``first`` in a static batch of its shape, admitting queued sequences into the
        rows that free up, until no row is live and nothing more fits. Returns (what ``run``
        returns, or None to go on; the prefilled sequences left for the next batch)."""
        state = self.state_for(run.model, self.shape_for(first, run.max_batch_size, run.max_context),
                               first, run.max_context)
        state.reset(first.width)
        state.place(first)
        self.counts["static_batches"] += 1
        self.counts["static_sequences"] += len(first.batch.seqs)
        pending: Optional[Fresh] = None
        while True:
            live = state.live_rows()
            if live:
                num_draws = min(self.stop_check_every, max(tokens_left(state.rows[i], run.max_context) for i in live))
                version = run.weight_version()  # no update runs inside an interval (the engine's lock)
                state.run_interval(run.shared_generator, num_draws)
                append_interval(state.rows, read_interval(state, num_draws), eos_ids=run.eos_ids,
                                max_context=run.max_context, version=version, weight_version=run.weight_version)
                action = run.control()
                waiting = pending.batch.seqs if pending is not None else []
                if action == StepControl.ABORT:
                    for s in [state.rows[i] for i in state.live_rows()] + waiting:
                        s.finish({"type": "abort", "message": "generation paused (mode=abort)"}, run.weight_version())
                    return [], None
                if action == StepControl.RETRACT:
                    return [state.rows[i] for i in state.live_rows()] + waiting, None
            # admit into the free rows, as the eager path does, once a quarter of them is free
            free = len(state.free_rows())
            if pending is None and (free == state.shape.bucket or free >= max(1, state.shape.bucket // 4)):
                admitted, pending = run.admit_fresh(free)
                if admitted and pending is None:
                    continue  # they all finished on their first draw: look again
            if pending is not None and state.make_room(pending):
                state.place(pending)
                self.counts["static_sequences"] += len(pending.batch.seqs)
                pending = None
            if not state.live_rows():
                return None, pending  # nothing runs here: the caller starts pending in its own batch
