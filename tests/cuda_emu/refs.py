"""refs.py: the references the emulated kernels are checked against. None of this shares code
with the kernels: weight dequantisation is gguf-py's (llama.cpp's numpy port of ggml's reference
code), everything else is numpy written from the operators' definitions, mostly in float64.
Where a kernel promises a particular f32 rounding (Q8_1 quantisation, RoPE's angles) the
reference follows that written specification, not the kernel's code.
"""

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import quants

# name -> (gguf type, elements per block, bytes per block, offsets of the f16 fields: the scale
# first, then the min / dmin where the format has one)
QTYPES = {
    "q4_0": (GT.Q4_0, 32, 18, (0,)),
    "q4_1": (GT.Q4_1, 32, 20, (0, 2)),
    "q5_0": (GT.Q5_0, 32, 22, (0,)),
    "q5_1": (GT.Q5_1, 32, 24, (0, 2)),
    "q8_0": (GT.Q8_0, 32, 34, (0,)),
    "q2_K": (GT.Q2_K, 256, 84, (80, 82)),
    "q3_K": (GT.Q3_K, 256, 110, (108,)),
    "q4_K": (GT.Q4_K, 256, 144, (0, 2)),
    "q5_K": (GT.Q5_K, 256, 176, (0, 2)),
    "q6_K": (GT.Q6_K, 256, 210, (208,)),
    "iq4_nl": (GT.IQ4_NL, 32, 18, (0,)),
    "iq4_xs": (GT.IQ4_XS, 256, 136, (0,)),
}


def random_blocks(rng, t, n_blocks):
    """n_blocks random blocks of type t, [n_blocks, block bytes] u8: every quant and packed-scale
    bit random, the f16 scale fields finite (|d| in 0.002..0.05, either sign; mins +-0.05)."""
    _, _, nbytes, offs = QTYPES[t]
    b = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    d = rng.uniform(0.002, 0.05, n_blocks) * rng.choice([-1.0, 1.0], n_blocks)
    fields = [d] + [rng.uniform(-0.05, 0.05, n_blocks) for _ in offs[1:]]
    for o, v in zip(offs, fields):
        b[:, o:o + 2] = v.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b


def dequantize(t, blocks, rows):
    """gguf-py's dequantisation: [rows, k] f32."""
    return quants.dequantize(blocks.reshape(rows, -1), QTYPES[t][0]).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Q8_1 (activations). gguf-py has no Q8_1; this follows ggml's quantize_row_q8_1_ref as written:
# d = amax / 127, id = 1 / d (0 when d is 0), q = round-half-away(x * id) with x * id in f32,
# stored d = f16(d), s = f16(f32(sum q) * d). Block: d, s (f16), 32 x i8.


def quantize_q8_1(x):
    x = np.asarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(x).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    p = (x * idv[:, None]).astype(np.float32).astype(np.float64)
    q = np.clip(np.sign(p) * np.floor(np.abs(p) + 0.5), -128, 127).astype(np.int32)
    s = (q.sum(axis=1).astype(np.float32) * d).astype(np.float32)
    out = np.zeros((x.shape[0], 36), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = s.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 4:] = q.astype(np.int8).view(np.uint8)
    return out


