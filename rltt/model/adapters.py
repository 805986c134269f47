"""LoRA adapters on a looped model: attach, switch off, merge, measure, export.

One implementation: the adapters live in `rltt.model.layers.StepLinear` (``lora_A`` (n, r, in),
``lora_B`` (n, out, r), n = T with one adapter per loop step, n = 1 shared by all steps), the same
the step-wise pretraining LoRA uses. RL's ``learner.lora`` attaches them to a loaded model
(`attach_adapters`) and writes the choice into the model's config (``lora_rank``, ``lora_alpha``,
``lora_targets``, ``lora_per_loop``, ``lora_dropout``), so a checkpoint saved with adapters loads
back with them.

- `adapters_disabled`: the base model's function, bit for bit (each adapted layer computes its
  plain ``F.linear``): the KL reference of a LoRA run, without a second copy of the weights.
- `merged_state_dict`: the base weights with each shared adapter folded in,
  ``W + scale · B A`` (in fp32, rounded once to W's dtype), without ``lora_*`` names: what an
  engine that cannot apply adapters (vLLM) loads, and what `merge_adapters_` makes of a model.
- `write_peft_adapter`: PEFT's on-disk format (``adapter_config.json`` with ``peft_type: LORA``,
  ``task_type: CAUSAL_LM`` (what ``AutoPeftModelForCausalLM`` asks for) and the base's path;
  ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` (r, in) and
  ``lora_B.weight`` (out, r)). PEFT knows one adapter per module, so per-loop adapters are written
  as one PEFT adapter per loop step, ``loop_<t>/``. `write_peft_state` writes the same from
  adapter tensors alone (what a vLLM engine serving the adapters receives at each update).
- `adapter_norms`: ``lora/*`` telemetry per target group.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from rltt.errors import RlttError
from rltt.model.layers import StepLinear

#: the parameter names an adapter adds to a `StepLinear`
ADAPTER_PARAMS = ("lora_A", "lora_B")
#: the file names of a PEFT adapter folder
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: beside them, what PEFT's config has no field for: shared or per loop, which loop step
RLTT_ADAPTER = "rltt_adapter.json"
#: the folder of a LoRA checkpoint holding its adapters in PEFT's format
ADAPTER_DIR = "adapter"


def is_adapter(name: str) -> bool:
    """Whether a state-dict or parameter name is an adapter tensor."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


@dataclass(frozen=True)
class AdapterSpec:
    """What `attach_adapters` puts on a model: rank r, alpha (scale = alpha / r), the projections
    (names as in `rltt.model.configuration.LORA_TARGETS`), one adapter per loop step or shared, and
    the dropout on the adapters' input while training."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    per_loop: bool = False
    dropout: float = 0.0


def adapted(model: torch.nn.Module) -> Iterator[tuple[str, StepLinear]]:
    """``(module name, layer)`` of every layer holding an adapter."""
    for name, module in model.named_modules():
        if isinstance(module, StepLinear) and module.lora_rank:
            yield name, module


def model_spec(model: torch.nn.Module) -> AdapterSpec | None:
    """The adapters a model's config declares (None without)."""
    c = model.config
    if not c.lora_rank:
        return None
    return AdapterSpec(c.lora_rank, float(c.lora_alpha), tuple(c.lora_targets), bool(c.lora_per_loop),
                       float(c.lora_dropout))


def attach_adapters(model: torch.nn.Module, spec: AdapterSpec, seed: int = 0) -> bool:
    """Give every target projection of ``model`` (a `LoopedForCausalLM`) an adapter, B = 0 (the
    function is unchanged), A drawn from a generator seeded with ``seed`` in module order, so every
    process building the same run draws the same A. A model whose config already declares these
    adapters (a checkpoint saved with them, or a second call) is left as it is: returns False.
    Other adapters already there are a one-line error."""
    have = model_spec(model)
    if have is not None:
        if (have.rank, have.alpha, set(have.targets), have.per_loop) != (spec.rank, float(spec.alpha),
                                                                         set(spec.targets), spec.per_loop):
            raise RlttError(f"learner.lora: the model already holds other LoRA adapters (rank {have.rank}, alpha "
                            f"{have.alpha:g}, targets {list(have.targets)}, per_loop {have.per_loop})")
        for _, layer in adapted(model):  # the dropout is a training setting: the recipe's
            layer.lora_dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else None
        model.config.lora_dropout = float(spec.dropout)
        return False
    generator = torch.Generator().manual_seed(int(seed))
    loops = model.config.num_loops
    for name, module in model.named_modules():
        if isinstance(module, StepLinear) and name.rsplit(".", 1)[-1] in spec.targets:
            module.add_lora(spec.rank, spec.alpha, loops, spec.per_loop, spec.dropout, generator)
    c = model.config
    c.lora_rank, c.lora_alpha, c.lora_targets = spec.rank, float(spec.alpha), list(spec.targets)
    c.lora_per_loop, c.lora_dropout = spec.per_loop, float(spec.dropout)
    return True


