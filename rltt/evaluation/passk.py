"""pass@k and mean@k from per-problem sample counts.

A problem sampled ``n`` times with ``c`` correct completions has the unbiased pass@k estimate

    pass@k = 1 − C(n − c, k) / C(n, k)        (k ≤ n)

— the probability that a uniformly drawn k-subset of its n samples holds a correct one. It is
computed as a product, ``C(n−c, k)/C(n, k) = Π_{i=n−c+1..n} (1 − k/i)``, which never forms a
binomial coefficient (no overflow at n in the thousands, no cancellation of large numbers);
it is 1 exactly when ``n − c < k``. mean@k is the mean per-problem success fraction c/n of k
samples per problem (numerically pass@1 when every problem has n = k samples). A benchmark's
score is the mean over problems.
"""

from __future__ import annotations

import numpy as np

from rltt.errors import RlttError


def pass_at_k(n, c, k: int) -> np.ndarray:
    """The unbiased pass@k estimate of each problem (arrays ``n``, ``c`` broadcast; ``1 ≤ k ≤ n``)."""
    n = np.asarray(n, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    n, c = np.broadcast_arrays(n, c)
    if k < 1:
        raise RlttError(f"pass@k: k must be >= 1, got {k}")
    if np.any(c < 0) or np.any(c > n):
        raise RlttError("pass@k: correct counts must lie in [0, n]")
    if np.any(n < k):
        raise RlttError(f"pass@k: k = {k} exceeds the samples of a problem (min n = {int(n.min())})")
    out = np.ones(n.shape, dtype=np.float64)
    some_wrong = (n - c) >= k  # otherwise every k-subset holds a correct sample: exactly 1
    if not np.any(some_wrong):
        return out
    nn, cc = n[some_wrong], c[some_wrong]
    # Π_{i=n−c+1..n} (1 − k/i) as exp Σ log1p(−k/i), vectorised over a ragged range per problem
    width = int(cc.max()) if cc.size else 0
    if width == 0:
        out[some_wrong] = 0.0
        return out
    steps = np.arange(width, dtype=np.int64)                 # i = n − c + 1 + j, j < c
    i = (nn - cc + 1)[:, None] + steps[None, :]
    live = steps[None, :] < cc[:, None]
    terms = np.where(live, np.log1p(-k / np.where(live, i, k + 1).astype(np.float64)), 0.0)
    out[some_wrong] = 1.0 - np.exp(terms.sum(axis=1))
    return out


def max_k(n) -> int:
    """The largest k every problem supports: the fewest samples any problem has."""
    n = np.asarray(n)
    if n.size == 0:
        raise RlttError("pass@k: no problems")
    return int(n.min())


def problem_scores(n, c, ks) -> np.ndarray:
    """A (len(ks), P) array: pass@k of every problem for every k in ``ks``."""
    return np.stack([pass_at_k(n, c, k) for k in ks]) if len(ks) else np.zeros((0, np.asarray(n).size))


def mean_at_k(n, c) -> np.ndarray:
    """Each problem's success fraction c/n (mean@k with k = n samples)."""
    n = np.asarray(n, dtype=np.float64)
    return np.asarray(c, dtype=np.float64) / n
