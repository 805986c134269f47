"""The curation loop (docs/design.md §5.10): k completions per prompt → solve rate → the kept band.

`run_curation` takes any `RolloutEngine`, so the policy can be a real LoopLM or a scripted test
engine. Prompts not yet in the output are sampled in blocks of consecutive source positions
(``rows_per_call`` completions per ``generate`` call: ``rows_per_call // samples`` prompts), each
prompt with its own seed, `prompt_seed` (the recipe seed and the prompt id — not the prompt's
position or the batch; ``SamplingParams.prompt_seeds``), scored with the reward runner, and the
block's records are appended to the output journal at once. A killed run therefore loses at
most the block in flight, and a rerun skips every recorded prompt and samples the rest exactly
as the uninterrupted run would have (the blocks are fixed by source position). SIGTERM /
SIGINT (`rltt.runtime.stop`) lets the block in flight finish within ``stop_grace_s`` (else it is
abandoned), keeps every appended block and raises `Stopped`: rerunning the same command
continues there. At the end it writes the full output in source order, the kept (in-band) set as a GSM8K
file, and a solve-rate histogram PNG.

Files, for ``--out curated.jsonl`` (or ``curated.parquet``):

- ``curated.jsonl``: every prompt's record (`RECORD_FIELDS`); it is also the journal appended
  to while the run goes. For Parquet the journal is ``curated.progress.jsonl``, converted to
  ``curated.parquet`` at the end and then removed.
- ``curated.kept.jsonl`` (``.kept.parquet``): the in-band prompts as GSM8K records
  ``{id, question, answer, solve_rate}`` — usable as a train recipe's ``data.source``.
- ``curated.hist.png``: the solve-rate histogram.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from rltt.curation.histogram import Band, plot_histogram, solve_rate_bins, text_histogram
from rltt.curation.store import (RecordJournal, read_parquet_records, refuse_record, write_jsonl_atomic,
                                 write_parquet_atomic)
from rltt.data.gsm8k import DEFAULT_TEMPLATE
from rltt.data.rewards import RewardRunner
from rltt.errors import RlttError
from rltt.orchestration.groups import score_rollout
from rltt.orchestration.prompt_stream import make_task
from rltt.rollout import RolloutEngine, SamplingParams
from rltt.runtime.paths import check_output_file
from rltt.runtime.stop import StepAbandoned, Stopped, StopSignals, commit

#: The fields of one output record.
RECORD_FIELDS = ("id", "question", "answer", "prompt", "solve_rate", "rewards", "solved", "mean_exit_step",
                 "mean_length", "reward_errors", "in_band", "source", "settings")
#: The fields of one kept (GSM8K-format) record.
KEPT_FIELDS = ("id", "question", "answer", "solve_rate")
FORMATS = (".jsonl", ".parquet")


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The sampling seed of one prompt: a stable hash of the run seed and the prompt id."""
    digest = hashlib.blake2b(f"{seed}\x00{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 2**62


@dataclass
class CurationPaths:
    """Where a curation run writes, derived from ``--out`` (and ``--kept``)."""

    out: Path
    journal: Path
    kept: Path
    histogram: Path

    @property
    def parquet(self) -> bool:
        return self.out.suffix == ".parquet"

    @classmethod
    def for_output(cls, out: str | Path, kept: str | Path | None = None,
                   inputs: dict[str, str | Path | None] | None = None) -> "CurationPaths":
        """The paths for ``--out``/``--kept``; none may be an input (``{label: path}``: the data
        source, the recipe file), and an existing ``--kept`` must be a kept set this command wrote."""
        out = Path(out)
        if out.suffix not in FORMATS:
            raise RlttError(f"--out: {out} must end in .jsonl or .parquet")
        inputs = dict(inputs or {})
        check_output_file(out, "--out", inputs)  # an existing --out is resumed only if it holds curation records
        journal = out.with_name(out.stem + ".progress.jsonl") if out.suffix == ".parquet" else out
        check_output_file(journal, "--out", inputs)
        kept_path = Path(kept) if kept is not None else out.with_name(out.stem + ".kept" + out.suffix)
        if kept_path.suffix not in FORMATS:
            raise RlttError(f"--kept: {kept_path} must end in .jsonl or .parquet")
        if kept_path.resolve() in (out.resolve(), journal.resolve()):
            raise RlttError(f"--kept: {kept_path} must differ from --out")
        check_output_file(kept_path, "--kept", inputs, owned=is_kept_file)
        histogram = out.with_name(out.stem + ".hist.png")
        check_output_file(histogram, "--out", inputs)
        return cls(out, journal, kept_path, histogram)


def is_kept_file(path: Path) -> bool:
    """True when ``path`` is a kept set `rltt curate` wrote (or empty): its records have exactly
    the `KEPT_FIELDS`. Anything else is never overwritten."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return set(pq.read_schema(path).names) == set(KEPT_FIELDS)
        with path.open("rb") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or set(record) != set(KEPT_FIELDS):
                        return False
    except Exception:  # noqa: BLE001 - unreadable: not ours
        return False
    return True


@dataclass
class CurationJob:
    """What to curate and how.

    ``records``: GSM8K records (``id``, ``question``, ``answer``) in order; ``source``: their
    name, stored in each output record. ``sampling``: the policy's sampling settings (``n`` and
    ``seed`` are set per prompt). ``fingerprint``: further settings an existing output must have
    been made with to be resumed (policy, rewards, ...); with ``samples``, ``seed``, ``template``
    and ``sampling`` they make the ``settings`` digest of every record.
    """

    source: str
    records: list[dict]
    out: str | Path
    samples: int = 8
    band: Band = field(default_factory=Band)
    kept: str | Path | None = None
    template: str = DEFAULT_TEMPLATE
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    fingerprint: dict = field(default_factory=dict)
    progress: bool = True
    rows_per_call: int = 64  # completions per generate call (whole prompts; at least one prompt)
    stop_grace_s: float = 20.0  # after SIGTERM/SIGINT: seconds the block in flight may still run

    def inputs(self) -> dict[str, str]:
        """What the outputs must not overwrite: the data source (when it is a local path)."""
        return {"the data source": self.source}

    @property
    def prompts_per_call(self) -> int:
        return max(1, self.rows_per_call // self.samples)

    def settings_digest(self) -> str:
        s = self.sampling
        settings = {
            "samples": self.samples, "seed": self.seed, "template": str(self.template),
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                         "max_new_tokens": s.max_new_tokens, "stop_token_ids": sorted(s.stop_token_ids),
                         "stop_strings": list(s.stop_strings), "ignore_eos": s.ignore_eos,
                         "exit_policy": None if s.exit_policy is None else str(s.exit_policy),
                         "schedule": s.schedule,
                         **({"thinking": vars(s.thinking)} if s.thinking is not None else {})},
            **self.fingerprint,
        }
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class CurationResult:
    """All records (source order), what this run did, and where it wrote."""

    records: list[dict]
    band: Band
    samples: int
    sampled: int  # prompts sampled by this run
    resumed: int  # prompts found finished in an existing output
    paths: CurationPaths

    @property
    def kept(self) -> list[dict]:
        return [r for r in self.records if r["in_band"]]

    @property
    def solve_rates(self) -> list[float]:
        return [r["solve_rate"] for r in self.records]

    def histogram_text(self) -> str:
        return text_histogram(solve_rate_bins(self.solve_rates, self.samples, self.band))

    def summary(self) -> str:
        """The counts, the text histogram and the files written."""
        total, kept = len(self.records), len(self.kept)
        mean = sum(self.solve_rates) / total if total else 0.0
        return "\n".join([
            f"{total} prompts ({self.sampled} sampled now, {self.resumed} resumed), {self.samples} samples each; "
            f"mean solve rate {mean:.3f}",
            f"kept {kept}, dropped {total - kept} (band {self.band}; "
            f"{sum(r['solve_rate'] < self.band.low - 1e-9 for r in self.records)} too hard, "
            f"{sum(r['solve_rate'] > self.band.high + 1e-9 for r in self.records)} too easy)",
            self.histogram_text(),
            f"records:   {self.paths.out}",
            f"kept set:  {self.paths.kept}  (use as data.source)",
            f"histogram: {self.paths.histogram}",
        ])


def _source_index(job: CurationJob) -> dict[str, dict]:
    by_id: dict[str, dict] = {}
    for record in job.records:
        rid = str(record.get("id", ""))
        if not rid:
            raise RlttError(f"{job.source}: a record has no id")
        if rid in by_id:
            raise RlttError(f"{job.source}: duplicate prompt id {rid!r}")
        by_id[rid] = record
    return by_id


def _record_check(job: CurationJob, by_id: dict[str, dict], digest: str | None):
    """The check an existing output's records must pass to be resumed (``digest`` None: all but
    the settings digest)."""

    def check(record: dict, where: str) -> None:
        missing = [k for k in RECORD_FIELDS if k not in record]
        if missing:
            raise refuse_record(where, f"not a curation record (missing {', '.join(missing)})")
        if record["source"] != job.source:
            raise refuse_record(where, f"a record curated from {record['source']!r}, not {job.source!r}")
        if not isinstance(record["solved"], list) or len(record["solved"]) != job.samples:
            count = len(record["solved"]) if isinstance(record["solved"], list) else "?"
            raise refuse_record(where, f"a record curated with {count} samples per prompt, not {job.samples}")
        if digest is not None and record["settings"] != digest:
            raise refuse_record(where, "a record curated with other settings (policy, sampling, rewards, prompt "
                                       "template, seed or --samples differ)")
        source_record = by_id.get(record["id"])
        if source_record is None:
            raise refuse_record(where, f"prompt id {record['id']!r} is not among the {len(by_id)} prompts of "
                                       f"{job.source} (another --split or --limit?)")
        if source_record["question"] != record["question"]:
            raise refuse_record(where, f"the question of {record['id']!r} differs from {job.source}'s")

    return check


def check_existing_output(job: CurationJob) -> int:
    """Check an existing output of ``job`` (all but the settings digest) without touching it;
    the number of finished prompts. Lets a caller fail before loading a model."""
    paths = CurationPaths.for_output(job.out, job.kept, job.inputs())
    check = _record_check(job, _source_index(job), None)
    if paths.journal.exists():
        return len(RecordJournal(paths.journal).read(check))
    if paths.parquet and paths.out.exists():
        return len(read_parquet_records(paths.out, check))
    return 0


def _load_finished(paths: CurationPaths, journal: RecordJournal, check) -> list[dict]:
    """Records of a previous run: the journal, or (Parquet) a finished output copied into one."""
    records = journal.read(check)
    if paths.parquet and not paths.journal.exists() and paths.out.exists():
        records = read_parquet_records(paths.out, check)
        write_jsonl_atomic(paths.journal, records)  # all or nothing: a kill here keeps the Parquet file in use
        journal.read()
    return records


def _sample_prompts(job: CurationJob, records: list[dict], engine: RolloutEngine, encode, decode,
                    runner: RewardRunner, digest: str) -> list[dict]:
    """Sample and score a block of prompts in one call; their output records."""
    tasks = [make_task(record, encode, job.template) for record in records]
    params = replace(job.sampling, n=job.samples, prompt_seeds=[prompt_seed(job.seed, t.id) for t in tasks])
    rollout = engine.generate([t.prompt_ids for t in tasks], params)
    scored = score_rollout(rollout, tasks, decode, runner)
    solved = scored.solved(runner.names[0])
    out = []
    for i, (task, record) in enumerate(zip(tasks, records)):
        rows = slice(i * job.samples, (i + 1) * job.samples)
        flags = solved[rows].tolist()
        mask = rollout.completion_mask[rows]
        tokens = int(mask.sum())
        rate = sum(flags) / len(flags)
        out.append({
            "id": task.id, "question": record["question"], "answer": record["answer"], "prompt": task.prompt,
            "solve_rate": rate, "rewards": scored.rewards[rows].tolist(), "solved": [bool(f) for f in flags],
            "mean_exit_step": float(rollout.exit_steps[rows][mask].float().sum()) / tokens if tokens else 0.0,
            "mean_length": tokens / len(flags),
            "reward_errors": sum(e.prompt_id == task.id for e in scored.errors),
            "in_band": job.band.contains(rate), "source": job.source, "settings": digest,
        })
    return out


def run_curation(job: CurationJob, engine: RolloutEngine, encode, decode, runner: RewardRunner) -> CurationResult:
    """Curate ``job.records`` with ``engine`` (resuming an existing output); see the module docstring.

    ``encode``: prompt text → token ids; ``decode``: token ids → text. An existing output that
    is malformed or from another source or settings raises an `RlttError` and is not touched.
    """
    from tqdm.auto import tqdm

    if job.samples < 1:
        raise RlttError(f"--samples: must be >= 1, got {job.samples}")
    paths = CurationPaths.for_output(job.out, job.kept, job.inputs())
    by_id = _source_index(job)
    digest = job.settings_digest()
    journal = RecordJournal(paths.journal)
    finished = _load_finished(paths, journal, _record_check(job, by_id, digest))
    done = {r["id"]: r for r in finished}
    order = [r["id"] for r in finished]
    pending = [r for rid, r in by_id.items() if rid not in done]

    bar = tqdm(total=len(by_id), initial=len(by_id) - len(pending), desc="rltt curate", unit="prompt",
               disable=not job.progress, dynamic_ncols=True)
    kept = sum(job.band.contains(r["solve_rate"]) for r in finished)
    position = {rid: i for i, rid in enumerate(by_id)}
    blocks: dict[int, list[dict]] = {}
    for record in pending:
        blocks.setdefault(position[record["id"]] // job.prompts_per_call, []).append(record)
    with bar, StopSignals(job.stop_grace_s, "rltt curate") as stop:
        for block in blocks.values():
            if stop.requested:  # every finished block is in the journal already
                raise _stopped(stop, len(done), paths)
            try:
                with stop.step():
                    news = _sample_prompts(job, block, engine, encode, decode, runner, digest)
                    commit()  # the block's records are appended whole
                    journal.append(news)
            except StepAbandoned:
                raise _stopped(stop, len(done), paths) from None
            for new in news:
                done[new["id"]] = new
                order.append(new["id"])
                kept += new["in_band"]
            bar.update(len(news))
            bar.set_postfix(kept=kept, solve=f"{news[-1]['solve_rate']:.2f}")

    records = [done[rid] for rid in by_id]
    stale = [r for r in records if r["in_band"] != job.band.contains(r["solve_rate"])]
    for record in stale:  # an earlier run used another --band
        record["in_band"] = job.band.contains(record["solve_rate"])
    _write_outputs(paths, records, journal, rewrite=bool(stale) or order != list(by_id))
    result = CurationResult(records, job.band, job.samples, len(pending), len(finished), paths)
    plot_histogram(paths.histogram, solve_rate_bins(result.solve_rates, job.samples, job.band), job.band,
                   title=f"solve rate over {job.samples} samples: {len(result.kept)}/{len(records)} kept")
    return result


def _stopped(stop: StopSignals, finished: int, paths: CurationPaths) -> Stopped:
    return Stopped("rltt curate", stop.signame or "a signal", finished, None, "run the same command again to continue",
                   progress=f"with {finished} prompts curated (kept in {paths.journal})")


def _write_outputs(paths: CurationPaths, records: list[dict], journal: RecordJournal, rewrite: bool) -> None:
    """The full output (source order) and the kept set; each file is replaced atomically."""
    if paths.parquet:
        write_parquet_atomic(paths.out, records)
        journal.remove()
    elif rewrite:
        write_jsonl_atomic(paths.out, records)
    kept = [{k: r[k] for k in KEPT_FIELDS} for r in records if r["in_band"]]
    if paths.kept.suffix == ".parquet":
        write_parquet_atomic(paths.kept, kept, empty_columns=KEPT_FIELDS)
    else:
        write_jsonl_atomic(paths.kept, kept)

