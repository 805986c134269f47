"""Reward isolation: hangs, sys.exit, os._exit, segfaults and bad returns cost one sample, not the run."""

import json
import time

import pytest

from rltt.data.rewards import RewardErrorLog, RewardRunner, is_builtin, load_reward_fn, reward_error_metrics

BAD = '''
import ctypes, os, sys, time

def bad(completion, answer, **kw):
    if completion == "hang":
        time.sleep(1000)
    if completion == "exit":
        sys.exit(3)
    if completion == "osexit":
        os._exit(1)
    if completion == "segv":
        ctypes.string_at(0)
    if completion == "raise":
        raise ValueError("cannot parse " + kw["prompt_id"])
    if completion == "str":
        return "0.75"
    if completion == "none":
        return None
    if completion == "big":
        return 1e39
    return 0.5
'''


@pytest.fixture
def runner(tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    r = RewardRunner.from_specs([("bad.py:bad", 1.0, 1.0), "rewards/gsm8k.py:strict"], root=tmp_path, workers=2)
    yield r
    r.close()


def _errors(result):
    return {e.prompt_id: e.message for e in result.errors}


def test_a_hanging_reward_times_out_within_the_limit(runner):
    start = time.monotonic()
    result = runner.score([("hang", "1", "p0"), ("ok", "1", "p1")])
    assert time.monotonic() - start < 10  # the reward sleeps 1000 s; the timeout is 1 s
    assert result.scores["bad.bad"] == [0.0, 0.5]
    assert "timed out after 1 s" in _errors(result)["p0"]
    assert runner.score([("ok", "1", "p2")]).scores["bad.bad"] == [0.5]  # the replaced worker serves on


@pytest.mark.parametrize("completion, message", [
    ("exit", "SystemExit: 3"),
    ("osexit", "the reward process died (exit code 1)"),
    ("segv", "the reward process died (killed by SIGSEGV)"),
])
def test_exits_and_crashes_score_zero_and_the_run_goes_on(runner, completion, message):
    result = runner.score([("ok", "1", "a"), (completion, "1", "b"), ("ok", "1", "c"), ("#### 1", "1", "d")])
    assert result.scores["bad.bad"] == [0.5, 0.0, 0.5, 0.5]
    assert result.scores["gsm8k.strict"] == [0.0, 0.0, 0.0, 1.0]
    assert message in _errors(result)["b"]
    assert list(_errors(result)) == ["b"]


@pytest.mark.parametrize("completion, message", [
    ("str", "returned '0.75', not a number"),
    ("none", "returned NoneType, not a number"),
    ("big", "not finite in float32"),
])
def test_non_numbers_and_float32_overflow_are_errors_not_coerced(runner, completion, message):
    result = runner.score([(completion, "1", "p")])
    assert result.scores["bad.bad"] == [0.0]
    assert message in _errors(result)["p"]


def test_raising_writes_the_text_to_reward_errors_jsonl(runner, tmp_path):
    log = runner.open_error_log(tmp_path / "run" / "reward_errors.jsonl")
    runner.step = 7
    result = runner.score([("raise", "1", "q1"), ("ok", "1", "q2")])
    assert result.error_counts() == {"bad.bad": 1, "gsm8k.strict": 0}
    assert reward_error_metrics(result.errors, runner.names) == {"reward/errors/bad.bad": 1,
                                                                 "reward/errors/gsm8k.strict": 0}
    lines = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert lines == [{"step": 7, "prompt_id": "q1", "function": "bad.bad", "kind": "ValueError",
                      "message": "ValueError: cannot parse q1", "occurrence": 1}]


def test_the_error_log_is_rate_limited_and_resumes(tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    path = tmp_path / "reward_errors.jsonl"
    with RewardRunner.from_specs(["bad.py:bad"], root=tmp_path, workers=1) as runner:
        runner.open_error_log(path)
        for step in range(1, 4):
            runner.step = step
            runner.score([("raise", "1", f"s{step}-{i}") for i in range(100)])
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    # 300 failures of one kind: the first 5, then every 100th
    assert [x["occurrence"] for x in lines] == [1, 2, 3, 4, 5, 100, 200, 300]
    assert "note" in lines[4]
    resumed = RewardErrorLog(path, resume_step=1)  # steps 2 and 3 are redone
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1] * 6
    assert resumed.counts[("bad.bad", "ValueError")] == 100


def test_builtins_run_in_process_and_user_copies_do_not(tmp_path):
    assert is_builtin(load_reward_fn("rewards/gsm8k.py:strict"))
    assert is_builtin(load_reward_fn("rewards.format:format_reward"))
    (tmp_path / "rewards").mkdir()
    from pathlib import Path

    import rewards.gsm8k

    (tmp_path / "rewards" / "gsm8k.py").write_text(Path(rewards.gsm8k.__file__).read_text())
    copy = load_reward_fn("rewards/gsm8k.py:strict", root=tmp_path)  # the user's copy, marked or not
    assert copy.__rltt_builtin__ and not is_builtin(copy)
    with RewardRunner.from_specs(["rewards/gsm8k.py:strict"]) as fast:
        assert fast._pool is None
