"""Writing and reading a run's metrics, and the helpers that compute the per-step telemetry.

- :class:`MetricsLogger` appends one JSON object per step to ``RUN_DIR/metrics.jsonl``
  (always), and mirrors numeric values to TensorBoard and W&B when asked.
- :func:`read_metrics` / :func:`scan_metrics` read that file back, tolerating a truncated
  last line (a run still writing, or one killed mid-write).
- :func:`grad_norms`, :func:`exit_stats`, :func:`entropy_stats`, :func:`mismatch_stats`,
  :func:`peak_memory_gb` and :class:`Timer` compute the values the schema names.

Only one process of a distributed run (rank 0) should own a :class:`MetricsLogger`.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from rltt.errors import RlttError
from rltt.telemetry import schema

METRICS_FILE = "metrics.jsonl"

#: Environment variable that turns strict mode on for every :class:`MetricsLogger` built
#: without an explicit ``strict``: ``RLTT_STRICT_METRICS=1`` (the test suite sets it).
STRICT_ENV = "RLTT_STRICT_METRICS"

#: p_1 at or above which a token counts as collapsed onto loop 1 (``exit/collapse``).
COLLAPSE_TOKEN_P1 = 0.9


# --------------------------------------------------------------------------- reading


@dataclass
class MetricsFile:
    """What :func:`scan_metrics` found in a metrics file."""

    path: Path
    records: list[dict[str, Any]]
    #: 1-based line numbers of lines that were not valid JSON objects (the truncated tail
    #: included).
    bad_lines: list[int] = field(default_factory=list)
    #: True when the last line had no newline and did not parse: a write in progress.
    truncated_tail: bool = False


def metrics_path(run_dir_or_file: str | os.PathLike[str]) -> Path:
    """``RUN_DIR/metrics.jsonl``, or the path itself when it names a file."""
    path = Path(run_dir_or_file)
    return path if path.suffix == ".jsonl" or path.is_file() else path / METRICS_FILE


def scan_metrics(path: str | os.PathLike[str]) -> MetricsFile:
    """Read a metrics file (or ``RUN_DIR``), keeping every line that parses as a JSON object.

    A last line without a trailing newline that does not parse is a record still being
    written and is dropped silently (``truncated_tail``); other bad lines are skipped and
    listed in ``bad_lines``. Raises :class:`RlttError` when the file does not exist.
    """
    path = metrics_path(path)
    if not path.is_file():
        raise RlttError(f"no metrics file at {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    ends_with_newline = text.endswith("\n")
    if ends_with_newline:
        lines.pop()  # the empty string after the final newline
    result = MetricsFile(path=path, records=[])
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            result.records.append(record)
            continue
        result.bad_lines.append(number)
        if number == len(lines) and not ends_with_newline:
            result.truncated_tail = True
    return result


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (or of the file ``path``), in file order.

    Tolerates a truncated last line (see :func:`scan_metrics`).
    """
    return scan_metrics(path).records


def truncate_metrics(path: str | os.PathLike[str], max_step: int) -> int:
    """Drop the records with ``step > max_step`` (and unparsable lines) from a metrics file.

    Used when a run resumes from the checkpoint of ``max_step``: the steps logged after that
    checkpoint are about to be redone. The file is rewritten atomically. Returns the number
    of records removed.
    """
    scanned = scan_metrics(path)
    kept = [r for r in scanned.records if not _is_after(r, max_step)]
    tmp = scanned.path.with_name(scanned.path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in kept:
            f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, scanned.path)
    return len(scanned.records) - len(kept)


def _is_after(record: Mapping[str, Any], max_step: int) -> bool:
    step = record.get(schema.STEP)
    return isinstance(step, numbers.Real) and step > max_step


# --------------------------------------------------------------------------- writing


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into ``/``-joined keys.

    ``{"reward": {"mean": 1}}`` becomes ``{"reward/mean": 1}``.
    """
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        full = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, full))
        else:
            flat[full] = value
    return flat


def to_json_value(value: Any) -> Any:
    """A JSON-ready scalar: 0-d tensors / numpy scalars become Python numbers.

    bool stays bool, int stays int, floats stay floats (NaN/inf are kept; Python's json reads
    them back). Strings and None pass through. Anything else raises TypeError.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric tensors must have one element, got shape {tuple(value.shape)}")
        value = value.detach().cpu().item()
    elif hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar / 0-d array
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric value of type {type(value).__name__} is not a scalar")


