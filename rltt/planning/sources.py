"""Where a plan's inputs come from: the model's config.json (no weights) and the device memory.

``model.path``:

- ``quickstart``: the cached quickstart model's config.json when it is built, else the config
  ``recipes/pretrain-tiny.yaml`` would build (its ``model.config`` with the tokenizer's
  ``vocab_size``) — nothing is built;
- a local directory: its config.json (a folder holding only config.json is enough);
- a hub id: config.json from the Hugging Face cache, else fetched alone (no weights).

Device memory: a GPU's total memory (``torch.cuda``), or ``--gpu-memory`` GiB; on CPU the
machine's available memory (psutil when installed, else ``MemAvailable`` of /proc/meminfo).
"""

from __future__ import annotations

from pathlib import Path

from rltt.errors import RlttError
from rltt.model.model_source import read_config

from rltt.telemetry.schema import GIB  # noqa: F401 - the CLI's unit, read from here


read_config_json = read_config  # the one reader of a model's config.json (`rltt.model.model_source`)


def quickstart_config() -> tuple[dict, str]:
    """The quickstart model's config (see the module docstring) and where it came from."""
    from rltt.lm_training.quickstart_model import RECIPE, quickstart_info

    info = quickstart_info()
    model = Path(info["model"]) if info and info.get("model") else None
    if model is not None and (model / "config.json").is_file():
        return read_config_json(model), f"the cached quickstart model ({model})"
    from rltt.lm_training.pretraining import load_pretrain_recipe

    recipe = load_pretrain_recipe(RECIPE, [])
    fields = dict(recipe.model.config)
    fields["vocab_size"] = max(recipe.tokenizer.vocab_size, int(fields.get("vocab_size", 0)))
    return {"model_type": "rltt_looped", **fields}, f"{RECIPE.name}'s model.config (not built yet)"


def hub_config(repo: str) -> dict:
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(repo, "config.json")
        path = cached if isinstance(cached, str) else hf_hub_download(repo, "config.json")
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, ...
        raise RlttError(f"model.path: {repo!r} is not a local directory and its config.json could not be read "
                        f"({type(exc).__name__}); pass model.path=DIR (a folder holding its config.json is enough)"
                        ) from None
    return read_config_json(Path(path).parent)


def model_config(model_path: str) -> tuple[dict, str]:
    """``(config.json contents, where from)`` for a recipe's ``model.path``."""
    if model_path == "quickstart":
        return quickstart_config()
    local = Path(model_path).expanduser()
    if local.exists():
        return read_config_json(local), str(local / "config.json")
    return hub_config(model_path), f"the hub's {model_path}/config.json"


def available_cpu_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RlttError("cannot read the available memory (no psutil, no MemAvailable in /proc/meminfo)")


def gpu_bytes(index: int = 0) -> int | None:
    """Total memory of CUDA device ``index``; None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(index).total_memory)
