"""Solve-rate curation (docs/design.md §5.10): `rltt curate` and `rltt eval`.

- `run_curation(CurationJob, engine, encode, decode, runner)`: the resumable loop (any engine).
- `curate_recipe`: the same on a train recipe's policy, sampling and rewards; `evaluate_recipe`
  (`rltt eval`) is `rltt.orchestration.evaluator`'s, re-exported here.
- `Band`, histograms (`solve_rate_bins`, `text_histogram`, `plot_histogram`), and the record file
  (`RecordJournal`).
"""

from rltt.curation.curation_loop import (KEPT_FIELDS, RECORD_FIELDS, CurationJob, CurationPaths, CurationResult,
                                  prompt_seed, run_curation)
from rltt.curation.histogram import Band, plot_histogram, solve_rate_bins, text_histogram
from rltt.curation.recipes import RecipePolicy, curate_recipe
from rltt.curation.store import RecordJournal
from rltt.orchestration.evaluator import EvalReport, evaluate_recipe

__all__ = [
    "KEPT_FIELDS",
    "RECORD_FIELDS",
    "Band",
    "CurationJob",
    "CurationPaths",
    "CurationResult",
    "EvalReport",
    "RecipePolicy",
    "RecordJournal",
    "curate_recipe",
    "evaluate_recipe",
    "plot_histogram",
    "prompt_seed",
    "run_curation",
    "solve_rate_bins",
    "text_histogram",
]
