"""bench/scale.py: the memory meter, the smoke run of the plan-vs-measured table (tiny sizes) and
the GPU recipes' plans."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.bench.helpers import ROOT, load_bench

SCRIPT = ROOT / "bench" / "scale.py"


def test_meter_counts_live_tensors_and_the_peak_of_what_a_call_creates():
    scale = load_bench("scale")
    held = torch.zeros(1_000_000)  # 4 MB alive before and after the call

    def call():
        a = torch.ones(2_000_000)  # 8 MB
        b = a * 2  # 8 MB more: the peak
        del a
        return b.sum()

    before = scale.live_tensor_bytes()
    assert before >= held.numel() * 4
    out, measured = scale.measure_call(call, timeline=True)
    assert float(out) == 4_000_000
    assert 16_000_000 <= measured.created_peak <= 16_100_000
    # the allocator events and the memory timeline's CREATE - DESTROY agree
    assert measured.timeline_peak == measured.created_peak
    assert abs(measured.start_bytes - before) < 1_000_000
    assert measured.peak == measured.start_bytes + measured.created_peak


@pytest.mark.slow
def test_smoke_prints_the_table_and_the_plan_is_near_the_measurement(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "measure", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| size | params | phase | checkpointing | planned GiB | measured GiB | planned/measured |" in proc.stdout
    summary = json.loads((tmp_path / "measure.json").read_text())
    assert [(r["size"], r["checkpointing"]) for r in summary["rows"]] == [("tiny", False), ("tiny", True)]
    for r in summary["rows"]:
        for phase in ("rollout", "learner"):
            measured = r["measured"][phase]
            assert measured["start_bytes"] > 0 and measured["created_peak"] > 0
            ratio = r["plan"][phase] / measured["peak"]
            assert 0.7 < ratio < 1.3, (r["checkpointing"], phase, ratio)
            assert f"| tiny | {r['plan']['parameters'] / 1e6:.1f} M | {phase} | " in proc.stdout
        assert r["length_mean"] > 0 and r["plan"]["prompt_tokens"] == max(r["prompt_lengths"])
    # the recipes as run (data.max_prompt_tokens set to the longest drawn prompt) are kept
    assert (tmp_path / "recipes" / "tiny-ckpt-on.yaml").is_file()
    report = subprocess.run([sys.executable, str(SCRIPT), "report", "--out", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and report.stdout.count("| tiny |") == 8  # 4 rows in each of the two tables


def test_recipes_plans_fit_one_80_gb_gpu(tmp_path):
    scale = load_bench("scale")
    assert scale.main(["recipes", "--out", str(tmp_path), "--gpu-memory", "74.5,131.3"]) == 0
    rows = json.loads((tmp_path / "recipes.json").read_text())
    assert {(r["recipe"], r["gpu_gib"]) for r in rows} == {(name, g) for name in scale.RECIPES for g in (74.5, 131.3)}
    assert all(r["fits"] for r in rows)
    assert all(r["parameters"] == 1_434_652_673 for r in rows)
    text = scale.format_recipe_plans(rows)
    assert "| recipes/gsm8k.yaml | 74.5 | yes |" in text and "| recipes/gsm8k-thinking.yaml | 74.5 | yes |" in text
