"""LoRA under DeepSpeed (CPU, gloo, one process): the adapters alone are trained and sent, the base
stays bitwise, and the run matches the torch backend's."""

import json
from pathlib import Path

import pytest

from rltt.model.adapters import is_adapter
from tests.learner.helpers import run_worker

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.heavy, pytest.mark.slow]

WORKER = Path(__file__).with_name("ds_lora_worker.py")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lora_under_zero_matches_the_torch_backend(stage, tmp_path):
    out = tmp_path / "result.json"
    run_worker(WORKER, stage, out)
    result = json.loads(out.read_text())
    assert result["trained"] == result["adapters"]  # DeepSpeed was handed the adapters alone
    assert result["base_equal"] and result["sent_adapters_only"]
    for ds, ref in zip(result["ds_losses"], result["torch_losses"]):
        assert ds == pytest.approx(ref, rel=1e-3, abs=1e-5)
    assert result["adapter_diff"] < 1e-4
    # its checkpoint: DeepSpeed's module state holds no base weight, and a learner rebuilt from it takes the
    # same next step, bitwise
    assert all(is_adapter(k) for k in result["deepspeed_module"]) and result["resumed_equal"]
    # sync/changed_frac counts the adapters alone: the first update moves B only (A's gradient is 0 at B = 0)
    assert result["ds_changed"] == pytest.approx(result["torch_changed"], abs=1e-3)
    assert 0 < result["ds_changed"][0] < 1 and result["ds_changed"][-1] > 0.99
