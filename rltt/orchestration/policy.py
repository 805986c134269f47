"""Loading the policy (model + tokenizer) a recipe names, and the one place a recipe's rollout
section becomes `SamplingParams` (`sampling_params`): training, evaluation and curation sample
with it. Evaluating the policy is `rltt.orchestration.evaluator`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rltt.data.reasoning import thinking_budget
from rltt.data.rewards import RewardRunner
from rltt.errors import RlttError
from rltt.model.adapters import merge_adapters_, model_spec
from rltt.orchestration.engines import engine_spec, make_engine
from rltt.rollout import RolloutEngine, SamplingParams
from rltt.runtime.device import pick_device
from rltt.sections import parsed_exit_policy


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


def with_chunk_rows(recipe, plan=None):
    """``recipe`` with ``rollout.chunk_rows: auto`` resolved to the rows one rollout batch holds in
    the memory plan (``plan``: `rltt.planning.memory_plan.plan_here` of the recipe, made here when
    not given): `rltt train`, `rltt eval` and `rltt curate` sample in the same chunks. A set value
    is kept; so is ``auto`` where not even one group fits the plan (the engine: one batch per call)."""
    if recipe.rollout.chunk_rows != "auto":
        return recipe
    if plan is None:
        from rltt.planning.memory_plan import plan_here

        plan = plan_here(recipe)
    if not plan.rollout_rows_per_chunk:
        return recipe
    return replace(recipe, rollout=replace(recipe.rollout, chunk_rows=plan.rollout_rows_per_chunk))


def sampling_params(rollout, stop_token_ids: list[int], decode, thinking=None, **call) -> SamplingParams:
    """The sampling settings of a recipe's ``rollout`` section: temperature, top-p/top-k, length,
    stop ids and strings (``decode``: token ids -> text, used only with ``rollout.stop_strings``),
    exit policy, schedule and the thinking budget (`rltt.data.reasoning.thinking_budget`).
    ``call`` sets what a call adds or changes (``n``, ``seed``, ``prompt_seeds``; an evaluation's
    ``temperature`` and ``exit_policy``)."""
    return SamplingParams(**{"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k,
                             "max_new_tokens": rollout.max_new_tokens, "stop_token_ids": list(stop_token_ids),
                             "stop_strings": list(rollout.stop_strings),
                             "decoder": decode if rollout.stop_strings else None,
                             "exit_policy": parsed_exit_policy(rollout, "exit_policy", "rollout.exit_policy"),
                             "schedule": rollout.schedule,
                             "thinking": thinking, **call})


@dataclass
class RecipePolicy:
    """A train recipe's policy loaded to sample and be scored (`rltt eval`, `rltt curate`): the
    model, tokenizer, the engine of ``rollout.engine`` on it and the reward runner."""

    model_path: Path
    model: object
    tokenizer: object
    engine: RolloutEngine
    runner: RewardRunner

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    @classmethod
    def load(cls, recipe, recipe_root: Path | None = None, model: str | None = None) -> "RecipePolicy":
        """The recipe's policy (or the checkpoint ``model``), the engine of ``rollout.engine`` on it
        and the reward runner (per-call ``rewards.N.timeout_s``). `close` releases them."""
        runner = RewardRunner.from_specs([(s.fn, s.weight, s.timeout_s) for s in recipe.rewards], root=recipe_root)
        try:
            path = resolve_model_path(model or recipe.model.path)
            net, tokenizer = load_policy(path, recipe.model.dtype, recipe.model.device, recipe.model.convert)
            net.eval()
            planned = with_chunk_rows(replace(recipe, model=replace(recipe.model, path=str(path))))
            if model_spec(net) is not None and engine_spec(planned.rollout.engine).adapters(planned.rollout) != "model":
                merge_adapters_(net)  # a LoRA checkpoint on an engine whose model holds no adapters (vLLM)
            engine = make_engine(planned.rollout, net)
        except BaseException:
            runner.close()
            raise
        return cls(path, net, tokenizer, engine, runner)

    def close(self) -> None:
        """Stop the reward workers and an engine with a process of its own (vLLM)."""
        self.runner.close()
        self.engine.close()

    def __enter__(self) -> "RecipePolicy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def thinking(self, recipe):
        """The recipe's ``rollout.thinking`` in this tokenizer's ids (None without a budget)."""
        return thinking_budget(recipe.rollout.thinking, self.tokenizer)

    def sampling(self, recipe, **call) -> SamplingParams:
        """The recipe's rollout sampling settings (`sampling_params`; ``call`` as there)."""
        return sampling_params(recipe.rollout, stop_ids(self.tokenizer), self.tokenizer.decode, self.thinking(recipe),
                               **call)
