"""Learner memory of one micro-batch: the activations autograd saves, and the log-prob kernels'
workspace.

**Activations** — the bytes of the tensors autograd saves in the score forward (what the
backward reads), for n positions of which n_s are scored, b = bytes of the learner's dtype,
d = hidden, q = Hq·D, kv = Hkv·D, F = intermediate, T loops, L layers::

    norm(w, rows)  = 4·w + b·w + 4·rows   # the fp32 upcast x, the normed x before the weight, rstd
    attention      = b·d + b·(2q + 2kv) + 4·Hq   # projections' input; SDPA's q, k, v, out; logsumexp
                     (+ norm(D·Hq, Hq) + norm(D·Hkv, Hkv) with q/k norms)
    mlp            = b·d + 4·b·F                 # projections' input; gate, act(gate), up, act·up
    layer          = n_norms·norm(d, 1) + attention + mlp     (n_norms: 2 pre/post, 4 sandwich/ouro)
    step           = L·layer + norm(d, 1)·[final norm] + b·d·[scalar injection, t > 1]
    per position   = T·step + T·(b·d + 4)  (the stacked h_t the exit gate reads, λ_t)
                     + 8 + 2·D·b + 1        (token ids, the RoPE cos/sin tables, the score mask)
    per scored     = T·b·d + 16·T + 16      (the h_t gathered for the log-prob kernel, its logsumexp,
                                             entropy, targets; the exit-distribution terms)
    activations    = n·per position + n_s·per scored

With an fp32 LM head on a 16-bit learner (``learner.lm_head_dtype: fp32``, b < 4) the head reads
each step's final norm recomputed in fp32 (`rltt.model.modeling.LoopedModel.final_norm_fp32`)::

    per position  += T·(8·d + 4)     (its fp32 upcast and normed x, rstd)
    per scored    += T·(4 − b)·d     (the gathered h_t in fp32)

The attention output needs no copy (SDPA returns it in the (B, S, H, D) layout the output
projection reads). The RMSNorm term above is the composite one (the CPU). On CUDA ``F.rms_norm``
is one fused operator (``_fused_rms_norm``) that saves its input and rstd, not the fp32 upcast, so
the plan counts (``fused_norm``, on with ``model.device: cuda``)::

    norm_cuda(w, rows) = b·w + 4·rows + b·w·[b < 4]   # input, rstd; a 16-bit norm's weight product
                                                       # saves its input too (the weight multiplies
                                                       # after the cast, `rltt.model.layers.RMSNorm`)

At Ouro-1.4B's shape (4 norms a layer) the composite term over-counted the bf16 activations by
2·d bytes per norm call, 3.7 GiB of a micro-batch of 4 rows × (512 + 512) tokens: the H200 run of
2026-12-04 (bench/gpu_check_deepspeed.py, card80) measured 4.0 GiB less than planned. The fp32 LM
head's recomputed final norm (below) keeps the composite term on CUDA too: an upper bound there.

**Activation checkpointing** (``learner.activation_checkpointing``, one checkpoint per (loop,
layer)): each of the T·L layer calls keeps only its input hidden state, and the backward
recomputes one layer at a time. The peak is the first recompute (loop T, layer L): by then the
LM-head backward has released the per-scored tensors and loop T's final norm its own::

    step_ckpt = L·b·d + norm(d, 1)·[final norm] + b·d·[scalar injection, t > 1]
    forward_ckpt = n·(per position with step_ckpt) + n_s·per scored
    activations_ckpt = forward_ckpt + max(0, n·layer − n_s·per scored − n·norm(d, 1)·[final norm])

Measured (the saved tensors plus the recompute's live tensors, sampled after every recomputed
op; ``tests/planning/test_activations.py``) it is within −8 % … +4 % on tiny models, forward_ckpt
alone within 1 %. When the exit gate is differentiated too (the ``mixture`` log-prob) the gate's
stacked states, n·T·(b·d + 4), are released before the recompute as well: not credited, the
estimate is then up to 16 % over on tiny models (less at real sizes, where T·L·b·d dominates).

**Packed scoring** (``learner.pack_sequences``, the default; `rltt.model.packing`): the forward
runs over n = U·P + m·(C − 1) positions for a micro-batch of m rows from U distinct prompts of P
tokens with completions of C (each prompt once; a row's last token is input to nothing), not the
padded m·(P + C). Its attention gathers each call's queries, keys and values into a prefix part
(U rows of P) and a suffix part (m rows whose keys are their prompt then their own suffix), so per
layer call it saves, beyond the padded formula's attention over the same n positions::

    packed_extra = b·q·n                      (the re-gathered output the output projection reads)
                 + 2·b·kv'·(n_k − n)          (keys and values gathered: n_k = U·P + m·(P + C − 1))
    kv' = q when Hkv < Hq (the masked call repeats K and V to every head), else kv

    activations_packed = activations(n, n_s) + T·L·packed_extra
                         (checkpointing: + packed_extra once, in the recomputed layer)

(`RunSettings.learner_positions` gives n, n_s and n_k; the padded forward is planned when packing
is off.)

**After the last loop's backward** — the second candidate for the learner's peak. Every layer of
the shared block is used once per loop step, so autograd sums a parameter's T gradient
contributions in a buffer (`rltt.planning.footprint`: ``loop_gradients``) that exists from the
backward of loop T until that of loop 1. When the backward has gone through loop T every buffer
exists and the activations still held are everything but the per-scored tensors and loop T's
step::

    held = activations − n_s·per scored − n·step − T_packed     (T_packed = L·packed_extra)
    held_ckpt = forward_ckpt − n_s·per scored − n·step_ckpt + n·layer + packed_extra
                (loop T's checkpoint inputs released; loop T − 1's last layer recomputed)

(step includes the scalar injection's b·d when T > 1.) Measured at 320 M parameters (T·L = 48
layer calls, bench/scale.py) this candidate, not the LM head's, is the peak.

**Log-prob kernel workspace** (`rltt.kernels`), M = T·n_s rows, vocabulary chunk
c = `default_chunk_size`\\ (M, V), weight V×d in b_w bytes; the backward is the peak::

    triton (CUDA):  g buffer M·c·b + grad_h M·d·4 + grad_W V·d·b_w + grad_h cast M·d·b
    chunked (CPU):  logits and p 2·M·c·4 + grad_h M·d·4 + fp32 h M·d·4·[b ≠ 4] + fp32 weight chunk
                    c·d·4·[b_w ≠ 4] + grad_W V·d·b_w + grad_h cast M·d·b·[b ≠ 4]
                    + rounded logits M·c·(b_k + 4) under a truncated rollout in b_k = 2 bytes

plus the gradient of the stacked per-step states flowing back, T·n·d·b.
"""

