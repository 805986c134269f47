"""Loading the policy (model + tokenizer) a recipe names, and evaluating its solve rate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rltt.data.rewards import RewardRunner
from rltt.errors import RlttError
from rltt.orchestration.groups import score_rollout, solved
from rltt.orchestration.prompts import Task
from rltt.rollout import RolloutEngine, SamplingParams


def resolve_model_path(path: str) -> Path:
    """``quickstart`` → the cached quickstart model (built on first use); a local directory; or a
    hub id, fetched with huggingface_hub when it is not a local path."""
    if path == "quickstart":
        from rltt.stages.quickstart import ensure_quickstart_model

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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_policy(path: str | Path, dtype: str = "fp32", device: str = "auto", convert: dict | None = None):
    """(model, tokenizer) from a checkpoint directory (rltt, Ouro or a dense model to convert)."""
    from transformers import AutoTokenizer

    from rltt.model import load_looped

    path = Path(path)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = load_looped(path, dtype=torch_dtype, **(convert or {})).to(resolve_device(device))
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
    solve_rate: float
    reward_mean: float
    per_task: dict[str, float]  # task id -> fraction of its samples solved
    mean_exit_step: float


def evaluate(engine: RolloutEngine, tasks: list[Task], tokenizer, runner: RewardRunner, samples: int,
             temperature: float, max_new_tokens: int, seed: int, exit_policy=None, schedule="deferred",
             chunk: int = 64) -> EvalResult:
    """Sample ``samples`` completions per task and score them; the primary reward decides 'solved'."""
    primary = runner.names[0]
    solved_flags, rewards, per_task, exits, tokens = [], [], {}, 0.0, 0
    for start in range(0, len(tasks), chunk):
        part = tasks[start:start + chunk]
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=samples, seed=seed + start,
                                stop_token_ids=stop_ids(tokenizer), exit_policy=exit_policy, schedule=schedule)
        rollout = engine.generate([t.prompt_ids for t in part], params)
        groups = score_rollout(rollout, part, tokenizer.decode, runner)
        flags = solved(groups, primary)
        solved_flags += flags
        rewards += groups.rewards
        for g, task in enumerate(part):
            per_task[task.id] = sum(flags[g * samples:(g + 1) * samples]) / samples
        mask = rollout.completion_mask
        exits += float(rollout.exit_steps[mask].float().sum())
        tokens += int(mask.sum())
    return EvalResult(sum(solved_flags) / len(solved_flags), sum(rewards) / len(rewards), per_task,
                      exits / max(tokens, 1))
