"""The helpers that compute the per-step telemetry values the schema names.

- :func:`grad_norms` — gradient L2 norms: total, per module group, per layer.
- :func:`exit_stats`, :func:`entropy_stats`, :func:`mismatch_stats` — loop statistics over
  completion tokens (exit distribution, per-loop entropy, sampler–learner mismatch).
- :func:`peak_memory_gb` and :class:`Timer` — systems: peak memory, wall-clock timings.

Each returns plain Python numbers keyed by :mod:`rltt.telemetry.schema` names, ready for
:meth:`rltt.telemetry.logger.MetricsLogger.log`.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from rltt.telemetry import schema

#: p_1 at or above which a token counts as collapsed onto loop 1 (``exit/collapse``).
COLLAPSE_TOKEN_P1 = 0.9


# --------------------------------------------------------------------------- gradient norms

#: Default module groups of the looped model, as parameter-name prefixes (first match wins;
#: parameters matching none are reported as ``other``).
DEFAULT_GRAD_GROUPS: dict[str, tuple[str, ...]] = {
    "embed": ("model.embed_tokens",),
    "block": ("model.layers",),
    "injection": ("model.injection",),
    "gate": ("model.exit_gate", "model.early_exit_gate"),
    "norm": ("model.norm",),
    "lm_head": ("lm_head",),
}

#: Regex whose first group is the layer index of a shared-block parameter.
DEFAULT_LAYER_PATTERN = r"(?:^|\.)layers\.(\d+)\."

#: Prefixes added by wrappers (DDP/DeepSpeed ``module.``, torch.compile ``_orig_mod.``),
#: stripped before matching.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")

GroupSpec = Callable[[str], bool] | str | Sequence[str]


def _matcher(spec: GroupSpec) -> Callable[[str], bool]:
    if callable(spec):
        return spec
    prefixes = (spec,) if isinstance(spec, str) else tuple(spec)
    return lambda name: any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def _clean_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


@torch.no_grad()
def grad_norms(
    model: torch.nn.Module,
    groups: Mapping[str, GroupSpec] | None = None,
    layer_pattern: str | re.Pattern[str] | None = DEFAULT_LAYER_PATTERN,
) -> dict[str, float]:
    """L2 norms of the current gradients: total, per module group and per layer.

    Call it after ``backward()`` and before gradient clipping / ``optimizer.zero_grad()``.

    ``groups`` maps a group name to a predicate on the parameter name, one prefix or a list
    of prefixes (default :data:`DEFAULT_GRAD_GROUPS`); each parameter counts in the first
    group that matches, or in ``other``. ``layer_pattern`` is a regex whose first group is
    the layer index (default: ``layers.<i>.``); None skips the per-layer norms. Parameters
    without a gradient are ignored; groups without any gradient are omitted.

    Returns ``{"grad_norm/total": ..., "grad_norm/group/<name>": ..., "grad_norm/layer/<i>": ...}``.
    (Under ZeRO-2/3 the gradients are sharded: compute norms on the full gradients instead.)
    """
    matchers = [(name, _matcher(spec)) for name, spec in (groups or DEFAULT_GRAD_GROUPS).items()]
    pattern = re.compile(layer_pattern) if isinstance(layer_pattern, str) else layer_pattern
    group_sq: dict[str, list[torch.Tensor]] = {}
    layer_sq: dict[int, list[torch.Tensor]] = {}
    all_sq: list[torch.Tensor] = []
    for raw_name, param in model.named_parameters():
        if param.grad is None:
            continue
        name = _clean_name(raw_name)
        grad = param.grad
        if grad.is_sparse:
            grad = grad.coalesce().values()
        sq = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32) ** 2
        all_sq.append(sq)
        group = next((g for g, match in matchers if match(name)), "other")
        group_sq.setdefault(group, []).append(sq)
        if pattern is not None:
            m = pattern.search(name)
            if m:
                layer_sq.setdefault(int(m.group(1)), []).append(sq)
    if not all_sq:
        return {}
    keys = [schema.GRAD_NORM_TOTAL]
    sums = [torch.stack(all_sq).sum()]
    for group, parts in group_sq.items():
        keys.append(schema.grad_group_key(group))
        sums.append(torch.stack(parts).sum())
    for layer in sorted(layer_sq):
        keys.append(schema.grad_layer_key(layer))
        sums.append(torch.stack(layer_sq[layer]).sum())
    # one device->host transfer for all norms
    values = torch.stack([s.to(sums[0].device) for s in sums]).sqrt().cpu().tolist()
    return dict(zip(keys, values))


# --------------------------------------------------------------------------- loop statistics


def _masked_mean_over_tokens(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over all but the first dimension of ``x`` (T, ...), weighting by ``mask`` (...)."""
    x = x.detach().float()
    flat = x.reshape(x.shape[0], -1)
    if mask is None:
        return flat.mean(dim=1)
    m = torch.as_tensor(mask, device=x.device).float().expand(x.shape[1:]).reshape(-1)
    return (flat * m).sum(dim=1) / m.sum().clamp_min(1.0)


