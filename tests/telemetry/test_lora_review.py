"""``lora/*`` norms (a LoRA run's adapters, per target group) are schema metrics and `rltt review`
shows them in its summary, group by group."""

from rltt.telemetry import schema
from rltt.telemetry.run_review import summary_rows
from rltt.telemetry.series import RunData


def _records(steps=6):
    out = []
    for s in range(1, steps + 1):
        record = {"step": s, "reward/mean": 0.1 * s, "grad_norm/total": 1.0}
        for group in ("q_proj", "down_proj"):
            record[f"lora/A_norm/{group}"] = 4.0
            record[f"lora/B_norm/{group}"] = 0.01 * s
            record[f"lora/update_norm/{group}"] = 0.02 * s
        out.append(record)
    return out


def test_lora_norms_are_known_metrics():
    for key in ("lora/A_norm/q_proj", "lora/B_norm/up_proj", "lora/update_norm/down_proj"):
        assert schema.lookup(key) is not None, key


def test_review_summary_lists_the_adapter_norms_by_group():
    run = RunData.from_records(_records())
    keys = [row[0] for row in summary_rows(run)]
    at = keys.index("grad_norm/total")
    assert keys[at + 1: at + 5] == ["lora/update_norm/down_proj", "lora/B_norm/down_proj",
                                    "lora/update_norm/q_proj", "lora/B_norm/q_proj"]
    row = dict((r[0], r) for r in summary_rows(run))["lora/update_norm/q_proj"]
    assert row[1] == "0.02" and row[2] == "0.12"
    assert "lora/" not in "".join(r[0] for r in summary_rows(RunData.from_records([{"step": 1, "reward/mean": 0}])))
