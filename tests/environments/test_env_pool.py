"""Environments run isolated (`rltt.environments.env_pool`): the episodes are bitwise those of the
in-process path, and an environment call that raises, hangs, exits, is killed, segfaults or
allocates without bound costs exactly its own episode — a counted error — while the batch's other
episodes are unchanged and the next batch runs normally on the same pool."""

import pickle

import pytest
import torch

from rltt.config import ConfigError
from rltt.environments.annotation_env import AnnotationEnvironment
from rltt.environments.env_pool import EnvPool, InProcessEnv
from rltt.environments.tool_env import ToolEnvironment
from rltt.errors import RlttError
from rltt.orchestration.episodes import EpisodeRunner, run_episodes
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.rollout import NativeEngine, SamplingParams

from tests.rollout.helpers import prompts, tiny_model

from .faulty_env import ANNOTATIONS, TOOL_CALLS, FaultyEnv, OwnAnswer, UnpicklableState
from .helpers import decode, encode
from .test_environments import RECIPES

TASKS = ["a", "b", "c", "d", "e"]
LATER = ["f", "g", "h", "i", "j"]
FIELDS = ("completion_ids", "completion_lengths", "completion_mask", "exit_steps", "logprobs", "tempered_logprobs",
          "kept_floor", "exit_logprobs", "forced_mask", "env_mask")


def _run(model, env, tasks, runner=None, vocab=None, max_turns=4, max_tokens=30, **kw):
    """Episodes of the 5 prompts (one per task), with ``ScriptedEnv``'s token text or ``vocab``'s."""
    fields = dict(temperature=1.0, top_k=40, max_new_tokens=6, n=1, prompt_seeds=[5, 17, 23, 29, 31],
                  stop_token_ids=[5, 6, 7, 8, 10], exit_policy="sample", schedule="deferred")
    fields.update(kw)
    enc, dec = (vocab.encode, vocab.decode) if vocab is not None else (encode, decode)
    return run_episodes(NativeEngine(model), prompts([4, 6, 3, 5, 4], seed=2), SamplingParams(**fields), env, tasks,
                        enc, dec, max_turns=max_turns, max_tokens=max_tokens, env_runner=runner)


def _rows(batch, rows):
    """Everything an episode row is made of, for the rows ``rows``."""
    out = {name: getattr(batch.rollout, name)[rows] for name in FIELDS}
    out["gates"] = batch.rollout.gate_probs[:, rows].nan_to_num(-7.0)
    for name in ("turns", "tool_calls", "tool_errors", "truncated"):
        out[name] = getattr(batch, name)[rows]
    return out


