"""Evaluation results as data: per-problem sample counts, their summary (pass@k, mean@k with
bootstrap intervals), the JSON object `rltt eval --json` prints, and reading such objects back
(a file, a run directory, several runs of one side) for pooling and paired comparison.

A result holds, per problem, its id, ``n`` samples and ``correct`` count — all the statistics
need, whatever engine, schedule or exit policy produced the samples.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rltt.errors import RlttError
from rltt.evaluation.compare import DEFAULT_PERMUTATIONS, paired_differences, resolve_test
from rltt.evaluation.intervals import DEFAULT_REPS, LEVEL, bootstrap_means
from rltt.evaluation.passk import max_k, mean_at_k, problem_scores

FORMAT = "rltt-eval/1"
COMPARE_FORMAT = "rltt-eval-compare/1"
RESULT_NAME = "eval.json"  # what a run directory holds when `rltt eval --out RUN_DIR/eval.json` wrote it


@dataclass
class ProblemCounts:
    """One run's per-problem results: ids, samples ``n`` and correct counts ``c`` (same order)."""

    ids: list[str]
    n: np.ndarray
    c: np.ndarray
    origin: str = ""

    def __post_init__(self) -> None:
        self.n = np.asarray(self.n, dtype=np.int64)
        self.c = np.asarray(self.c, dtype=np.int64)
        where = self.origin or "result"
        if not (len(self.ids) == self.n.size == self.c.size):
            raise RlttError(f"{where}: ids, n and correct differ in length")
        if len(set(self.ids)) != len(self.ids):
            raise RlttError(f"{where}: a problem id appears twice")
        if self.n.size and (np.any(self.n < 1) or np.any(self.c < 0) or np.any(self.c > self.n)):
            raise RlttError(f"{where}: every problem needs n >= 1 and 0 <= correct <= n")

    @classmethod
    def from_rates(cls, per_task: dict[str, float], samples: int, origin: str = "") -> "ProblemCounts":
        """From per-problem solve fractions of ``samples`` samples each (exact: c = round(rate · n))."""
        ids = [str(k) for k in per_task]
        c = [int(round(float(per_task[k]) * samples)) for k in per_task]
        return cls(ids, [samples] * len(ids), c, origin)

    def select(self, ids: list[str]) -> "ProblemCounts":
        index = {pid: i for i, pid in enumerate(self.ids)}
        rows = [index[pid] for pid in ids]
        return ProblemCounts(list(ids), self.n[rows], self.c[rows], self.origin)

    def problems(self) -> list[dict]:
        return [{"id": pid, "n": int(n), "correct": int(c)} for pid, n, c in zip(self.ids, self.n, self.c)]


def common_ids(runs: list[ProblemCounts]) -> list[str]:
    """The problems every run holds, in the first run's order."""
    shared = set(runs[0].ids).intersection(*(r.ids for r in runs[1:]))
    return [pid for pid in runs[0].ids if pid in shared]


def align(runs: list[ProblemCounts], ids: list[str] | None = None) -> list[ProblemCounts]:
    ids = common_ids(runs) if ids is None else ids
    if not ids:
        raise RlttError("the results share no problem ids: " + ", ".join(r.origin or "?" for r in runs))
    return [r.select(ids) for r in runs]


def metric_scores(runs: list[ProblemCounts], k_max: int | None = None) -> dict[str, np.ndarray]:
    """``{"pass@1": (S, P), …, "pass@K": …, "mean@K": …}`` of aligned runs; K the fewest samples."""
    k = min(max_k(r.n) for r in runs) if k_max is None else k_max
    ks = list(range(1, k + 1))
    per_run = [problem_scores(r.n, r.c, ks) for r in runs]  # each (K, P)
    out = {f"pass@{kk}": np.stack([s[i] for s in per_run]) for i, kk in enumerate(ks)}
    out[f"mean@{k}"] = np.stack([mean_at_k(r.n, r.c) for r in runs])
    return out


