"""bench/findings/: its arm scheduler, and the smoke mode end to end (every arm runs, every file is written)."""

import importlib
import json
from pathlib import Path

import pytest

from tests.bench.helpers import load_bench


def _load():
    return load_bench("findings")


def test_scheduler_runs_dependencies_first_and_skips_after_a_failure(tmp_path):
    bench = _load()
    order = []

    def step(name, fail=False):
        def fn():
            order.append(name)
            if fail:
                raise ValueError("boom")
        return fn

    arms = {
        "a": bench.Arm("a", fn=step("a"), cost=1),
        "b": bench.Arm("b", fn=step("b"), deps=("a",), cost=1),
        "bad": bench.Arm("bad", fn=step("bad", fail=True), cost=5),
        "after-bad": bench.Arm("after-bad", fn=step("after-bad"), deps=("bad",)),
        "after-after": bench.Arm("after-after", fn=step("after-after"), deps=("after-bad",)),
    }
    bench.run_arms(arms, tmp_path / "logs", jobs=1)
    assert order[0] == "bad"  # one job: the longest chain first
    assert order.index("a") < order.index("b")
    assert {n: a.status for n, a in arms.items()} == {
        "a": "done", "b": "done", "bad": "failed", "after-bad": "skipped", "after-after": "skipped"}
    assert "boom" in arms["bad"].error


@pytest.mark.slow  # one CLI start-up (~10 s on a loaded machine)
def test_cli_arms_log_their_command_and_fail_on_a_bad_recipe_key(tmp_path):
    bench = _load()
    arms = {"bad-key": bench.Arm("bad-key", ["train", bench.RL_RECIPE, "train.no_such_key=1",
                                             f"logging.run_dir={tmp_path / 'run'}"])}
    bench.run_arms(arms, tmp_path / "logs", jobs=1)
    arm = arms["bad-key"]
    assert arm.status == "failed" and "exit status 2" in arm.error and "train.no_such_key" in arm.error
    assert (tmp_path / "logs" / "bad-key.log").read_text().startswith("rltt train recipes/quickstart.yaml")


def test_only_rejects_unknown_findings():
    bench = _load()
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "band,nope"])
    assert bench.parse_args(["--only", "lr,credit"]).only == ("lr", "credit")
    assert bench.parse_args(["--credit-arms", "final, rltt-exit_pdf"]).credit_arms == ("final", "rltt-exit_pdf")
    with pytest.raises(SystemExit):
        bench.parse_args(["--credit-arms", "final,bogus"])


