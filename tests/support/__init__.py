"""Helpers shared by the tests (never imported by ``tools/``: what the benchmarks share is
``tools/bench/common.py``): the rank pool (``distributed``), the ``--help`` of many programs in
one process (``helps``), random batches, a policy built by hand, the SGLang guard and the
session's shared SGLang servers (``sglang``, ``sglang_shared``), the CPU demo run as a user
starts it (``demo_run``), kill -9 and resume (``kill_resume``, also a script), launched nodes
(``launch_nodes``), the embedded engine driven in-process (``engine_runs``), tiny HF models
whose every tensor matters (``models_fixtures``), the reward worker's targets
(``reward_worker_targets``). Not part of the wheel; tests import shared helpers only from here
(tests/test_layers.py checks that no test module imports another)."""
