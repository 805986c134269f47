"""`rltt curate` on a train recipe: its policy, engine (``rollout.engine``: native or vllm),
sampling settings and rewards (each with its ``rewards.N.timeout_s``), loaded by
`rltt.orchestration.policy.RecipePolicy`. `rltt eval` is `rltt.orchestration.evaluator`."""

from __future__ import annotations

from pathlib import Path

from rltt.curation.curation_loop import CurationJob, CurationResult, check_existing_output, run_curation
from rltt.curation.histogram import Band
from rltt.data.prompts import recipe_prompt_renderer
from rltt.errors import RlttError
from rltt.orchestration.policy import RecipePolicy
from rltt.orchestration.prompt_stream import load_records
from rltt.orchestration.train_recipe import TrainRecipe


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
