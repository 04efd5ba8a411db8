"""``python -m megatron_grpo.train --config FILE [overrides]``: one rank of a run (torchrun).

The first thing a rank does, before the trainer's imports (seconds on a busy machine), is ask
to die with torchrun's agent: a launcher killed during that window would otherwise leave the
rank orphaned, blocked for the whole rendezvous timeout in ``init_process_group``. The last
is to exit without the interpreter's teardown (``runtime.process.exit_now``).
"""

import os
import sys

from megatron_grpo.runtime.process import die_with_parent, exit_now

if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # also dies now if torchrun's agent is already gone

    from megatron_grpo.trainer.rank import rank_main

    # rank_main returns once everything the rank started is closed; an exception (a bug)
    # propagates with its traceback and the normal exit
    exit_now(rank_main(sys.argv[1:]))