def q8_1_fields(blocks):
    """(d, s, q) of Q8_1 blocks as float64: d, s [n_blocks], q [n_blocks, 32]."""
    blocks = np.ascontiguousarray(blocks).reshape(-1, 36)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64).reshape(-1)
    s = blocks[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(-1)
    q = blocks[:, 4:].copy().view(np.int8).astype(np.float64)
    return d, s, q


# ---------------------------------------------------------------------------------------------
# Matrix-vector products


def mmvq(t, wblocks, rows, k, act, min_from_s=True):
    """y[t, r] = sum_i W[r, i] * A[t, i] in float64, with W gguf-dequantised and A the values of
    the Q8_1 activation blocks `act`; and the magnitude sum |W| |A| the error is measured
    against. Q4_1 / Q5_1 take their min term from the blocks' f16 s, as ggml's vec_dot does (the
    mmvq kernels promise that), so the reference replaces sum(d * q) by s there unless
    `min_from_s` is false (the mmq kernels sum the quants exactly)."""
    w = dequantize(t, wblocks, rows).astype(np.float64)      # [rows, k]
    d, s, q = q8_1_fields(act)
    a = (q * d[:, None]).reshape(-1, k)                        # [n_tok, k]
    ref = a @ w.T                                              # [n_tok, rows]
    mag = np.abs(a) @ np.abs(w).T
    if min_from_s and t in ("q4_1", "q5_1"):
        nb = k // 32
        m = wblocks.reshape(rows, nb, -1)[:, :, 2:4].copy().view(np.float16)
        m = m.astype(np.float64).reshape(rows, nb)              # [rows, nb]
        exact = (d * q.sum(axis=1)).reshape(-1, nb)            # [n_tok, nb]
        ref = ref + (s.reshape(-1, nb) - exact) @ m.T
    return ref, mag


# ---------------------------------------------------------------------------------------------
# Operators


def rms_norm(x, w, eps):
    """x / sqrt(mean(x^2) + eps) * w per row, float64. x: [rows, n]."""
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * w.astype(np.float64)


def rope(x, n_tok, n_heads, head_dim, n_dims, pos0, freq_base, freq_scale, neox, freq_factors):
    """RoPE as ops.cu specifies it: theta_i = (pos0 + t) * freq_scale * theta_scale^i built by i
    successive f32 multiplies from theta_scale = f32(freq_base ^ (-2 / n_dims)) (the power in
    double), divided (f32) by freq_factors[i]; cos / sin of that f32 angle in double; the
    rotation in float64. x: [n_tok, n_heads, head_dim] f32."""
    out = x.astype(np.float64).reshape(n_tok, n_heads, head_dim).copy()
    half = n_dims // 2
    ts = np.float32(np.float64(freq_base) ** (-2.0 / n_dims))
    idx = np.arange(half)
    i0, i1 = (idx, idx + half) if neox else (2 * idx, 2 * idx + 1)
    for t in range(n_tok):
        theta = np.float32(np.float32(pos0 + t) * np.float32(freq_scale))
        ang = np.empty(half, np.float32)
        for i in range(half):
            ang[i] = theta / np.float32(freq_factors[i]) if freq_factors is not None else theta
            theta = np.float32(theta * ts)
        c, s = np.cos(ang.astype(np.float64)), np.sin(ang.astype(np.float64))
        x0, x1 = out[t][:, i0].copy(), out[t][:, i1].copy()
        out[t][:, i0] = x0 * c - x1 * s
        out[t][:, i1] = x0 * s + x1 * c
    return out


def silu_mul(g, u):
    g = g.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * u.astype(np.float64)


def attention(q, kc, vc, n_tok, n_head, n_head_kv, head_dim, pos0, scale):
    """Causal grouped-query attention in float64: token t (position pos0 + t) attends to
    positions 0..=pos0 + t; head h reads KV head h / (n_head / n_head_kv); q rounded to f16 first
    (as the kernel and the CPU path do). q: [n_tok, n_head * head_dim] f32; kc, vc: [n_ctx,
    n_head_kv * head_dim] f16. Returns [n_tok, n_head, head_dim]."""
    k = kc.astype(np.float64).reshape(-1, n_head_kv, head_dim)
    v = vc.astype(np.float64).reshape(-1, n_head_kv, head_dim)
    qh = q.astype(np.float16).astype(np.float64).reshape(n_tok, n_head, head_dim)
    out = np.zeros((n_tok, n_head, head_dim))
    group = n_head // n_head_kv
    for t in range(n_tok):
        n_kv = pos0 + t + 1
        for h in range(n_head):
            s = k[:n_kv, h // group] @ qh[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[:n_kv, h // group]
    return out
