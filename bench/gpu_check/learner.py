"""The ``learner`` section: one RL learner step on the Ouro-shaped model, timed after a warm-up step."""

from __future__ import annotations

import math

from .context import Context, PeakMemory, model_setting
from .report import Deadline, SectionResult

# -- learner -------------------------------------------------------------------------------------------
def learner_batch(ctx: Context, vocab: int, num_loops: int):
    """G completions of random lengths per random prompt (rows share their prompt, as in RL)."""
    import torch

    from rltt.learner import LearnerBatch

    p = ctx.shapes.learner
    gen = torch.Generator().manual_seed(5)
    rows = p["prompts"] * p["group"]
    width = p["prompt_len"] + p["completion_len"]
    ids = torch.zeros(rows, width, dtype=torch.long)
    attn = torch.zeros(rows, width, dtype=torch.long)
    target = torch.zeros(rows, width, dtype=torch.bool)
    for i in range(p["prompts"]):
        prompt = torch.randint(1, vocab, (p["prompt_len"],), generator=gen)
        for j in range(p["group"]):
            r = i * p["group"] + j
            n = int(torch.randint(p["completion_len"] // 2, p["completion_len"] + 1, (), generator=gen))
            ids[r, : p["prompt_len"]] = prompt
            ids[r, p["prompt_len"]: p["prompt_len"] + n] = torch.randint(1, vocab, (n,), generator=gen)
            attn[r, : p["prompt_len"] + n] = 1
            target[r, p["prompt_len"]: p["prompt_len"] + n] = True
    exits = torch.where(target, torch.randint(1, num_loops + 1, (rows, width), generator=gen), torch.ones_like(ids))
    sampler = torch.where(target, -torch.rand(rows, width, generator=gen) * 5 - 5, torch.zeros(rows, width))
    adv = torch.randn(rows, generator=gen)
    return LearnerBatch(input_ids=ids, attention_mask=attn, target_mask=target, exit_steps=exits, advantages=adv,
                        sampler_logprobs=sampler, temperature=1.0)


def section_learner(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:

    from rltt.kernels import resolve_impl
    from rltt.learner import AlgorithmConfig, Learner, LearnerConfig
    from rltt.telemetry import schema

    model = ctx.ouro_model()
    p = ctx.shapes.learner
    batch = learner_batch(ctx, model.config.vocab_size, model.config.num_loops)
    cfg = LearnerConfig(backend="torch", dtype="bf16", lr=1e-6, micro_batch_size=p["micro"], pack_sequences=True)
    learner = Learner(model.train(), cfg, AlgorithmConfig(track_kl=False), batch_size=batch.size,
                      max_len=p["completion_len"])
    scored = int(batch.target_mask.sum())
    packed = p["prompts"] * p["prompt_len"] + int(batch.target_mask.sum())
    setting = (f"{model_setting(model)}; {p['prompts']} prompts x G={p['group']}, prompt {p['prompt_len']} + "
               f"completions {p['completion_len'] // 2}-{p['completion_len']} tokens, micro-batch {p['micro']}, packed "
               f"scoring, ppo_clip exit log-prob, torch AdamW bf16, log-prob kernel "
               f"{resolve_impl(None, learner.device)}; timed step after one warm-up step")
    t_first, _ = ctx.timed(lambda: learner.update(batch))
    sec.add("first_step_s", round(t_first, 3), "s (AdamW state allocation, compiles)", setting)
    # the timed step compiles nothing and allocates no AdamW state: the first step bounds it (1.2x the first
    # step skipped it on the H200, 19 s first step in a 25 s budget)
    if not deadline.allows(t_first):
        sec.skip("timed learner step")
        return
    with PeakMemory(ctx) as mem:
        t_step, metrics = ctx.timed(lambda: learner.update(batch))
    sec.add("step_s", round(t_step, 3), "s", setting)
    sec.add("scored_tokens_per_s", round(scored / t_step, 1), f"tok/s ({scored} completion tokens)", setting)
    sec.add("packed_tokens_per_s", round(packed / t_step, 1), f"tok/s ({packed} packed tokens, each prompt once)",
            setting)
    sec.add("peak_memory_gib", mem.peak_gib, "GiB (weights, grads and AdamW states included)", setting)
    sec.add("loss_finite", bool(math.isfinite(metrics[schema.LOSS_TOTAL])), "", setting)
    model.eval()

