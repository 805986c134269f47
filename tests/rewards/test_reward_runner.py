"""Reward specs and RewardRunner: weighting, failures recorded and scored 0, spec errors."""

import math
from pathlib import Path

import pytest

from rltt.data.rewards import RewardRunner, RewardSample, WeightedReward, load_reward_fn, reward_name
from rltt.errors import RlttError

REPO = Path(__file__).resolve().parents[2]


def test_spec_forms_resolve_to_working_functions(tmp_path, monkeypatch):
    by_path = load_reward_fn("rewards/gsm8k.py:strict")
    by_module = load_reward_fn("rewards.gsm8k:strict")
    by_abs = load_reward_fn(f"{REPO}/rewards/gsm8k.py:strict")
    for fn in (by_path, by_module, by_abs):
        assert fn("#### 3", "3") == 1.0 and fn("#### 4", "3") == 0.0
    monkeypatch.chdir(tmp_path)  # relative paths also resolve from the rltt checkout
    assert load_reward_fn("rewards/format.py:format_reward")("#### 1") == 1.0
    assert reward_name("rewards/gsm8k.py:strict") == "gsm8k.strict"
    assert reward_name("rewards.math:math_verify") == "math.math_verify"


def test_user_file_relative_to_root(tmp_path):
    (tmp_path / "my_reward.py").write_text("def length(completion, answer, **kw):\n    return len(completion)\n")
    assert load_reward_fn("my_reward.py:length", root=tmp_path)("abcd", "") == 4


@pytest.mark.parametrize(
    "spec, message",
    [
        ("rewards/nope.py:strict", r"reward file not found: rewards/nope.py"),
        ("rewards/gsm8k.py:nope", r"no function 'nope' in rewards/gsm8k.py \(it defines: flexible, strict\)"),
        ("rewards.nope:strict", r"no module 'rewards.nope'"),
        ("rewards/gsm8k.py", r"bad reward spec 'rewards/gsm8k.py'"),
        ("rewards/gsm8k.py:", r"bad reward spec"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(RlttError, match=message) as info:
        load_reward_fn(spec)
    assert "\n" not in str(info.value)


def test_broken_reward_file(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RlttError, match="broken.py failed to import: RuntimeError: boom"):
        load_reward_fn("broken.py:fn", root=tmp_path)
    (tmp_path / "const.py").write_text("VALUE = 3\n")
    with pytest.raises(RlttError, match="not a function"):
        load_reward_fn("const.py:VALUE", root=tmp_path)


def test_weighted_total_and_per_function_scores():
    runner = RewardRunner.from_specs({"rewards/gsm8k.py:strict": 1.0, "rewards/format.py:format_reward": 0.25})
    result = runner.score([("ok\n#### 72", "#### 72", "a"), ("#### 5", "72", "b"), ("72", "72", "c")])
    assert result.scores == {"gsm8k.strict": [1.0, 0.0, 0.0], "format.format_reward": [1.0, 1.0, 0.0]}
    assert result.total == [1.25, 0.25, 0.0]
    assert result.errors == []
    assert result.mean("gsm8k.strict") == pytest.approx(1 / 3)
    assert result.mean() == pytest.approx(0.5)


def test_raising_reward_scores_zero_and_is_recorded():
    def flaky(completion, answer, **kw):
        if "crash" in completion:
            raise ValueError("cannot parse")
        return 1.0

    def bad_type(completion, answer, **kw):
        return None if completion == "none" else (math.nan if completion == "nan" else True)

    runner = RewardRunner([WeightedReward("flaky", flaky, 2.0), WeightedReward("typed", bad_type, 1.0)])
    samples = [
        RewardSample("fine", "1", prompt_id="p0"),
        RewardSample("crash now", "1", prompt_id="p1"),
        ("none", "1", "p2"),
        ("nan", "1", "p3"),
    ]
    result = runner.score(samples)
    assert result.scores["flaky"] == [1.0, 0.0, 1.0, 1.0]
    assert result.scores["typed"] == [1.0, 1.0, 0.0, 0.0]
    assert result.total == [3.0, 1.0, 2.0, 2.0]
    records = {(e.prompt_id, e.function) for e in result.errors}
    assert records == {("p1", "flaky"), ("p2", "typed"), ("p3", "typed")}
    crash = next(e for e in result.errors if e.function == "flaky")
    assert crash.message == "ValueError: cannot parse"
    assert "p1" in str(crash) and "flaky" in str(crash)
    runner.score([("crash", "1", "p4")])
    assert len(runner.errors) == 4  # the runner keeps a running log


def test_reward_receives_prompt_id_and_extra():
    seen = []

    def spy(completion, answer, **kw):
        seen.append(kw)
        return 0.0

    RewardRunner([WeightedReward("spy", spy)]).score([RewardSample("c", "a", "id7", {"question": "q"})])
    assert seen == [{"prompt_id": "id7", "question": "q"}]


def test_runner_config_errors():
    with pytest.raises(RlttError, match="at least one"):
        RewardRunner([])
    with pytest.raises(RlttError, match="duplicate"):
        RewardRunner([WeightedReward("a", len), WeightedReward("a", len)])
    with pytest.raises(RlttError, match="weight"):
        RewardRunner.from_specs({"rewards/gsm8k.py:strict": "high"})
    with pytest.raises(RlttError, match="reward file not found"):
        RewardRunner.from_specs(["rewards/missing.py:f"])