def test_depth_source_picks_the_task_and_its_hop_counts(tmp_path):
    bench = _load()
    cli, depth = (importlib.import_module(f"findings.{m}") for m in ("cli", "depth"))  # the package _load() loaded
    args = bench.parse_args(["--depth-source", "synthetic:chains-easy", "--only", "depth"])
    scale = cli.scale_of(args)
    assert scale.depth_source == "synthetic:chains-easy" and "--depth-source synthetic:chains-easy" in \
        cli.command_line(args, tmp_path)
    assert depth.hop_counts("synthetic:chains-easy") == (0, 1, 2, 3) and depth.hop_counts("synthetic:chains") == (1, 2, 3, 4)
    arms = cli.build_arms(tmp_path, scale, ("depth",), False, {})
    assert "data.source=synthetic:chains-easy" in arms["depth-pretrain-T1"].argv
    assert arms["depth-eval-pre-T4"].argv[arms["depth-eval-pre-T4"].argv.index("--source") + 1] == \
        "synthetic:chains-easy"
    for bad in ("synthetic:quickstart", "data/x.jsonl", "synthetic:nope"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--depth-source", bad])
    # a wider block for both twins: the overrides reach both pretraining arms, and the command line
    args = bench.parse_args(["--only", "depth", "--depth-pretrain-override", "model.config.hidden_size=256",
                             "--depth-pretrain-override", "optim.lr=1e-3"])
    arms = cli.build_arms(tmp_path, cli.scale_of(args), ("depth",), False, {})
    for loops in (4, 1):
        argv = arms[f"depth-pretrain-T{loops}"].argv
        assert {"model.config.hidden_size=256", "optim.lr=1e-3", f"model.config.num_loops={loops}"} <= set(argv)
    assert "--depth-pretrain-override model.config.hidden_size=256" in cli.command_line(args, tmp_path)
    for bad in ("hidden", "train.steps=10", "model.config.num_loops=2"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--depth-pretrain-override", bad])


@pytest.mark.slow
def test_smoke_mode_runs_every_arm_and_writes_every_output(tmp_path):
    bench = _load()
    out = tmp_path / "findings"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    check_smoke_outputs(bench, out)


def bench_depth_hops(problem_id: str) -> int:
    """The hops of held-out problem ``chains-SEED-INDEX``, from the generator itself."""
    from rltt.data.chains import ChainDifficulty

    _, seed, index = problem_id.rsplit("-", 2)
    return ChainDifficulty(hops=4, min_hops=1).problem(int(index), int(seed)).hops


def check_smoke_outputs(bench, out: Path) -> None:
    report = json.loads((out / "findings.json").read_text())
    arms = report["arms"]
    expected = {"band-pool", "band-curate-low", "band-curate-mixed", "band-curate-high",
                *(f"band-{b}-s0" for b in bench.BANDS), *(f"lr-{lr:.0e}-s0" for lr in bench.LRS),
                "dense-pretrain-T4", "dense-pretrain-T1", "dense-rl-T4-s0", "dense-rl-T1-s0",
                *(f"dense-eval-{m}" for m in ("pre-T4", "pre-T1", "rl-T4-s0", "rl-T1-s0")),
                *(f"credit-{k}-s0{e}" for k in bench.CREDIT for e in ("", "-eval")),
                *(f"depth-{a}-T{t}" for a in ("pretrain", "eval-pre") for t in (4, 1)),
                *(f"depth-{a}-T{t}-s0" for a in ("rl", "eval-rl") for t in (4, 1))}
    assert set(arms) == expected
    assert all(a["status"] == "done" for a in arms.values()), {n: a["error"] for n, a in arms.items() if a["error"]}
    steps = bench.SMOKE.rl_steps
    for name, arm in arms.items():
        if name.startswith(("band-low", "band-mixed", "band-high", "lr-", "dense-rl", "credit-", "depth-rl")) and \
                not name.endswith("-eval"):
            records = [json.loads(line) for line in (Path(arm["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records] == list(range(steps + 1)), name
            assert "eval/solve_rate" in records[0] and "eval/solve_rate" in records[-1], name
    for band in bench.BANDS:  # every band's kept set is non-empty and inside its window
        lo, hi = bench.BANDS[band]
        kept = [json.loads(line) for line in (out / "band" / f"{band}.jsonl").read_text().splitlines()]
        assert kept and all(lo - 1e-9 <= r["solve_rate"] <= hi + 1e-9 for r in kept), band
    res = report["results"]
    assert set(res) == set(bench.FINDINGS)
    assert all(res["band"]["bands"][b]["seeds"] == 1 for b in bench.BANDS)
    assert all(len(r["reviews"]) == 1 and r["reviews"][0]["exit"] == 0 for r in res["lr"].values())
    for loops in ("T4", "T1"):
        assert res["dense"][loops]["pretrain"]["lm_loss"] > 0 and res["dense"][loops]["seeds"] == 1
    # dense: each model evaluated on the same held-out problems, T = 4 - T = 1 paired over them
    for stage in ("pre", "rl"):
        row = res["dense"]["paired"][stage]
        assert {"T4", "T1", "difference"} <= set(row) and 0.0 <= row["difference"]["p_value"] <= 1.0, stage
        a, b = (json.loads((out / "dense" / f"{stage}-T{t}{'-s0' if stage == 'rl' else ''}.json").read_text())
                for t in (4, 1))
        assert [p["id"] for p in a["problems"]] == [p["id"] for p in b["problems"]]
        assert len(a["problems"]) == bench.SMOKE.eval_size
        assert row["difference"]["mean"] == pytest.approx(row["T4"]["mean"] - row["T1"]["mean"], abs=1e-9)
    assert all(res["credit"][k]["seeds"] == 1 for k in bench.CREDIT)
    # credit: every final checkpoint evaluated, every arm compared with final on the same problems
    for k in bench.CREDIT:
        assert res["credit"][k]["eval_seeds"] == 1 and 0.0 <= res["credit"][k]["pass1"]["mean"] <= 1.0
        evaluated = json.loads((Path(arms[f"credit-{k}-s0"]["run_dir"]) / "eval.json").read_text())
        assert len(evaluated["problems"]) == bench.SMOKE.eval_size
    assert set(res["credit"]["vs_final"]) == set(bench.CREDIT) - {"final"}
    assert all(0.0 <= d["p_value"] <= 1.0 and "ci95" in d for d in res["credit"]["vs_final"].values())
    # depth: every model's held-out eval split by hop count (each problem's hops regenerated from its id)
    depth = res["depth"]
    for stage in ("pre", "rl"):
        rows = {int(h): r for h, r in depth["stages"][stage].items()}
        counted = 0
        for hops, row in rows.items():
            if not row:  # no problem of this hop count among the smoke's few
                continue
            assert {"T4", "T1", "difference"} <= set(row), (stage, hops)
            assert 0.0 <= row["T4"]["mean"] <= 1.0 and "p_value" in row["difference"]
            split = json.loads((out / "depth" / f"{stage}-T4{'-s0' if stage == 'rl' else ''}-h{hops}.json").read_text())
            assert all(bench_depth_hops(p["id"]) == hops for p in split["problems"])
            counted += len(split["problems"])
        assert counted == bench.SMOKE.depth_eval_size
    for name in bench.FINDINGS:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 100_000, name
    md = (out / "findings.md").read_text()
    assert md.startswith(bench.SECTION)
    for title in ("### 1. Solve-rate band", "### 2. Learning rate", "### 3. Dense twin", "### 4. Per-loop credit",
                  "### 5. Depth"):
        assert title in md
    for name in bench.FINDINGS:
        assert f"({name}.png)" in md
    assert md.count("rltt train recipes/quickstart.yaml") == len([n for n in arms if arms[n]["command"].startswith(
        "rltt train")]) and "rltt pretrain recipes/pretrain-tiny.yaml model.config.num_loops=1" in md
