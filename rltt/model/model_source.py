"""What a model source says before any weights load — its folder, its ``config.json``, the loops T
and the positions it has — read in one place (`ModelSource`): the loaders, the recipe checks, the
trainer's prompt-length check, the memory plan and the vLLM engine all ask it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rltt.errors import RlttError

CONFIG_FILE = "config.json"

#: ``model_type`` -> (the config key holding T, its value when absent); any other config holds
#: rltt's ``num_loops`` if it has T at all (a dense model has none: its conversion sets T)
LOOP_KEYS: dict[str, tuple[str, int | None]] = {
    "ouro": ("total_ut_steps", 4),  # as `rltt.model.ouro.ouro_to_loop_config` maps it
}
RLTT_LOOPS = ("num_loops", None)


def read_config(folder: Path, key: str = "model.path") -> dict:
    """The JSON object in ``folder/config.json``; a missing, unreadable or non-object file is a
    one-line `RlttError` starting with ``key``."""
    config = Path(folder) / CONFIG_FILE
    if not config.is_file():
        raise RlttError(f"{key}: no {CONFIG_FILE} in {folder}")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RlttError(f"{key}: {config} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise RlttError(f"{key}: {config} does not hold a JSON object")
    return data


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint folder and its ``config.json`` contents."""

    folder: Path
    config: dict

    @classmethod
    def read(cls, folder: str | Path, key: str = "model.path") -> "ModelSource":
        """The source at ``folder`` (errors as `read_config`, naming ``key``)."""
        folder = Path(folder).expanduser()
        return cls(folder, read_config(folder, key))

    @classmethod
    def local(cls, path: str | Path) -> "ModelSource | None":
        """The source at a local folder with a readable ``config.json``; None for anything else
        (``quickstart`` before it is built, a hub id, a folder without one): not known yet."""
        if str(path) == "quickstart":
            return None
        try:
            return cls.read(path)
        except (RlttError, OSError, ValueError):
            return None

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def num_loops(self) -> int | None:
        """T (rltt's ``num_loops``, Ouro's ``total_ut_steps``); None for a dense model or a value
        that is not a positive int."""
        key, default = LOOP_KEYS.get(self.model_type, RLTT_LOOPS)
        return _positive_int(self.config.get(key, default))

    @property
    def max_positions(self) -> int | None:
        """``max_position_embeddings`` (None when absent or not a positive int)."""
        return _positive_int(self.config.get("max_position_embeddings"))
