"""The ``smoke`` section: 5 steps of ``rltt train`` through the CLI's entry point, in this process."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from .context import MEAN_EXIT, Context, engine_calls
from .report import Deadline, SectionResult

# -- smoke: `rltt train` --------------------------------------------------------------------------------
def write_smoke_run(ctx: Context, tmp: Path) -> Path:
    """A small random LoopLM with a locally trained tokenizer, and a recipe on the GSM8K sample."""
    import torch
    import yaml

    from rltt.data import GSM8K_SAMPLE_DIR
    from rltt.data.gsm8k import load_gsm8k
    from rltt.data.tokenizer import train_tokenizer
    from rltt.model import LoopConfig, LoopedForCausalLM

    p = ctx.shapes.smoke
    records = load_gsm8k(GSM8K_SAMPLE_DIR, "train") + load_gsm8k(GSM8K_SAMPLE_DIR, "test")
    tok = train_tokenizer([r["question"] + "\n" + r["answer"] for r in records], vocab_size=128, kind="char")
    torch.manual_seed(0)
    config = LoopConfig(vocab_size=len(tok), hidden_size=p["hidden"], intermediate_size=2 * p["hidden"],
                        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_loops=4,
                        max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id)
    model = LoopedForCausalLM(config)
    from rltt.model.exits import gate_lambda

    lam = gate_lambda(MEAN_EXIT, config.num_loops)
    with torch.no_grad():
        model.model.exit_gate.weight.zero_()
        model.model.exit_gate.bias.fill_(math.log(lam / (1 - lam)))
    model.save_pretrained(tmp / "policy")
    tok.save_pretrained(tmp / "policy")
    recipe = {
        "model": {"path": str(tmp / "policy"), "dtype": p["dtype"], "device": ctx.device.type},
        "data": {"source": str(GSM8K_SAMPLE_DIR), "eval_size": p["eval_size"]},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}, {"fn": "rewards/format.py:format_reward", "weight": 0.1}],
        "rollout": {"prompts_per_step": p["prompts"], "group_size": p["group"], "max_new_tokens": p["new_tokens"],
                    "exit_policy": "sample", "schedule": "deferred"},
        "algorithm": {"track_kl": True},
        "learner": {"backend": "torch", "dtype": p["dtype"], "lr": 1e-4, "micro_batch_size": p["micro"]},
        "train": {"steps": 5, "eval_every": 5, "threads": p["threads"]},
        "logging": {"run_dir": str(tmp / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": True},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def section_smoke(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    """``rltt train RECIPE`` through the CLI's entry point, in this process (deepspeed, ray and vllm
    stay unimportable; the section's alarm bounds it)."""
    from rltt.cli.main import main as rltt_main
    from rltt.telemetry import read_metrics, schema

    p = ctx.shapes.smoke
    with tempfile.TemporaryDirectory(prefix="rltt-gpu-check-") as name:
        tmp = Path(name)
        recipe = write_smoke_run(ctx, tmp)
        start = time.perf_counter()
        with engine_calls(sec) as calls:
            code = rltt_main(["train", str(recipe)])
        wall = time.perf_counter() - start
        if code:
            raise RuntimeError(f"rltt train {recipe.name} exited with {code} (its error is printed above)")
        records = read_metrics(tmp / "run")
        steps = [r for r in records if r["step"] > 0]
        final = tmp / "run" / "checkpoints"
        setting = (f"rltt train (the CLI, in-process) on {ctx.device.type}: random LoopLM d={p['hidden']}, "
                   f"L={p['layers']}, T=4, char tokenizer trained locally, GSM8K sample, {p['prompts']} prompts x "
                   f"G={p['group']}, {p['new_tokens']} new tokens, deferred + sampled exits, torch backend "
                   f"{p['dtype']}, track_kl, eval at steps 0 and 5, final checkpoint")

        def mean(key):
            values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
            return round(sum(values) / len(values), 4) if values else None

        sec.add("steps_logged", len(steps), "steps", setting)
        sec.add("generate_calls", len(calls), "calls (training steps and evaluations)", setting)
        if calls:
            sec.add("generate_first_s", round(calls[0], 2), "s", setting)
            sec.add("generate_max_s", round(max(calls), 2), "s", setting)
        sec.add("wall_s", round(wall, 2), "s (model load, evaluations, checkpoint)", setting)
        sec.add("step_time_s_mean", mean(schema.TIME_STEP), "s", setting)
        sec.add("rollout_tok_s_mean", mean(schema.THROUGHPUT_TOKENS_PER_S), "tok/s", setting)
        sec.add("peak_memory_gb_max", max((r.get(schema.MEMORY_PEAK_GB) or 0 for r in steps), default=None), "GB", setting)
        sec.add("reward_mean", mean(schema.REWARD_MEAN), "", setting)
        sec.add("eval_solve_rate_final", steps[-1].get("eval/solve_rate") if steps else None, "", setting)
        sec.add("checkpoint_written", final.is_dir() and any(final.iterdir()), "", setting)
        if len(steps) != 5:
            raise RuntimeError(f"rltt train logged {len(steps)} steps, expected 5")

