"""Multi-turn episodes on the native engine: continued rows against re-submitted histories.

    python bench/rollout.py --episodes                 # the default shape below (a few minutes on 2 loaded cores)
    python bench/rollout.py --episodes --prompt-len 128 --turn-tokens 16
    python bench/episode_turns.py train RECIPE [key=value ...]
                        # `rltt train` with the native engine re-submitting histories instead of
                        # continuing rows (compare its metrics with the same `rltt train` command)

`bench/rollout.py --episodes` runs `rltt.orchestration.episodes.run_episodes` with the same random
model as the rest of bench/rollout.py (d=512, L=4, T=4, V=4096 unless told otherwise; exit gate set
for E[t*] = ``--mean-exit`` under ``sample`` exits), the ``deferred`` schedule (``--schedule``),
temperature-1 sampling, ``--group`` rows per prompt, and a scripted environment: a turn ends at a
stop token (the ``--stop-ids`` lowest ids: about one turn in ``V / stop-ids`` tokens), the
environment answers ``--answer`` fixed tokens, ``--turns`` turns at most. Two ways, in one process,
interleaved ``--repeats`` times (the fastest of each reported):

- **continued**: `NativeEngine.open_turns` — each row's KV cache and decode state kept between turns,
  only the answer's tokens prefilled (`rltt.rollout.continuation`);
- **re-submitted**: the default `rltt.rollout.turns.ResubmitTurns` on the same engine — every later
  turn a new ``generate`` call on prompt + history.

Reported per way: serial passes per generated token (`RolloutStats.passes_per_token`, prefill
included), (token, step) entries computed per generated token, CPU and wall seconds per episode.
The two ways draw the same numbers (turn seeds), so they sample the same episodes unless a
rounding difference flips a token (checked and printed).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltt.environments import EnvReply, Environment  # noqa: E402
from rltt.orchestration.episodes import run_episodes  # noqa: E402
from rltt.rollout import NativeEngine, SamplingParams  # noqa: E402
from rltt.rollout.turns import ResubmitTurns  # noqa: E402

SECTION = "### Multi-turn: continued rows vs re-submitted history (`bench/rollout.py --episodes`)"


class _Resubmitting(NativeEngine):
    def open_turns(self, prompts, params, max_tokens):
        yield ResubmitTurns(self, prompts, params)


class _FixedAnswers(Environment):
    """Every turn is answered with the same ``answer`` ids until the episode has ``turns`` turns."""

    name = "bench"
    stop_strings = ()

    def __init__(self, answer: list[int], turns: int):
        self.text, self.turns = " ".join(map(str, answer)), turns

    def start(self, task):
        return {"turns": 0}

    def step(self, state, turn):
        state["turns"] += 1
        return EnvReply(None) if state["turns"] >= self.turns else EnvReply(self.text, tool_call=True)


def _encode(text: str) -> list[int]:
    return [int(t) for t in text.split()]


def _decode(ids) -> str:
    return " ".join(map(str, ids))


def episodes_bench(args, model) -> str:
    """Run both ways and return the markdown table (also printed)."""
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    num_prompts = max(1, args.rows // args.group)
    prompts = torch.randint(args.stop_ids, args.vocab, (num_prompts, args.prompt_len), generator=gen).tolist()
    answer = torch.randint(args.stop_ids, args.vocab, (args.answer,), generator=gen).tolist()
    env = _FixedAnswers(answer, args.turns)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.turn_tokens, n=args.group,
                            prompt_seeds=list(range(1, num_prompts + 1)), exit_policy="sample",
                            schedule=args.schedule, stop_token_ids=list(range(args.stop_ids)), ignore_eos=True)
    engines = {"continued": NativeEngine(model), "re-submitted": _Resubmitting(model)}

    def once(engine):
        wall, cpu = time.perf_counter(), time.process_time()
        out = run_episodes(engine, prompts, params, env, [None] * num_prompts, _encode, _decode,
                           max_turns=args.turns, max_tokens=args.episode_tokens)
        return time.perf_counter() - wall, time.process_time() - cpu, out

    once(engines["continued"])  # warm-up
    best = {k: (float("inf"), float("inf")) for k in engines}
    outs = {}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for name, engine in engines.items():
            wall, cpu, outs[name] = once(engine)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    load_after = os.getloadavg()[0]
    a, b = outs["continued"].rollout, outs["re-submitted"].rollout
    same = a.completion_ids.shape == b.completion_ids.shape and torch.equal(a.completion_ids, b.completion_ids)
    rows = a.num_rows
    lines = [f"# {rows} episodes ({num_prompts} prompts x {args.group}), prompt {args.prompt_len} tokens, "
             f"<= {args.turn_tokens} tokens a turn, {args.answer}-token answers, <= {args.turns} turns, "
             f"{args.schedule}; d={args.hidden} L={args.layers} T={args.loops} V={args.vocab}; "
             f"{args.threads} thread(s); fastest of {args.repeats}; load average {load_before:.1f} before, "
             f"{load_after:.1f} after",
             f"# turns per episode {float(outs['continued'].turns.float().mean()):.2f}, model tokens per episode "
             f"{a.stats.tokens / rows:.1f}; the same episodes both ways: {'yes' if same else 'no'}",
             "| turns | passes / token | entries / token | CPU s / episode | wall s / episode |",
             "|---|---:|---:|---:|---:|"]
    for name, batch in (("continued", a), ("re-submitted", b)):
        s = batch.stats
        lines.append(f"| {name} | {s.passes_per_token:.3f} | {s.entries_computed / s.tokens:.2f} | "
                     f"{best[name][1] / rows:.4f} | {best[name][0] / rows:.4f} |")
    lines.append(f"\ncontinued / re-submitted: entries {a.stats.entries_computed / b.stats.entries_computed:.3f}x, "
                 f"CPU time {best['continued'][1] / best['re-submitted'][1]:.3f}x, "
                 f"wall time {best['continued'][0] / best['re-submitted'][0]:.3f}x")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def resubmitting_cli(argv: list[str]) -> int:
    """`rltt` (``argv``: its arguments) with `NativeEngine.open_turns` replaced by every engine's
    default, `ResubmitTurns`: the same runs with each later turn re-submitted as a new prompt."""
    from rltt.cli.main import main

    NativeEngine.open_turns = _Resubmitting.open_turns
    sys.argv = ["rltt", *argv]
    return main()


if __name__ == "__main__":  # guarded: worker processes started from a forkserver import this file
    sys.exit(resubmitting_cli(sys.argv[1:]))
