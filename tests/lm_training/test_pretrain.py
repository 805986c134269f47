"""rltt pretrain: loss goes down, exact resume, checkpoints, collapse alarm."""

import json

import pytest
import torch

from rltt.model import load_looped
from rltt.runtime.checkpoint import list_checkpoints
from rltt.lm_training.pretraining import pretrain
from rltt.telemetry import read_metrics, schema

from .helpers import tiny_pretrain_recipe

#: keys that measure time, not training
VOLATILE = ("wall_time", "time/", "throughput/", "memory/")


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_short_pretrain_lowers_loss_and_writes_everything(tmp_path, monkeypatch):
    import rltt.lm_training.stage_loop as stage_loop

    resets = []  # memory/peak_gb is each record's own peak: the CUDA peak restarts after every record
    monkeypatch.setattr(stage_loop, "reset_peak_memory", lambda *a: resets.append(a))
    run = tmp_path / "run"
    result = pretrain(tiny_pretrain_recipe(run, ["train.steps=30", "checkpoint.every=10", "eval.every=30", "optim.lr=1e-2"]))
    records = read_metrics(run)
    losses = [r[schema.LM_LOSS] for r in records if schema.LM_LOSS in r]
    assert len(losses) == 30
    assert len(resets) == sum(schema.MEMORY_PEAK_GB in r for r in records) > 0
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    last = records[-1]
    for key in ("lm/loss_step_1", "lm/loss_step_3", "exit/p_1", "exit/p_3", "exit/mean_step", "exit/collapse",
                "grad_norm/total", "grad_norm/layer/0", "grad_norm/layer/1", "lr", "throughput/tokens_per_s",
                "eval/lm_loss", "eval/solve_rate"):
        assert key in last, key
    assert abs(sum(last[f"exit/p_{t}"] for t in (1, 2, 3)) - 1) < 1e-4
    # warmup then cosine decay
    lrs = [r["lr"] for r in records]
    assert lrs[0] < lrs[1] and lrs[-1] < max(lrs)
    model = load_looped(result.final_dir)
    assert model.config.num_loops == 3
    assert (result.final_dir / "tokenizer.json").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 30 and "eval/lm_loss" in summary["eval"]
    assert [s for s, _ in list_checkpoints(run)] == [10, 20, 30]  # checkpoint.keep_last = 3


class Interrupt(Exception):
    pass


def test_resume_reproduces_uninterrupted_metrics(tmp_path):
    full = tmp_path / "full"
    pretrain(tiny_pretrain_recipe(full))

    part = tmp_path / "part"

    def crash(step, metrics):
        if step == 6:  # after the step-4 checkpoint, mid-way to step 8
            raise Interrupt

    with pytest.raises(Interrupt):
        pretrain(tiny_pretrain_recipe(part), on_step=crash)
    assert [s for s, _ in list_checkpoints(part)] == [4]
    assert max(r["step"] for r in read_metrics(part)) == 6
    pretrain(tiny_pretrain_recipe(part), resume=True)

    a, b = _stable(read_metrics(full)), _stable(read_metrics(part))
    assert [r["step"] for r in b] == list(range(1, 9))
    assert a == b
    wa = load_looped(full / "final").state_dict()
    wb = load_looped(part / "final").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_existing_run_needs_resume(tmp_path):
    from rltt.errors import RlttError

    pretrain(tiny_pretrain_recipe(tmp_path / "r", ["train.steps=1"]))
    with pytest.raises(RlttError, match="--resume"):
        pretrain(tiny_pretrain_recipe(tmp_path / "r", ["train.steps=1"]))


def test_collapse_alarm_fires_on_forced_collapse(tmp_path, capsys):
    run = tmp_path / "collapsed"
    # λ_1 ≈ σ(12): every token exits after loop 1, and β = 0 does nothing against it
    result = pretrain(tiny_pretrain_recipe(run, ["model.gate_bias=12", "objective.beta=0", "train.steps=6",
                                                 "eval.solve_problems=0"]))
    assert result.alarms and result.alarms[0]["kind"] == "exit_collapse"
    assert result.alarms[0]["step"] == 3  # patience 3 on logged steps 1, 2, 3
    records = read_metrics(run)
    assert all(r[schema.EXIT_COLLAPSE] > 0.99 for r in records if schema.EXIT_COLLAPSE in r)
    alarms = [json.loads(line) for line in (run / "alarms.jsonl").read_text().splitlines()]
    assert len(alarms) == 1 and alarms[0]["step"] == 3
    assert "exit-gate collapse" in capsys.readouterr().err


def test_collapse_alarm_silent_on_healthy_run(tmp_path):
    run = tmp_path / "healthy"
    result = pretrain(tiny_pretrain_recipe(run, ["train.steps=6", "eval.solve_problems=0"]))
    assert result.alarms == []
    assert not (run / "alarms.jsonl").exists()
    assert all(r[schema.EXIT_COLLAPSE] < 0.5 for r in read_metrics(run) if schema.EXIT_COLLAPSE in r)


def test_bf16_autocast_runs(tmp_path):
    run = tmp_path / "bf16"
    pretrain(tiny_pretrain_recipe(run, ["train.steps=3", "model.dtype=bf16", "eval.every=3"]))
    losses = [r[schema.LM_LOSS] for r in read_metrics(run) if schema.LM_LOSS in r]
    assert len(losses) == 3 and all(0 < v < 10 for v in losses)


def test_resume_before_first_checkpoint_starts_over_cleanly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    pretrain(tiny_pretrain_recipe(full, ["train.steps=4", "eval.every=4"]))

    def crash(step, metrics):
        if step == 2:  # no checkpoint yet (checkpoint.every = 4)
            raise Interrupt

    with pytest.raises(Interrupt):
        pretrain(tiny_pretrain_recipe(part, ["train.steps=4", "eval.every=4"]), on_step=crash)
    pretrain(tiny_pretrain_recipe(part, ["train.steps=4", "eval.every=4"]), resume=True)
    assert _stable(read_metrics(part)) == _stable(read_metrics(full))


def test_flush_denormal_is_set_for_the_run_only(tmp_path):
    """The stage flushes denormals while it trains (CPU speed) and leaves the process's IEEE
    arithmetic as it found it: code that runs after it in the same process sees denormals."""
    tiny = torch.tensor([1e-39])  # a float32 denormal
    assert float(tiny * 1.0) != 0.0
    seen = []
    pretrain(tiny_pretrain_recipe(tmp_path / "run", ["train.steps=2", "checkpoint.every=0", "eval.every=2"]),
             on_step=lambda step, metrics: seen.append(float(tiny * 1.0)))
    assert seen == [0.0, 0.0]  # flushed during the run
    assert float(tiny * 1.0) != 0.0  # restored after it
