"""The one filter for library warnings that are not the run's own news.

megatron-core warns at import, per rank and module, that apex / TransformerEngine are absent
(expected on a CPU machine) and about CUDA settings it cannot see; torch's and megatron's
checkpoint code warn about their own deprecations. None of it is actionable for a user, and
it would bury the run's output. Used by ``train`` (every rank), ``eval`` and the converters.
"""

from __future__ import annotations

import warnings

_MESSAGES = (r".*(Apex|Transformer Engine).*", r".*(cuda_graph_scope|CUDA_DEVICE_MAX_CONNECTIONS).*",
             r"full scope is deprecated.*")


def quiet_library_warnings() -> None:
    """Ignore the warnings above in this process (idempotent)."""
    for pattern in _MESSAGES:
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch\.distributed|megatron)")