class MetricsLogger:
    """Per-step metrics to ``RUN_DIR/metrics.jsonl`` (+ TensorBoard / W&B when asked).

    ``resume_step``: the step of the checkpoint a resumed run continues from. The existing
    file is kept (append mode) but its records with ``step > resume_step`` are removed,
    since those steps will be logged again (``resume_step=0``, no checkpoint yet: all of
    them, the step-0 record included). Without it, an existing file is appended to
    as is (a partial last line left by a crash is removed first, so it cannot corrupt the
    next record).

    ``strict``: raise ValueError on keys the vocabulary (:mod:`rltt.telemetry.schema`) does
    not document. None (the default) reads the environment: strict when
    ``RLTT_STRICT_METRICS`` is ``1``/``true``/``yes`` (:func:`strict_from_env`). The test
    suite sets it for the whole session, so every training loop a test runs checks its keys.

    Each :meth:`log` writes and flushes one line, so ``rltt review`` can read a live run.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        tensorboard: bool = False,
        wandb: bool = False,
        *,
        resume_step: int | None = None,
        wandb_project: str = "rltt",
        wandb_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        strict: bool | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.strict = strict_from_env() if strict is None else bool(strict)
        if resume_step is not None and self.path.exists():
            # step 0 = no checkpoint: every record is redone, the step-0 (initial eval) one included
            truncate_metrics(self.path, resume_step if resume_step > 0 else -1)
        elif self.path.exists():
            _drop_partial_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        self._wandb_run = None
        if tensorboard:
            self._tb = _open_tensorboard(self.run_dir / "tensorboard", resume_step)
        if wandb:
            self._wandb_run = _open_wandb(self.run_dir, wandb_project, wandb_name, config)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one record ``{"step": step, "wall_time": ..., **metrics}``; returns it.

        Nested dicts are flattened with ``/``; tensors and numpy scalars are converted.
        A ``step`` key inside ``metrics`` must agree with ``step``.
        """
        if self._file.closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        flat = flatten(metrics)
        if schema.STEP in flat and flat.pop(schema.STEP) != step:
            raise ValueError(f"metrics['step'] disagrees with step={step}")
        if self.strict:
            unknown = schema.unknown_keys(flat)
            if unknown:
                raise ValueError(f"metric keys not in rltt.telemetry.schema: {unknown} "
                                 f"(register them in rltt.telemetry.schema.METRICS)")
        record: dict[str, Any] = {schema.STEP: int(step), schema.WALL_TIME: round(time.time(), 3)}
        for key, value in flat.items():
            try:
                record[key] = to_json_value(value)
            except TypeError as exc:
                raise TypeError(f"metric {key!r}: {exc}") from None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = {
            k: float(v)
            for k, v in record.items()
            if k not in (schema.STEP, schema.WALL_TIME)
            and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, int(step))
        if self._wandb_run is not None:
            self._wandb_run.log(numeric, step=int(step))
        return record

    def close(self) -> None:
        """Flush and close the file and the optional writers (idempotent)."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def strict_from_env() -> bool:
    """Whether ``RLTT_STRICT_METRICS`` asks for strict metric keys (1 / true / yes / on)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _drop_partial_tail(path: Path) -> None:
    """Remove a trailing line without newline that is not valid JSON (a crash mid-write)."""
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
        except ValueError:
            f.truncate(cut)
        else:  # a complete record that only lacks its newline
            f.write(b"\n")


def _open_tensorboard(log_dir: Path, resume_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RlttError(
            "tensorboard logging was requested but the 'tensorboard' package is not "
            "installed (pip install 'rltt[logging]')"
        ) from exc
    # purge_step makes TensorBoard hide the events of the steps a resumed run redoes
    return SummaryWriter(log_dir=str(log_dir), purge_step=None if resume_step is None
                         else resume_step + 1)


def _open_wandb(run_dir: Path, project: str, name: str | None, config: Mapping[str, Any] | None):
    try:
        import wandb
    except ImportError as exc:
        raise RlttError(
            "wandb logging was requested but the 'wandb' package is not installed "
            "(pip install wandb, or turn wandb logging off)"
        ) from exc
    return wandb.init(project=project, name=name, dir=str(run_dir), mode="offline",
                      config=dict(config or {}), resume="allow")


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


def peak_memory_gb(device: torch.device | str | None = None) -> float:
    """Peak memory in GiB: CUDA max allocated on a CUDA device, else this process's max RSS."""
    dev = torch.device(device) if device is not None else None
    use_cuda = (dev.type == "cuda") if dev is not None else (
        torch.cuda.is_available() and torch.cuda.is_initialized())
    if use_cuda:
        return torch.cuda.max_memory_allocated(dev) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


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
