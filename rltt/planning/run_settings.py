"""`RunSettings`: the recipe values memory depends on, read once from a `TrainRecipe`.

The planner works on these numbers, not on the recipe, so trying a change (``learner.micro_batch_size=2``,
``learner.activation_checkpointing=true``) is a `dataclasses.replace` — `KEYS` names the recipe key
of each field for the verdict line. ``learner.activation_checkpointing`` is read with ``getattr``
(False when the recipe schema has no such key yet).

Sequence length: ``data.max_prompt_tokens`` + the completion width, which is
``rollout.max_new_tokens`` or, with a thinking budget (``rollout.thinking.budget`` > 0), the longest
forced completion ``budget + interruption + answer_budget`` when that is longer — the width the
native engine preallocates — or, with a multi-turn environment, ``env.max_tokens`` (the longest
episode: prompt + ``env.max_tokens`` positions) when that is longer. Without a tokenizer the
interruption's token count is bounded by its UTF-8 bytes (a byte-level BPE token covers at least
one byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rltt.rollout.attention import DEFAULT_ATTENTION

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
#: ``train.memory_headroom``'s default (`rltt.orchestration.train_recipe.RLTrainSection`)
DEFAULT_HEADROOM = 0.10

#: RunSettings field -> the recipe key a user changes
KEYS = {
    "micro_batch_size": "learner.micro_batch_size",
    "checkpointing": "learner.activation_checkpointing",
    "pack_sequences": "learner.pack_sequences",
    "zero_stage": "learner.zero_stage",
    "backend": "learner.backend",
    "needs_reference": "algorithm.track_kl",
    "chunk_rows": "rollout.chunk_rows",
    "continuous": "rollout.continuous_batching",
    "completion_tokens": "rollout.max_new_tokens",
    "prompt_tokens": "data.max_prompt_tokens",
    "vllm_utilization": "rollout.vllm.gpu_memory_utilization",
    "vllm_sleep": "rollout.vllm.sleep",
    "headroom": "train.memory_headroom",
}


@dataclass(frozen=True)
class RunSettings:
    device: Literal["cuda", "cpu"]
    gpus: int
    model_dtype: str
    learner_dtype: str
    backend: str
    zero_stage: int
    micro_batch_size: int
    checkpointing: bool
    needs_reference: bool
    kl_coef: float
    engine: str
    vllm_utilization: float
    vllm_kv_gb: float
    prompts_per_step: int
    group_size: int
    prompt_tokens: int
    completion_tokens: int
    top_p: float
    top_k: int
    chunk_rows: int | str
    pack_sequences: bool = True
    fp32_head: bool = False  # learner.lm_head_dtype: fp32 (its activations count only on a 16-bit learner)
    vllm_sleep: bool = False  # rollout.vllm.sleep as the engine resolves it (null: on with CUDA, never on CPU)
    vllm_eager: bool = False  # rollout.vllm.enforce_eager as resolved (null: eager on CPU, CUDA graphs on GPU)
    vllm_multiprocess: bool = False  # rollout.vllm.multiprocess: vLLM's engine core in a process of its own
    vllm_lora: str = "adapters"  # rollout.vllm.lora: a LoRA run's adapters served by vLLM's LoRA, or merged
    cuda_graphs: bool = False  # rollout.cuda_graphs as the native engine resolves it (null: on with CUDA)
    attention: str = DEFAULT_ATTENTION  # rollout.attention (a captured triton pass keeps per-bucket inputs)
    continuous: bool = True  # rollout.continuous_batching as the engine table reads it: chunk_rows slots per call
    headroom: float = DEFAULT_HEADROOM  # train.memory_headroom: the share of each device the plan leaves free
    lora_rank: int = 0  # learner.lora.rank (0: full fine-tuning)
    lora_targets: tuple[str, ...] = ()  # learner.lora.target_modules
    lora_per_loop: bool = False  # learner.lora.per_loop

    @classmethod
    def from_recipe(cls, recipe, device: str, gpus: int = 1) -> "RunSettings":
        r, learner, algo = recipe.rollout, recipe.learner, recipe.algorithm
        return cls(
            device=device, gpus=gpus, model_dtype=recipe.model.dtype, learner_dtype=learner.dtype,
            backend=learner.backend, zero_stage=int(learner.zero_stage) if learner.backend == "deepspeed" else 0,
            micro_batch_size=learner.micro_batch_size,
            checkpointing=bool(getattr(learner, "activation_checkpointing", False)),
            needs_reference=algo.kl_coef > 0 or algo.track_kl, kl_coef=algo.kl_coef,
            engine=r.engine, vllm_utilization=r.vllm.gpu_memory_utilization, vllm_kv_gb=r.vllm.kv_cache_gb,
            prompts_per_step=r.prompts_per_step, group_size=r.group_size,
            prompt_tokens=recipe.data.max_prompt_tokens,
            completion_tokens=completion_width(r, getattr(recipe, "env", None)), top_p=r.top_p, top_k=r.top_k,
            chunk_rows=r.chunk_rows, pack_sequences=bool(getattr(learner, "pack_sequences", True)),
            fp32_head=getattr(learner, "lm_head_dtype", "model") == "fp32",
            vllm_sleep=(device == "cuda") if r.vllm.sleep is None else (bool(r.vllm.sleep) and device == "cuda"),
            vllm_eager=(device == "cpu") if r.vllm.enforce_eager is None else bool(r.vllm.enforce_eager),
            vllm_multiprocess=bool(r.vllm.multiprocess), vllm_lora=getattr(r.vllm, "lora", "adapters"),
            cuda_graphs=device == "cuda" and getattr(r, "cuda_graphs", None) is not False,
            attention=getattr(r, "attention", DEFAULT_ATTENTION),
            continuous=r.continuous_batching,  # checked against the engine by the recipe (`EngineSpec.continuous`)
            headroom=recipe.train.memory_headroom,
            **lora_settings(getattr(learner, "lora", None)),
        )

    @property
    def lora(self) -> bool:
        """Whether the run trains LoRA adapters (``learner.lora``) instead of every parameter."""
        return self.lora_rank > 0

    def budget_bytes(self, device_bytes: int) -> int:
        """What the plan may fill of a device of ``device_bytes``: all but ``train.memory_headroom``."""
        return int(device_bytes * (1 - self.headroom))

    # -- dtypes ------------------------------------------------------------------------------
    @property
    def train_bytes(self) -> int:
        """Bytes per parameter of the trained policy: both backends run bf16 when ``learner.dtype``
        is bf16 and keep the loaded dtype (``model.dtype``) otherwise (`rltt.learner.learner.Learner`
        casts to bf16 only; a bf16 module is trained with fp32 masters either way)."""
        if self.learner_dtype == "bf16":
            return DTYPE_BYTES[self.learner_dtype]
        return DTYPE_BYTES[self.model_dtype]

    @property
    def engine_bytes(self) -> int:
        """The engines sample in ``learner.dtype`` (`rltt.orchestration.components.engine_dtype`)."""
        return DTYPE_BYTES[self.learner_dtype]

    @property
    def truncates(self) -> bool:
        """Whether rollouts sample from a top-p / top-k kept set (which the learner then scores)."""
        return self.top_p < 1.0 or self.top_k > 0

    # -- batch geometry ------------------------------------------------------------------------
    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def rows_per_rank(self) -> int:
        """Rollout rows one rank samples per step: its share of the prompts, G rows each."""
        return -(-self.prompts_per_step // self.gpus) * self.group_size

    @property
    def micro_rows(self) -> int:
        """Rows per learner micro-batch (`rltt.learner.Learner`: min(micro_batch_size, batch))."""
        return min(self.micro_batch_size, self.rows_per_rank)

    @property
    def micro_prompts(self) -> int:
        """Distinct prompts in the learner micro-batch that holds the most: a group's G rows are
        consecutive and micro-batches slice a rank's rows in order, so one may straddle groups."""
        rows, m, g = self.rows_per_rank, self.micro_rows, self.group_size
        return max((min(start + m, rows) - 1) // g - start // g + 1 for start in range(0, rows, m))

    def learner_positions(self) -> tuple[int, int, int | None]:
        """``(positions, scored, key positions)`` of the largest learner micro-batch's score forward
        (`rltt.planning.activations`). Padded (``learner.pack_sequences: false``): every row's prompt
        + completion, no key term (None). Packed: each distinct prompt once plus every row's
        completion but its last token, and the keys packed attention gathers per layer call (each
        prompt once for its own positions, then every row's prompt and suffix)."""
        m, p, c = self.micro_rows, self.prompt_tokens, self.completion_tokens
        if not self.pack_sequences:
            return m * (p + c), m * c, None
        prompts, suffix = self.micro_prompts, max(c - 1, 0)
        return prompts * p + m * suffix, m * c, prompts * p + m * (p + suffix)


def lora_settings(lora) -> dict:
    """The `RunSettings` fields of a ``learner.lora`` section (none: full fine-tuning)."""
    if lora is None:
        return {}
    return {"lora_rank": lora.rank, "lora_targets": tuple(lora.target_modules), "lora_per_loop": bool(lora.per_loop)}


def completion_width(rollout, env=None) -> int:
    """The completion positions the engine allocates per row (module docstring); with a multi-turn
    environment (``env.name`` set) the episode's ``env.max_tokens`` when longer: its last turn runs
    on prompt + history, and the learner scores prompt + the whole episode."""
    thinking = rollout.thinking
    width = rollout.max_new_tokens
    if thinking.budget:
        forced = thinking.budget + len(thinking.interruption.encode("utf-8")) + thinking.answer_budget
        width = max(width, forced)
    if env is not None and getattr(env, "enabled", False):
        width = max(width, env.max_tokens)
    return width
