"""`rltt train` with the newer menu entries — a GSPO loss, RLOO advantages and a rollout correction —
runs end to end in strict metrics mode (the test session sets RLTT_STRICT_METRICS) and logs the
correction's metrics (docs/design.md §5.5–5.6)."""

import pytest
import yaml

from rltt.cli.main import main
from rltt.telemetry import read_metrics

from .test_local import EXPECTED_KEYS, write_recipe

CORRECTION_KEYS = ("correction/masked_frac", "correction/weight_mean", "correction/weight_max")


@pytest.mark.slow
def test_three_steps_of_gspo_rloo_with_a_masking_correction(tmp_path):
    path = write_recipe(tmp_path)
    code = main(["train", str(path), "algorithm.loss=gspo", "algorithm.advantage=rloo",
                 "algorithm.advantage_scale=none", "algorithm.correction=token_mask", "algorithm.correction_lo=0.5",
                 "algorithm.correction_hi=2.0", "algorithm.ppo_epochs=2", "checkpoint.every=0"])
    assert code == 0
    run = tmp_path / "run"
    resolved = yaml.safe_load((run / "recipe.resolved.yaml").read_text())["algorithm"]
    assert (resolved["loss"], resolved["advantage"], resolved["correction"]) == ("gspo", "rloo", "token_mask")
    steps = [r for r in read_metrics(run) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in (*EXPECTED_KEYS, *CORRECTION_KEYS):
        assert all(key in r for r in steps), key
    # the engine and the learner agree to rounding here: nothing leaves [0.5, 2]
    assert all(r["correction/masked_frac"] == 0.0 for r in steps)


@pytest.mark.slow
def test_cispo_reinforce_pp_with_sequence_tis(tmp_path):
    path = write_recipe(tmp_path)
    assert main(["train", str(path), "algorithm.loss=cispo", "algorithm.advantage=reinforce_pp",
                 "algorithm.advantage_scale=batch", "algorithm.correction=seq_tis", "train.steps=2",
                 "train.eval_every=0", "checkpoint.every=0"]) == 0
    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert len(steps) == 2 and all(0 < r["correction/weight_max"] <= 2.0 for r in steps)


def test_a_bad_menu_value_is_a_one_line_error(tmp_path, capsys):
    path = write_recipe(tmp_path)
    assert main(["train", str(path), "algorithm.advantage=gae"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.advantage" in err and "grpo | rloo | reinforce_pp" in err
