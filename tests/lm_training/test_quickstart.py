"""ensure_quickstart_model: builds once into the cache, then returns the cached checkpoint."""

import json

import pytest

from rltt.model import load_looped
from rltt.lm_training import quickstart_model as quickstart
from rltt.lm_training.quickstart_model import ensure_quickstart_model, quickstart_info

#: a seconds-long variant of recipes/pretrain-tiny.yaml (same code path, tiny sizes)
FAST = ["train.steps=3", "checkpoint.every=2", "eval.every=3", "eval.solve_problems=2", "eval.max_new_tokens=4",
        "eval.loss_batches=1", "data.block_size=32", "data.held_out_docs=8", "tokenizer.train_docs=50",
        "tokenizer.kind=char", "tokenizer.vocab_size=64", "model.config.hidden_size=64",
        "model.config.intermediate_size=64", "model.config.num_attention_heads=1", "train.batch_size=2"]


def test_builds_once_then_caches(tmp_path, monkeypatch):
    path = ensure_quickstart_model(tmp_path, overrides=FAST, progress=False)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    model = load_looped(path)
    assert model.config.num_loops == 4 and model.config.head_dim == 64
    info = json.loads((path.parents[1] / "quickstart.json").read_text())
    assert info["step"] == 3 and "eval/solve_rate" in info["eval"]

    def no_training(*args, **kwargs):
        raise AssertionError("the cached model must not be rebuilt")

    monkeypatch.setattr("rltt.lm_training.pretraining.pretrain", no_training)
    assert ensure_quickstart_model(tmp_path, overrides=FAST, progress=False) == path


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLTT_CACHE", str(tmp_path / "cache"))
    assert quickstart.default_cache_dir() == tmp_path / "cache"
    assert quickstart_info() is None


def test_interrupted_build_resumes(tmp_path, monkeypatch):
    from rltt.lm_training import pretraining as stage

    real = stage.pretrain

    def interrupted(recipe, resume=False, on_step=None):
        def stop(step, metrics):
            if step == 2:
                raise KeyboardInterrupt

        return real(recipe, resume=resume, on_step=stop)

    monkeypatch.setattr(stage, "pretrain", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_quickstart_model(tmp_path, overrides=FAST, progress=False)
    monkeypatch.setattr(stage, "pretrain", real)
    path = ensure_quickstart_model(tmp_path, overrides=FAST, progress=False)
    steps = [json.loads(line)["step"] for line in (path.parent / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] or steps == [3]  # logging.every of the recipe decides which are logged
    assert json.loads((path.parents[1] / "quickstart.json").read_text())["step"] == 3


@pytest.mark.slow
def test_full_quickstart_model_has_mixed_solve_rate(tmp_path):
    path = ensure_quickstart_model(tmp_path, progress=False)
    info = json.loads((path.parents[1] / "quickstart.json").read_text())
    assert 0.2 <= info["eval"]["eval/solve_rate"] <= 0.6
    assert info["eval"]["eval/exit/p_1"] < 0.9 and info["eval"]["eval/exit/collapse"] < 0.5


def test_cache_key_is_the_resolved_recipe(tmp_path, monkeypatch):
    """A comment, a reordering or a logging setting in the recipe file keeps the cached model;
    a value that changes training rebuilds it; a cache written under the earlier text key is
    accepted and re-recorded under the resolved key."""
    text = quickstart.RECIPE.read_text(encoding="utf-8")
    base = quickstart._key(FAST)
    edited = tmp_path / "pretrain-tiny.yaml"
    logging = "run_dir: runs/pretrain-tiny\n  every: 5"
    assert logging in text
    edited.write_text("# a comment\n" + text.replace(logging, "run_dir: elsewhere\n  every: 2"), encoding="utf-8")
    monkeypatch.setattr(quickstart, "RECIPE", edited)
    assert quickstart._key(FAST) == base
    assert quickstart._key([*FAST, "optim.lr=0.002"]) != base
    assert quickstart._key([*FAST, "logging.every=1"]) == base

    home = tmp_path / "cache" / f"quickstart-model-{base[:8]}"
    model = home / "run" / "final"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (home / "quickstart.json").write_text(json.dumps({"key": quickstart._text_key(edited.read_text(), FAST),
                                                      "model": str(model)}))
    monkeypatch.setattr("rltt.lm_training.pretraining.pretrain", lambda *a, **k: pytest.fail("must not rebuild"))
    assert ensure_quickstart_model(tmp_path / "cache", overrides=FAST, progress=False) == model
    assert json.loads((home / "quickstart.json").read_text())["key"] == base
