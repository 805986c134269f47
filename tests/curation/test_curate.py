"""`run_curation` with a scripted policy: exact solve rates, the band, resume, refusals, Parquet."""

import json

import pyarrow.parquet as pq
import pytest
import yaml

from rltt.curation import Band, CurationJob, CurationPaths, prompt_seed, run_curation
from rltt.curation.curation_loop import check_existing_output
from rltt.data.gsm8k import load_gsm8k
from rltt.errors import RlttError
from rltt.orchestration.prompt_stream import PromptStream
from rltt.orchestration.train_recipe import load_train_recipe

from . import fakes

RECORDS = fakes.records(6)
CORRECT = {"q0": 0, "q1": 1, "q2": 2, "q3": 3, "q4": 4, "q5": 2}  # of K = 4 samples
RATES = {rid: k / 4 for rid, k in CORRECT.items()}


def job(out, records=RECORDS, **kw) -> CurationJob:
    kw = {"samples": 4, "source": "scripted", "seed": 3, "progress": False, "rows_per_call": 4, **kw}
    return CurationJob(records=records, out=out, **kw)


def curate(out, engine=None, records=RECORDS, correct=CORRECT, **kw):
    engine = engine or fakes.ScriptedEngine(records, correct)
    result = run_curation(job(out, records, **kw), engine, fakes.encode, fakes.decode, fakes.runner())
    return result, engine


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_known_solve_rates_band_and_outputs(tmp_path):
    out = tmp_path / "curated.jsonl"
    result, engine = curate(out)
    records = read_jsonl(out)
    assert [r["id"] for r in records] == [r["id"] for r in RECORDS]
    assert {r["id"]: r["solve_rate"] for r in records} == RATES
    q3 = records[3]
    assert q3["solved"] == [True, True, True, False]
    assert q3["rewards"] == [1.5, 1.5, 1.5, 0.0]  # strict + 0.5 flexible
    assert q3["question"] == RECORDS[3]["question"] and q3["answer"] == RECORDS[3]["answer"]
    assert q3["prompt"] == "Question: What is 3 plus 10?\nAnswer:"
    assert 1 <= q3["mean_exit_step"] <= fakes.NUM_LOOPS
    assert {r["id"] for r in records if r["in_band"]} == {"q1", "q2", "q3", "q5"}  # 0.1 <= s <= 0.9
    # one generate call per prompt (rows_per_call = K), K samples, seeded by (seed, prompt id)
    assert engine.calls == [([r["id"]], [prompt_seed(3, r["id"])]) for r in RECORDS]
    kept = load_gsm8k(tmp_path / "curated.kept.jsonl")
    assert [(k["id"], k["question"], k["answer"]) for k in kept] == \
        [(r["id"], r["question"], r["answer"]) for r in RECORDS if r["id"] in {"q1", "q2", "q3", "q5"}]
    assert [len(result.kept), len(result.records)] == [4, 6]
    summary = result.summary()
    assert "kept 4, dropped 2" in summary and "1 too hard, 1 too easy" in summary
    assert "     0.500   *    " in summary  # the text histogram: two prompts at 0.5, in the band
    png = tmp_path / "curated.hist.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompts_are_sampled_in_blocks_fixed_by_source_position(tmp_path):
    one = tmp_path / "one.jsonl"
    curate(one)
    out = tmp_path / "blocks.jsonl"
    _, engine = curate(out, rows_per_call=9)  # 9 // 4 = 2 prompts per call
    assert engine.calls == [(ids, [prompt_seed(3, i) for i in ids]) for ids in (["q0", "q1"], ["q2", "q3"], ["q4", "q5"])]
    assert out.read_bytes() == one.read_bytes()  # per-prompt seeds: the batch does not change a prompt's samples

    part = tmp_path / "part.jsonl"
    part.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:3]))  # killed inside block 2
    _, engine = curate(part, rows_per_call=9)
    assert [ids for ids, _ in engine.calls] == [["q3"], ["q4", "q5"]]
    assert part.read_bytes() == one.read_bytes()