from __future__ import annotations

from rltt.kernels._common import default_chunk_size
from rltt.planning.shapes import ModelShape


def norm_bytes(width: int, rows: int, b: int, fused: bool = False) -> int:
    """Saved by one RMSNorm over ``width`` features in ``rows`` rows (per position); ``fused``:
    CUDA's ``_fused_rms_norm`` (module docstring), else the composite operations."""
    if fused:  # its input and rstd, and (16-bit: weight applied after the cast) the weight product's input
        return b * width * (1 + (b < 4)) + 4 * rows
    return 4 * width + b * width + 4 * rows


def attention_bytes(shape: ModelShape, b: int, fused_norm: bool = False) -> int:
    saved = b * shape.hidden + b * (2 * shape.q_dim + 2 * shape.kv_dim) + 4 * shape.heads
    if shape.qk_norm:
        saved += (norm_bytes(shape.q_dim, shape.heads, b, fused_norm)
                  + norm_bytes(shape.kv_dim, shape.kv_heads, b, fused_norm))
    if shape.lora_rank:
        saved += b * shape.lora_rank * sum(t in shape.lora_targets for t in ("q_proj", "k_proj", "v_proj", "o_proj"))
    return saved


def mlp_bytes(shape: ModelShape, b: int) -> int:
    saved = b * shape.hidden + 4 * b * shape.intermediate
    if shape.lora_rank:
        saved += b * shape.lora_rank * sum(t in shape.lora_targets for t in ("gate_proj", "up_proj", "down_proj"))
    return saved


def layer_bytes(shape: ModelShape, b: int, fused_norm: bool = False) -> int:
    """Saved per position by one call of one decoder layer."""
    return (shape.norms_per_layer * norm_bytes(shape.hidden, 1, b, fused_norm) + attention_bytes(shape, b, fused_norm)
            + mlp_bytes(shape, b))


def _step(shape: ModelShape, b: int, checkpointing: bool, fused_norm: bool = False) -> int:
    """Saved per position by one loop step (its L layer calls and the final norm)."""
    block = shape.layers * (b * shape.hidden if checkpointing else layer_bytes(shape, b, fused_norm))
    return block + norm_bytes(shape.hidden, 1, b, fused_norm) * shape.final_norm


