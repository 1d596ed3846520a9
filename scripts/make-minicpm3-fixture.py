#!/usr/bin/env python3
"""Writes a tiny random-weight minicpm3 GGUF and an independent float64 numpy reference of its forward pass.

Outputs (committed; rerun to regenerate, the RNG is seeded so the bytes are reproducible):
  tests/data/minicpm3/tiny-minicpm3.gguf   F32 weights, minicpm3 metadata as llama.cpp's converter writes it
                                           (q_lora_rank, kv_lora_rank, key_length = nope + rope,
                                           rope.dimension_count = rope, no value_length: the value head is
                                           n_embd / n_head), LongRoPE factors, a 128-token byte-level vocabulary
  tests/data/minicpm3/reference.json       prompt, prefill logits (every position, full vocabulary) with the
                                           short and with the long RoPE factors, the greedy continuation with its
                                           top-2 margins, and the settings used

The reference is written from the architecture's definition (Hugging Face's MiniCPM3 model and llama.cpp's
minicpm3 graph), not from oato's code. Multi-head latent attention with a RoPE key shared by the heads:
  x = token_embd[tok] * scale_emb                                          (scale_emb = 12)
  per layer:  h = rmsnorm(x) * attn_norm
              q  = Wq_b (rmsnorm(Wq_a h) * attn_q_a_norm)                   [n_head, nope + rope]
              c, k_pe = split(Wkv_a_mqa h, [kv_lora, rope])
              k_nope, v = split(Wkv_b (rmsnorm(c) * attn_kv_a_norm), per head [nope, v])
              NeoX RoPE on q's last `rope` dimensions of each head and on k_pe, pairs (i, i + rope/2),
              angle pos * base^(-2i/rope) / factor_i (rope_factors_short while the context is within the
              training context, rope_factors_long beyond it)
              k = [k_nope, k_pe] per head; softmax(q.k / sqrt(nope + rope)) v per head
              x += (Wo att) * scale_depth / sqrt(n_layer)                    (scale_depth = 1.4)
              h = rmsnorm(x) * ffn_norm;  x += (Wdown (silu(Wgate h) * Wup h)) * scale_depth / sqrt(n_layer)
  logits = Woutput (rmsnorm(x) * output_norm * dim_model_base / n_embd)     (dim_model_base = 256)
The three scales are constants of llama.cpp's graph (src/models/minicpm3.cpp), not GGUF metadata.

Checks of the reference itself (asserted here): the GGUF read back with gguf.GGUFReader has the names, dims
and values written; the batched pass equals a token-by-token pass with an explicit KV cache written as plain
loops (within 1e-12); NeoX RoPE as pairwise rotation equals the same rotation as complex multiplication.

It also records, as "f16_emulated", the pass with oato's CPU attention rounding (keys and values stored as
f16, the query and the softmax weights rounded to f16), and, as "sensitivity", how far the logits move under
plausible engine bugs, so a test can show its tolerance is far below what an error would cost.
"""

import importlib.util
import math
import os
import sys

import numpy as np

import gguf

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT_DIR = os.path.join(ROOT, "tests", "data", "minicpm3")
GGUF_PATH = os.path.join(OUT_DIR, "tiny-minicpm3.gguf")
REF_PATH = os.path.join(OUT_DIR, "reference.json")

# The helpers both fixtures share (RMS norm, RoPE angles, SiLU, f16 rounding, JSON, the vocabulary).
_spec = importlib.util.spec_from_file_location("qwen2_fixture", os.path.join(ROOT, "scripts", "make-qwen2-fixture.py"))
Q2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(Q2)
rms_norm, silu, sig = Q2.rms_norm, Q2.silu, Q2.sig

SETTINGS = {
    "seed": 20251123,
    "arch": "minicpm3",
    "n_vocab": 128,
    "n_embd": 64,
    "n_layer": 3,
    "n_head": 4,
    "n_head_kv": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_ff": 64,
    "n_ctx_train": 256,
    "rope_freq_base": 10000.0,
    "rms_eps": 1e-5,
    "scale_emb": 12.0,
    "scale_depth": 1.4,
    "dim_model_base": 256,
    "weight_scale": 0.1,
    "norm_scale": 0.1,
    "n_greedy": 8,
}
PROMPT = [11, 22, 33, 44, 55, 66, 77]