def summarize_runs(runs: list[ProblemCounts], reps: int = DEFAULT_REPS, seed: int = 0) -> dict:
    """pass@1 … pass@K and mean@K (K: the fewest samples of any problem) of one run or several
    runs pooled (their common problems), each ``{"mean", "se", "ci95"}`` by the bootstrap."""
    runs = align(runs)
    scores = metric_scores(runs)
    estimates = bootstrap_means(list(scores.values()), reps, seed)
    return {name: est.to_dict() for name, est in zip(scores, estimates)}


def bootstrap_info(reps: int, seed: int, runs: int, problems: int) -> dict:
    unit = "problems" if runs == 1 else "runs, then problems"
    return {"reps": reps, "seed": seed, "level": LEVEL, "resampled": unit, "runs": runs, "problems": problems}


def result_object(meta: dict, counts: ProblemCounts, reps: int = DEFAULT_REPS, seed: int = 0) -> dict:
    """The JSON object of one evaluation: ``meta`` (model, source, …), the summary and the problems."""
    return {"format": FORMAT, **meta, "summary": summarize_runs([counts], reps, seed),
            "bootstrap": bootstrap_info(reps, seed, 1, len(counts.ids)), "problems": counts.problems()}


# -- reading results back ---------------------------------------------------------------------------------------


def counts_of(obj: object, origin: str) -> ProblemCounts:
    """The per-problem counts of a result object (``problems``; or ``per_task`` rates and ``samples``)."""
    if not isinstance(obj, dict):
        raise RlttError(f"{origin}: not an rltt eval result (expected a JSON object)")
    if isinstance(obj.get("problems"), list):
        try:
            rows = obj["problems"]
            return ProblemCounts([str(r["id"]) for r in rows], [int(r["n"]) for r in rows],
                                 [int(r["correct"]) for r in rows], origin)
        except (KeyError, TypeError, ValueError):
            raise RlttError(f"{origin}: every entry of 'problems' needs id, n and correct") from None
    if isinstance(obj.get("per_task"), dict) and isinstance(obj.get("samples"), int):
        return ProblemCounts.from_rates(obj["per_task"], obj["samples"], origin)
    raise RlttError(f"{origin}: not an rltt eval result (no 'problems' list; write one with rltt eval --out)")