def freeze_base(model: torch.nn.Module) -> int:
    """Only the adapters train: every other parameter of ``model`` stops requiring gradients (it
    keeps its dtype). Returns the adapters' parameter count."""
    count = 0
    for name, p in model.named_parameters():
        keep = is_adapter(name)
        p.requires_grad_(keep)
        count += p.numel() if keep else 0
    return count


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Within the block every adapter of ``model`` is off: the base model, bit for bit."""
    layers = [layer for _, layer in adapted(model)]
    before = [layer.lora_enabled for layer in layers]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield model
    finally:
        for layer, was in zip(layers, before):
            layer.lora_enabled = was


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of ``model``'s state dict."""
    return {k: v for k, v in model.state_dict().items() if is_adapter(k)}


def base_identity(model: torch.nn.Module, path: str | None = None) -> dict[str, str]:
    """What names the base of a LoRA model in its checkpoints (`rltt.runtime.checkpoint.BASE_FILE`):
    the directory it was loaded from (``path``, default ``config._name_or_path``), the dtype of its tensors and a
    sha256 over every tensor of its state dict but the adapters — name, dtype, shape and bytes, in
    name order — so a checkpoint is only ever loaded onto the base it was trained on. One pass over
    the base's bytes: computed once per run."""
    import hashlib

    digest, dtypes = hashlib.sha256(), set()
    for name, tensor in sorted((k, v) for k, v in model.state_dict().items() if not is_adapter(k)):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        if data.is_floating_point():
            dtypes.add(str(data.dtype).removeprefix("torch."))
    path = path if path is not None else getattr(model.config, "_name_or_path", "")
    return {"path": str(path or ""), "dtype": "/".join(sorted(dtypes)),
            "sha256": digest.hexdigest()}


