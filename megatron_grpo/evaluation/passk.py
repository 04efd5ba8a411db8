"""pass@k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1).

With ``n`` responses to a problem of which ``c`` are correct, the probability that at least
one of ``k`` responses drawn without replacement is correct is

    pass@k = 1 - C(n - c, k) / C(n, k)

and the metric is its mean over problems. The binomials overflow for large n, so (as in the
paper's code) the ratio is computed as the product ``prod_{i=n-c+1}^{n} (1 - k / i)``; when
``n - c < k`` every draw of k holds a correct one and pass@k = 1. pass@1 is then c / n.
"""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` responses (1 <= k <= n)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(n: int, correct_counts: list[int], k: int) -> float:
    """pass@k averaged over problems, ``correct_counts[i]`` correct of ``n`` for problem i."""
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
