"""Per-loop log-prob kernels (docs/design.md §4).

``per_loop_logprobs(hidden (T, N, d), weight (V, d), targets (N,))`` returns the log-prob of
each target under every loop's distribution and every loop's entropy, without ever holding
more than one vocabulary chunk of logits (``kept_floor=``: renormalised over a top-k/top-p kept
set per token). Triton on CUDA, chunked PyTorch elsewhere; choose
with ``impl=`` or ``RLTT_LOGPROB_IMPL`` (auto | triton | chunked | reference). Triton is only
imported when its implementation is used.
"""

from rltt.kernels._common import LoopLogProbs
from rltt.kernels.dispatch import ENV_VAR, IMPLS, per_loop_logprobs, resolve_impl

__all__ = ["ENV_VAR", "IMPLS", "LoopLogProbs", "per_loop_logprobs", "resolve_impl"]
