"""A LoRA run on Ray: the rollout workers receive the adapter tensors alone at each update, and
the run's metrics equal the local loop's."""

import pytest

from rltt.cli.main import main
from rltt.orchestration.ray.rollout_pool import RayRolloutPool, RemoteTensors
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.telemetry import read_metrics

from ..test_local import write_recipe
from .test_ray_run import RAY, STEPS, assert_same_metrics

pytestmark = [pytest.mark.heavy, pytest.mark.slow]

LORA = {"learner.lora": {"rank": 4, "alpha": 8.0}, "learner.lr": 1e-2}


def test_ray_workers_get_adapter_tensors_alone_and_the_run_equals_the_local_loop(ray_cluster, tmp_path,
                                                                                  monkeypatch):
    local = write_recipe(tmp_path / "local", **LORA)
    Trainer(load_train_recipe(local, STEPS), recipe_root=tmp_path / "local").run()
    sent = []
    load = RayRolloutPool.load_weights

    def record(self, version, tensors):
        names = ray_cluster.get(tensors.ref) if isinstance(tensors, RemoteTensors) else tensors
        sent.append(sorted(names))
        return load(self, version, tensors)

    monkeypatch.setattr(RayRolloutPool, "load_weights", record)
    path = write_recipe(tmp_path / "ray", **LORA)
    assert main(["train", str(path), *STEPS, *RAY]) == 0
    assert sent and all(names and all(n.endswith(("lora_A", "lora_B")) for n in names) for names in sent)
    assert_same_metrics(read_metrics(tmp_path / "ray" / "run"), read_metrics(tmp_path / "local" / "run"))