def exit_stats(exit_probs: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """Exit-distribution telemetry from ``exit_probs`` of shape (T, ...) (p_t per token).

    ``mask`` (broadcastable to ``exit_probs.shape[1:]``, 1 = completion token) selects the
    tokens averaged over. Returns ``exit/p_<t>`` for t = 1..T (mean p_t), ``exit/mean_step``
    (mean of sum_t t*p_t), ``exit/collapse`` (fraction of tokens with p_1 >=
    :data:`COLLAPSE_TOKEN_P1`) and ``exit/entropy`` (mean H(p)).
    """
    p = torch.as_tensor(exit_probs).detach().float()
    if p.dim() < 1 or p.shape[0] < 1:
        raise ValueError("exit_probs must have shape (T, ...) with T >= 1")
    T = p.shape[0]
    if p.dim() == 1:
        p = p[:, None]
    steps = torch.arange(1, T + 1, device=p.device, dtype=p.dtype).view(T, *([1] * (p.dim() - 1)))
    per_token = torch.stack([
        (p * steps).sum(0),  # expected exit step
        (p[0] >= COLLAPSE_TOKEN_P1).float(),  # collapsed onto loop 1
        -(p * p.clamp_min(1e-12).log()).sum(0),  # H(p)
    ])
    token_means = _masked_mean_over_tokens(per_token, mask).tolist()
    p_means = _masked_mean_over_tokens(p, mask).tolist()
    out = {schema.exit_p_key(t + 1): v for t, v in enumerate(p_means)}
    out[schema.EXIT_MEAN_STEP] = token_means[0]
    out[schema.EXIT_COLLAPSE] = token_means[1]
    out[schema.EXIT_ENTROPY] = token_means[2]
    return out


def entropy_stats(entropy: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """``entropy/loop_<t>`` from per-loop token entropies of shape (T, ...) (e.g. the kernel's)."""
    means = _masked_mean_over_tokens(torch.as_tensor(entropy), mask).tolist()
    return {schema.entropy_key(t + 1): v for t, v in enumerate(means)}


def mismatch_stats(
    logp_learner: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """Sampler–learner log-prob mismatch over completion tokens (docs/design.md §3.4).

    ``mismatch/max_abs`` and ``mismatch/mean_abs`` of ``d = logp_learner - logp_sampler``,
    and ``mismatch/k3`` = mean(exp(d) - 1 - d), the k3 estimate of KL(sampler || learner)
    (tokens were drawn by the sampler). Shapes must match; ``mask`` selects tokens.
    """
    learner = torch.as_tensor(logp_learner).detach().double()
    sampler = torch.as_tensor(logp_sampler, device=learner.device).detach().double()
    d = learner - sampler
    if mask is not None:
        d = d[torch.as_tensor(mask, device=d.device).expand(d.shape).bool()]
    d = d.reshape(-1)
    if d.numel() == 0:
        return {}
    k3 = torch.expm1(d) - d
    return {
        schema.MISMATCH_MAX_ABS: d.abs().max().item(),
        schema.MISMATCH_MEAN_ABS: d.abs().mean().item(),
        schema.MISMATCH_K3: k3.mean().item(),
    }


# --------------------------------------------------------------------------- systems


def _on_cuda(device: torch.device | str | None) -> bool:
    dev = torch.device(device) if device is not None else None
    return (dev.type == "cuda") if dev is not None else (torch.cuda.is_available() and torch.cuda.is_initialized())


def peak_memory_gb(device: torch.device | str | None = None) -> float:
    """Peak memory in GiB: CUDA max allocated on a CUDA device (since the last `reset_peak_memory`),
    else this process's max RSS (since the process started: the OS keeps no resettable peak)."""
    dev = torch.device(device) if device is not None else None
    if _on_cuda(device):
        return torch.cuda.max_memory_allocated(dev) / schema.GIB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return rss / schema.GIB if sys.platform == "darwin" else rss * 1024 / schema.GIB


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Start a new CUDA peak (`peak_memory_gb` then reports the peak since this call): the trainers
    call it after each record so that ``memory/peak_gb`` is a step's (or logging interval's) peak,
    not the process's so far. No-op off CUDA."""
    if _on_cuda(device):
        torch.cuda.reset_peak_memory_stats(torch.device(device) if device is not None else None)


class Timer:
    """Wall-clock timer: ``with Timer() as t: ...`` then ``t.elapsed`` (seconds).

    With ``into`` and ``key`` the elapsed time is also stored in the dict ``into[key]``
    (``with Timer(metrics, "time/rollout"): ...``), added to a value already there, so a
    phase timed in pieces sums up. ``cuda_sync=True`` synchronises CUDA at both ends so
    asynchronous kernels are counted.
    """

    def __init__(self, into: dict[str, Any] | None = None, key: str | None = None,
                 cuda_sync: bool = False) -> None:
        if (into is None) != (key is None):
            raise ValueError("Timer: give both `into` and `key`, or neither")
        self.into, self.key, self.cuda_sync = into, key, cuda_sync
        self.start: float | None = None
        self.elapsed: float = 0.0

    def _sync(self) -> None:
        if self.cuda_sync and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def __enter__(self) -> "Timer":
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self.elapsed = time.perf_counter() - (self.start or 0.0)
        if self.into is not None:
            self.into[self.key] = self.into.get(self.key, 0.0) + self.elapsed