def test_band_is_inclusive_and_configurable(tmp_path):
    records = fakes.records(11)
    correct = {f"q{i}": i for i in range(11)}  # solve rates 0.0, 0.1, ..., 1.0 with K = 10
    result, _ = curate(tmp_path / "a.jsonl", records=records, correct=correct, samples=10)
    assert [r["id"] for r in result.kept] == [f"q{i}" for i in range(1, 10)]
    result, _ = curate(tmp_path / "b.jsonl", records=records, correct=correct, samples=10,
                       band=Band.parse("0.5,1"))
    assert [r["id"] for r in result.kept] == [f"q{i}" for i in range(5, 11)]
    for bad in ("0.9,0.1", "x", "0.1", "-0.1,0.5"):
        with pytest.raises(RlttError, match="--band"):
            Band.parse(bad)


def test_resume_after_a_kill_mid_line_skips_finished_prompts(tmp_path):
    full = tmp_path / "full" / "curated.jsonl"
    curate(full)
    lines = full.read_bytes().splitlines(keepends=True)

    out = tmp_path / "part" / "curated.jsonl"
    out.parent.mkdir()
    out.write_bytes(lines[0] + lines[1] + lines[2][:25])  # killed while writing the third record
    result, engine = curate(out)
    assert [ids for ids, _ in engine.calls] == [["q2"], ["q3"], ["q4"], ["q5"]]  # q0, q1 not re-sampled
    assert (result.resumed, result.sampled) == (2, 4)
    assert out.read_bytes() == full.read_bytes()
    assert (out.parent / "curated.kept.jsonl").read_bytes() == (full.parent / "curated.kept.jsonl").read_bytes()

    _, again = curate(out)  # finished: nothing left to sample, nothing changes
    assert again.calls == [] and out.read_bytes() == full.read_bytes()


def test_interrupted_run_keeps_what_it_wrote(tmp_path):
    full = tmp_path / "full.jsonl"
    curate(full)
    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        curate(out, engine=fakes.ScriptedEngine(RECORDS, CORRECT, fail_after=3))
    assert [r["id"] for r in read_jsonl(out)] == ["q0", "q1", "q2"]
    _, engine = curate(out)
    assert len(engine.calls) == 3
    assert out.read_bytes() == full.read_bytes()


def test_more_prompts_later_extend_the_output(tmp_path):
    full = tmp_path / "full.jsonl"
    curate(full)
    out = tmp_path / "out.jsonl"
    curate(out, records=RECORDS[:3])  # like --limit 3, then the whole source
    _, engine = curate(out)
    assert [ids for ids, _ in engine.calls] == [["q3"], ["q4"], ["q5"]]
    assert out.read_bytes() == full.read_bytes()


def test_new_band_on_rerun_relabels_without_sampling(tmp_path):
    out = tmp_path / "curated.jsonl"
    curate(out)
    result, engine = curate(out, band=Band(0.0, 0.25))
    assert engine.calls == []
    assert {r["id"] for r in read_jsonl(out) if r["in_band"]} == {"q0", "q1"}
    assert [r["id"] for r in load_gsm8k(tmp_path / "curated.kept.jsonl")] == ["q0", "q1"]


@pytest.mark.parametrize("damage, line", [
    (lambda lines: lines[:1] + [b"this is not json\n"] + lines[2:], 2),
    (lambda lines: lines[:2] + [b"[1, 2]\n"] + lines[3:], 3),
    (lambda lines: lines[:3] + [lines[3].replace(b'"source": "scripted"', b'"source": "other.jsonl"')] + lines[4:], 4),
    (lambda lines: lines[:1] + [lines[1].replace(b'"id": "q1"', b'"id": "zz9"')] + lines[2:], 2),
    (lambda lines: lines[:2] + [lines[1]] + lines[3:], 3),  # a duplicate id
    (lambda lines: lines[:1] + [b'{"id": "q1", "question": "x"}\n'] + lines[2:], 2),
])
def test_a_malformed_output_is_reported_and_left_untouched(tmp_path, damage, line):
    out = tmp_path / "curated.jsonl"
    curate(out)
    bad = b"".join(damage(out.read_bytes().splitlines(keepends=True))[:5]) + b'{"id": "q5", "trunc'
    out.write_bytes(bad)
    engine = fakes.ScriptedEngine(RECORDS, CORRECT)
    with pytest.raises(RlttError) as err:
        curate(out, engine=engine)
    message = str(err.value)
    assert message.startswith(f"{out}:{line}:") and "\n" not in message
    assert out.read_bytes() == bad and engine.calls == []
    with pytest.raises(RlttError, match=f"{out}:{line}:"):
        check_existing_output(job(out))