def _per_position(shape: ModelShape, b: int, checkpointing: bool, fp32_readout: bool = False,
                  fused_norm: bool = False) -> int:
    d, T = shape.hidden, shape.loops
    injected = b * d * (T - 1) * shape.injection
    readout = T * (8 * d + 4) if fp32_readout and b < 4 else 0  # composite fp32 norm: an upper bound on CUDA
    return T * _step(shape, b, checkpointing, fused_norm) + injected + T * (b * d + 4) + 8 + 2 * shape.head_dim * b + 1 + readout


def _per_scored(shape: ModelShape, b: int, fp32_readout: bool = False) -> int:
    h = 4 if fp32_readout and b < 4 else b
    return shape.loops * h * shape.hidden + 16 * shape.loops + 16


def packed_attention_extra(shape: ModelShape, b: int, positions: int, key_positions: int) -> int:
    """What one layer call of packed scoring saves beyond the padded formula's attention over the
    same ``positions`` (module docstring): the gathered output, and keys/values gathered for
    ``key_positions``."""
    kv = shape.q_dim if shape.kv_heads < shape.heads else shape.kv_dim
    return b * shape.q_dim * positions + 2 * b * (kv * key_positions - shape.kv_dim * positions)


def activation_bytes(shape: ModelShape, b: int, positions: int, scored: int, checkpointing: bool = False,
                     key_positions: int | None = None, fp32_readout: bool = False, fused_norm: bool = False) -> int:
    """Bytes autograd keeps at its peak for a forward over ``positions`` positions, ``scored`` of
    them scored (see the module docstring); with ``checkpointing`` the first layer recompute
    included, less what the backward released before it. ``key_positions``: packed scoring, the
    keys its attention gathers per layer call (None: the padded forward). ``fp32_readout``: an fp32
    LM head on a 16-bit learner. ``fused_norm``: CUDA's fused RMSNorm (`norm_bytes`)."""
    extra = 0 if key_positions is None else packed_attention_extra(shape, b, positions, key_positions)
    per_scored = _per_scored(shape, b, fp32_readout)
    total = positions * _per_position(shape, b, checkpointing, fp32_readout, fused_norm) + scored * per_scored
    if checkpointing:
        released = scored * per_scored + positions * norm_bytes(shape.hidden, 1, b, fused_norm) * shape.final_norm
        total += max(0, positions * layer_bytes(shape, b, fused_norm) + extra - released)
    else:
        total += shape.loops * shape.layers * extra
    return total


def held_after_last_loop(shape: ModelShape, b: int, positions: int, scored: int, checkpointing: bool = False,
                         key_positions: int | None = None, fp32_readout: bool = False,
                         fused_norm: bool = False) -> int:
    """Activation bytes still held when the backward has gone through loop T (module docstring):
    what the loop-summed gradient buffers of the shared block add to."""
    extra = 0 if key_positions is None else packed_attention_extra(shape, b, positions, key_positions)
    last_step = _step(shape, b, checkpointing, fused_norm) + b * shape.hidden * shape.injection * (shape.loops > 1)
    per_scored = scored * _per_scored(shape, b, fp32_readout)
    forward = positions * _per_position(shape, b, checkpointing, fp32_readout, fused_norm) + per_scored
    if checkpointing:
        return forward - per_scored - positions * last_step + positions * layer_bytes(shape, b, fused_norm) + extra
    return forward + shape.loops * shape.layers * extra - per_scored - positions * last_step - shape.layers * extra


def logits_workspace_bytes(shape: ModelShape, b: int, weight_bytes: int, positions: int, scored: int,
                           impl: str, kept_bytes: int = 4) -> int:
    """Peak extra bytes of the per-loop log-prob kernels' backward (``impl``: triton | chunked),
    plus the gradient of the stacked per-step states (module docstring). ``kept_bytes`` < 4: a
    truncated 16-bit rollout, whose kept set the chunked kernel decides on a rounded copy of the
    chunk's logits (the 16-bit cast and its fp32 copy); Triton rounds in registers."""
    d, V = shape.hidden, shape.vocab
    rows = shape.loops * scored
    chunk = default_chunk_size(rows, V)
    grad_w = V * d * weight_bytes
    if impl == "triton":
        kernel = rows * chunk * b + rows * d * 4 + grad_w + rows * d * b
    else:
        wide = b != 4
        kernel = (2 * rows * chunk * 4 + rows * d * 4 + rows * d * 4 * wide + chunk * d * 4 * (weight_bytes != 4)
                  + grad_w + rows * d * b * wide + rows * chunk * (kept_bytes + 4) * (kept_bytes != 4))
    return kernel + shape.loops * positions * d * b
