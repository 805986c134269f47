"""Compute-aware RL: the price on compute in the advantages, the compute telemetry of a run, and
evaluation at another exit policy (in the run and with `rltt eval`)."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import yaml

from rltt.cli.main import main
from rltt.errors import ConfigError
from rltt.orchestration.groups import ScoredRollout, compute_penalty, score_groups
from rltt.orchestration.evaluator import HeldOutEvaluator
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.rollout import RolloutBatch, RolloutStats, SamplingParams, Schedule
from rltt.runtime.distributed import Ranks
from rltt.telemetry import read_metrics
from rltt.telemetry import schema as m

from .helpers import tiny_checkpoint

T = 4


def _rollout(exit_rows: list[list[int]], forced: list[list[bool]] | None = None, n: int = 2) -> RolloutBatch:
    """A rollout with the given exit steps per row (token ids are irrelevant here)."""
    R, width = len(exit_rows), max(len(r) for r in exit_rows)
    lengths = torch.tensor([len(r) for r in exit_rows])
    exits = torch.zeros((R, width), dtype=torch.long)
    forced_mask = torch.zeros((R, width), dtype=torch.bool)
    for r, steps in enumerate(exit_rows):
        exits[r, :len(steps)] = torch.tensor(steps)
        if forced:
            forced_mask[r, :len(forced[r])] = torch.tensor(forced[r])
    prompts = [[5, 6]] * (R // n)
    index = [i for i in range(R // n) for _ in range(n)]
    return RolloutBatch(
        prompts=prompts, prompt_index=torch.tensor(index), prompt_lengths=torch.full((R,), 2),
        completion_ids=torch.full((R, width), 7), completion_lengths=lengths,
        completion_mask=torch.arange(width)[None, :] < lengths[:, None], exit_steps=exits,
        logprobs=torch.zeros((R, width)), tempered_logprobs=torch.zeros((R, width)),
        gate_probs=torch.full((T, R, width), float("nan")), finish_reasons=["stop"] * R,
        schedule=Schedule("deferred"), params=SamplingParams(n=n), stats=RolloutStats(), num_loops=T,
        dtype=torch.float32, forced_mask=forced_mask)


# rows (G = 2): mean exit 1 | (4 + 4 + 2) / 3 | 2 | 3 (the forced token, exit 0, does not count)
EXITS = [[1, 1], [4, 4, 2], [2, 2], [3, 0]]
FORCED = [[False, False], [False, False, False], [False, False], [False, True]]
MEAN_EXIT = [1.0, 10 / 3, 2.0, 3.0]
TASK = [1.0, 1.0, 0.0, 1.0]  # group 0 uniform on the task, group 1 mixed


def _scored(rewards=TASK):
    rollout = _rollout(EXITS, FORCED)
    return ScoredRollout(rollout, [SimpleNamespace(id="a"), SimpleNamespace(id="b")],
                         torch.tensor(rewards, dtype=torch.float64), {"f": torch.tensor(rewards)}, [])


def test_compute_penalty_against_a_hand_computation():
    penalty = compute_penalty(_rollout(EXITS, FORCED), 0.2)
    assert penalty.tolist() == pytest.approx([0.2 * e / T for e in MEAN_EXIT])
    assert compute_penalty(_rollout([[4, 4], [0]], [[False, False], [True]]), 1.0).tolist() == [1.0, 0.0]


def _grpo(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / (std + 1e-6) for v in values]


@pytest.mark.parametrize("cost", [0.2, 1.5])
def test_score_groups_subtracts_the_price_before_the_advantages(cost):
    groups = score_groups(_scored(), "group", compute_cost=cost)
    shaped = [r - cost * e / T for r, e in zip(TASK, MEAN_EXIT)]
    want = _grpo(shaped[:2]) + _grpo(shaped[2:])
    assert groups.batch.advantages.tolist() == pytest.approx(want, rel=1e-5)
    # the cheaper completion of the all-correct group is preferred; the flags and rewards stay the task's
    assert groups.batch.advantages[0] > 0 > groups.batch.advantages[1]
    assert groups.uniform.tolist() == [True, False]
    assert groups.rewards.tolist() == TASK
    assert groups.compute.tolist() == pytest.approx([cost * e / T for e in MEAN_EXIT])
    # the rows keep their penalty through selection (dynamic sampling) and concatenation
    picked = groups.select_groups([1])
    assert picked.compute.tolist() == pytest.approx(groups.compute[2:].tolist())
    assert type(groups).cat([picked, groups.select_groups([0])]).compute.tolist() == \
        pytest.approx(groups.compute[[2, 3, 0, 1]].tolist())


@pytest.mark.parametrize("scale", ["group", "none"])
def test_a_price_on_the_advantages_is_centred_per_group_and_unscaled(scale):
    cost = 0.2
    groups = score_groups(_scored(), scale, compute_cost=cost, compute_price="advantage")
    price = [cost * e / T for e in MEAN_EXIT]
    task = (_grpo(TASK[:2]) + _grpo(TASK[2:])) if scale == "group" else \
        [TASK[0] - sum(TASK[:2]) / 2, TASK[1] - sum(TASK[:2]) / 2, TASK[2] - sum(TASK[2:]) / 2, TASK[3] - sum(TASK[2:]) / 2]
    task[:2] = [0.0, 0.0]  # a group whose task rewards tie has no task advantage
    want = [a - (p - (price[2 * (i // 2)] + price[2 * (i // 2) + 1]) / 2) for i, (a, p) in enumerate(zip(task, price))]
    assert groups.batch.advantages.tolist() == pytest.approx(want, rel=1e-5, abs=1e-7)
    # the tied group is steered by the price in reward units, not scaled up to a unit advantage
    tied = groups.batch.advantages[:2]
    assert tied[0] > 0 > tied[1] and abs(float(tied[0])) == pytest.approx(abs(price[0] - price[1]) / 2, rel=1e-5)
    under_reward = score_groups(_scored(), scale, compute_cost=cost).batch.advantages[:2]
    if scale == "group":
        assert abs(float(under_reward[0])) > 10 * abs(float(tied[0]))
    assert groups.uniform.tolist() == [True, False] and groups.rewards.tolist() == TASK
    assert groups.compute.tolist() == pytest.approx(price)
    with pytest.raises(ValueError, match="compute_price"):
        score_groups(_scored(), scale, compute_cost=cost, compute_price="tokens")


def test_without_a_price_nothing_changes():
    groups = score_groups(_scored(), "group")
    assert groups.compute is None
    assert groups.batch.advantages[:2].tolist() == [0.0, 0.0]  # the uniform group carries nothing
    assert groups.batch.advantages[2:].tolist() == pytest.approx(_grpo(TASK[2:]), rel=1e-5)


def test_the_price_adds_to_a_kl_penalty_in_the_reward():
    kl = torch.tensor([0.01, 0.02, 0.03, 0.04])
    groups = score_groups(_scored(), "none", penalty=kl, compute_cost=0.2)
    shaped = [r - k - 0.2 * e / T for r, k, e in zip(TASK, kl.tolist(), MEAN_EXIT)]
    want = [shaped[0] - (shaped[0] + shaped[1]) / 2, shaped[1] - (shaped[0] + shaped[1]) / 2,
            shaped[2] - (shaped[2] + shaped[3]) / 2, shaped[3] - (shaped[2] + shaped[3]) / 2]
    assert groups.batch.advantages.tolist() == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert groups.uniform.tolist() == [True, False]


# --------------------------------------------------------------------------- recipes


REWARD = """
def diversity(completion, answer, **kw):
    return len(set(completion)) / 10