def _assert_same(a, b, rows=None, fields=None):
    rows = list(range(a.rollout.num_rows)) if rows is None else rows
    left, right = _rows(a, rows), _rows(b, rows)
    for name in fields or left:
        assert torch.equal(left[name], right[name]), name
    assert [a.answers[r] for r in rows] == [b.answers[r] for r in rows]
    assert [a.rollout.finish_reasons[r] for r in rows] == [b.rollout.finish_reasons[r] for r in rows]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def clean(model):
    """The in-process episodes of a faultless environment (this batch and the next), the episode that
    faults in the tests (one whose first turn reaches the environment's step), and per call
    (start, step) the in-process episodes of an environment that raises there on that episode."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run (the one-thread fixture is per test)
    try:
        before = _run(model, FaultyEnv(), TASKS)
        victim = next(r for r in range(len(TASKS)) if int(before.tool_calls[r]) > 0)
        raised = {at: _run(model, FaultyEnv("raise", TASKS[victim], at), TASKS) for at in ("start", "step")}
        return before, _run(model, FaultyEnv(), LATER), victim, raised
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("make_env, vocab", [
    (lambda: AnnotationEnvironment(), ANNOTATIONS),
    (lambda: ToolEnvironment(["calculator", "python"]), TOOL_CALLS),
], ids=["annotations", "tools"])
def test_isolated_episodes_are_bitwise_the_in_process_ones(model, make_env, vocab):
    # the model's text is the environment's syntax: it writes calls often (several per batch)
    kw = dict(vocab=vocab, max_turns=6, max_tokens=40, max_new_tokens=10, n=2, stop_token_ids=[])
    inline = _run(model, make_env(), TASKS, **kw)
    pool = EnvPool(make_env(), workers=2, timeout_s=30.0, memory_mb=1024)
    try:
        isolated = _run(model, make_env(), TASKS, runner=pool, **kw)
    finally:
        pool.close()
    assert int(inline.tool_calls.sum()) >= 3 and bool(inline.rollout.env_mask.any())  # the environment answered
    assert not inline.errors and not isolated.errors and pool.restarts == 0
    _assert_same(inline, isolated)


FAULTS = [  # (fault, the call it faults in, the message, workers replaced)
    ("raise", "step", "RuntimeError: scripted fault", 0),
    ("hang", "step", "timed out after 2 s (the environment process was killed and replaced)", 1),
    ("exit", "step", "the environment process died (exit code 3); replaced", 1),
    ("sigkill", "step", "the environment process died (killed by SIGKILL); replaced", 1),
    ("segfault", "step", "the environment process died (killed by SIGSEGV); replaced", 1),
    ("memory", "step", "MemoryError", 0),
    ("raise", "start", "RuntimeError: scripted fault", 0),
    ("sigkill", "start", "the environment process died (killed by SIGKILL); replaced", 1),
]


@pytest.mark.parametrize("fault, at, message, restarts", FAULTS, ids=[f"{f}-{a}" for f, a, _, _ in FAULTS])
def test_a_faulting_environment_call_costs_its_episode_only(model, clean, fault, at, message, restarts):
    before, after, victim, raised = clean
    env = FaultyEnv(fault, TASKS[victim], at)
    pool = EnvPool(env, workers=2, timeout_s=2.0, memory_mb=256)
    try:
        faulty = _run(model, env, TASKS, runner=pool)
        assert set(faulty.errors) == {victim} and message in faulty.errors[victim], faulty.errors
        assert faulty.failed().tolist() == [r == victim for r in range(len(TASKS))]  # scored 0, in env/errors
        assert pool.restarts == restarts
        # the batch is bitwise what an exception in that call gives in-process: the failed episode ends at
        # its first turn, the others run on; their tokens, exits and the environment's answers are those of
        # the faultless batch (their log-probs may differ in the last bits: later turns batch fewer rows)
        _assert_same(raised[at], faulty)
        assert int(faulty.turns[victim]) == 1
        others = [r for r in range(len(TASKS)) if r != victim]
        _assert_same(before, faulty, others, ("completion_ids", "completion_lengths", "exit_steps", "env_mask",
                                              "turns", "tool_calls", "tool_errors", "truncated"))
        first_turn = int(faulty.rollout.completion_lengths[victim])
        assert first_turn > 0 and torch.equal(faulty.rollout.completion_ids[victim, :first_turn],
                                              before.rollout.completion_ids[victim, :first_turn])
        later = _run(model, env, LATER, runner=pool)  # the next batch, on the same pool
        assert not later.errors and pool.restarts == restarts
        _assert_same(after, later)
    finally:
        pool.close()


def test_a_killed_environment_scores_0_and_counts_once_in_env_errors(model, clean):
    """Through the step's scoring and metrics: the episode whose worker was killed scores 0 under a
    reward that gives every other row 1, and the rollout logs env/errors = 1."""
    from types import SimpleNamespace

    from rltt.data.rewards import RewardRunner, WeightedReward
    from rltt.orchestration.groups import sample_scored
    from rltt.orchestration.prompt_stream import Task
    from rltt.orchestration.step import rollout_metrics
    from rltt.runtime.distributed import Ranks
    from rltt.telemetry import schema as m

    _, _, victim, _ = clean
    env = FaultyEnv("sigkill", TASKS[victim])
    tasks = [Task(t, t, ids, "1") for t, ids in zip(TASKS, prompts([4, 6, 3, 5, 4], seed=2))]
    episodes = EpisodeRunner(env, encode, decode, 4, 30, EnvPool(env, workers=2, timeout_s=5.0, memory_mb=256))
    params = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=6, n=1, prompt_seeds=[5, 17, 23, 29, 31],
                            stop_token_ids=[5, 6, 7, 8, 10], exit_policy="sample", schedule="deferred")
    runner = RewardRunner([WeightedReward("one", lambda completion, answer, **kw: 1.0)])
    try:
        scored = sample_scored(NativeEngine(model), tasks, params, decode, runner, episodes)
    finally:
        episodes.close()
    assert scored.rewards.tolist() == [0.0 if r == victim else 1.0 for r in range(len(TASKS))]
    groups = SimpleNamespace(uniform=torch.ones(len(TASKS), dtype=torch.bool), num_groups=len(TASKS), compute=None)
    assert rollout_metrics(scored, groups, Ranks(), "one")[m.ENV_ERRORS] == 1


def test_the_in_process_runner_catches_exceptions_the_same_way(model, clean):
    _, _, victim, _ = clean
    env = FaultyEnv("raise", TASKS[victim])
    inline = _run(model, env, TASKS, runner=InProcessEnv(env))
    pool = EnvPool(env, workers=1, timeout_s=5.0, memory_mb=256)
    try:
        isolated = _run(model, env, TASKS, runner=pool)
    finally:
        pool.close()
    assert inline.errors == isolated.errors == {victim: "RuntimeError: scripted fault"}
    _assert_same(inline, isolated)


def test_a_state_that_does_not_pickle_costs_its_episode_only(model, clean):
    before, _, victim, raised = clean
    env = UnpicklableState(task=TASKS[victim])
    pool = EnvPool(env, workers=1, timeout_s=5.0, memory_mb=256)
    try:
        batch = _run(model, env, TASKS, runner=pool)
    finally:
        pool.close()
    assert set(batch.errors) == {victim} and "could not be sent back" in batch.errors[victim], batch.errors
    assert pool.restarts == 0
    _assert_same(raised["start"], batch)  # as if its start had raised


def test_an_environments_own_answer_runs_isolated_too(model):
    env = OwnAnswer()
    inline = _run(model, env, TASKS)
    pool = EnvPool(env, workers=2, timeout_s=5.0, memory_mb=256)
    try:
        isolated = _run(model, env, TASKS, runner=pool)
    finally:
        pool.close()
    one_turn = {r for r in range(len(TASKS)) if int(inline.turns[r]) == 1}
    assert 0 < len(one_turn) < len(TASKS)
    assert inline.errors == isolated.errors == {r: "ValueError: one turn" for r in one_turn}
    assert all(inline.answers[r].count("|") == int(inline.turns[r]) - 1 for r in range(len(TASKS)) if r not in one_turn)
    _assert_same(inline, isolated)


class _Unpicklable(FaultyEnv):
    def __init__(self):
        super().__init__()
        self.hook = lambda: None


def test_an_environment_that_does_not_pickle_is_a_one_line_error():
    with pytest.raises(RlttError) as info:
        EnvPool(_Unpicklable())
    assert "env.isolated: false" in str(info.value) and "\n" not in str(info.value)
    pickle.loads(pickle.dumps(ToolEnvironment(["python"])))  # the shipped environments pickle


def test_the_recipe_runs_its_environment_isolated_with_its_keys():
    recipe = load_train_recipe(RECIPES / "quickstart-tools.yaml", ["env.workers=2", "env.timeout_s=9",
                                                                  "env.memory_mb=512"])
    runner = EpisodeRunner.from_recipe(recipe, encode, decode)
    assert isinstance(runner.env_runner, EnvPool) and runner.env_runner.timeout_s == 9.0
    assert runner.env_runner.workers.size == 2 and runner.env_runner.workers.memory_mb == 512
    runner.close()
    inline = EpisodeRunner.from_recipe(load_train_recipe(RECIPES / "quickstart-tools.yaml", ["env.isolated=false"]),
                                       encode, decode)
    assert type(inline.env_runner) is InProcessEnv


@pytest.mark.parametrize("override, key", [
    ("env.timeout_s=0", "env.timeout_s"),
    ("env.timeout_s=5", "env.timeout_s"),  # not longer than env.limits.timeout_s: a tool call runs within it
    ("env.timeout_s=nan", "env.timeout_s"),
    ("env.workers=0", "env.workers"),
    ("env.memory_mb=16", "env.memory_mb"),
])
def test_bad_isolation_values_fail_in_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_train_recipe(RECIPES / "quickstart-tools.yaml", [override])
    assert f"'{key}'" in str(info.value) and "\n" not in str(info.value), str(info.value)
