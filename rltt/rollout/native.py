"""The native PyTorch rollout engine: batched, depth-mixed, `dense` or `deferred` (docs/design.md §2).

One call of `NativeEngine.generate` runs serial passes of the shared block until every row
has finished. Each pass (see `Scheduler`) advances every active row's decode token by one
step — rows at different steps share the pass (depth-mixed batching) — and computes, in the
same pass, the pending entries of earlier tokens that step needs. After the pass, tokens
whose exit policy says "exit here" are sampled from the full-vocabulary logits of that step
(tempered, truncated by top-k/top-p: the kept set is recorded per token, `kept_floor`).
Every pass is recorded (`PassRecord`) so `replay_logprobs` can re-execute it bit for bit.

Every call runs on the one decode loop (`rltt.rollout.decode_loop`) under an admission policy
(`rltt.rollout.admission`): with ``chunk_rows`` below the call's rows, by default the rows share
``chunk_rows`` slots of one executor, a finished row's slot taken by the next row (`Continuous`,
docs/engine.md "Continuous batching"); with ``continuous=False`` they run in chunks of whole prompts,
one after another, so the KV cache holds one chunk's rows, never the whole call's (`SeatAll` on one loop
per chunk, docs/design.md §2.7). Multi-turn episodes keep a chunk's rows in their slots between turns
(`open_turns`, `rltt.rollout.continuation`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Mapping

import torch

from rltt.errors import RlttError
from rltt.model.adapters import is_adapter
from rltt.model.modeling import LoopedForCausalLM
from rltt.rollout.attention import DEFAULT_ATTENTION, PassSetup
from rltt.rollout.buckets import pass_buckets
from rltt.rollout.admission import Continuous, SeatAll, seat_all
from rltt.rollout.continuation import native_turns
from rltt.rollout.decode_loop import DecodeLoop, LoopRun, kv_positions
from rltt.rollout.rows import Row, rows_batch
from rltt.rollout.engine import EXTRA_WEIGHTS, RolloutEngine
from rltt.rollout.params import SamplingParams, check_prompts, stop_token_set
from rltt.rollout.rollout_batch import RolloutBatch, RolloutStats, join_schedules
from rltt.rollout.sampler import RowRandom


class NativeEngine(RolloutEngine):
    """Generation with a `LoopedForCausalLM` in the engine's process (CPU or GPU).

    The engine uses ``model`` in place (dtype and device as they are); loading the tensors of
    that same model (a learner training it in place) copies nothing. ``extra_weights`` holds the
    learner's `EXTRA_WEIGHTS` it was last given (the learned loop weights), as served. Its batches
    carry the full pass record (``replayable``).

    ``chunk_rows``: at most this many rows per batch of passes (`chunks`; a prompt's ``n`` rows stay
    together, so a chunk holds at least one prompt); None runs each call as one batch.

    ``cuda_graphs`` (``rollout.cuda_graphs``; None: on with CUDA): passes padded to bucketed item
    counts, their pieces between attention calls captured as CUDA graphs and replayed
    (`rltt.rollout.buckets`). ``buckets`` (None: as ``cuda_graphs``): the bucketed passes without
    capture — on CPU they run eagerly, bit for bit the unbucketed passes' values.

    ``attention`` (``rollout.attention``): ``sdpa`` (default) or ``triton`` — one Triton launch per
    layer reading the cache slots in place (`rltt.rollout.attention`); recorded in each batch's
    `Schedule.attention`, which `replay_logprobs` follows. Needs Triton, and CUDA or Triton's interpreter.
    ``continuous`` (``rollout.continuous_batching``, the default): with ``chunk_rows`` below a call's
    rows, the rows share ``chunk_rows`` slots of one executor and a row of the next prompts takes a slot
    as soon as a row finishes (`rltt.rollout.admission.Continuous`); False: chunks one after another.
    Either record replays bit for bit. A call of at most ``chunk_rows`` rows seats every row at once.

    Both ``cuda_graphs``/``buckets`` and ``attention`` are resolved once, here, into the engine's
    `PassSetup` (``setup``), which every executor it makes receives; a replay that should run the passes as they ran takes ``setup.buckets``.
    """

    replayable = True

    def __init__(self, model: LoopedForCausalLM, chunk_rows: int | None = None, cuda_graphs: bool | None = None,
                 buckets: bool | None = None, attention: str = DEFAULT_ATTENTION, continuous: bool = True):
        if not isinstance(model, LoopedForCausalLM):
            raise RlttError(f"NativeEngine needs a LoopedForCausalLM, got {type(model).__name__}")
        if chunk_rows is not None and (not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool)
                                       or chunk_rows < 1):
            raise RlttError(f"NativeEngine: chunk_rows must be a positive int or None, got {chunk_rows!r}")
        if not isinstance(continuous, bool):
            raise RlttError(f"NativeEngine: continuous must be true or false, got {continuous!r}")
        self.model = model.eval()
        self.chunk_rows = chunk_rows
        self.continuous = continuous
        self.weights_version = 0
        self.extra_weights: dict[str, torch.Tensor] = {}
        # a one-line error now, not at the first pass
        self.setup = PassSetup.of(attention, model.lm_head.weight.device, pass_buckets(model, cuda_graphs, buckets))

    @property
    def buckets(self):
        """The engine's bucketed passes (`rltt.rollout.buckets.PassBuckets`), None when unbucketed."""
        return self.setup.buckets

    @buckets.setter
    def buckets(self, buckets) -> None:
        """Another set of buckets (a capture emulated on CPU, `rltt.rollout.graph_emulation`): every later
        executor of this engine runs its passes through them."""
        self.setup = replace(self.setup, buckets=buckets)

    @property
    def attention(self) -> str:
        """The name of the engine's attention implementation (``rollout.attention``)."""
        return self.setup.attention.name

    @torch.no_grad()
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into the model in place: every tensor of its state dict, or — a model
        with LoRA adapters (`rltt.model.adapters`) — the adapter tensors alone (the frozen base is
        already here)."""
        own = self.model.state_dict()
        unknown = sorted(set(tensors) - set(own) - set(EXTRA_WEIGHTS))
        adapters = {k for k in own if is_adapter(k)}
        if adapters and adapters <= set(tensors) and not any(k in tensors for k in own if k not in adapters):
            own = {k: own[k] for k in adapters}  # an adapter-only update
        missing = sorted(set(own) - set(tensors))
        if unknown or missing:
            raise RlttError(f"NativeEngine.load_weights: unexpected tensors {unknown[:3]}, missing {missing[:3]}")
        for name, target in own.items():
            source = tensors[name]
            if source.data_ptr() != target.data_ptr():  # the model's own tensor (shared): nothing to copy
                target.copy_(source)
        self.extra_weights = {k: v.detach().clone() for k, v in tensors.items() if k in EXTRA_WEIGHTS}
        self.weights_version = int(version)

    def chunks(self, num_prompts: int, n: int) -> list[tuple[int, int]]:
        """The ``(first, end)`` prompt ranges one call runs as separate batches: whole prompts (a
        prompt's ``n`` rows share its prefill), at most ``chunk_rows // n`` of them — at least one —
        per chunk; one chunk of every prompt without ``chunk_rows``."""
        per = num_prompts if self.chunk_rows is None else max(1, self.chunk_rows // n)
        return [(a, min(a + per, num_prompts)) for a in range(0, num_prompts, per)]

    def open_turns(self, prompts: list[list[int]], params: SamplingParams, max_tokens: int):
        """Multi-turn sessions that keep each row's KV cache and decode state between turns and
        prefill only what was appended (`rltt.rollout.continuation`), one chunk of prompts at a time."""
        return native_turns(self, prompts, params, max_tokens)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions per prompt on the decode loop (class docstring: continuous
        slots, or chunks of whole prompts each with a KV cache for its own rows and positions only).
        Every row keeps the random key the whole call gives it, so it draws the same numbers however
        the rows share passes (what that changes is rounding, docs/design.md §2.7), and the record
        replays bit for bit."""
        start_time = time.perf_counter()
        cfg = self.model.config
        T = cfg.num_loops
        params.validate(T, cfg.vocab_size)
        prompts = check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)
        params.check_prompt_seeds(len(prompts))
        policy = params.exit_policy if params.exit_policy is not None else self.model.exit_policy()  # parsed already
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        n = params.n
        random = RowRandom(seed, self.model.lm_head.weight.device, len(prompts) * n, params.prompt_seeds, n)
        stops = stop_token_set(params, cfg)

        num_rows = len(prompts) * n
        bound = self.chunk_rows if self.chunk_rows is not None else num_rows
        if self.continuous and bound < num_rows:  # one loop of ``chunk_rows`` slots, rows admitted as slots free
            loop = DecodeLoop(self.model, bound, _width(prompts, params, cfg), params, policy, random, stops,
                              self.setup)
            runs = [loop.run(Continuous(prompts, n, bound), [params.max_new_tokens] * num_rows)]
            chunks = [(0, len(prompts))]
        else:  # chunks of whole prompts, one after another, each a loop of its own rows (freed when it ends)
            chunks = self.chunks(len(prompts), n)
            runs = []
            for k, (first, end) in enumerate(chunks):
                part = prompts[first:end]
                loop = DecodeLoop(self.model, len(part) * n, _width(part, params, cfg), params, policy,
                                  random.take(first * n, end * n), stops, self.setup)
                prefill = seat_all(loop, part, n)
                runs.append(loop.run(SeatAll(waiting=k + 1 < len(chunks)), [params.max_new_tokens] * len(part) * n,
                                     prefill, bound))
        return self._batch(prompts, runs, chunks, replace(params, seed=seed), start_time)

    def _batch(self, prompts: list[list[int]], runs: list[LoopRun], chunks: list[tuple[int, int]],
               params: SamplingParams, start_time: float) -> RolloutBatch:
        """The call's `RolloutBatch` from its loops' runs (one per chunk, in row order)."""
        cfg, n = self.model.config, params.n
        rows: list[Row] = [row for run in runs for row in run.rows]
        stats = [run.stats for run in runs]
        run_stats = stats[0] if len(stats) == 1 else RolloutStats.join(stats, serial=True, wall_time=0.0)
        schedule = join_schedules([run.schedule for run in runs], [(b - a) * n for a, b in chunks])
        batch = rows_batch(prompts, [i for i in range(len(prompts)) for _ in range(n)], rows, schedule=schedule,
                           params=params, stats=run_stats, num_loops=cfg.num_loops,
                           dtype=self.model.lm_head.weight.dtype, pad_id=cfg.pad_token_id or 0)
        run_stats.wall_time = time.perf_counter() - start_time
        return batch


def _width(prompts: list[list[int]], params: SamplingParams, cfg) -> int:
    """Positions per slot of a loop over ``prompts`` (`kv_positions`)."""
    return kv_positions(max(len(p) for p in prompts), params, cfg.max_position_embeddings)
