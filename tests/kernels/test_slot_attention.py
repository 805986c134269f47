"""rltt.kernels.slot_attention: one launch of attention over cache slots read in place, against its
plain-torch reference and against SDPA over gathered keys, on CPU under Triton's interpreter.

Shapes are tiny (the interpreter runs every program in numpy). The interpreter's key block is
`BLOCK_N["cpu"]` = 16 keys, so key lengths of 1, 15, 16, 17, 33 cross block edges."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from rltt.kernels.slot_attention import BLOCK_N, slot_attention, slot_attention_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpret")

TOL = {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def cache(steps, rows, hkv, max_len, d, dtype, seed=0):
    """Key/value slot views (T·R, Hkv, max_len, D) of a (T, R, Hkv, max_len, D) cache, as the engine's."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(steps, rows, hkv, max_len, d, generator=gen).to(dtype)
    values = torch.randn(steps, rows, hkv, max_len, d, generator=gen).to(dtype)
    return keys.flatten(0, 1), values.flatten(0, 1)


def queries(n, hq, d, dtype, seed=1):
    return torch.randn(n, hq, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sdpa_gathered(q, key_slots, value_slots, slot, qpos, scale):
    """What the engine's SDPA path computes: each item's slot gathered, one query per item, a causal mask."""
    n, hq, d = q.shape
    n_rep = hq // key_slots.shape[1]
    key_len = int(qpos.max()) + 1
    keys = key_slots[:, :, :key_len].index_select(0, slot).repeat_interleave(n_rep, dim=1)
    values = value_slots[:, :, :key_len].index_select(0, slot).repeat_interleave(n_rep, dim=1)
    mask = (torch.arange(key_len)[None, :] <= qpos[:, None])[:, None, None, :]  # (N, 1, 1, K)
    return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, scale=scale)[:, :, 0]


def entries(spec, rows):
    """Items of a pass from ``(step, row, start, end)`` entries: slots and positions, entry by entry."""
    slot = [(t - 1) * rows + r for t, r, s, e in spec for _ in range(s, e + 1)]
    qpos = [p for _, _, s, e in spec for p in range(s, e + 1)]
    return torch.tensor(slot), torch.tensor(qpos)


# a depth-mixed pass: single-token decode entries at steps 1-3, a multi-token entry (prefill) crossing
# a block edge, a pending entry, and an entry at position 0 (one key)
MIXED = [(1, 0, 16, 16), (2, 1, 0, 0), (3, 2, 14, 18), (2, 0, 32, 32), (1, 3, 5, 7), (3, 3, 15, 15)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 8), (2, 2, 8), (3, 1, 12)])  # GQA, MHA, GQA with D not a power of 2
def test_matches_reference_and_sdpa(dtype, hq, hkv, d):
    T, R, max_len = 3, 4, 36
    key_slots, value_slots = cache(T, R, hkv, max_len, d, dtype)
    slot, qpos = entries(MIXED, R)
    q = queries(len(slot), hq, d, dtype)
    scale = d ** -0.5
    out = slot_attention(q, key_slots, value_slots, slot, qpos, scale)
    ref = slot_attention_reference(q, key_slots, value_slots, slot, qpos, scale)
    assert out.shape == (len(slot), hq, d) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if dtype != torch.float16:  # CPU SDPA in fp16 is not the engine's case (fp32, bf16 models)
        torch.testing.assert_close(out, sdpa_gathered(q, key_slots, value_slots, slot, qpos, scale), **TOL[dtype])


def test_first_position_reads_one_key():
    """qpos = 0: the output is the value at key 0 of the item's slot (softmax over one key)."""
    key_slots, value_slots = cache(2, 2, 1, 8, 4, torch.float32)
    slot = torch.tensor([0, 3])
    out = slot_attention(queries(2, 2, 4, torch.float32), key_slots, value_slots, slot, torch.tensor([0, 0]), 1.0)
    torch.testing.assert_close(out, value_slots[slot, :, 0][:, [0, 0]], atol=0, rtol=0)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 33])
