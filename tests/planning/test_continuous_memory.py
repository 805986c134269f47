"""The memory plan of continuous batching (`rltt.rollout.admission.Continuous`) against what a call allocates:
one executor of ``chunk_rows`` slots (KV cache and state at the call's longest prompt + the completion
width) and, for every row of the call, its gates and sampled values held until the call ends."""

from dataclasses import replace

import torch

from rltt.planning import rollout_memory as rm
from rltt.planning.engine_memory import NativeMemory
from rltt.planning.run_settings import RunSettings
from rltt.planning.shapes import ModelShape
from rltt.rollout import NativeEngine, SamplingParams
from rltt.rollout import decode_loop as continuous_module

from ..rollout.helpers import prompts, tiny_model

LENGTHS = [5, 1, 9, 4, 7]
N, SLOTS, NEW = 2, 3, 6


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_the_plan_counts_what_a_continuous_call_holds(monkeypatch):
    model = tiny_model()
    cfg = model.config
    shape = ModelShape.of(cfg)
    executors, held = [], []

    class Measured(continuous_module.PassExecutor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            executors.append(self)

    class Deferred(continuous_module._Deferred):
        def add(self, rows, steps, values):
            held.append(_bytes(values))
            super().add(rows, steps, values)

    def copy_out(gates):
        out = gates.clone()
        held.append(_bytes(out))
        return out

    monkeypatch.setattr(continuous_module, "PassExecutor", Measured)
    monkeypatch.setattr(continuous_module, "_Deferred", Deferred)
    monkeypatch.setattr(continuous_module, "_copy_out", copy_out)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, n=N, seed=3, ignore_eos=True, exit_policy="sample")
    batch = NativeEngine(model, SLOTS, continuous=True).generate(prompts(LENGTHS, seed=3), params)
    assert (batch.completion_lengths == NEW).all()  # every row at the width: the plan's count is exact
    (executor,) = executors  # one executor for the call
    positions = max(LENGTHS) + NEW
    assert executor.num_rows == SLOTS and executor.max_len == positions
    b = 4  # fp32
    kv = sum(_bytes(k) + _bytes(v) for k, v in zip(executor.cache.keys, executor.cache.values))
    assert kv == rm.kv_bytes(shape, SLOTS, positions, b)
    state = _bytes(executor.carry) + _bytes(executor.gates) + _bytes(executor.tokens)
    assert state <= rm.state_bytes(shape, SLOTS, positions, b)
    rows = len(LENGTHS) * N
    assert sum(held) == rm.held_bytes(shape, rows, NEW)

    # the plan's rollout terms at these settings: the same KV, the state with every row's held values
    settings = RunSettings(device="cpu", gpus=1, model_dtype="fp32", learner_dtype="fp32", backend="torch",
                           zero_stage=0, micro_batch_size=4, checkpointing=False, needs_reference=False, kl_coef=0.0,
                           engine="native", vllm_utilization=0.5, vllm_kv_gb=1.0, prompts_per_step=len(LENGTHS),
                           group_size=N, prompt_tokens=max(LENGTHS), completion_tokens=NEW, top_p=1.0, top_k=0,
                           chunk_rows=SLOTS, continuous=True)
    plan = NativeMemory().rollout(shape, settings, SLOTS, 0)
    assert plan["rollout_kv"] == kv
    assert plan["rollout_state"] == rm.state_bytes(shape, SLOTS, positions, b) + sum(held)
    chunked = NativeMemory().rollout(shape, replace(settings, continuous=False), SLOTS, 0)
    assert chunked["rollout_kv"] == kv and chunked["rollout_state"] < plan["rollout_state"]
    assert plan["rollout_workspace"] > chunked["rollout_workspace"]  # one more prompt's prefix, decode items beside
