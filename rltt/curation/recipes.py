"""`rltt curate` and `rltt eval` on a train recipe: its policy, engine (``rollout.engine``: native or
vllm, through `rltt.orchestration.engines.make_engine`), sampling settings and rewards (each with its
``rewards.N.timeout_s``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rltt.curation.curation_loop import CurationJob, CurationResult, check_existing_output, run_curation
from rltt.curation.histogram import Band
from rltt.data.prompts import recipe_prompt_renderer
from rltt.data.reasoning import thinking_budget
from rltt.data.rewards import RewardRunner
from rltt.orchestration.policy import EvalResult, evaluate, load_policy, resolve_model_path, stop_ids
from rltt.orchestration.prompt_stream import eval_tasks, load_records
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.errors import RlttError
from rltt.rollout import RolloutEngine, SamplingParams
from rltt.orchestration.engines import make_engine

EVAL_SEED_OFFSET = 7  # the train loop's held-out evaluation uses recipe.seed + 7: same draws here


@dataclass
class RecipePolicy:
    """What a recipe's policy needs to sample and be scored."""

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
    def load(cls, recipe: TrainRecipe, recipe_root: Path | None = None, model: str | None = None) -> "RecipePolicy":
        """The recipe's policy (or the checkpoint ``model``), the engine of ``rollout.engine`` on it
        and the reward runner (per-call ``rewards.N.timeout_s``). `close` releases them."""
        runner = RewardRunner.from_specs([(s.fn, s.weight, s.timeout_s) for s in recipe.rewards], root=recipe_root)
        try:
            path = resolve_model_path(model or recipe.model.path)
            net, tokenizer = load_policy(path, recipe.model.dtype, recipe.model.device, recipe.model.convert)
            net.eval()
            engine = make_engine(recipe.rollout, net)
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

    def sampling(self, recipe: TrainRecipe) -> SamplingParams:
        """The recipe's rollout sampling settings (``n`` and ``seed`` are set per call)."""
        ro = recipe.rollout
        return SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                              max_new_tokens=ro.max_new_tokens, stop_token_ids=stop_ids(self.tokenizer),
                              stop_strings=list(ro.stop_strings),
                              decoder=self.tokenizer.decode if ro.stop_strings else None,
                              exit_policy=ro.exit_policy, schedule=ro.schedule,
                              thinking=thinking_budget(ro.thinking, self.tokenizer))


def source_label(source: str) -> str:
    """How a data source is named in curation records: a local path resolved, else as given."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def curation_records(source: str, split: str, limit: int | None, seed: int) -> list[dict]:
    """The prompts to curate: ``source``'s ``split`` (first ``limit``); synthetic sources need ``limit``."""
    if limit is not None and limit < 1:
        raise RlttError(f"--limit: must be >= 1, got {limit}")
    if source.startswith("synthetic") and limit is None:
        raise RlttError(f"--limit: the synthetic source {source!r} is endless; pass --limit N")
    return load_records(source, split, limit, seed, count=limit)


def curate_recipe(recipe: TrainRecipe, out: str | Path, *, samples: int | None = None, band: Band | None = None,
                  source: str | None = None, split: str | None = None, limit: int | None = None,
                  kept: str | Path | None = None, recipe_root: Path | None = None, model: str | None = None,
                  progress: bool = True) -> CurationResult:
    """Curate the recipe's data source (or ``source``) with its policy (or ``model``)."""
    source = source or recipe.data.source
    split = split or recipe.data.split
    samples = samples if samples is not None else recipe.rollout.group_size
    if samples < 1:
        raise RlttError(f"--samples: must be >= 1, got {samples}")
    records = curation_records(source, split, limit if limit is not None else recipe.data.limit, recipe.data.seed)
    job = CurationJob(source=source_label(source), records=records, out=out, samples=samples, band=band or Band(),
                      kept=kept, template=recipe.data.prompt_template, seed=recipe.seed, progress=progress,
                      stop_grace_s=recipe.train.stop_grace_s)
    check_existing_output(job)  # a bad existing output fails before the model loads
    with RecipePolicy.load(recipe, recipe_root, model) as policy:
        job.template = recipe_prompt_renderer(recipe.data, policy.tokenizer)
        job.sampling = policy.sampling(recipe)
        job.fingerprint = {"model": str(policy.model_path.resolve()), "dtype": recipe.model.dtype,
                           "convert": recipe.model.convert, "split": split,
                           "rewards": [[s.fn, s.weight] for s in recipe.rewards]}
        if recipe.rollout.engine != "native":  # another sampler: an output from the native one does not resume
            job.fingerprint["engine"] = recipe.rollout.engine
        return run_curation(job, policy.engine, policy.encode, policy.decode, policy.runner)


@dataclass
class EvalReport:
    """A held-out evaluation: where, how, and the `EvalResult`."""

    model: str
    source: str
    split: str
    tasks: int
    samples: int
    temperature: float
    result: EvalResult

    def to_dict(self) -> dict:
        r = self.result
        return {"model": self.model, "source": self.source, "split": self.split, "tasks": self.tasks,
                "samples": self.samples, "temperature": self.temperature, "solve_rate": r.solve_rate,
                "reward_mean": r.reward_mean, "mean_exit_step": r.mean_exit_step, "per_task": r.per_task}

    def summary(self) -> str:
        r = self.result
        return (f"{self.model} on {self.source} [{self.split}]: {self.tasks} prompts x {self.samples} samples "
                f"(temperature {self.temperature:g})\n"
                f"solve rate {r.solve_rate:.4f}, mean reward {r.reward_mean:.4f}, mean exit step "
                f"{r.mean_exit_step:.2f}")


def evaluate_recipe(recipe: TrainRecipe, *, samples: int | None = None, split: str | None = None,
                    limit: int | None = None, source: str | None = None, temperature: float | None = None,
                    recipe_root: Path | None = None, model: str | None = None) -> EvalReport:
    """Held-out solve rate and mean reward of the recipe's policy (or ``model``) on its eval source.

    Defaults follow the recipe's own evaluation (``train.eval_samples``, ``train.eval_temperature``,
    ``data.eval_source``/``eval_split``/``eval_size``, seed ``recipe.seed + 7``), so it reproduces
    the numbers `rltt train` logs as ``eval/solve_rate``.
    """
    d = recipe.data
    samples = samples if samples is not None else recipe.train.eval_samples
    temperature = temperature if temperature is not None else recipe.train.eval_temperature
    size = limit if limit is not None else d.eval_size
    split = split or d.eval_split
    if samples < 1:
        raise RlttError(f"--samples: must be >= 1, got {samples}")
    if size < 1:
        raise RlttError(f"--limit: must be >= 1, got {size}")
    if temperature < 0:
        raise RlttError(f"--temperature: must be >= 0, got {temperature}")
    eval_source = source or d.eval_source
    with RecipePolicy.load(recipe, recipe_root, model) as policy:
        tasks = eval_tasks(eval_source, d.source, policy.encode, recipe_prompt_renderer(d, policy.tokenizer), split,
                           size, d.seed)
        result = evaluate(policy.engine, tasks, policy.tokenizer, policy.runner, samples, temperature,
                          recipe.rollout.max_new_tokens, seed=recipe.seed + EVAL_SEED_OFFSET,
                          exit_policy=recipe.rollout.exit_policy, schedule=recipe.rollout.schedule,
                          thinking=thinking_budget(recipe.rollout.thinking, policy.tokenizer))
    shown_source = eval_source or (f"{d.source} (held out)" if d.source.startswith("synthetic") else d.source)
    return EvalReport(str(policy.model_path), shown_source, split, len(tasks), samples, temperature, result)