def test_key_lengths_across_block_edges(length):
    key_slots, value_slots = cache(1, 2, 2, 40, 8, torch.float32)
    slot, qpos = torch.tensor([1]), torch.tensor([length - 1])
    q = queries(1, 4, 8, torch.float32)
    out = slot_attention(q, key_slots, value_slots, slot, qpos, 0.5)
    ref = slot_attention_reference(q, key_slots, value_slots, slot, qpos, 0.5)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_block_size_changes_rounding_only():
    key_slots, value_slots = cache(3, 4, 2, 36, 8, torch.float32)
    slot, qpos = entries(MIXED, 4)
    q = queries(len(slot), 4, 8, torch.float32)
    a = slot_attention(q, key_slots, value_slots, slot, qpos, 0.3, block_n=16)
    b = slot_attention(q, key_slots, value_slots, slot, qpos, 0.3, block_n=32)
    torch.testing.assert_close(a, b, **TOL[torch.float32])
    assert BLOCK_N["cpu"] == 16  # the tests' key lengths cross this block's edges


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_and_independent_of_the_other_items(dtype):
    """Two calls give the same bits; an item's output is the same computed alone or with others (in any
    order), so padding or regrouping a pass changes no item's value."""
    key_slots, value_slots = cache(3, 4, 2, 36, 8, dtype)
    slot, qpos = entries(MIXED, 4)
    q = queries(len(slot), 4, 8, dtype)
    first = slot_attention(q, key_slots, value_slots, slot, qpos, 0.3)
    assert torch.equal(first, slot_attention(q, key_slots, value_slots, slot, qpos, 0.3))
    order = torch.randperm(len(slot), generator=torch.Generator().manual_seed(3))
    assert torch.equal(slot_attention(q[order], key_slots, value_slots, slot[order], qpos[order], 0.3), first[order])
    alone = slot_attention(q[4:5], key_slots, value_slots, slot[4:5], qpos[4:5], 0.3)
    assert torch.equal(alone, first[4:5])


def test_strided_inputs():
    """q as the engine hands it (a view of (N, H, 1, D) rows) and a non-contiguous cache view."""
    big_k, big_v = cache(3, 4, 2, 36, 16, torch.float32)
    key_slots, value_slots = big_k[..., :8], big_v[..., :8]  # every other half row: D stride 1, row stride 16
    slot, qpos = entries(MIXED, 4)
    q = queries(len(slot), 8, 8, torch.float32)[:, ::2]  # head stride 16
    assert not q.is_contiguous() and not key_slots.is_contiguous()
    out = slot_attention(q, key_slots, value_slots, slot, qpos, 0.3)
    torch.testing.assert_close(out, slot_attention_reference(q.contiguous(), key_slots.contiguous(),
                                                             value_slots.contiguous(), slot, qpos, 0.3),
                               **TOL[torch.float32])


