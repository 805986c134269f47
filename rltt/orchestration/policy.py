"""Loading the policy (model + tokenizer) a recipe names, and evaluating its solve rate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from rltt.data.rewards import RewardRunner
from rltt.errors import RlttError
from rltt.orchestration.groups import score_rollout
from rltt.orchestration.prompt_stream import Task
from rltt.rollout import RolloutEngine, SamplingParams
from rltt.runtime.device import pick_device
from rltt.telemetry import schema as m


def resolve_model_path(path: str) -> Path:
    """``quickstart`` → the cached quickstart model (built on first use); a local directory; or a
    hub id, fetched with huggingface_hub when it is not a local path."""
    if path == "quickstart":
        from rltt.lm_training.quickstart_model import ensure_quickstart_model

        return Path(ensure_quickstart_model())
    local = Path(path).expanduser()
    if local.exists():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path))
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, ...
        raise RlttError(f"model.path: {path!r} is not a local directory and could not be fetched "
                        f"({type(exc).__name__})") from None


def load_policy(path: str | Path, dtype: str = "fp32", device: str = "auto", convert: dict | None = None):
    """(model, tokenizer) from a checkpoint directory (rltt, Ouro or a dense model to convert)."""
    from transformers import AutoTokenizer

    from rltt.model import load_looped

    path = Path(path)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = load_looped(path, dtype=torch_dtype, **(convert or {})).to(pick_device(device, "model.device"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RlttError(f"model.path: no tokenizer in {path} ({type(exc).__name__})") from None
    return model, tokenizer


def stop_ids(tokenizer) -> list[int]:
    ids = tokenizer.eos_token_id
    return [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))


@dataclass
class EvalResult:
    """Sums over the evaluated samples; the rates are properties, so results of disjoint task
    shards (data-parallel ranks) merge exactly: ``EvalResult(**combine([vars(p) for p in parts],
    EvalResult.OPS))`` (or `reduce_ranks` across ranks)."""

    #: how shards merge (`rltt.runtime.distributed.combine`)
    OPS: ClassVar[dict[str, str]] = {"solved": "sum", "samples": "sum", "reward_sum": "sum", "per_task": "concat",
                                     "exit_step_sum": "sum", "tokens": "sum", "row_passes": "sum",
                                     "passes_tokens": "sum"}

    solved: int
    samples: int
    reward_sum: float
    per_task: dict[str, float]  # task id -> fraction of its samples solved
    exit_step_sum: float
    tokens: int  # sampled completion tokens (the exits counted)
    row_passes: float = 0.0  # serial block passes of the rows, where the engine counts them
    passes_tokens: int = 0  # the completion tokens of those calls

    @property
    def solve_rate(self) -> float:
        return self.solved / self.samples if self.samples else 0.0

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.samples if self.samples else 0.0

    @property
    def mean_exit_step(self) -> float:
        return self.exit_step_sum / max(self.tokens, 1)

    @property
    def passes_per_token(self) -> float | None:
        """Serial block passes per generated token; None when the engine did not count them (vLLM)."""
        return self.row_passes / self.passes_tokens if self.passes_tokens else None


def eval_exit_policy(recipe) -> str | None:
    """The exit policy a train recipe evaluates with: ``train.eval_exit_policy`` (e.g. a
    deployment ``threshold:q``), else the rollout's ``rollout.exit_policy``."""
    own = getattr(recipe.train, "eval_exit_policy", None)
    return own if own is not None else recipe.rollout.exit_policy


def evaluate(engine: RolloutEngine, tasks: list[Task], tokenizer, runner: RewardRunner, samples: int,
             temperature: float, max_new_tokens: int, seed: int, exit_policy=None, schedule="deferred",
             chunk: int = 64, shard: tuple[int, int] = (0, 1), thinking=None) -> EvalResult:
    """Sample ``samples`` completions per task and score them; the primary reward decides 'solved'.

    Tasks go to the engine in chunks of ``chunk``, each seeded by its position; ``shard = (i, n)``
    evaluates the chunks ``i, i + n, ...`` only, so the merged results of the n shards equal one
    unsharded evaluation. ``thinking``: the rollout's `ThinkingBudget` (forced answer), or None."""
    primary = runner.names[0]
    rank, world = shard
    result = EvalResult(0, 0, 0.0, {}, 0.0, 0)
    for index, start in enumerate(range(0, len(tasks), chunk)):
        if index % world != rank:
            continue
        part = tasks[start:start + chunk]
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=samples, seed=seed + start,
                                stop_token_ids=stop_ids(tokenizer), exit_policy=exit_policy, schedule=schedule,
                                thinking=thinking)
        rollout = engine.generate([t.prompt_ids for t in part], params)
        scored = score_rollout(rollout, part, tokenizer.decode, runner)
        flags = scored.solved(primary).view(len(part), samples)
        result.solved += int(flags.sum())
        result.samples += flags.numel()
        result.reward_sum += sum(scored.rewards.tolist())
        for task, row in zip(part, flags.sum(1).tolist()):
            result.per_task[task.id] = row / samples
        mask = rollout.action_mask  # sampled tokens (forced ones have no exit)
        result.exit_step_sum += float(rollout.exit_steps[mask].float().sum())
        result.tokens += int(mask.sum())
        if rollout.stats.row_passes is not None:
            result.row_passes += float(rollout.stats.row_passes.sum())
            result.passes_tokens += rollout.stats.tokens
    return result


class HeldOutEvaluator:
    """The run's held-out evaluation: the solve rate of the rollout policy on ``tasks``, with the
    recipe's evaluation settings (exit policy: `eval_exit_policy`), beside the mean recorded exit
    step and the serial passes per token it took. With several ranks each evaluates its share of
    the task chunks (every rank holds the same weights) and the sums are reduced: the same numbers
    as one process, in 1/world of the time. A collective: every rank calls it."""

    def __init__(self, recipe, engine: RolloutEngine, tasks: list[Task], tokenizer, runner: RewardRunner, ranks,
                 thinking=None):
        self.recipe, self.engine, self.tasks, self.tokenizer = recipe, engine, tasks, tokenizer
        self.runner, self.ranks, self.thinking = runner, ranks, thinking

    def __call__(self) -> dict[str, float]:
        r = self.recipe
        part = evaluate(self.engine, self.tasks, self.tokenizer, self.runner, r.train.eval_samples,
                        r.train.eval_temperature, r.rollout.max_new_tokens, seed=r.seed + 7,
                        exit_policy=eval_exit_policy(r), schedule=r.rollout.schedule,
                        shard=(self.ranks.rank, self.ranks.world), thinking=self.thinking)
        result = EvalResult(**self.ranks.reduce(vars(part), EvalResult.OPS))
        out = {m.EVAL_SOLVE_RATE: result.solve_rate, m.EVAL_REWARD_MEAN: result.reward_mean,
               m.EVAL_COMPUTE_MEAN_EXIT: result.mean_exit_step}
        if result.passes_per_token is not None:
            out[m.EVAL_COMPUTE_PASSES_PER_TOKEN] = result.passes_per_token
        return out
