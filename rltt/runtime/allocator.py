"""PyTorch's CUDA caching allocator as rltt runs it: expandable segments unless the user chose.

The memory plan (`rltt.planning`) counts allocated bytes; what the device holds is what the caching
allocator reserves. With fixed-size segments (PyTorch's default) a phase whose tensor shapes vary —
the learner's packed micro-batches, the rollout's growing KV views — leaves cached blocks that later
requests of other sizes cannot reuse: on an H200 (2026-12-04, bench/gpu_check_deepspeed.py, card80,
recipes/gsm8k.yaml at Ouro-1.4B's shape) the learner at micro-batch 4 reserved 74.75 GiB for an
allocated peak of 46.50 GiB, 28 GiB above it. Expandable segments map more memory into one segment
as it grows, so freed space is reusable by requests of any size.

`configure` sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when the variable is unset,
before anything initialises CUDA (`rltt.cli.main` calls it first); a value the user set — any
value, ``expandable_segments:False`` included — is kept. Child processes inherit it: DeepSpeed and
torchrun ranks run `rltt.cli.main` themselves, worker processes copy the environment, and Ray actors
get it through `rltt.orchestration.ray.cluster.FORWARDED_ENV`. Measured in the second H200 run
(2026-12-04b, bench/gpu_check_deepspeed.py, card80, both settings per phase): 0.13-5.3 GiB reserved
above the allocated peak with expandable segments, 0.2-9.2 GiB with fixed ones.
"""

from __future__ import annotations

import os
from typing import MutableMapping

ENV = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"


def configure(environ: MutableMapping[str, str] | None = None) -> str:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to `DEFAULT` when it is unset or empty (``environ``: default
    ``os.environ``); return the setting in force. Call it before CUDA initialises: the allocator
    reads the variable once."""
    env = os.environ if environ is None else environ
    if not env.get(ENV, "").strip():
        env[ENV] = DEFAULT
    return env[ENV]


def expandable(setting: str | None) -> bool:
    """Whether a ``PYTORCH_CUDA_ALLOC_CONF`` value turns expandable segments on (the last
    ``expandable_segments`` option wins, as in PyTorch's parser)."""
    on = False
    for option in (setting or "").split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip() == "True"
    return on
