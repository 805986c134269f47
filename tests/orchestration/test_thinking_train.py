"""`rltt train recipes/gsm8k-thinking.yaml` on CPU with a tiny chat checkpoint: chat prompts, a
thinking budget small enough that every rollout is forced, and the length/* metrics logged."""

from pathlib import Path

import pytest

from rltt.cli.main import main
from rltt.telemetry import read_metrics
from tests.data.chat_tokenizer import chat_checkpoint

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k-thinking.yaml"
LENGTH_KEYS = ["length/forced_frac", "length/think_mean", "length/answer_mean", "length/unclosed_frac"]


@pytest.mark.slow
def test_three_steps_with_chat_prompts_and_a_thinking_budget(tmp_path):
    ckpt = chat_checkpoint(tmp_path / "policy")
    run = tmp_path / "run"
    overrides = [
        f"model.path={ckpt}", "model.dtype=fp32", "model.device=cpu", "data.source=synthetic:easy", "data.eval_size=2",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "rollout.thinking.budget=4", "rollout.thinking.answer_budget=2",
        "rollout.thinking.interruption=\n</think>\n", "algorithm.dynamic_sampling=false",
        "learner.backend=torch", "learner.dtype=fp32", "learner.micro_batch_size=4", "train.steps=3",
        "train.eval_every=3", f"logging.run_dir={run}", "logging.tensorboard=false", "logging.progress=false",
        "logging.review_every=0", "logging.review_at_end=false", "checkpoint.every=0", "checkpoint.save_final=false",
    ]
    assert main(["train", str(RECIPE), *overrides]) == 0
    records = [r for r in read_metrics(run) if "length/forced_frac" in r]
    assert len(records) == 3
    for record in records:
        assert all(key in record for key in LENGTH_KEYS)
        # the random policy rarely samples </think> or EOS in 4 tokens: most rows are forced, and
        # the interruption closes their thinking
        assert 0.5 <= record["length/forced_frac"] <= 1.0
        assert record["length/unclosed_frac"] <= 1.0 - record["length/forced_frac"]
        assert 0 < record["length/think_mean"] <= 4 + 2  # budget + "\n</think>"
        assert record["length/answer_mean"] <= 2 + 1  # the answer budget (+ the newline after </think>)
