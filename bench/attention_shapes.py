"""How many distinct attention shapes the native engine meets per rollout.

A GPU attention backend that builds an execution plan per new shape (PyTorch's cuDNN SDPA backend
does) pays that build at every shape a rollout has not met before; a pass's attention shapes change
with the key length, the entries and the row groups. This counts, on CPU, the calls the engine makes
to ``scaled_dot_product_attention`` and how many of them have a (query, key, key stride, mask) shape
not seen before in this engine's life, for the workloads of bench/gpu_check's sections that ran
out of time on the first GPU check:

    python bench/attention_shapes.py

- ``smoke``: 8 prompts of 80-200 tokens x G = 8, 64 new tokens, deferred, sampled exits (three
  calls with new seeds, unbucketed and bucketed);
- ``graphs``: batch 32, prompt 32, 32 new tokens, greedy, sampled exits, the same call twice
  (dense and deferred);
- ``plan``: 4 prompts of 64 tokens x G = 8, 128 new tokens, deferred, sampled exits, E[t*] = 2.5.

Small random models (the shapes depend on the schedule and lengths, not on the width). Bench only:
it counts shapes, it does not time a GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltt.model import LoopConfig, LoopedForCausalLM  # noqa: E402
from rltt.model.exits import gate_lambda  # noqa: E402
from rltt.rollout import NativeEngine, SamplingParams  # noqa: E402


class ShapeCounter:
    """Wraps ``F.scaled_dot_product_attention``: calls and first-seen shapes since the last `reset`."""

    def __init__(self):
        self.seen: set = set()
        self.calls = self.new = 0
        self._sdpa = F.scaled_dot_product_attention

    def __enter__(self) -> "ShapeCounter":
        def spy(q, k, v, attn_mask=None, **kwargs):
            key = (tuple(q.shape), tuple(k.shape), tuple(k.stride()),
                   None if attn_mask is None else tuple(attn_mask.shape))
            self.calls += 1
            if key not in self.seen:
                self.seen.add(key)
                self.new += 1
            return self._sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

        F.scaled_dot_product_attention = spy
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._sdpa

    def reset(self, forget: bool) -> None:
        self.calls = self.new = 0
        if forget:
            self.seen.clear()


def model(hidden: int, mean_exit: float | None = None) -> LoopedForCausalLM:
    torch.manual_seed(0)
    cfg = LoopConfig(vocab_size=100, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, num_loops=4, max_position_embeddings=1024)
    m = LoopedForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.exit_gate.weight.zero_()
        lam = gate_lambda(mean_exit, 4) if mean_exit else 0.5
        m.model.exit_gate.bias.fill_(math.log(lam / (1 - lam)))
    return m


def count(counter: ShapeCounter, label: str, engine: NativeEngine, prompts, params: SamplingParams) -> None:
    counter.reset(forget=False)
    batch = engine.generate(prompts, params)
    passes = batch.stats.passes
    print(f"| {label} | {passes} | {counter.calls} | {counter.new} | {counter.new / max(passes, 1):.2f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print("| workload | passes | SDPA calls | new shapes | new per pass |\n|---|---:|---:|---:|---:|")
    with ShapeCounter() as counter:
        m = model(128)
        prompts = [torch.randint(1, 99, (int(n),), generator=gen).tolist()
                   for n in torch.randint(80, 200, (8,), generator=gen)]
        for buckets in (False, True):
            counter.reset(forget=True)
            engine = NativeEngine(m, buckets=buckets)
            for i in range(3):
                count(counter, f"smoke, {'bucketed' if buckets else 'unbucketed'}, call {i + 1} (seed {i})", engine,
                      prompts, SamplingParams(temperature=1.0, max_new_tokens=64, n=8, schedule="deferred", seed=i,
                                              ignore_eos=True, exit_policy="sample"))
        m = model(64)
        prompts = torch.randint(1, 99, (32, 32), generator=gen).tolist()
        for schedule in ("dense", "deferred"):
            counter.reset(forget=True)
            engine = NativeEngine(m)
            for i in range(2):
                count(counter, f"graphs, {schedule}, call {i + 1} (the same call)", engine, prompts,
                      SamplingParams(temperature=0.0, max_new_tokens=32, schedule=schedule, seed=1, ignore_eos=True,
                                     exit_policy="sample"))
        m = model(64, mean_exit=2.5)
        prompts = torch.randint(1, 99, (4, 64), generator=gen).tolist()
        counter.reset(forget=True)
        engine = NativeEngine(m)
        for i in range(2):
            count(counter, f"plan, call {i + 1} (seed {i + 1})", engine, prompts,
                  SamplingParams(temperature=1.0, max_new_tokens=128, n=8, schedule="deferred", seed=i + 1,
                                 ignore_eos=True, exit_policy="sample"))


if __name__ == "__main__":
    main()
