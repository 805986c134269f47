"""Periodic evaluation of the LM stages: held-out loss and (synthetic task) solve rate."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from rltt.data.gsm8k import extract_final_answer, format_prompt, to_decimal
from rltt.data.synthetic import SyntheticProblem
from rltt.lm_training.losses import batch_loss
from rltt.telemetry import exit_stats, schema


@torch.no_grad()
def held_out_metrics(model, batches: list[torch.Tensor], beta: float, device, autocast=nullcontext) -> dict:
    """Mean held-out ``eval/lm_loss``, ``eval/lm_loss_step_<t>`` and exit distribution."""
    if not batches:
        return {}
    was_training = model.training
    model.eval()
    totals, steps, probs = 0.0, None, []
    for batch in batches:
        with autocast():
            loss, exit_probs = batch_loss(model, batch.to(device), beta)
        totals += float(loss.expected_loss)
        steps = loss.step_losses if steps is None else steps + loss.step_losses
        probs.append(exit_probs.float().reshape(exit_probs.shape[0], -1))
    model.train(was_training)
    n = len(batches)
    out = {"eval/lm_loss": totals / n}
    out.update({f"eval/lm_loss_step_{t + 1}": float(v) / n for t, v in enumerate(steps)})
    stats = exit_stats(torch.cat(probs, dim=1))
    out.update({f"eval/{key}": value for key, value in stats.items()})
    return out


@dataclass
class SolveResult:
    """Solve rate of sampled completions, with the completions for inspection."""

    solve_rate: float
    completions: list[str]
    correct: list[bool]
    mean_length: float


def is_correct(completion: str, problem: SyntheticProblem) -> bool:
    """Whether the completion's ``#### N`` answer equals the problem's result."""
    predicted = extract_final_answer(completion)
    return predicted is not None and to_decimal(predicted) == problem.result


@torch.no_grad()
def solve_rate(model, tokenizer, problems: list[SyntheticProblem], *, template: str, max_new_tokens: int,
               temperature: float = 1.0, exit_policy="final", batch_size: int = 64, seed: int = 0,
               device="cpu") -> SolveResult:
    """Sample one completion per problem (pure temperature sampling, no top-k/top-p) and score it.

    Uses ``model.generate`` with left padding; the sampling RNG is forked and seeded with
    ``seed`` so evaluation neither depends on nor disturbs the training RNG.
    """
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    completions: list[str] = []
    lengths: list[int] = []
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for start in range(0, len(problems), batch_size):
                chunk = problems[start : start + batch_size]
                prompts = [format_prompt(p.question, template) for p in chunk]
                enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                out = model.generate(
                    **enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                    max_new_tokens=max_new_tokens, exit_policy=exit_policy,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                )
                new = out[:, enc["input_ids"].shape[1]:]
                for row in new:
                    ids = row.tolist()
                    if tokenizer.eos_token_id in ids:
                        ids = ids[: ids.index(tokenizer.eos_token_id)]
                    lengths.append(len(ids))
                    completions.append(tokenizer.decode(ids, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    correct = [is_correct(c, p) for c, p in zip(completions, problems)]
    return SolveResult(
        solve_rate=sum(correct) / max(1, len(correct)),
        completions=completions,
        correct=correct,
        mean_length=sum(lengths) / max(1, len(lengths)),
    )


def solve_metrics(result: SolveResult) -> dict:
    """The eval record's solve-rate keys."""
    return {"eval/solve_rate": result.solve_rate, schema.SOLVE_RATE: result.solve_rate,
            "eval/completion_length": result.mean_length}
