"""Continuous batching against chunks: a recipe's rollouts, the native engine with ``chunk_rows`` rows, in
one process, on the recipe's model and prompts (the rows of its first steps, the seeds a training run
gives them), weights fixed.

    python bench/continuous.py                                  # quickstart-longtail and quickstart-tools
    python bench/continuous.py --recipe recipes/quickstart-longtail.yaml --steps 4 --pairs 2 --chunk-rows 16

Arms, each run on the same steps' prompts in turn, ``--pairs`` times in alternating order:

- ``chunks``: ``rollout.continuous_batching=false`` — whole prompts, ``chunk_rows // G`` at a time;
- ``continuous``: the default — ``chunk_rows`` slots, a finished row's slot taken by the next row;
- multi-turn recipes (``env``) add ``resubmitted``: every turn of every row re-submitted as a new prompt
  to the continuous engine (a row waiting for its tool gives its slot up and re-enters with its prefix,
  recomputed), against ``continuous``, whose episodes keep each row in its slot between turns (a
  session per chunk of whole prompts, only the environment's answer prefilled).

Printed per arm: ``rollout/occupancy`` (live rows per pass over ``chunk_rows``, averaged over the steps'
passes), the passes, the (token, step) entries computed, the completion tokens, tokens per second of process CPU time (the recipe's one
intra-op thread: other jobs on a shared machine do not inflate it; the fastest pair's and the median over
pairs, wall clock beside) and the ratio against chunks measured in the same pair. The rows are the same in
every arm of a single-turn recipe (each row draws from its own key); only rounding differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rltt.orchestration.engines import make_engine  # noqa: E402
from rltt.orchestration.episodes import EpisodeRunner  # noqa: E402
from rltt.orchestration.policy import load_policy, resolve_model_path, sampling_params, stop_ids  # noqa: E402
from rltt.orchestration.prompt_stream import PromptStream  # noqa: E402
from rltt.rollout.seeds import rollout_seed  # noqa: E402
from rltt.orchestration.train_recipe import load_train_recipe  # noqa: E402
from rltt.data.prompts import recipe_prompt_renderer  # noqa: E402
from rltt.rollout.engine import RolloutEngine  # noqa: E402

RECIPES = ["recipes/quickstart-longtail.yaml", "recipes/quickstart-tools.yaml"]


def steps_of(recipe, tokenizer, steps: int):
    """The first ``steps`` steps' tasks and sampling settings, as a training run draws them."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    stream = PromptStream(recipe.data.source, encode, recipe_prompt_renderer(recipe.data, tokenizer),
                          recipe.data.split, recipe.data.limit, recipe.data.seed)
    out = []
    decode = tokenizer.decode
    for step in range(1, steps + 1):
        tasks = stream.next(recipe.rollout.prompts_per_step)
        seeds = [rollout_seed(recipe.seed, step, 0, i) for i in range(len(tasks))]
        params = sampling_params(recipe.rollout, stop_ids(tokenizer), decode, None,
                                 seed=rollout_seed(recipe.seed, step, 0, -1), prompt_seeds=seeds,
                                 n=recipe.rollout.group_size)
        out.append((tasks, params))
    return out, encode


class Resubmitted(RolloutEngine):
    """The continuous engine with every turn re-submitted as a new prompt (`ResubmitTurns`)."""

    def __init__(self, engine):
        self.inner = engine
        self.replayable = engine.replayable

    def generate(self, prompts, params):
        return self.inner.generate(prompts, params)

    def load_weights(self, version, tensors):
        self.inner.load_weights(version, tensors)


def run_arm(engine, work, episodes) -> dict:
    occupied = passes = tokens = entries = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for tasks, params in work:
        if episodes is not None:
            batch = episodes.run(engine, tasks, params).rollout
        else:
            batch = engine.generate([t.prompt_ids for t in tasks], params)
        stats = batch.stats
        occupied += stats.occupied
        entries += stats.entries_computed
        passes += stats.occupied_passes
        tokens += int(batch.action_mask.sum())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"occupancy": occupied / passes if passes else float("nan"), "passes": int(passes), "tokens": int(tokens),
            "entries": int(entries),
            "tok_s": tokens / cpu, "wall_tok_s": tokens / wall}


def bench(recipe_path: str, steps: int, pairs: int, chunk_rows: int) -> None:
    recipe = load_train_recipe(ROOT / recipe_path, [f"rollout.chunk_rows={chunk_rows}"])
    torch.manual_seed(recipe.seed)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    model, tokenizer = load_policy(resolve_model_path(recipe.model.path), recipe.model.dtype, "cpu")
    model.eval()
    work, encode = steps_of(recipe, tokenizer, steps)
    episodes = EpisodeRunner.from_recipe(recipe, encode, tokenizer.decode)
    continuous = make_engine(recipe.rollout, model)
    arms = {"chunks": make_engine(replace(recipe.rollout, continuous_batching=False), model), "continuous": continuous}
    if episodes is not None:
        arms["resubmitted"] = Resubmitted(continuous)
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for pair in range(pairs):
        order = list(arms) if pair % 2 == 0 else list(reversed(arms))
        for name in order:
            results[name].append(run_arm(arms[name], work, episodes))
        line = ", ".join(f"{n} {results[n][-1]['tok_s']:.1f} CPU tok/s" for n in arms)
        print(f"  pair {pair + 1} ({' then '.join(order)}): {line}", flush=True)
    if episodes is not None:
        episodes.close()
    rows = recipe.rollout.prompts_per_step * recipe.rollout.group_size
    print(f"\n{recipe_path}: {steps} steps x {rows} rows, chunk_rows={chunk_rows}, {pairs} pairs, "
          f"threads={torch.get_num_threads()}")
    print("| arm | occupancy | passes | entries | tokens | CPU tok/s (best) | CPU tok/s (median) | wall tok/s (best) | "
          "/ chunks, CPU (per pair) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, runs in results.items():
        ratios = [r["tok_s"] / c["tok_s"] for r, c in zip(runs, results["chunks"])]
        first = runs[0]
        print(f"| {name} | {first['occupancy']:.3f} | {first['passes']:,} | {first['entries']:,} | {first['tokens']:,} | "
              f"{max(r['tok_s'] for r in runs):.1f} | {statistics.median(r['tok_s'] for r in runs):.1f} | "
              f"{max(r['wall_tok_s'] for r in runs):.1f} | {', '.join(f'{x:.2f}x' for x in ratios)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", action="append", help="recipe(s) to run (default: the long-tail and tools ones)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--chunk-rows", type=int, default=16)
    args = ap.parse_args()
    for recipe in args.recipe or RECIPES:
        bench(recipe, args.steps, args.pairs, args.chunk_rows)


if __name__ == "__main__":
    main()