def test_other_settings_are_refused(tmp_path):
    out = tmp_path / "curated.jsonl"
    curate(out)
    before = out.read_bytes()
    with pytest.raises(RlttError, match=r"curated.jsonl:1: a record curated with 4 samples per prompt, not 2"):
        curate(out, samples=2)
    with pytest.raises(RlttError, match=r"curated.jsonl:1: a record curated with other settings"):
        curate(out, seed=4)
    assert out.read_bytes() == before


def test_parquet_output_resumes_from_its_progress_file(tmp_path):
    reference = tmp_path / "ref.jsonl"
    curate(reference)
    out = tmp_path / "curated.parquet"
    with pytest.raises(KeyboardInterrupt):
        curate(out, engine=fakes.ScriptedEngine(RECORDS, CORRECT, fail_after=2))
    progress = tmp_path / "curated.progress.jsonl"
    assert not out.exists() and [r["id"] for r in read_jsonl(progress)] == ["q0", "q1"]
    _, engine = curate(out)
    assert len(engine.calls) == 4 and not progress.exists()
    assert pq.read_table(out).to_pylist() == read_jsonl(reference)
    kept = load_gsm8k(tmp_path / "curated.kept.parquet")
    assert [r["id"] for r in kept] == ["q1", "q2", "q3", "q5"]
    assert [r["id"] for r in load_gsm8k(out)] == [r["id"] for r in RECORDS]  # the full output loads too

    _, engine = curate(out, band=Band(0.0, 0.0))  # a finished Parquet output: nothing re-sampled
    assert engine.calls == [] and [r["id"] for r in load_gsm8k(tmp_path / "curated.kept.parquet")] == ["q0"]


def test_an_unreadable_parquet_output_is_left_untouched(tmp_path):
    out = tmp_path / "curated.parquet"
    out.write_bytes(b"PAR1 not really")
    with pytest.raises(RlttError, match="curated.parquet: not a readable Parquet file"):
        curate(out)
    assert out.read_bytes() == b"PAR1 not really"


def test_no_prompt_in_band_still_writes_a_loadable_kept_file(tmp_path):
    result, _ = curate(tmp_path / "c.parquet", band=Band(0.3, 0.4))
    assert result.kept == []
    assert pq.read_table(tmp_path / "c.kept.parquet").column_names == ["id", "question", "answer", "solve_rate"]


def test_paths_and_bad_outputs():
    paths = CurationPaths.for_output("runs/c.jsonl")
    assert (str(paths.journal), str(paths.kept), str(paths.histogram)) == \
        ("runs/c.jsonl", "runs/c.kept.jsonl", "runs/c.hist.png")
    assert str(CurationPaths.for_output("c.parquet", kept="k.jsonl").kept) == "k.jsonl"
    with pytest.raises(RlttError, match="--out: c.csv must end in .jsonl or .parquet"):
        CurationPaths.for_output("c.csv")
    with pytest.raises(RlttError, match="--kept"):
        CurationPaths.for_output("c.jsonl", kept="c.jsonl")


def test_kept_file_is_a_train_recipe_data_source(tmp_path):
    curate(tmp_path / "curated.jsonl")
    kept = tmp_path / "curated.kept.jsonl"
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump({"data": {"source": str(kept)}}))
    recipe = load_train_recipe(recipe_path)
    assert recipe.data.source == str(kept)
    stream = PromptStream(recipe.data.source, fakes.encode, recipe.data.prompt_template, seed=0)
    assert sorted(t.id for t in stream.next(4)) == ["q1", "q2", "q3", "q5"]
