"""The plan's host-memory line for a partial rollout's buffer (``orchestration.partial_rollouts``):
`PartialBuffer` counts K · P groups of G rows of W tokens (``max_new_tokens``, or a thinking budget's
forced completion when longer) at 46 + 4·T bytes a token;
a real `PartialStep` buffer whose rows all run to ``max_new_tokens`` holds exactly that many bytes
(its checkpoint state's tensors), groups dropped as stale keep no rows, and `rltt plan` shows the line
for a recipe with partial rollouts (and the K-deep pipeline's ``held_ahead`` line without)."""

from __future__ import annotations

from rltt.cli.main import main
from rltt.orchestration.prompt_stream import PromptStream
from rltt.rollout.rows import token_bytes
from rltt.orchestration.ray.partial_step import PartialStep
from rltt.planning import plan_run
from rltt.planning.partial_buffer import PartialBuffer
from rltt.planning.plan_table import format_plan

from ..orchestration.ray.test_partial_rollouts import LONG, LOOPS, STOP, FakeEngine, FakeLearner, make_step, recipe
from .helpers import TINY_LOOPED, config_folder
from .test_held_rows import tensor_bytes

QUICKSTART = "recipes/quickstart.yaml"


def _runner():
    from rltt.data.rewards import RewardRunner, WeightedReward

    return RewardRunner([WeightedReward("length", lambda completion, answer, **kw: len(completion) / 20)])


def test_a_full_buffer_holds_the_planned_bytes():
    """Every prompt starts with LONG: no row stops before max_new_tokens, so the K · P groups held
    reach the bound (rows with forced tokens: tests/orchestration/ray/test_partial_rollouts.py)."""
    K, max_new = 3, 10
    r = recipe(K, 6, max_new=max_new)
    stream = PromptStream(r.data.source, lambda text: [LONG] + [10 + ord(c) % 40 for c in text[:6]], lambda q: q,
                          seed=r.data.seed)
    step = PartialStep(r, FakeEngine(), FakeLearner(1), stream, _runner(), str, [STOP], max_staleness=K,
                       segment_tokens=4, last_step=6)
    step._admit()
    while step.flight:
        step._tick()
    plan = PartialBuffer.from_recipe(r, LOOPS)
    assert len(step.done) == plan.groups == K * r.rollout.prompts_per_step
    assert all(len(row) == max_new for g in step.done for row in g.rows)
    assert plan.per_token == token_bytes(LOOPS) == 46 + 4 * LOOPS
    assert tensor_bytes(step.state_dict()) == sum(row.nbytes() for g in step.done for row in g.rows) == plan.bytes


def test_no_buffer_exceeds_the_plan_and_dropped_groups_keep_no_rows():
    K = 2
    step = make_step(recipe(K, 10, max_new=32), _runner(), segments=1)
    bound = PartialBuffer.from_recipe(step.recipe, LOOPS).bytes
    tick, most, dropped = step._tick, [0], []

    def measured():
        tick()
        held = tensor_bytes(step.state_dict())
        assert held == sum(row.nbytes() for g in step.flight + step.done for row in g.rows)  # nothing else
        dropped.extend(g for g in step.dropped if g not in dropped)
        most[0] = max(most[0], held)

    step._tick = measured
    for n in range(1, 11):
        step(n)
    assert dropped and all(not g.rows for g in dropped)  # groups were dropped, their rows freed
    assert 0 < most[0] <= bound


def test_the_plan_shows_the_partial_buffer_for_a_partial_rollout_recipe(tmp_path, capsys):
    r = recipe(2, 4, max_new=48)
    plan = plan_run(r, TINY_LOOPED, 16 * 2**30, device="cpu")
    loops = TINY_LOOPED["num_loops"]
    want = 2 * 2 * 2 * 48 * (46 + 4 * loops)  # K · P · G · max_new_tokens · per token
    assert plan.host == {"partial_buffer": want} == {"partial_buffer": PartialBuffer.from_recipe(r, loops).bytes}
    assert "partial rollouts in progress" in format_plan(plan) and plan.to_json()["host"] == plan.host
    thinking = r.rollout.thinking  # a forced completion longer than max_new_tokens is the rows' width
    thinking.budget, thinking.answer_budget = 40, 30
    assert PartialBuffer.from_recipe(r, loops).tokens == 40 + len(thinking.interruption.encode()) + 30 > 48
    thinking.budget = 0
    r.orchestration.partial_rollouts = False  # the K-deep pipeline holds steps of rows instead
    assert set(plan_run(r, TINY_LOOPED, 16 * 2**30, device="cpu").host) == {"held_ahead"}

    folder = config_folder(tmp_path, TINY_LOOPED)
    ray = ["orchestration.backend=ray", "orchestration.max_staleness=2", "algorithm.correction=decoupled"]
    assert main(["plan", QUICKSTART, f"model.path={folder}", *ray, "orchestration.partial_rollouts=true", "--cpu"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("partial rollouts in progress"))
    assert "host memory of the Ray driver" in line and "rows held ahead" not in out
    assert main(["plan", QUICKSTART, f"model.path={folder}", *ray, "--cpu"]) == 0
    assert "rows held ahead (K steps)" in capsys.readouterr().out