"""


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("compute")
    ckpt = tiny_checkpoint(root / "policy")
    (root / "my_rewards.py").write_text(REWARD)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(ckpt)},
        "data": {"source": "synthetic:easy", "eval_size": 4},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}, {"fn": "my_rewards.py:diversity", "weight": 0.5}],
        "rollout": {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 6},
        "learner": {"lr": 1e-3, "micro_batch_size": 3},
        "train": {"steps": 2, "eval_every": 2},
        "logging": {"run_dir": str(root / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0},
    }))
    return path


def test_recipe_keys_and_their_one_line_errors(recipe_path):
    assert load_train_recipe(recipe_path).algorithm.compute_cost == 0.0
    assert load_train_recipe(recipe_path).train.eval_exit_policy is None
    for policy in ("sample", "threshold:0.9"):
        assert load_train_recipe(recipe_path, ["algorithm.compute_cost=0.1",
                                               f"rollout.exit_policy={policy}"]).algorithm.compute_cost == 0.1
    with pytest.raises(ConfigError, match=r"algorithm.compute_cost"):
        load_train_recipe(recipe_path, ["algorithm.compute_cost=-0.1"])
    with pytest.raises(ConfigError, match="algorithm.compute_price"):
        load_train_recipe(recipe_path, ["algorithm.compute_cost=0.1", "algorithm.compute_price=tokens"])
    assert load_train_recipe(recipe_path, ["algorithm.compute_cost=0.1", "rollout.exit_policy=sample",
                                           "algorithm.compute_price=advantage"]).algorithm.compute_price == "advantage"
    for policy in ("final", "fixed:2"):
        with pytest.raises(ConfigError, match=r"'algorithm.compute_cost'.*rollout.exit_policy") as err:
            load_train_recipe(recipe_path, ["algorithm.compute_cost=0.1", f"rollout.exit_policy={policy}"])
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"train.eval_exit_policy"):
        load_train_recipe(recipe_path, ["train.eval_exit_policy=threshold:2"])


def test_heldout_evaluation_at_a_threshold_policy_changes_the_mean_exit(recipe_path):
    """The tiny policy's own exit policy is threshold:0.5 (exits mostly at loop 2 of 3);
    threshold:0.01 stops every token at loop 1, final runs all 3: fewer passes per token too."""
    trainer = Trainer(load_train_recipe(recipe_path), recipe_root=recipe_path.parent)
    try:
        out = {}
        for policy in (None, "threshold:0.01", "final"):
            recipe = load_train_recipe(recipe_path, [] if policy is None else [f"train.eval_exit_policy={policy}"])
            out[policy] = HeldOutEvaluator(recipe, trainer.engine, trainer.eval_tasks, trainer.tokenizer,
                                           trainer.runner, Ranks())()
            assert not m.unknown_keys(out[policy])
        assert out["threshold:0.01"][m.EVAL_COMPUTE_MEAN_EXIT] == 1.0
        assert out["final"][m.EVAL_COMPUTE_MEAN_EXIT] == 3.0
        assert 1.0 < out[None][m.EVAL_COMPUTE_MEAN_EXIT] < 3.0
        ppt = {k: v[m.EVAL_COMPUTE_PASSES_PER_TOKEN] for k, v in out.items()}
        assert ppt["threshold:0.01"] < ppt[None] < ppt["final"]  # the deferred schedule skips the loops
    finally:
        trainer.close()


@pytest.mark.slow  # a 2-step `rltt train` (~7 s idle, 20+ s on a loaded machine)
def test_a_priced_run_logs_the_compute_telemetry_apart_from_the_task_reward(recipe_path, tmp_path):
    """With the exit in the action too: the gate gets a gradient and the ratio is exactly 1."""
    run_dir = tmp_path / "run"
    recipe = load_train_recipe(recipe_path, ["algorithm.compute_cost=0.4", "rollout.exit_policy=sample",
                                             "algorithm.exit_action=true", f"logging.run_dir={run_dir}"])
    assert Trainer(recipe, recipe_root=recipe_path.parent).run().steps == 2
    records = read_metrics(run_dir)
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == 2
    for r in train:
        assert 0 < r[m.REWARD_COMPUTE] <= 0.4 and 1 <= r[m.COMPUTE_MEAN_EXIT] <= 3
        assert r[m.COMPUTE_PASSES_PER_TOKEN] > 0 and 0 <= r[m.COMPUTE_EXIT_ENTROPY] <= math.log(3) + 1e-9
        assert r[m.THROUGHPUT_GOODPUT] >= 0
        assert r["grad_norm/group/gate"] > 0 and r[m.POLICY_RATIO_MAX] == 1.0 == r[m.POLICY_RATIO_MIN]
        assert r[m.MISMATCH_MAX_ABS] < 1e-4  # the joint log-prob, exit included, is the sampler's
        # the task reward: the weighted reward functions, nothing of the price
        assert r[m.REWARD_MEAN] == pytest.approx(r["reward/gsm8k.strict"] + 0.5 * r["reward/my_rewards.diversity"])
    evals = [r for r in records if m.EVAL_SOLVE_RATE in r]
    assert evals and all(m.EVAL_COMPUTE_MEAN_EXIT in r and m.EVAL_COMPUTE_PASSES_PER_TOKEN in r for r in evals)


def test_rltt_eval_scores_at_a_given_exit_policy(recipe_path, capsys):
    assert main(["eval", str(recipe_path), "--limit", "2", "--exit-policy", "threshold:0.01", "--json",
                 "--bootstrap", "20"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["exit_policy"] == "threshold:0.01" and obj["mean_exit_step"] == 1.0
    assert obj["passes_per_token"] > 0
    assert main(["eval", str(recipe_path), "train.eval_exit_policy=final", "--limit", "2", "--bootstrap", "20"]) == 0
    text = capsys.readouterr().out
    assert "exit policy final: mean exit step 3.000, passes/token" in text
    assert main(["eval", str(recipe_path), "--exit-policy", "sometimes"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--exit-policy: unknown exit policy 'sometimes'" in err and "\n" not in err
