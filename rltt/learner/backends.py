"""Optimisation backends behind one small interface: plain PyTorch AdamW (fp32 master weights
and fp32 gradient sums for a 16-bit module), or DeepSpeed ZeRO 0–3.

A backend owns the optimizer (and, for DeepSpeed, the engine). One optimizer step is
``backward(loss)`` for each of ``accumulation`` micro-batches (losses already weighted to
sum to the batch loss), then ``step(losses)``, which clips, updates, advances the LR schedule
and returns the gradient norms before clipping and the reason the update was skipped (None
when it was applied).

The non-finite guard (`rltt.runtime.guard`): a non-finite loss (``losses``: this rank's
micro-batch losses) or gradient skips the update — the weights and the optimizer state stay
bitwise as they were, the gradients are dropped and the LR schedule does not advance.
Under DeepSpeed every rank reaches the same decision: the loss verdict is all-reduced, and a
non-finite global gradient norm is DeepSpeed's own (all-reduced) overflow verdict, read back
with ``was_step_applied``. ``full_state_dict(module)`` gives a module's full
tensors (gathered when ZeRO-3 partitions them: a collective), ``save`` / ``load`` the
optimizer state (DeepSpeed: every rank its shard, into the same directory).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltt.errors import RlttError
from rltt.runtime import guard
from rltt.telemetry import grad_norms

if TYPE_CHECKING:
    from rltt.learner.settings import LearnerConfig


class _Backend:
    """Shared LR schedule (linear warmup, then constant) and checkpoint of the update count."""

    optimizer: Any
    cfg: LearnerConfig
    updates: int = 0

    def _apply_lr(self) -> None:
        warmup = self.cfg.warmup_steps
        factor = 1.0 if warmup <= 0 else min(1.0, (self.updates + 1) / warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * factor

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    #: parameters are partitioned across ranks (ZeRO-3): full tensors need a gather
    partitioned: bool = False
    #: trains the module it is given in place, in ``learner.dtype`` (the learner casts it first);
    #: False: the backend wraps the module and handles the dtype itself
    in_place: bool = False
    #: averages gradients over the launcher's ranks (a torchrun run is data-parallel)
    data_parallel: bool = False

    @staticmethod
    def partitions(cfg: LearnerConfig) -> bool:
        """Whether ``cfg`` partitions the parameters across ranks."""
        return False

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return module.state_dict()

    # -- what an update changed of the weights the engines receive (``sync/changed_frac``) -------
    #: elements of each trained tensor `watch` keeps (evenly strided; every element of a smaller tensor): at
    #: most 256 values (1 KB) a tensor whatever its size — about 220 KB for Ouro-1.4B's tensors, too small for
    #: the memory plan to show; the fraction of a larger tensor is estimated from them (its standard error
    #: at most 0.5/√256 ≈ 0.03 a tensor, less over many)
    WATCH_SAMPLE = 256
    _watched: torch.dtype | None = None  # the engines' dtype while an update is watched
    _before: dict[str, torch.Tensor] | None = None  # each trained tensor's sample before it, in that dtype

    def _held_trained(self) -> dict[str, torch.Tensor]:
        """The trained tensors this rank holds, by name (ZeRO-3: its partitions)."""
        return {name: p for name, p in self.module.named_parameters() if p.requires_grad}

    def _sum_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` summed over the ranks that partition the trained tensors (1 rank: itself)."""
        return counts

    @classmethod
    def _sample(cls, t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1)
        return flat[:: max(1, -(-flat.numel() // cls.WATCH_SAMPLE))]

    def watch(self, dtype: torch.dtype, steps: int) -> None:
        """Start counting the trained elements whose value in ``dtype`` (the engines') the coming update
        changes: of each trained tensor this rank holds, `WATCH_SAMPLE` evenly strided elements (all of a
        smaller one) kept in ``dtype`` until `changed_fraction`."""
        self._watched = dtype
        self._before = {name: self._sample(t).to(dtype, copy=True) for name, t in self._held_trained().items()}

    @torch.no_grad()
    def changed_fraction(self) -> float:
        """The fraction of the trained elements whose value in the watched dtype differs from before
        `watch`: each tensor's sampled share of changed elements weighted by its size (exact for tensors
        of at most `WATCH_SAMPLE` elements; every rank's partitions, a collective under ZeRO-3); ends
        the watch."""
        if self._before is None:
            return 0.0
        changed, total = 0.0, 0
        for name, t in self._held_trained().items():
            now, before = self._sample(t).to(self._watched), self._before[name]
            if before.numel():
                changed += float((now != before).sum()) / before.numel() * t.numel()
            total += t.numel()
        self._watched, self._before = None, None
        counts = self._sum_ranks(torch.tensor([changed, float(total)], dtype=torch.float64))
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0


class _Masters(torch.nn.Module):
    """The fp32 master copies of a module's trained parameters, under the module's parameter names:
    what `grad_norms` and `guard.check` read (the fp32 gradients, named as on the module)."""

    def __init__(self, named: dict[str, torch.nn.Parameter]):
        super().__init__()
        self.named = named

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from ((prefix + name, p) for name, p in self.named.items())


#: the parameter attribute holding the gradient hook of the torch backend that trains it
_MASTER_HOOK = "_rltt_master_hook"


class TorchBackend(_Backend):
    """AdamW + linear warmup + global-norm clipping on a plain module, on one process.

    An fp32 module is trained directly (AdamW on its parameters, gradients summed in ``.grad``).
    A module with 16-bit trained parameters (``learner.dtype: bf16``, or a bf16 ``model.dtype``)
    is trained in mixed precision: every trained parameter has an fp32 master copy (``masters``,
    by parameter name); a post-accumulate-grad hook adds each micro-batch's 16-bit gradient into
    the master's fp32 ``.grad`` and frees it, so the micro-batch gradients are summed in fp32;
    the non-finite guard, the gradient norms, clipping and AdamW (its moments fp32) work on the
    masters, and after each update the module's weights are the masters rounded to their dtype.
    ``save`` writes the masters beside the optimizer state, so a resume continues from them.

    Not data-parallel: under torchrun (WORLD_SIZE > 1) or with several Ray learners the recipe is
    refused (`rltt.runtime.distributed.ranks_from_env`); nothing here all-reduces gradients.
    """

    name = "torch"
    in_place = True

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, accumulation: int = 1,
                 run_dir: Path | None = None):
        self.module = self.forward_model = model
        self.cfg = cfg
        trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self._trained = trained
        #: name -> fp32 master of the trained parameter of that name; None: an fp32 module, trained directly
        self.masters: dict[str, torch.nn.Parameter] | None = None
        # a parameter trained by a new backend (a rebuilt learner, whatever wraps it) sums into this
        # backend's masters only
        for p in trained.values():
            handle = getattr(p, _MASTER_HOOK, None)
            if handle is not None:
                handle.remove()
                delattr(p, _MASTER_HOOK)
        if any(p.dtype != torch.float32 for p in trained.values()):
            self.masters = {name: torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
                            for name, p in trained.items()}
            for name, p in trained.items():
                setattr(p, _MASTER_HOOK, p.register_post_accumulate_grad_hook(self._accumulator(self.masters[name])))
            self._master_view = _Masters(self.masters)
            params = list(self.masters.values())
        else:
            params = list(trained.values())
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)

    @staticmethod
    def _accumulator(master: torch.nn.Parameter):
        def accumulate(p: torch.Tensor) -> None:  # after autograd wrote this micro-batch's gradient to p.grad
            if master.grad is None:
                master.grad = p.grad.to(torch.float32, copy=True)
            else:
                master.grad.add_(p.grad)  # in fp32: the 16-bit operand is widened exactly
            p.grad = None

        return accumulate

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def held_gradients(self) -> dict[str, torch.Tensor | None]:
        """The gradient summed since the last step, by trained parameter name (the fp32 masters'
        under mixed precision; None: none yet)."""
        source = self.masters if self.masters is not None else self._trained
        return {name: p.grad for name, p in source.items()}

    def step(self, losses=()) -> tuple[dict[str, float], str | None]:
        """Clip and update, or skip when a loss in ``losses`` or a gradient is not finite:
        ``(gradient norms before clipping, skip reason or None)``."""
        params = self.module if self.masters is None else self._master_view
        norms = grad_norms(params)
        reason = guard.check(list(losses), params)
        if reason is None:
            if self.cfg.grad_clip and self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params.parameters(), self.cfg.grad_clip)
            self._apply_lr()
            self.optimizer.step()
            if self.masters is not None:
                self._round_masters_into_module(self.updates)
            self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norms, reason

    @torch.no_grad()
    def _round_masters_into_module(self, update: int) -> None:
        """The masters rounded into the module's 16-bit weights as ``learner.rounding`` says
        (`rltt.learner.rounding`), keyed by the ``update`` that produced them."""
        from rltt.learner.rounding import ROUNDINGS

        rounding = ROUNDINGS[self.cfg.rounding]
        for index, (name, p) in enumerate(self._trained.items()):
            rounding(p, self.masters[name], update, index)

    def save(self, path: Path) -> None:
        state = {"optimizer": self.optimizer.state_dict(), "updates": self.updates}
        if self.masters is not None:
            state["masters"] = {name: m.detach() for name, m in self.masters.items()}
        torch.save(state, path / "optimizer.pt")

    def load(self, path: Path) -> None:
        """The optimizer state, the update count and (mixed precision) the fp32 masters; called
        after the module's weights were loaded. A checkpoint without masters (written by an fp32
        learner, or before they were saved) rebuilds them from those weights, and says so on
        stderr; an fp32 module resumed from a checkpoint with masters takes the masters."""
        from rltt.runtime.checkpoint import load_state_file

        file = path / "optimizer.pt"
        state = load_state_file(file)  # weights_only: a crafted pickle cannot run code
        saved = state.get("masters")
        if saved is not None:
            expected = self.masters if self.masters is not None else self._trained
            if set(saved) != set(expected) or any(saved[k].shape != expected[k].shape for k in expected):
                raise RlttError(f"{file}: its fp32 master weights do not match the model's trained parameters")
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]
        with torch.no_grad():
            if self.masters is None:
                for name, p in self._trained.items():
                    if saved is not None:
                        p.copy_(saved[name])
                return
            if saved is None:
                print(f"note: {file} holds no fp32 master weights; rebuilding them from the checkpoint's "
                      f"{self._dtypes()} weights", file=sys.stderr)
            for name, m in self.masters.items():
                m.copy_(saved[name] if saved is not None else self._trained[name])
            if saved is not None:  # the weights the last update left, as it rounded them
                self._round_masters_into_module(max(self.updates - 1, 0))

    def _dtypes(self) -> str:
        return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in self._trained.values()}))