def test_empty_pass_and_bad_shapes():
    key_slots, value_slots = cache(1, 2, 2, 8, 4, torch.float32)
    empty = torch.zeros(0, dtype=torch.long)
    assert slot_attention(queries(0, 4, 4, torch.float32), key_slots, value_slots, empty, empty, 1.0).shape == (0, 4, 4)
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="heads"):  # 3 query heads over 2 key heads
        slot_attention(queries(1, 3, 4, torch.float32), key_slots, value_slots, one, one, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        slot_attention(queries(1, 4, 4, torch.bfloat16), key_slots, value_slots, one, one, 1.0)
    with pytest.raises(ValueError, match="integer"):
        slot_attention(queries(1, 4, 4, torch.float32), key_slots, value_slots, one.float(), one, 1.0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_passes(data):
    hkv = data.draw(st.integers(1, 2))
    hq = hkv * data.draw(st.integers(1, 3))
    d = data.draw(st.sampled_from([4, 6, 8]))
    T, R = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    max_len = data.draw(st.integers(1, 24))
    n = data.draw(st.integers(1, 6))
    slot = torch.tensor(data.draw(st.lists(st.integers(0, T * R - 1), min_size=n, max_size=n)))
    qpos = torch.tensor(data.draw(st.lists(st.integers(0, max_len - 1), min_size=n, max_size=n)))
    seed = data.draw(st.integers(0, 2**16))
    key_slots, value_slots = cache(T, R, hkv, max_len, d, torch.float32, seed)
    q = queries(n, hq, d, torch.float32, seed + 1)
    out = slot_attention(q, key_slots, value_slots, slot, qpos, d ** -0.5)
    torch.testing.assert_close(out, slot_attention_reference(q, key_slots, value_slots, slot, qpos, d ** -0.5),
                               **TOL[torch.float32])


#: the kernels compiled ahead of time: (name, function, constexprs, argument types after the tensors'
#: dtype is substituted for "t")
def _aot_cases(sa):
    attention_types = ["*t"] * 3 + ["*i64", "*i64", "*t", "*i64", "*i64", "i32", "fp32"] + ["i32"] * 16
    # q, k, v, slot, qpos, out, table, count, layer, scale, 14 strides, head_dim, n_rep
    write_types = ["*t", "*t", "*i64", "*i64", "*i64", "*i64", "i32"] + ["i32"] * 7
    # k, v, slot, qpos, table, count, layer, 6 strides, head_dim
    return [("attention", sa._slot_attention_kernel, dict(BLOCK_N=sa.BLOCK_N["cuda"], BLOCK_D=128, CACHE_TABLE=False),
             attention_types),
            ("attention-table", sa._slot_attention_kernel,
             dict(BLOCK_N=sa.BLOCK_N["cuda"], BLOCK_D=128, CACHE_TABLE=True), attention_types),
            ("write-table", sa._slot_write_kernel, dict(BLOCK_D=128), write_types)]


def compile_for_gpus() -> dict:
    """Compile the kernels ahead of time for sm_80 and sm_90 in bf16, fp16 and fp32 with the CUDA block
    size and head dim 128 (run in a child process without the interpreter): the slot attention as an
    eager pass launches it and as a captured pass does (the cache through its table, `CACHE_TABLE`),
    and the captured pass's key/value write."""
    import triton
    from triton.backends.compiler import GPUTarget

    from rltt.kernels import slot_attention as sa

    out = {}
    for name, kernel, cfg, types in _aot_cases(sa):
        for arch in (80, 90):
            for t in ("bf16", "fp16", "fp32"):
                fn = triton.jit(kernel)
                signature = dict(zip([a for a in fn.arg_names if a not in cfg], [x.replace("t", t) if x == "*t" else x
                                                                                 for x in types]))
                signature.update({k: "constexpr" for k in cfg})
                aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                           if signature[a].startswith("*")}
                try:
                    compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs=cfg, attrs=aligned),
                                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
                    out[f"{name}-sm{arch}-{t}"] = {"elf": compiled.asm["cubin"][:4] == b"\x7fELF",
                                                   "shared": compiled.metadata.shared}
                except Exception as exc:  # noqa: BLE001 - reported per case
                    out[f"{name}-sm{arch}-{t}"] = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    return out


def test_compiles_for_gpus(tmp_path):
    """What can be checked without a GPU: the kernels compile to a cubin for A100 and H100/H200 in every
    model dtype (tests/kernels/test_triton_aot.py does the same for the log-prob kernels)."""
    import json
    import os
    import subprocess
    import sys

    from tests.kernels.test_triton_aot import ROOT, missing_backend

    reason = missing_backend()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = ("import json; from tests.kernels.test_slot_attention import compile_for_gpus; "
            "print('RESULTS', json.dumps(compile_for_gpus()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))[len("RESULTS "):])
    assert len(got) == 18  # 3 kernels (`_aot_cases`) x 2 architectures x 3 dtypes
    for case, result in got.items():
        assert "error" not in result and result["elf"], (case, result)
