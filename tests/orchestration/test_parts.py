"""The trainer by composition: orchestrations, engines and learner backends are tables whose keys
are the recipe's allowed values; a new orchestration plugs in without the loop changing; the
trainer closes both seams and releases its orchestration once; a part that dies is rebuilt and
the run resumes exactly."""

from dataclasses import replace
from typing import get_args

import pytest

from rltt.errors import ConfigError
from rltt.learner.backends import BACKENDS
from rltt.orchestration.engines import ENGINES
from rltt.orchestration.parts import LOCAL, Orchestration, PartDied, build_local_parts
from rltt.orchestration.orchestration_section import Backend
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import ORCHESTRATIONS, Trainer, train
from rltt.telemetry import read_metrics

from .test_local import write_recipe

SHORT = ["train.steps=3", "train.eval_every=0", "checkpoint.every=1"]


def test_the_recipe_allows_exactly_the_tables_names(tmp_path):
    path = write_recipe(tmp_path)
    assert set(ORCHESTRATIONS) == set(get_args(Backend))
    for name in ENGINES:
        schedule = ENGINES[name].schedules[0]
        assert load_train_recipe(path, [f"rollout.engine={name}", f"rollout.schedule={schedule}"]).rollout.engine == name
    for name in BACKENDS:
        assert load_train_recipe(path, [f"learner.backend={name}"]).learner.backend == name
    with pytest.raises(ConfigError, match="rollout.engine.*native | vllm"):
        load_train_recipe(path, ["rollout.engine=tgi"])
    with pytest.raises(ConfigError, match="learner.backend.*torch | deepspeed"):
        load_train_recipe(path, ["learner.backend=fsdp"])


def _recording(events: list, fail_at_update: int | None = None):
    """The local orchestration, recording what the trainer closes and releases; with
    ``fail_at_update`` the first build's learner dies (a `PartDied`) at that update."""
    builds = []

    def build(recipe, model_path, run_dir, ranks, restarts=0):
        parts = build_local_parts(recipe, model_path, run_dir, ranks, restarts)
        builds.append(restarts)
        engine, learner = parts.engine, parts.learner
        engine.close = lambda: events.append(("engine.close", restarts))
        learner.close = lambda: events.append(("learner.close", restarts))
        if fail_at_update is not None and restarts == 0:
            update, calls = learner.update, []

            def dying_update(batch):
                calls.append(1)
                if len(calls) == fail_at_update:
                    raise PartDied("a learner died while updating", None)
                return update(batch)

            learner.update = dying_update
        return replace(parts, release=lambda: events.append(("release", restarts)))

    return Orchestration(LOCAL.ranks, build, restarts_key="orchestration.ray.learner_restarts",
                         rebuilds="the recording learner"), builds


def test_a_new_orchestration_plugs_in_and_the_trainer_closes_both_seams_then_releases(tmp_path):
    events = []
    orchestration, builds = _recording(events)
    trainer = Trainer(load_train_recipe(write_recipe(tmp_path), SHORT), recipe_root=tmp_path,
                      orchestration=orchestration)
    result = trainer.run()
    assert result.steps == 3 and builds == [0]
    assert events == [("engine.close", 0), ("learner.close", 0), ("release", 0)]
    trainer.close()  # a second close releases nothing twice
    assert len(events) == 3


def test_a_part_that_dies_is_rebuilt_and_the_run_resumes_exactly(tmp_path, monkeypatch, capsys):
    Trainer(load_train_recipe(write_recipe(tmp_path / "a"), SHORT), recipe_root=tmp_path / "a").run()
    want = read_metrics(tmp_path / "a" / "run")

    events = []
    orchestration, builds = _recording(events, fail_at_update=3)
    monkeypatch.setitem(ORCHESTRATIONS, "local", orchestration)
    recipe = load_train_recipe(write_recipe(tmp_path / "b"), [*SHORT, "orchestration.ray.learner_restarts=1"])
    result, _ = train(recipe, recipe_root=tmp_path / "b")
    assert result.steps == 3 and builds == [0, 1]  # rebuilt once, resumed from the step-2 checkpoint
    assert "rebuilding the recording learner from" in capsys.readouterr().err
    got = read_metrics(tmp_path / "b" / "run")
    timing = ("time/", "throughput/", "memory/", "wall_time")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]  # noqa: E731
    assert strip(got) == strip(want)
    # the first build was closed and released before the second was built
    assert events[:3] == [("engine.close", 0), ("learner.close", 0), ("release", 0)]

    with pytest.raises(PartDied):  # without restarts left, the death ends the run
        recipe0 = load_train_recipe(write_recipe(tmp_path / "c"), [*SHORT, "orchestration.ray.learner_restarts=0"])
        train(recipe0, recipe_root=tmp_path / "c")
