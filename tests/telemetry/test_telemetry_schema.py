import ast
import re
from pathlib import Path

import pytest

from rltt.telemetry import MetricsLogger, schema
from tests.telemetry.telemetry_synth import healthy_records, lm_records, quickstart_records

ROOT = Path(__file__).resolve().parents[2]

#: The keys the training loops are expected to log (RL loop, LM stages, held-out evaluation).
EXPECTED = [
    "step", "reward/mean", "reward/std", "reward/gsm8k_strict", "reward/errors", "solve_rate",
    "groups/uniform_frac", "kl/ref", "loss/policy", "loss/total", "policy/clip_frac",
    "policy/ratio_mean", "policy/ratio_max", "policy/ratio_min", "grad_norm/total",
    "grad_norm/group/embed", "grad_norm/group/block", "grad_norm/group/gate",
    "grad_norm/group/lm_head", "grad_norm/group/norm", "grad_norm/layer/0",
    "grad_norm/layer/11", "entropy/loop_1", "entropy/loop_4", "exit/p_1", "exit/p_4",
    "exit/mean_step", "exit/collapse", "mismatch/max_abs", "mismatch/mean_abs", "mismatch/k3",
    "length/mean", "length/max", "length/trunc_frac", "time/rollout", "time/learner",
    "time/weight_sync", "time/step", "throughput/tokens_per_s", "memory/peak_gb", "lr",
    "lm/loss", "lm/loss_step_1", "lm/loss_step_3",
    "compute/mean_exit", "compute/passes_per_token", "compute/exit_entropy", "reward/compute",
    "throughput/goodput", "rollout/sequences", "rollout/refills",
    "eval/solve_rate", "eval/reward_mean", "eval/compute/mean_exit", "eval/compute/passes_per_token",
    "eval/lm_loss", "eval/lm_loss_step_1", "eval/completion_length", "eval/exit/p_1",
    "eval/exit/p_4", "eval/exit/mean_step", "eval/exit/collapse", "eval/exit/entropy",
]


@pytest.mark.parametrize("key", EXPECTED)
def test_every_expected_key_is_documented(key):
    spec = schema.lookup(key)
    assert spec is not None, key
    assert spec.meaning and spec.unit


def test_templates_resolve_to_their_spec():
    assert schema.lookup("exit/p_3").key == schema.EXIT_P
    assert schema.lookup("grad_norm/layer/7").key == schema.GRAD_NORM_LAYER
    assert schema.lookup("reward/format").key == schema.REWARD_FN
    assert schema.lookup("reward/mean").key == schema.REWARD_MEAN  # literal beats template
    assert schema.lookup("exit/p_x") is None
    assert schema.lookup("grad_norm/layer/a") is None
    assert schema.lookup("nonsense/key") is None


def test_key_builders():
    assert schema.exit_p_key(2) == "exit/p_2"
    assert schema.entropy_key(1) == "entropy/loop_1"
    assert schema.grad_layer_key(0) == "grad_norm/layer/0"
    assert schema.grad_group_key("gate") == "grad_norm/group/gate"
    assert schema.lm_loss_step_key(3) == "lm/loss_step_3"
    assert schema.reward_key("gsm8k") == "reward/gsm8k"
    with pytest.raises(ValueError):
        schema.exit_p_key(0)  # loops are 1-based
    with pytest.raises(ValueError):
        schema.reward_key("mean")  # would overwrite reward/mean
    with pytest.raises(ValueError):
        schema.reward_key("compute")  # the compute price, kept apart from the task rewards


def test_indexed_and_named_sort_and_filter():
    keys = ["exit/p_10", "exit/p_2", "exit/p_1", "exit/mean_step", "reward/mean",
            "reward/format", "reward/errors", "reward/gsm8k"]
    assert list(schema.indexed(keys, schema.EXIT_P)) == [1, 2, 10]
    assert schema.named(keys, schema.REWARD_FN) == {"format": "reward/format",
                                                    "gsm8k": "reward/gsm8k"}


def test_markdown_table_and_unknown_keys():
    table = schema.markdown_table()
    assert "| `kl/ref` |" in table and "| `lm/loss_step_{t}` |" in table
    lm_table = schema.markdown_table("lm")
    assert "`lm/loss`" in lm_table and "`kl/ref`" not in lm_table
    assert schema.unknown_keys({"kl/ref": 1, "kl/refs": 2}) == ["kl/refs"]


def test_constants_name_the_registered_keys():
    assert schema.EVAL_SOLVE_RATE == "eval/solve_rate"
    assert schema.ROLLOUT_REFILLS == "rollout/refills"
    assert schema.lookup("eval/exit/p_3").key == schema.EVAL_EXIT_P
    assert schema.lookup("eval/lm_loss_step_2").key == schema.EVAL_LM_LOSS_STEP
    assert list(schema.indexed(["eval/exit/p_1", "exit/p_2"], schema.EXIT_P)) == [2]
    assert list(schema.indexed(["eval/exit/p_1", "exit/p_2"], schema.EVAL_EXIT_P)) == [1]
    assert schema.eval_key(schema.exit_p_key(2)) == "eval/exit/p_2"
    assert schema.eval_key(schema.EXIT_MEAN_STEP) == schema.EVAL_EXIT_MEAN_STEP
    assert schema.eval_key("eval/lm_loss") == schema.EVAL_LM_LOSS
    with pytest.raises(ValueError, match="eval/kl/ref"):
        schema.eval_key(schema.KL_REF)  # not measured on held-out data


def _metric_literals():
    """Plain string literals in the package (outside telemetry) that look like metric keys."""
    groups = "|".join(sorted({spec.group for spec in schema.METRICS if "/" in spec.key}))
    pattern = re.compile(rf"^({groups})/[A-Za-z0-9_./]+$")
    for path in sorted((ROOT / "rltt").rglob("*.py")):
        if "telemetry" in path.relative_to(ROOT).parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_fstring = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                      for v in node.values}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in in_fstring and pattern.match(node.value)):
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node.value


def test_every_key_literal_in_the_loops_is_registered():
    found = list(_metric_literals())
    assert any(key == "rollout/refills" for _, key in found)  # the scan sees the RL loop
    assert [(where, key) for where, key in found if schema.lookup(key) is None] == []


@pytest.mark.parametrize("make", [healthy_records, quickstart_records, lm_records])
def test_synthetic_runs_log_only_registered_keys(make, tmp_path):
    with MetricsLogger(tmp_path, strict=True) as logger:
        for record in make():
            logger.log(record["step"], {k: v for k, v in record.items() if k != "step"})


def test_renamed_keys_read_under_their_current_names(tmp_path):
    """An older run's former key names come back under the current ones; no loop logs them."""
    from rltt.telemetry import read_metrics

    for old, new in schema.RENAMED.items():
        assert schema.lookup(old) is None and schema.lookup(new) is not None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/exit_step_mean": 2.5, '
                                            '"rollout/passes_per_token": 2.6, "eval/exit_step_mean": 3.0}\n')
    assert read_metrics(tmp_path) == [{"step": 1, "compute/mean_exit": 2.5, "compute/passes_per_token": 2.6,
                                       "eval/compute/mean_exit": 3.0}]
    assert schema.current_names({"rollout/exit_step_mean": 1.0, "compute/mean_exit": 2.0}) == \
        {"compute/mean_exit": 2.0}
