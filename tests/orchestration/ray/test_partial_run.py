"""`rltt train … orchestration.partial_rollouts=true` on a local Ray cluster: rows continue across
weights versions (each trained token at most K versions behind the learner), the new metrics are
logged (with a thinking budget counted across segments), and a run killed after a checkpoint and
resumed hands every prompt of its stream to training (or drops it) exactly once — none skipped,
none repeated."""

import pytest

from rltt.orchestration.ray.partial_step import PartialStep
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.telemetry import read_metrics
from rltt.telemetry import schema as m

from ..test_local import write_recipe

pytestmark = [pytest.mark.heavy, pytest.mark.slow]

K = 2
PARTIAL = ["train.steps=4", "train.eval_every=0", "checkpoint.every=1", "orchestration.backend=ray",
           "orchestration.ray.timeout_s=120", f"orchestration.max_staleness={K}", "orchestration.partial_rollouts=true",
           "orchestration.partial_segment_tokens=1", "rollout.max_new_tokens=16",
           # a thinking budget counted across each row's 1-token segments
           "rollout.thinking.budget=6", "rollout.thinking.answer_budget=3"]


def test_partial_rollouts_resume_neither_skips_nor_repeats_a_prompt(ray_cluster, tmp_path, monkeypatch):
    trained, dropped, held = [], [], {}
    scored = PartialStep._scored

    def recording(self, take):
        out = scored(self, take)
        trained.extend(g.task.index for g in take)
        dropped.extend(g.task.index for g in self.last_dropped)
        held["now"] = [g.task.index for g in self.flight + self.done] + [g.task.index for g in self.dropped]
        held["position"] = self.prompts.position
        return out

    monkeypatch.setattr(PartialStep, "_scored", recording)
    path = write_recipe(tmp_path)
    save = Trainer.save

    def save_then_crash(self, state=None):
        final = save(self, state)
        if self.step == 2:
            raise KeyboardInterrupt  # dies after step 2's checkpoint, groups in flight and done held in it
        return final

    monkeypatch.setattr(Trainer, "save", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        Trainer(load_train_recipe(path, PARTIAL), recipe_root=tmp_path).run()
    monkeypatch.setattr(Trainer, "save", save)
    Trainer(load_train_recipe(path, PARTIAL), resume=True, recipe_root=tmp_path).run()

    records = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert 0 <= r[m.ORCH_STALENESS_MEAN] <= r[m.ORCH_STALENESS] <= K
        for key in (m.ORCH_PARTIAL_ROWS, m.ORCH_DROPPED_ROWS, m.ORCH_LEARNER_IDLE_FRAC, m.ORCH_ROLLOUT_IDLE_FRAC,
                    m.LENGTH_FORCED_FRAC):
            assert key in r, key
    assert any(r[m.LENGTH_FORCED_FRAC] > 0 for r in records)  # rows reached the budget and were forced
    assert len(trained) == 4 * 2  # prompts_per_step 2
    # every prompt the stream handed out: trained, dropped or still held at the end, exactly once
    assert sorted(trained + dropped + held["now"]) == list(range(held["position"]))