#: the file of a run directory holding the exact config rltt passed to ``deepspeed.initialize``
DEEPSPEED_CONFIG_FILE = "deepspeed_config.json"
#: DeepSpeed's default ``reduce_bucket_size`` and ``allgather_bucket_size`` (elements)
DS_BUCKET = 500_000_000


def bucket_elements(parameters: int) -> int:
    """The ZeRO reduce/all-gather bucket rltt asks for, in elements: DeepSpeed's default, or the
    model's parameter count (rounded up to even, as the all-gather bucket must be) when that is
    smaller — ZeRO-2 allocates its reduce bucket at full size at every backward and ZeRO-3 at
    start-up, whatever the model's size."""
    return min(DS_BUCKET, parameters + parameters % 2)


def deepspeed_config(cfg: LearnerConfig, micro_batch_size: int, accumulation: int,
                     parameters: int | None = None) -> dict[str, Any]:
    """The config rltt hands DeepSpeed. A bf16 model accumulates its micro-batch gradients in fp32
    (``data_types.grad_accum_dtype``; DeepSpeed's default is the model's dtype): ZeRO-1 sums them
    in an fp32 buffer (its BF16 optimizer) and all-reduces that sum once per update — in fp32
    (``communication_data_type``), so the sum is not rounded to bf16; ZeRO-2/3 reduce each
    micro-batch's bf16 gradient (across ranks, in bf16) into fp32 gradient partitions. DeepSpeed
    0.19 has no fp32 accumulation for a bf16 model without ZeRO, so `LearnerConfig` refuses
    ZeRO-0 with bf16. With ``parameters`` (the trained parameter count) ZeRO 1-3's buckets are
    `bucket_elements` long."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": cfg.grad_clip or 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": list(cfg.betas), "eps": 1e-8,
                                                   "weight_decay": cfg.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if parameters is not None and cfg.zero_stage >= 1:
        bucket = bucket_elements(parameters)
        config["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    if cfg.dtype == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        if cfg.zero_stage == 1:
            config["communication_data_type"] = "fp32"
    return config


def write_deepspeed_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """``config`` as JSON into ``run_dir/deepspeed_config.json`` (the directory is made)."""
    import json

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / DEEPSPEED_CONFIG_FILE
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def _free_port() -> int:
    """A TCP port the OS reports free on this host (for a one-process group's rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed_if_needed() -> None:
    """Start torch.distributed for DeepSpeed: from torchrun/deepspeed env vars, else a 1-process group."""
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ:  # a one-process group: a fresh port, never one left in the environment
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":  # DeepSpeed's CPU accelerator builds its comm op here: not behind a dead builder's lock
        from rltt.runtime.extension_lock import clear_stale_build_lock

        clear_stale_build_lock("deepspeed_shm_comm")
    deepspeed.init_distributed(dist_backend=backend)


class DeepSpeedBackend(_Backend):
    """DeepSpeed engine (ZeRO stage ``cfg.zero_stage``; CPU → gloo and its CPU accelerator).

    The LR warmup is the same as the torch backend's, so both give the same losses for the
    same seed.
    """

    name = "deepspeed"
    data_parallel = True

    @staticmethod
    def partitions(cfg: LearnerConfig) -> bool:
        return cfg.zero_stage == 3

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, accumulation: int = 1,
                 run_dir: Path | None = None):
        try:
            import deepspeed
        except ImportError:
            raise RlttError("learner.backend: deepspeed is not installed (pip install 'rltt[deepspeed]')") from None
        init_distributed_if_needed()
        self.cfg = cfg
        self.accumulation = accumulation
        params = [p for p in model.parameters() if p.requires_grad]
        ds_config = deepspeed_config(cfg, cfg.micro_batch_size, accumulation, parameters=sum(p.numel() for p in params))
        if run_dir is not None and torch.distributed.get_rank() == 0:  # before DeepSpeed reads (or fails on) it
            write_deepspeed_config(Path(run_dir), ds_config)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params,
                                                                 config=ds_config)
        self.module = self.engine.module
        self.forward_model = self.engine  # forwards go through the engine (ZeRO-3 bookkeeping)
        self.partitioned = self.partitions(cfg)

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s tensors; under ZeRO-3 gathered from every rank's partition (a collective)."""
        if not self.partitioned:
            return module.state_dict()
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def _held_trained(self) -> dict[str, torch.Tensor]:
        """ZeRO-3: this rank's partition of each trained parameter (its padding included: never
        trained, so never changed); ZeRO 0-2: the full trained parameters, the same on every rank."""
        params = {name: p for name, p in self.module.named_parameters() if p.requires_grad}
        return {name: p.ds_tensor for name, p in params.items()} if self.partitioned else params

    def _sum_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        if not self.partitioned or torch.distributed.get_world_size() == 1:
            return counts
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        total = counts.to(device)
        torch.distributed.all_reduce(total)
        return total.cpu()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # micro-batch losses are already weighted
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # counts the micro-step; the update happens at the boundary

    def _loss_verdict(self, losses) -> str | None:
        """Why this step must be skipped, from this rank's losses and (ZeRO 0: every rank holds the
        all-reduced gradients) its gradients — the same verdict on every rank: a rank with a bad
        loss makes all of them skip (one all-reduce)."""
        local = guard.check(list(losses), self.module if self.cfg.zero_stage == 0 else None)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world == 1:
            return local
        # every rank's verdict (0 fine, 1 loss, 2 gradient) in its slot; the sum is everyone's
        flags = torch.zeros(world)
        if local is not None:
            flags[torch.distributed.get_rank()] = 1.0 if local.startswith("loss") else 2.0
        if torch.distributed.get_backend() == "nccl":
            flags = flags.cuda()
        torch.distributed.all_reduce(flags)
        bad = [(rank, int(code)) for rank, code in enumerate(flags.tolist()) if code]
        if not bad:
            return None
        rank, code = bad[0]
        what = "loss is not finite" if code == 1 else "non-finite gradient"
        return f"{what} on rank {rank}" + (f" ({len(bad)} of {world} ranks)" if len(bad) > 1 else "")

    def _skipped_engine_step(self) -> None:
        """The boundary ``engine.step()`` with the inner optimizer's step disabled: DeepSpeed
        counts the step and drops the gradients, whatever its wrapper does around the inner step
        (clipping, its own overflow check, copying master weights back) leaves the weights and
        the optimizer state as they were."""
        inner = self.engine.basic_optimizer if getattr(self.engine, "basic_optimizer", None) is not None \
            else self.optimizer
        inner.step = lambda *args, **kwargs: None  # an instance attribute shadows the method
        try:
            self.engine.step()
        finally:
            del inner.step

    def step(self, losses=()) -> tuple[dict[str, float], str | None]:
        """The boundary step (see the module docstring): ``(gradient norms, skip reason or None)``."""
        norms = grad_norms(self.module) if self.cfg.zero_stage == 0 else {}
        reason = self._loss_verdict(losses)
        self._apply_lr()
        if reason is not None:
            self._skipped_engine_step()
            return norms, reason
        self.engine.step()
        total = self.engine.get_global_grad_norm()
        if not self.engine.was_step_applied():  # DeepSpeed found the global gradient norm non-finite
            return norms, f"non-finite gradient (global norm {float(total) if total is not None else 'inf'})"
        self.updates += 1
        if total is not None and math.isfinite(float(total)):
            norms.setdefault("grad_norm/total", float(total))
        return norms, None

    # Collective: every rank calls save/load (each writes/reads its ZeRO shard). The tag must not be
    # "latest": DeepSpeed writes a file of that name beside the tag's directory.
    TAG = "state"

    # A module with frozen parameters (a LoRA learner's base) is saved without them: the checkpoint
    # holds what is trained, the learner rebuilds the base from the recipe's model.
    def _frozen(self) -> bool:
        return any(not p.requires_grad for p in self.module.parameters())

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path / "deepspeed"), tag=self.TAG, client_state={"updates": self.updates},
                                    save_latest=False, exclude_frozen_parameters=self._frozen())

    def load(self, path: Path) -> None:
        _, client = self.engine.load_checkpoint(str(path / "deepspeed"), tag=self.TAG,
                                                load_module_strict=not self._frozen())
        self.updates = int((client or {}).get("updates", 0))


#: ``learner.backend`` -> its class; the recipe's allowed values are this table's keys
BACKENDS: dict[str, type[_Backend]] = {"torch": TorchBackend, "deepspeed": DeepSpeedBackend}


def make_backend(model: torch.nn.Module, cfg: LearnerConfig, accumulation: int = 1, run_dir: Path | None = None):
    """The ``cfg.backend`` backend; with ``run_dir`` a DeepSpeed backend writes the config it passes
    DeepSpeed to ``run_dir/deepspeed_config.json`` (rank 0)."""
    return BACKENDS[cfg.backend](model, cfg, accumulation, run_dir=run_dir)
