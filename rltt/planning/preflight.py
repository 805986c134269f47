"""What `rltt train` states before its first step (on stderr, rank 0): the memory plan it runs
with, and the cost of the held-out evaluation that runs before step 1.

The evaluation before step 1 samples every held-out prompt (``data.eval_size`` of them, after
``data.max_prompt_tokens`` and the split's own size) ``train.eval_samples`` times, up to
``rollout.max_new_tokens`` tokens each (or the thinking budget's longer width). On the GPU
recipes that is GSM8K's whole test split, 1,319 prompts × 512 tokens: 2.6 steps' worth of rollout
tokens before any training. The estimate is in sampled tokens (an upper bound: rows stop at
their stop token) and block passes (at most T per token, on the native engine; vLLM counts its
own), with the same figures for one training step beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltt.planning.engine_memory import GIB, engine_memory


@dataclass(frozen=True)
class EvalCost:
    """The held-out evaluation's work, per evaluation (every rank's share together)."""

    prompts: int
    samples: int  # train.eval_samples
    max_tokens: int  # the completion width each row may sample
    loops: int  # T: block passes per token at most
    step_rows: int  # rows of one training step's rollout (prompts_per_step × group_size)

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    @property
    def tokens(self) -> int:
        """Sampled tokens at most: every row runs to the completion width."""
        return self.rows * self.max_tokens

    @property
    def block_passes(self) -> int:
        """Block passes at most: T per token (the dense schedule's count; exits only lower it)."""
        return self.tokens * self.loops

    @property
    def steps_worth(self) -> float:
        """The evaluation's tokens in training steps' rollout tokens (same width per row)."""
        return self.rows / self.step_rows


def eval_cost(recipe, prompts: int, loops: int) -> EvalCost:
    """The cost of one held-out evaluation of ``prompts`` prompts under ``recipe`` (`TrainRecipe`)
    for a model of ``loops`` loop steps."""
    from rltt.planning.run_settings import completion_width

    r = recipe.rollout
    return EvalCost(prompts=prompts, samples=recipe.train.eval_samples,
                    max_tokens=completion_width(r, getattr(recipe, "env", None)),
                    loops=loops, step_rows=r.prompts_per_step * r.group_size)


def eval_line(cost: EvalCost, every: int) -> str:
    """One line naming the evaluation's size, its cost and the keys that set it."""
    return (f"held-out evaluation before step 1 (then every {every} steps): {cost.prompts:,} prompts × "
            f"{cost.samples} sample(s) × up to {cost.max_tokens} new tokens = {cost.tokens:,} tokens, up to "
            f"{cost.block_passes:,} block passes (T = {cost.loops} per token at most) — "
            f"{cost.steps_worth:.1f}× one training step's rollout ({cost.step_rows} rows); "
            f"data.eval_size, train.eval_samples and train.eval_every set it (train.eval_every=0: none)")


def plan_lines(plan) -> list[str]:
    """The memory plan a run goes with, in brief (`rltt plan RECIPE` prints the whole table)."""
    engine = engine_memory(plan.engine)
    lines = [f"memory plan: rollout phase {plan.phases['rollout'] / GIB:.1f} GiB "
             f"({engine.chunk_label(plan.rollout_rows_per_chunk)}), learner phase "
             f"{plan.phases['learner'] / GIB:.1f} GiB, of {plan.budget_bytes / GIB:.1f} GiB usable "
             f"({plan.device_bytes / GIB:.1f} GiB less train.memory_headroom={plan.headroom:g}); allocated bytes — "
             f"the allocator may reserve more, which the headroom is for (the whole plan: rltt plan RECIPE.yaml)"]
    setting = "auto" if plan.chunk_rows_setting == "auto" else f"rollout.chunk_rows={plan.chunk_rows_setting}"
    chunk = engine.chunk_line(plan.rollout_rows_per_chunk, plan.rows_per_rank, setting, plan.chunks_per_step)
    return lines + ([chunk] if chunk else [])