def make_weights(s):
    """Every tensor as float32, in numpy layout: a matrix mapping n_in to n_out has shape (n_out, n_in)."""
    rng = np.random.default_rng(s["seed"])
    e, nh, ff, nv = s["n_embd"], s["n_head"], s["n_ff"], s["n_vocab"]
    nope, rope, v = s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"]
    ql, kl = s["q_lora_rank"], s["kv_lora_rank"]
    ws, ns = s["weight_scale"], s["norm_scale"]

    def mat(n_out, n_in, scale=ws):
        return (rng.standard_normal((n_out, n_in)) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + rng.standard_normal(n) * ns).astype(np.float32)

    t = {}
    # Embedding rows of size ~1/12: the graph multiplies them by scale_emb.
    t["token_embd.weight"] = mat(nv, e, 1.0 / 12.0)
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(e)
        t[p + "attn_q_a.weight"] = mat(ql, e)
        t[p + "attn_q_a_norm.weight"] = norm(ql)
        t[p + "attn_q_b.weight"] = mat(nh * (nope + rope), ql, 0.2)
        t[p + "attn_kv_a_mqa.weight"] = mat(kl + rope, e)
        t[p + "attn_kv_a_norm.weight"] = norm(kl)
        t[p + "attn_kv_b.weight"] = mat(nh * (nope + v), kl, 0.2)
        t[p + "attn_output.weight"] = mat(e, nh * v, 0.1)
        t[p + "ffn_norm.weight"] = norm(e)
        t[p + "ffn_gate.weight"] = mat(ff, e)
        t[p + "ffn_up.weight"] = mat(ff, e)
        t[p + "ffn_down.weight"] = mat(e, ff, 0.3)
    t["output_norm.weight"] = norm(e)
    t["output.weight"] = mat(nv, e, 0.015)
    # LongRoPE factors, one per rotated pair (the converter writes them as f32 [rope / 2]).
    t["rope_factors_long.weight"] = (1.0 + 15.0 * rng.random(rope // 2)).astype(np.float32)
    t["rope_factors_short.weight"] = (1.0 + 0.5 * rng.random(rope // 2)).astype(np.float32)
    return t


def write_gguf(s, t, path):
    w = gguf.GGUFWriter(path, s["arch"])
    w.add_name("tiny-minicpm3 (random weights, oato test fixture)")
    # The keys llama.cpp's converter (conversion/minicpm.py, MiniCPM3Model) writes.
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(s["n_ctx_train"])
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head"])
    w.add_layer_norm_rms_eps(s["rms_eps"])
    w.add_vocab_size(s["n_vocab"])
    w.add_q_lora_rank(s["q_lora_rank"])
    w.add_kv_lora_rank(s["kv_lora_rank"])
    w.add_key_length(s["qk_nope_head_dim"] + s["qk_rope_head_dim"])
    w.add_rope_dimension_count(s["qk_rope_head_dim"])
    Q2.finish_gguf(w, s, t, "default")


# ------------------------------------------------------------------------------------ float64 reference


def rope_neox(x, pos, base, factors):
    """x: [T, n_heads, d]; rotates pairs (i, i + d/2) by pos * base^(-2i/d) / factors[i]."""
    d = x.shape[-1]
    a = (Q2.rope_angles(pos, d, base) / factors)[:, None, :]
    c, s = np.cos(a), np.sin(a)
    x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


def rope_neox_complex(x, pos, base, factors):
    d = x.shape[-1]
    z = x[..., : d // 2] + 1j * x[..., d // 2 :]
    z = z * np.exp(1j * Q2.rope_angles(pos, d, base) / factors)[:, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


class Ref(Q2.Ref):
    """The model in float64 (weights are the float32 values written to the file, widened exactly); the
    batched and token-by-token passes are qwen2's, with this architecture's q/k/v, block tail, embedding
    and head. `bug` names a plausible engine mistake to simulate (for the sensitivity figures), else None."""

    def __init__(self, s, t, factors="short", bug=None):
        super().__init__(s, t)
        self.factors = self.t[f"rope_factors_{factors}.weight"]
        self.bug = bug
        self.res_scale = 1.0 if bug == "no_residual_scale" else s["scale_depth"] / math.sqrt(s["n_layer"])

    def qkv(self, il, x, pos):
        """q, k: [T, n_head, nope + rope]; v: [T, n_head, v]."""
        s, t, p = self.s, self.t, f"blk.{il}."
        n, nh = len(pos), s["n_head"]
        nope, rope, kl = s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["kv_lora_rank"]
        eps, base = s["rms_eps"], s["rope_freq_base"]
        h = rms_norm(x, t[p + "attn_norm.weight"], eps)
        q = rms_norm(h @ t[p + "attn_q_a.weight"].T, t[p + "attn_q_a_norm.weight"], eps)
        q = (q @ t[p + "attn_q_b.weight"].T).reshape(n, nh, nope + rope)
        kva = h @ t[p + "attn_kv_a_mqa.weight"].T
        c, k_pe = kva[:, :kl], kva[:, kl:]
        kv = (rms_norm(c, t[p + "attn_kv_a_norm.weight"], eps) @ t[p + "attn_kv_b.weight"].T).reshape(n, nh, -1)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        if self.bug == "rope_leading_dims":
            # RoPE on each head's first `rope` dimensions instead of its last.
            q = np.concatenate([rope_neox(q[..., :rope], pos, base, self.factors), q[..., rope:]], axis=-1)
        else:
            q = np.concatenate([q[..., :nope], rope_neox(q[..., nope:], pos, base, self.factors)], axis=-1)
        k_pe = rope_neox(k_pe[:, None, :], pos, base, self.factors)
        k = np.concatenate([k_nope, np.broadcast_to(k_pe, (n, nh, rope))], axis=-1)
        return q, k, v

    def block_tail(self, il, x, att):
        s, t, p = self.s, self.t, f"blk.{il}."
        x = x + (att.reshape(len(x), -1) @ t[p + "attn_output.weight"].T) * self.res_scale
        h = rms_norm(x, t[p + "ffn_norm.weight"], s["rms_eps"])
        g = silu(h @ t[p + "ffn_gate.weight"].T) * (h @ t[p + "ffn_up.weight"].T)
        return x + (g @ t[p + "ffn_down.weight"].T) * self.res_scale

    def embed(self, tokens):
        scale = 1.0 if self.bug == "no_embedding_scale" else self.s["scale_emb"]
        return self.t["token_embd.weight"][np.asarray(tokens)] * scale

    def head(self, x):
        s, t = self.s, self.t
        scale = 1.0 if self.bug == "no_logit_scale" else s["dim_model_base"] / s["n_embd"]
        return (rms_norm(x, t["output_norm.weight"], s["rms_eps"]) * scale) @ t["output.weight"].T


# ------------------------------------------------------------------------------------------------- main


def main():
    s = SETTINGS
    os.makedirs(OUT_DIR, exist_ok=True)
    t = make_weights(s)
    write_gguf(s, t, GGUF_PATH)
    Q2.check_gguf_roundtrip(GGUF_PATH, t, arch="minicpm3")
    size = os.path.getsize(GGUF_PATH)
    assert size < 400_000, f"{GGUF_PATH} is {size} bytes"

    ref = Ref(s, t)

    xr = np.random.default_rng(1).standard_normal((5, 3, s["qk_rope_head_dim"]))
    rp = np.arange(5) + 3
    f = ref.factors
    err = np.abs(rope_neox(xr, rp, 1e4, f) - rope_neox_complex(xr, rp, 1e4, f)).max()
    assert err < 1e-12, f"NeoX RoPE: pairwise and complex forms differ by {err}"

    logits, greedy, runner_up, margins, _ = Q2.prefill_and_greedy(ref, PROMPT, s["n_greedy"])

    f16 = ref.forward_batched(PROMPT, f16=True)
    f16_dev = float(np.abs(f16 - logits).max())
    long_ref = Ref(s, t, factors="long")
    long_logits = long_ref.forward_batched(PROMPT)
    long_f16 = long_ref.forward_batched(PROMPT, f16=True)
    sens = {bug: Ref(s, t, bug=bug).forward_batched(PROMPT) for bug in
            ["no_embedding_scale", "no_residual_scale", "no_logit_scale", "rope_leading_dims"]}
    sens["long_factors_for_short_context"] = long_logits
    sens = {k: float(np.abs(v - logits).max()) for k, v in sens.items()}

    rows = lambda a: [[sig(v) for v in row] for row in a]
    out = {
        "about": "float64 numpy reference for tests/data/minicpm3/tiny-minicpm3.gguf, by scripts/make-minicpm3-fixture.py",
        "settings": s,
        "prompt": PROMPT,
        "logits": rows(logits),
        "greedy": greedy,
        "greedy_runner_up": runner_up,
        "greedy_margins": [sig(m, 6) for m in margins],
        "f16_emulated": {
            "about": "the prefill with q, k, v and softmax weights rounded to f16, as oato's CPU attention",
            "logits": rows(f16),
            "max_abs_dev_from_exact": sig(f16_dev, 6),
        },
        "long_factors": {
            "about": "the prefill with rope_factors_long (a context longer than n_ctx_train); exact, and f16-emulated",
            "logits": rows(long_logits),
            "f16_logits": rows(long_f16),
        },
    }
    Q2.finish(out, sens, logits, GGUF_PATH, REF_PATH)
    print(f"prompt {PROMPT} -> greedy {greedy}, top-2 margins {[round(m, 4) for m in margins]}")
    print(f"f16 rounding moves the logits by at most {f16_dev:.3e} (prefill)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
