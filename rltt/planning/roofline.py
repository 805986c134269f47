"""The roofline of a rollout: the least time a device could take for the work a `generate` call did.

A decode pass streams the shared block's weights from memory once, whatever its number of items,
and each item reads its row's keys and values at that loop step; a pass's arithmetic grows with its
items. So a call's time is at least the larger of

    memory  = bytes / bandwidth,   bytes = passes · W_block + steps · W_head + row_passes · C · KV_slot
    compute = FLOPs / peak,        FLOPs = entries · 2 · P_block + tokens · 2 · V · d
                                           + row_passes · 4 · C · q · L

where ``passes`` are the call's serial passes (measured: the schedule and the batch's slowest row
decide them), ``W_block`` the L layers' weights (L · P_layer · bytes), ``W_head`` the LM head's
(V · d · bytes, read once per sampling step; ``steps``: the longest row's new tokens),
``row_passes`` the passes summed over rows, ``C`` the mean key positions a row attends
(prompt + half its new tokens), ``KV_slot`` one position's keys and values in the L layers of one
step (L · 2 · Hkv · D · bytes), ``entries`` the (token, step) entries computed (prompt and deferred
ones included), ``P_block`` the L layers' matmul parameters and ``q`` the query width. The bound in
tokens/s is ``tokens / max(memory, compute)`` and a measured figure's *fraction* is that bound's
time over the measured time. Norms, the exit gate, embeddings' gathers and KV writes are left out:
the bound stays a lower bound on time.

Device figures: the vendors' data-sheet memory bandwidth and dense bf16 tensor peak (no sparsity),
keyed by the name `torch.cuda.get_device_name` reports (`device_spec`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rltt.planning.shapes import ModelShape

TB = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """A device's data-sheet figures: ``bandwidth`` bytes/s of its memory, ``bf16_flops`` dense bf16
    tensor FLOP/s."""

    name: str
    bandwidth: float
    bf16_flops: float


#: (words the device name must contain, its figures); the first entry whose words all appear wins, so
#: the more specific names come first
DEVICES: tuple[tuple[frozenset, DeviceSpec], ...] = tuple((frozenset(words.split()), spec) for words, spec in (
    ("h100 pcie", DeviceSpec("H100 PCIe", 2.0 * TB, 756 * TB)),
    ("h100 nvl", DeviceSpec("H100 NVL", 3.9 * TB, 835 * TB)),
    ("h100", DeviceSpec("H100 SXM", 3.35 * TB, 989 * TB)),
    ("h200 nvl", DeviceSpec("H200 NVL", 4.8 * TB, 835 * TB)),
    ("h200", DeviceSpec("H200", 4.8 * TB, 989 * TB)),
    ("gh200", DeviceSpec("GH200", 4.0 * TB, 989 * TB)),
    ("b200", DeviceSpec("B200", 8.0 * TB, 2250 * TB)),
    ("a100 pcie 80gb", DeviceSpec("A100 PCIe 80GB", 1.935 * TB, 312 * TB)),
    ("a100 pcie", DeviceSpec("A100 PCIe 40GB", 1.555 * TB, 312 * TB)),
    ("a100 40gb", DeviceSpec("A100 SXM 40GB", 1.555 * TB, 312 * TB)),
    ("a100", DeviceSpec("A100 SXM 80GB", 2.039 * TB, 312 * TB)),
    ("l40s", DeviceSpec("L40S", 0.864 * TB, 362 * TB)),
    ("l40", DeviceSpec("L40", 0.864 * TB, 181 * TB)),
    ("l4", DeviceSpec("L4", 0.3 * TB, 121 * TB)),
    ("a10", DeviceSpec("A10", 0.6 * TB, 125 * TB)),
))


def device_spec(name: str) -> DeviceSpec | None:
    """The figures of the device ``name`` (``torch.cuda.get_device_name``'s text, e.g. "NVIDIA H100 80GB
    HBM3", or a table name such as "H100 PCIe"); None for a device the table does not know (a CPU)."""
    words = set(re.split(r"[\s\-_]+", name.lower()))
    for need, spec in DEVICES:
        if need <= words:
            return spec
    return None


@dataclass(frozen=True)
class RolloutWork:
    """What one `generate` call did (its `RolloutStats` and lengths): ``passes`` serial passes,
    ``row_passes`` passes summed over rows, ``entries`` (token, step) entries computed, ``tokens``
    new tokens, ``steps`` the longest row's new tokens, ``context`` mean key positions attended."""

    passes: int
    row_passes: int
    entries: int
    tokens: int
    steps: int
    context: float

    @staticmethod
    def of(stats, prompt_len: int, new_tokens: int) -> "RolloutWork":
        """From a call's `RolloutStats` (``row_passes`` counted) at prompt length ``prompt_len`` and
        at most ``new_tokens`` new tokens per row."""
        return RolloutWork(passes=int(stats.passes), row_passes=int(stats.row_passes.sum()),
                           entries=int(stats.entries_computed), tokens=int(stats.tokens), steps=new_tokens,
                           context=prompt_len + new_tokens / 2)


@dataclass(frozen=True)
class Roofline:
    """The bound of one call's work on one device (see the module docstring)."""

    bytes: float
    flops: float
    memory_s: float
    compute_s: float
    tokens: int

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def limit(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def fraction(self, seconds: float) -> float:
        """The share of the bound a call reached that took ``seconds``."""
        return self.seconds / seconds


def block_matmul_parameters(shape: ModelShape) -> int:
    """The L layers' projection parameters (what a pass multiplies each item by)."""
    return shape.layers * sum(i * o for i, o in shape.projections().values())


def rollout_roofline(shape: ModelShape, dtype_bytes: int, work: RolloutWork, spec: DeviceSpec) -> Roofline:
    """The least time ``spec`` could take for ``work`` on a model of ``shape`` held in ``dtype_bytes``."""
    block_bytes = shape.layers * shape.layer_parameters() * dtype_bytes
    head_bytes = shape.vocab * shape.hidden * dtype_bytes
    kv_slot = shape.layers * 2 * shape.kv_dim * dtype_bytes
    nbytes = work.passes * block_bytes + work.steps * head_bytes + work.row_passes * work.context * kv_slot
    flops = (work.entries * 2 * block_matmul_parameters(shape) + work.tokens * 2 * shape.vocab * shape.hidden
             + work.row_passes * 4 * work.context * shape.q_dim * shape.layers)
    return Roofline(bytes=nbytes, flops=flops, memory_s=nbytes / spec.bandwidth, compute_s=flops / spec.bf16_flops,
                    tokens=work.tokens)
