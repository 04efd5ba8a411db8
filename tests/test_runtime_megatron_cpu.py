"""megatron-core runs on CPU (gloo) through the cpu_shim: a GPTModel at TP=2 x PP=2 trains a
step through `get_forward_backward_func` and its loss equals the TP=1 x PP=1 loss of the
same weights (moved between layouts with megatron's own dist_checkpointing)."""

import pytest
import torch

from megatron_grpo.runtime import cpu_shim
from tests.support.distributed import RankFailure, run_distributed
from tests.support.kill_resume import running

VOCAB, SEQ, MBS, NUM_MB = 256, 16, 2, 2


def _build_gpt(tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    return GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope",
    )


def _batches():
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, VOCAB, (MBS, SEQ), generator=gen), torch.randint(0, VOCAB, (MBS, SEQ), generator=gen))
        for _ in range(NUM_MB)
    ]


def _train_step_loss(model):
    """Forward+backward of NUM_MB micro-batches; returns the mean CE loss (last stage) and
    the sum of squared gradients of this rank's parameters (for a gradient sanity check)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = iter(_batches())

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        per_token = model(tokens, None, None, labels=labels)  # [B, S] cross-entropy

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return per_token, loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=NUM_MB,
        seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
    )
    grads = [p.grad if p.grad is not None else getattr(p, "main_grad", None) for p in model.parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in grads), "backward produced no gradient"
    return float(sum(o["loss"] for o in out) / NUM_MB) if out else None


def _save_reference(rank, world, ckpt_dir):
    from megatron.core import dist_checkpointing

    model = _build_gpt(1, 1)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    return _train_step_loss(model)


def _load_and_step(rank, world, ckpt_dir, tp, pp):
    from megatron.core import dist_checkpointing

    model = _build_gpt(tp, pp)
    torch.nn.init.normal_(next(model.parameters()))  # make sure the load really overwrites
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)
    return _train_step_loss(model)


@pytest.mark.slow
def test_tp2_pp2_loss_equals_tp1(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    (ref_loss,) = run_distributed(_save_reference, 1, ckpt, tp=1, pp=1, timeout_s=400)
    losses = run_distributed(_load_and_step, 4, ckpt, 2, 2, tp=2, pp=2, timeout_s=400)
    last_stage = [l for l in losses if l is not None]
    assert len(last_stage) == 2  # the two TP ranks of the last pipeline stage
    for loss in last_stage:
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (loss, ref_loss)


def _fails_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _hangs(rank, world):
    import time

    time.sleep(60)


def test_harness_surfaces_rank_tracebacks():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 ---.*ValueError: boom on rank 1"):
        run_distributed(_fails_on_rank_1, 2, timeout_s=300)  # generous: a loaded CI machine starts ranks slowly


def test_harness_times_out_instead_of_hanging():
    with pytest.raises(TimeoutError, match="did not finish within 3s"):
        run_distributed(_hangs, 2, timeout_s=3)


def test_shim_is_noop_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_shim, "_INSTALLED", False)
    before = torch.cuda.current_device
    assert cpu_shim.install() is False
    assert torch.cuda.current_device is before



_HOLDS_A_WRITER_QUEUE = """
import time
from megatron_grpo.runtime import cpu_shim
from megatron.core.dist_checkpointing.strategies import filesystem_async
assert cpu_shim.install()
queue = filesystem_async._get_write_results_queue()  # what megatron's first save calls
print(queue._manager._process.pid, flush=True)
time.sleep(120)
"""

_FORKS_IN_AND_OUT_OF_THE_BLOCK = """
import os, time
from megatron_grpo.runtime.process import forks_die_with_this_process

def child():
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    return pid

with forks_die_with_this_process():  # as megatron's checkpoint writers are forked
    inside = child()
outside = child()
print(inside, outside, flush=True)
time.sleep(120)
"""


def _children_after_kill_minus_9(script: str, should_go: int | None = None) -> tuple[list[int], list[int]]:
    """Run ``script`` (it prints pids of its children on one line), kill it with -9; returns
    those pids and the ones still running once the first ``should_go`` (default all) are
    gone, or 30 s later."""
    import subprocess
    import sys
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert all(psutil.Process(pid).ppid() == proc.pid for pid in pids)  # running children
    finally:
        proc.kill()
        proc.wait()

    deadline = time.monotonic() + 30
    while any(map(running, pids[:should_go])) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if running(pid)]
    for pid in left:  # do not leave them behind for the rest of the suite
        psutil.Process(pid).kill()
    return pids, left


def test_checkpoint_writer_manager_is_forked_and_dies_with_its_rank():
    """The shim's forked manager holds copies of the rank's sockets: it goes when its rank is
    killed with -9, so the rank's peers see the rank go."""
    assert _children_after_kill_minus_9(_HOLDS_A_WRITER_QUEUE)[1] == []


def test_children_forked_during_a_checkpoint_save_die_with_the_rank():
    """megatron's checkpoint writers are forked inside ``forks_die_with_this_process``; a
    child forked outside it is the control that a killed parent alone does not end it."""
    (inside, outside), left = _children_after_kill_minus_9(_FORKS_IN_AND_OUT_OF_THE_BLOCK, should_go=1)
    assert left == [outside]  # the control survived its parent (the helper then killed it)