def read_result(path: Path) -> ProblemCounts:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RlttError(f"{path}: cannot read ({exc.__class__.__name__})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RlttError(f"{path}: malformed JSON ({exc.msg})") from None
    return counts_of(obj, str(path))


def result_files(spec: str) -> list[Path]:
    """The result files of one side: comma-separated files, run directories or glob patterns. A
    directory contributes its ``eval.json``, else every ``eval*.json`` in it and in its ``eval/``."""
    files: list[Path] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        matches = sorted(glob.glob(part)) if glob.has_magic(part) else [part]
        if not matches:
            raise RlttError(f"no result matches {part!r}")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                found = [path / RESULT_NAME] if (path / RESULT_NAME).is_file() else \
                    sorted(path.glob("eval*.json")) + sorted(path.glob("eval/*.json"))
                if not found:
                    raise RlttError(f"{path}: no {RESULT_NAME} (or eval*.json) in this directory; "
                                    f"write one with rltt eval RECIPE --out {path / RESULT_NAME}")
                files.extend(found)
            elif path.is_file():
                files.append(path)
            else:
                raise RlttError(f"no such result file or directory: {match}")
    if not files:
        raise RlttError(f"no result files in {spec!r}")
    return list(dict.fromkeys(files))


def load_side(spec: str) -> tuple[list[Path], list[ProblemCounts]]:
    files = result_files(spec)
    return files, [read_result(f) for f in files]


def pool_object(spec: str, reps: int = DEFAULT_REPS, seed: int = 0) -> dict:
    """Several runs of one configuration pooled: the summary over their common problems."""
    files, runs = load_side(spec)
    aligned = align(runs)
    return {"format": FORMAT, "files": [str(f) for f in files], "summary": summarize_runs(aligned, reps, seed),
            "bootstrap": bootstrap_info(reps, seed, len(runs), len(aligned[0].ids)),
            "problems": _pooled_problems(aligned)}


def _pooled_problems(runs: list[ProblemCounts]) -> list[dict]:
    return [{"id": pid, "n": int(sum(r.n[i] for r in runs)), "correct": int(sum(r.c[i] for r in runs))}
            for i, pid in enumerate(runs[0].ids)]


def compare_object(spec_a: str, spec_b: str, reps: int = DEFAULT_REPS, seed: int = 0, test: str = "auto",
                   permutations: int = DEFAULT_PERMUTATIONS) -> dict:
    """A − B on their common problems for pass@1 … pass@K (K: the fewest samples on either side)."""
    files_a, runs_a = load_side(spec_a)
    files_b, runs_b = load_side(spec_b)
    ids = common_ids(runs_a + runs_b)
    every = {pid for r in runs_a + runs_b for pid in r.ids}
    a, b = align(runs_a, ids), align(runs_b, ids)
    k = min(max_k(r.n) for r in a + b)
    sa, sb = metric_scores(a, k), metric_scores(b, k)
    names = [f"pass@{kk}" for kk in range(1, k + 1)]
    diffs = paired_differences([sa[m] for m in names], [sb[m] for m in names], seed, test, permutations)
    side = lambda files, runs, scores: {  # noqa: E731
        "files": [str(f) for f in files], "runs": len(runs),
        "summary": {m: e.to_dict() for m, e in zip(names, bootstrap_means([scores[m] for m in names], reps, seed))}}
    return {"format": COMPARE_FORMAT, "a": side(files_a, a, sa), "b": side(files_b, b, sb),
            "problems": len(ids), "problems_left_out": len(every) - len(ids),
            "test": resolve_test(test, len(a), len(b)), "permutations": permutations, "level": LEVEL,
            "bootstrap": {"reps": reps, "seed": seed, "level": LEVEL},  # the sides' summaries
            "difference": {m: d.to_dict() for m, d in zip(names, diffs)}}


# -- text -------------------------------------------------------------------------------------------------------


def _est(e: dict) -> str:
    lo, hi = ("-inf" if e["ci95"][0] is None else f"{e['ci95'][0]:.4f}",
              "+inf" if e["ci95"][1] is None else f"{e['ci95'][1]:.4f}")
    return f"{e['mean']:.4f} ± {e['se']:.4f} [{lo}, {hi}]"


def summary_lines(summary: dict) -> list[str]:
    """One line per metric: mean ± SE [95 % interval]."""
    width = max(len(k) for k in summary)
    return [f"{name:<{width}}  {_est(e)}" for name, e in summary.items()]


def compare_lines(obj: dict) -> list[str]:
    """The comparison as a short table."""
    test = {"problems": "sign flips over problems (the runs held fixed)",
            "runs": "permutation of runs between A and B (the problems held fixed)"}
    lines = [f"A: {obj['a']['runs']} run(s): {', '.join(obj['a']['files'])}",
             f"B: {obj['b']['runs']} run(s): {', '.join(obj['b']['files'])}",
             f"{obj['problems']} problems paired" + (f" ({obj['problems_left_out']} not in every result, left out)"
                                                      if obj["problems_left_out"] else "")
             + f"; A and B: 95 % intervals by bootstrap ({obj['bootstrap']['reps']} replicates, seed "
               f"{obj['bootstrap']['seed']})",
             f"A - B: SE, 95 % interval (the test inverted) and p-value all from {test[obj['test']]}"]
    names = list(obj["difference"])
    width = max(len(n) for n in names)
    lines.append(f"{'':<{width}}  {'A':<34}  {'B':<34}  {'A - B':<34}  p")
    for name in names:
        d = obj["difference"][name]
        lines.append(f"{name:<{width}}  {_est(obj['a']['summary'][name]):<34}  {_est(obj['b']['summary'][name]):<34}"
                     f"  {_est(d):<34}  {d['p_value']:.4g}")
    if obj["test"] == "runs":
        p_min = min(d["p_min"] for d in obj["difference"].values())
        lines.append(f"(with {obj['a']['runs']} + {obj['b']['runs']} runs the smallest p-value the runs test can give "
                     f"is {p_min:.3g})")
    return lines
