"""Helpers shared by the tests (and the ``tools/`` benchmarks run from a checkout): the rank
pool (``distributed``), random batches, a policy built by hand, the SGLang guard. Not part of
the wheel; tests import shared helpers only from here."""