def read_peft_state(directory: str | Path, spec: AdapterSpec, num_loops: int) -> dict[str, torch.Tensor]:
    """The adapter tensors (rltt's names and shapes) `write_peft_state` wrote into ``directory``."""
    from safetensors.torch import load_file

    directory = Path(directory)
    parts: dict[str, list[torch.Tensor]] = {}
    for t in range(num_loops if spec.per_loop else 1):
        file = (directory / f"loop_{t + 1}" if spec.per_loop else directory) / PEFT_WEIGHTS
        if not file.is_file():
            raise RlttError(f"{file} is missing: the LoRA checkpoint's adapters")
        for key, value in load_file(str(file)).items():
            parts.setdefault(key.removeprefix("base_model.model.").removesuffix(".weight"), []).append(value)
    return {name: torch.stack(values) for name, values in parts.items()}


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · B A`` of one adapter (A (r, in), B (out, r)), in fp32."""
    return (b.float() @ a.float()) * scale


def merged_state_dict(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """``state`` (a model's full state dict) with each adapter folded into its weight,
    ``W + scale · B A`` computed in fp32 and rounded once to W's dtype, and no adapter names.
    Only shared adapters merge into one weight: per-loop adapters are a one-line error."""
    if not config.lora_rank:
        return dict(state)
    if config.lora_per_loop:
        raise RlttError("learner.lora.per_loop: per-loop adapters differ between loop steps and cannot be merged "
                        "into the one shared weight (use per_loop: false, or an engine that applies them)")
    scale = config.lora_alpha / config.lora_rank
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_A"):
            prefix = key[: -len("lora_A")]
            w = out[prefix + "weight"]
            out[prefix + "weight"] = (w.float() + delta(state[key][0], state[prefix + "lora_B"][0], scale)).to(w.dtype)
    return out


@torch.no_grad()
def merge_adapters_(model: torch.nn.Module) -> torch.nn.Module:
    """Fold ``model``'s shared adapters into its weights in place and remove them (the config says
    ``lora_rank: 0``): a plain model of the adapted function, for export."""
    if not model.config.lora_rank:
        return model
    merged = merged_state_dict(model.state_dict(), model.config)
    for _, layer in adapted(model):
        del layer.lora_A, layer.lora_B
        layer.lora_rank, layer.lora_dropout = 0, None
    model.config.lora_rank = 0
    model.load_state_dict(merged, strict=True)
    return model


def target_group(module_name: str) -> str:
    """The target projection a module name ends with (``q_proj``, …, ``down_proj``)."""
    return module_name.rsplit(".", 1)[-1]


@torch.no_grad()
def adapter_norms(model: torch.nn.Module) -> dict[str, float]:
    """Per target group g: ``lora/A_norm/g`` and ``lora/B_norm/g`` (Frobenius norms over every
    layer's and loop step's A, B) and ``lora/update_norm/g``, the norm of the weight updates
    ``scale · B A`` they make — from r×r products, ‖BA‖² = tr((BᵀB)(AAᵀ)), never an out×in matrix."""
    sums: dict[str, list[float]] = {}
    for name, layer in adapted(model):
        a, b = layer.lora_A.detach().float(), layer.lora_B.detach().float()
        update = torch.einsum("nor,nos->nrs", b, b).mul_(torch.einsum("nri,nsi->nrs", a, a)).sum()
        acc = sums.setdefault(target_group(name), [0.0, 0.0, 0.0])
        acc[0] += float(a.square().sum())
        acc[1] += float(b.square().sum())
        acc[2] += float(update.clamp_min(0)) * layer.lora_scale ** 2
    out = {}
    for group, (a2, b2, u2) in sorted(sums.items()):
        out[f"lora/A_norm/{group}"] = math.sqrt(a2)
        out[f"lora/B_norm/{group}"] = math.sqrt(b2)
        out[f"lora/update_norm/{group}"] = math.sqrt(u2)
    return out


def write_peft_adapter(model: torch.nn.Module, directory: str | Path, base: str = "",
                       state: dict[str, torch.Tensor] | None = None) -> Path:
    """``model``'s adapters in PEFT's format into ``directory`` (module docstring); ``base``: the
    base model's path, recorded as ``base_model_name_or_path``; ``state``: the model's full state
    dict when already gathered (ZeRO-3). Returns the directory."""
    spec = model_spec(model)
    if spec is None:
        raise RlttError("write_peft_adapter: the model holds no LoRA adapters")
    state = adapter_state_dict(model) if state is None else state
    return write_peft_state(state, spec, model.config.num_loops, directory, base)


def write_peft_state(state: dict[str, torch.Tensor], spec: AdapterSpec, num_loops: int, directory: str | Path,
                     base: str = "") -> Path:
    """Adapter tensors (rltt's names, ``lora_A`` (n, r, in) / ``lora_B`` (n, out, r); other names
    are skipped) of adapters ``spec`` in PEFT's format into ``directory``: what `write_peft_adapter`
    writes of a model, and what an engine serving PEFT adapters (vLLM) loads. Returns the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    state = {k: v for k, v in state.items() if is_adapter(k)}
    loops = num_loops if spec.per_loop else 1
    for t in range(loops):
        folder = directory / f"loop_{t + 1}" if spec.per_loop else directory
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for key, value in state.items():
            module, which = key.rsplit(".", 1)
            tensors[f"base_model.model.{module}.{which}.weight"] = value[t].detach().to("cpu").contiguous()
        save_file(tensors, str(folder / PEFT_WEIGHTS))
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": spec.rank,
            "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "target_modules": sorted(spec.targets),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
            "init_lora_weights": True, "modules_to_save": None,
        }
        (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        loop = {"per_loop": spec.per_loop, "loop_step": t + 1 if spec.per_loop else None, "num_loops": num_loops}
        (folder / RLTT_ADAPTER).write_text(json.dumps(loop, indent=2) + "\n")
    return directory
