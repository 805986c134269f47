"""Evaluation statistics: pass@k and mean@k from per-problem sample counts, bootstrap standard
errors and 95 % intervals (pooling several runs with the between-run variance counted), and the
paired comparison of two results on the same problems.

- ``rltt.evaluation.passk``: the unbiased pass@k estimator, mean@k;
- ``rltt.evaluation.intervals``: the seeded two-level bootstrap (runs, then problems);
- ``rltt.evaluation.compare``: A − B with its SE, interval (the test inverted) and p-value, all from one
  sign-flip or run-permutation test;
- ``rltt.evaluation.results``: the JSON object of `rltt eval --json`, reading results back, pooling.

Depends on numpy and `rltt.errors` only: it consumes per-sample correctness, whatever engine,
schedule or exit policy sampled it.
"""
