"""``runtime.errors.one_line`` (an exception as one line, the one helper every layer uses) and
``runtime.collectives.agree`` (each rank's error line gathered: every rank learns the same
first failure), on real gloo ranks."""

from megatron_grpo.runtime.collectives import FirstFailure, agree
from megatron_grpo.runtime.errors import LIMIT, one_line
from tests.support.distributed import run_distributed


def test_one_line_joins_whitespace_names_the_type_and_cuts_the_message():
    assert one_line(ValueError("bad\n  value\tthere")) == "ValueError: bad value there"
    assert one_line(KeyError()) == "KeyError"
    long = RuntimeError("x" * (LIMIT + 50))
    assert one_line(long) == "RuntimeError: " + "x" * LIMIT
    assert one_line(long, None) == "RuntimeError: " + "x" * (LIMIT + 50)
    assert one_line(long, 5) == "RuntimeError: xxxxx"


def _agree(rank: int, world: int, failing: tuple[int, ...]):
    return agree(f"broke on {rank}" if rank in failing else None)


def test_every_rank_agrees_on_the_first_failure():
    assert run_distributed(_agree, 3, ()) == [None] * 3
    answers = run_distributed(_agree, 3, (2, 1))
    assert answers == [FirstFailure(rank=1, line="broke on 1", others=1, world=3)] * 3
    assert str(answers[0]) == "rank 1 (and 1 more ranks): broke on 1"
    assert str(FirstFailure(rank=0, line="x", others=0, world=1)) == "rank 0: x"
    assert agree(None) is None and agree("alone") == FirstFailure(0, "alone", 0, 1)  # no process group
