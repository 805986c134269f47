"""``rltt plan RECIPE.yaml [key=value ...] [--gpus N] [--gpu-memory GiB] [--cpu] [--json]``: whether a
train recipe fits the device, before anything loads.

Reads the model's config.json only (`rltt.planning.sources`), plans the per-device memory of the
rollout and learner phases and the rollout chunk (`rltt.planning.plan_run`) and prints the
table (or, with ``--json``, one JSON object). Exit 0 when it fits; 2 with one line on stderr
naming the recipe keys to change when it does not.

Device: ``--cpu`` or ``model.device: cpu`` plan against the machine's available memory; a GPU
plan uses ``--gpu-memory`` GiB per device, else the GPU's total memory (without a GPU,
``--gpu-memory`` is required for ``model.device: cuda``; ``auto`` then plans for the CPU it
would run on).
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="will a train recipe fit? per-device memory of every component, the rollout chunk, a verdict",
        description="Plans the memory of `rltt train RECIPE.yaml` from the model's config.json alone: weights, "
                    "reference, optimizer, gradients, activations, rollout KV; exit 0 when it fits, 2 (with the "
                    "recipe keys to change) when it does not.")
    parser.add_argument("recipe", metavar="RECIPE.yaml", help="train recipe (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, as rltt train takes them (e.g. model.path=/models/Ouro-1.4B)")
    parser.add_argument("--gpus", type=int, default=1, metavar="N", help="data-parallel ranks (default 1)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                        help="memory per GPU in GiB (default: the GPU's own; required without a GPU)")
    parser.add_argument("--cpu", action="store_true", help="plan a CPU run against the available memory")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.set_defaults(func=run)


def _load(args):
    """The recipe and the device to plan for (``cuda`` | ``cpu``)."""
    from rltt.errors import RlttError
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning.memory_plan import recipe_device

    if args.gpus < 1:
        raise RlttError(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpu_memory is not None and not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        raise RlttError(f"--gpu-memory must be a positive number of GiB, got {args.gpu_memory}")
    if args.cpu and args.gpu_memory is not None:
        raise RlttError("--cpu and --gpu-memory exclude each other")
    # model.device=cuda needs no usable CUDA here: the plan is for a GPU of --gpu-memory GiB
    recipe = load_train_recipe(args.recipe, args.overrides)
    device = recipe_device(recipe)
    if args.cpu:
        device = "cpu"
    elif args.gpu_memory is not None:
        device = "cuda"
    return recipe, device


def _device_bytes(args, device: str, placement: str) -> tuple[int, str | None]:
    from rltt.errors import RlttError
    from rltt.planning.sources import GIB, available_cpu_bytes, gpu_bytes

    if device == "cpu":
        note = None if args.cpu or placement == "cpu" else \
            "model.device=auto runs on this machine's CPU (no GPU here); pass --gpu-memory GiB to plan for a GPU"
        return available_cpu_bytes(), note
    if args.gpu_memory is not None:
        return int(args.gpu_memory * GIB), None
    index = int(placement.partition(":")[2] or 0) if placement.startswith("cuda") else 0
    total = gpu_bytes(index)
    if total is None:
        raise RlttError(f"model.device={placement!r} but no usable GPU here: pass --gpu-memory GiB to plan for a "
                        "GPU, or --cpu")
    return total, None


def run(args: argparse.Namespace) -> int:
    from rltt.planning import plan_run
    from rltt.planning.plan_table import format_plan
    from rltt.planning.sources import model_config

    recipe, device = _load(args)
    config, source = model_config(recipe.model.path)
    device_bytes, device_note = _device_bytes(args, device, recipe.model.device)
    plan = plan_run(recipe, config, device_bytes, gpus=args.gpus, device=device)
    plan.notes.insert(0, f"model config: {source}")
    if device_note:
        plan.notes.append(device_note)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(format_plan(plan, title=f"rltt plan: {args.recipe}"))
    if not plan.fits:
        print(f"rltt plan: {plan.problem}", file=sys.stderr)
        return 2
    return 0
