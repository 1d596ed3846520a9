#!/usr/bin/env python3
"""Writes a tiny random-weight qwen2 GGUF and an independent float64 numpy reference of its forward pass.

Outputs (committed; rerun to regenerate, the RNG is seeded so the bytes are reproducible):
  tests/data/qwen2/tiny-qwen2.gguf   F32 weights, qwen2 metadata, a 128-token byte-level vocabulary
  tests/data/qwen2/reference.json    prompt, prefill logits (every position, full vocabulary), the greedy
                                     continuation with its top-2 margins, and the settings used

The reference is written from the architecture's definition (as in Hugging Face's Qwen2 model and
llama.cpp's qwen2 graph), not from oato's code:
  x = token_embd[tok]
  per layer:  h = rmsnorm(x) * attn_norm;  q, k, v = Wq h + bq, Wk h + bk, Wv h + bv
              NeoX RoPE on q and k: pairs (i, i + d/2), angle pos * base^(-2i/d)
              causal grouped-query attention, query head j reads kv head j // (n_head / n_head_kv),
              softmax(q.k / sqrt(d)) v;  x += Wo att
              h = rmsnorm(x) * ffn_norm;  x += Wdown (silu(Wgate h) * Wup h)
  logits = Woutput (rmsnorm(x) * output_norm)

Checks of the reference itself (asserted here):
  - the GGUF read back with gguf.GGUFReader has the names, ggml dims ([n_in, n_out]) and values written;
  - the batched pass (a [T, T] causally masked score matrix) equals a token-by-token pass with an explicit
    KV cache written as plain loops (within 1e-12);
  - NeoX RoPE as pairwise rotation equals the same rotation as complex multiplication.

It also records, as "f16_emulated", the same pass with the rounding oato's CPU attention does (keys and
values stored as f16, the query and the softmax weights rounded to f16 before their dot products), and,
as "sensitivity", how far the logits move under plausible engine bugs (normal instead of NeoX RoPE, no
q/k/v biases, query head h reading kv head h % n_head_kv), so a test can show its tolerance is far below
what an error would cost.
"""

import json
import math
import os
import sys

import numpy as np

import gguf

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT_DIR = os.path.join(ROOT, "tests", "data", "qwen2")
GGUF_PATH = os.path.join(OUT_DIR, "tiny-qwen2.gguf")
REF_PATH = os.path.join(OUT_DIR, "reference.json")

SETTINGS = {
    "seed": 20250601,
    "arch": "qwen2",
    "n_vocab": 128,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_head_kv": 2,
    "head_dim": 16,
    "n_ff": 96,
    "n_ctx_train": 256,
    "rope_freq_base": 10000.0,
    "rms_eps": 1e-6,
    "weight_scale": 0.1,
    "bias_scale": 0.2,
    "norm_scale": 0.1,
    "n_greedy": 8,
}
# Chosen among a few candidates so that every greedy step's top-2 margin (smallest 0.296) is about a
# hundred times the logit error that f16 attention rounding causes (about 3e-3): the continuation is then
# a strict check, not a coin toss between near-ties.
PROMPT = [10, 20, 30, 40, 50, 60, 70]


# ---------------------------------------------------------------------------------------------- weights


def make_weights(s):
    """Every tensor as float32, in numpy layout: a matrix mapping n_in to n_out has shape (n_out, n_in)."""
    rng = np.random.default_rng(s["seed"])
    e, q, kv, ff, v = s["n_embd"], s["n_head"] * s["head_dim"], s["n_head_kv"] * s["head_dim"], s["n_ff"], s["n_vocab"]
    ws, bs, ns = s["weight_scale"], s["bias_scale"], s["norm_scale"]

    def mat(n_out, n_in, scale=ws):
        return (rng.standard_normal((n_out, n_in)) * scale).astype(np.float32)

    def vec(n, scale):
        return (rng.standard_normal(n) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + rng.standard_normal(n) * ns).astype(np.float32)

    t = {}
    # Embedding rows of unit-ish size (rows of n_embd; ggml dims [n_embd, n_vocab]).
    t["token_embd.weight"] = mat(v, e, 1.0)
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(e)
        t[p + "attn_q.weight"] = mat(q, e)
        t[p + "attn_q.bias"] = vec(q, bs)
        t[p + "attn_k.weight"] = mat(kv, e)
        t[p + "attn_k.bias"] = vec(kv, bs)
        t[p + "attn_v.weight"] = mat(kv, e)
        t[p + "attn_v.bias"] = vec(kv, bs)
        t[p + "attn_output.weight"] = mat(e, q)
        t[p + "ffn_norm.weight"] = norm(e)
        t[p + "ffn_gate.weight"] = mat(ff, e)
        t[p + "ffn_up.weight"] = mat(ff, e)
        t[p + "ffn_down.weight"] = mat(e, ff)
    t["output_norm.weight"] = norm(e)
    # A larger head scale spreads the logits so that greedy choices are clear.
    t["output.weight"] = mat(v, e, 0.3)
    return t


def byte_level_vocab(n):
    """GPT-2's byte-to-unicode strings for bytes 0..n-1 (one token per byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(n)]


def write_gguf(s, t, path):
    w = gguf.GGUFWriter(path, s["arch"])
    w.add_name("tiny-qwen2 (random weights, oato test fixture)")
    w.add_context_length(s["n_ctx_train"])
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(s["rope_freq_base"])
    w.add_layer_norm_rms_eps(s["rms_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    finish_gguf(w, s, t, "qwen2")


def finish_gguf(w, s, t, pre):
    """Minimal tokenizer metadata (GGUF cannot hold an empty array, so there is no merges key), the
    tensors, and the file written."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(byte_level_vocab(s["n_vocab"]))
    w.add_token_types([gguf.TokenType.NORMAL] * s["n_vocab"])
    for name, arr in t.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_gguf_roundtrip(path, t, arch="qwen2"):
    r = gguf.GGUFReader(path)
    seen = {}
    for rt in r.tensors:
        seen[rt.name] = rt
    assert set(seen) == set(t), "tensor names differ after reading back"
    for name, arr in t.items():
        rt = seen[name]
        # ggml dims are numpy's shape reversed: (n_out, n_in) is stored as [n_in, n_out].
        assert list(rt.shape) == list(reversed(arr.shape)), (name, list(rt.shape), arr.shape)
        assert rt.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert np.array_equal(np.asarray(rt.data).reshape(arr.shape), arr), name
    arch_name, arch = arch, r.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == arch_name


# ------------------------------------------------------------------------------------ float64 reference


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_angles(pos, d, base):
    """[len(pos), d/2]: angle of pair i at position p is p * base^(-2i/d)."""
    i = np.arange(d // 2, dtype=np.float64)
    return np.asarray(pos, dtype=np.float64)[:, None] * base ** (-2.0 * i / d)


def rope_neox(x, pos, base):
    """x: [T, n_heads, d]; rotates pairs (i, i + d/2) by the position's angle."""
    d = x.shape[-1]
    a = rope_angles(pos, d, base)[:, None, :]
    c, s = np.cos(a), np.sin(a)
    x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


def rope_normal(x, pos, base):
    """Llama's (GPT-J) RoPE, pairs (2i, 2i + 1): used only to show the test would see the mistake."""
    d = x.shape[-1]
    a = rope_angles(pos, d, base)[:, None, :]
    c, s = np.cos(a), np.sin(a)
    out = x.copy()
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


def rope_neox_complex(x, pos, base):
    """The same NeoX rotation as complex multiplication, an independent check of rope_neox."""
    d = x.shape[-1]
    z = x[..., : d // 2] + 1j * x[..., d // 2 :]
    z = z * np.exp(1j * rope_angles(pos, d, base))[:, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def to_f16(x):
    return x.astype(np.float16).astype(np.float64)


class Ref:
    """The model in float64 (weights are the float32 values written to the file, widened exactly)."""

    def __init__(self, s, t, rope="neox", biases=True, kv_map="div"):
        self.s = s
        self.t = {k: v.astype(np.float64) for k, v in t.items()}
        self.rope = {"neox": rope_neox, "normal": rope_normal}[rope]
        self.biases = biases
        self.kv_map = kv_map

    def kv_head(self, h):
        s = self.s
        group = s["n_head"] // s["n_head_kv"]
        return h // group if self.kv_map == "div" else h % s["n_head_kv"]

    def qkv(self, il, x, pos):
        s, t, p = self.s, self.t, f"blk.{il}."
        h = rms_norm(x, t[p + "attn_norm.weight"], s["rms_eps"])
        q = h @ t[p + "attn_q.weight"].T
        k = h @ t[p + "attn_k.weight"].T
        v = h @ t[p + "attn_v.weight"].T
        if self.biases:
            q, k, v = q + t[p + "attn_q.bias"], k + t[p + "attn_k.bias"], v + t[p + "attn_v.bias"]
        n, d = len(pos), s["head_dim"]
        q = self.rope(q.reshape(n, s["n_head"], d), pos, s["rope_freq_base"])
        k = self.rope(k.reshape(n, s["n_head_kv"], d), pos, s["rope_freq_base"])
        return q, k, v.reshape(n, s["n_head_kv"], d)

    def block_tail(self, il, x, att):
        s, t, p = self.s, self.t, f"blk.{il}."
        x = x + att.reshape(len(x), -1) @ t[p + "attn_output.weight"].T
        h = rms_norm(x, t[p + "ffn_norm.weight"], s["rms_eps"])
        g = silu(h @ t[p + "ffn_gate.weight"].T) * (h @ t[p + "ffn_up.weight"].T)
        return x + g @ t[p + "ffn_down.weight"].T

    def head(self, x):
        t = self.t
        return rms_norm(x, t["output_norm.weight"], self.s["rms_eps"]) @ t["output.weight"].T

    def embed(self, tokens):
        return self.t["token_embd.weight"][np.asarray(tokens)]

    def forward_batched(self, tokens, f16=False):
        """Logits [T, n_vocab] of one prefill batch, attention as a causally masked [T, T] matrix.

        With f16=True, rounds as oato's CPU attention does: q, k, v to f16, softmax weights to f16."""
        s = self.s
        n = len(tokens)
        pos = np.arange(n)
        x = self.embed(tokens)
        mask = np.triu(np.full((n, n), -np.inf), k=1)
        for il in range(s["n_layer"]):
            q, k, v = self.qkv(il, x, pos)
            if f16:
                q, k, v = to_f16(q), to_f16(k), to_f16(v)
            d = q.shape[-1]
            att = np.empty(q.shape[:2] + v.shape[-1:])
            for h in range(s["n_head"]):
                kh = self.kv_head(h)
                sc = q[:, h, :] @ k[:, kh, :].T / math.sqrt(d) + mask
                pr = np.exp(sc - sc.max(axis=1, keepdims=True))
                pr /= pr.sum(axis=1, keepdims=True)
                if f16:
                    pr = to_f16(pr)
                att[:, h, :] = pr @ v[:, kh, :]
            x = self.block_tail(il, x, att)
        return self.head(x)

    def forward_step(self, token, cache):
        """Logits [n_vocab] of one token at position len(cache[0]['k']), appending its keys and values
        to `cache` (per layer, lists of [n_head_kv, d]); attention written as plain loops."""
        s = self.s
        pos = len(cache[0]["k"])
        x = self.embed([token])
        for il in range(s["n_layer"]):
            q, k, v = self.qkv(il, x, [pos])
            cache[il]["k"].append(k[0])
            cache[il]["v"].append(v[0])
            d = q.shape[-1]
            att = np.zeros((1, s["n_head"], v.shape[-1]))
            for h in range(s["n_head"]):
                kh = self.kv_head(h)
                scores = [float(np.dot(q[0, h], kj[kh])) / math.sqrt(d) for kj in cache[il]["k"]]
                m = max(scores)
                w = [math.exp(sc - m) for sc in scores]
                z = sum(w)
                for wj, vj in zip(w, cache[il]["v"]):
                    att[0, h] += (wj / z) * vj[kh]
            x = self.block_tail(il, x, att)
        return self.head(x)[0]

    def new_cache(self):
        return [{"k": [], "v": []} for _ in range(self.s["n_layer"])]


# ------------------------------------------------------------------------------------------------- main


def sig(v, digits=7):
    """A float with `digits` significant digits (JSON stays short; f32 holds about 7)."""
    return float(f"{v:.{digits}g}")


def dump_json(v, indent=0):
    """JSON with one key per line and one logits row per line (readable diffs, small file)."""
    pad = " " * indent
    if isinstance(v, dict):
        items = [f'{pad} {json.dumps(k)}: {dump_json(x, indent + 1).lstrip()}' for k, x in v.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}" + ("\n" if indent == 0 else "")
    if isinstance(v, list) and v and isinstance(v[0], list):
        rows = [pad + "  " + json.dumps(r) for r in v]
        return pad + "[\n" + ",\n".join(rows) + "\n" + pad + " ]"
    return pad + json.dumps(v)


def top2(row):
    o = np.argsort(-row)
    return int(o[0]), int(o[1]), float(row[o[0]] - row[o[1]])


def prefill_and_greedy(ref, prompt, n_greedy):
    """The prefill's logits, batched, checked against a token-by-token pass with an explicit cache;
    the greedy continuation, one token at a time over the cache, checked against a batched pass of the
    whole sequence at the end. Returns (logits, greedy, runner_up, margins, logits of the whole sequence)."""
    logits = ref.forward_batched(prompt)
    cache = ref.new_cache()
    step_logits = np.stack([ref.forward_step(tok, cache) for tok in prompt])
    err = np.abs(logits - step_logits).max()
    assert err < 1e-12, f"batched and token-by-token reference passes differ by {err}"
    greedy, margins, runner_up = [], [], []
    last = step_logits[-1]
    all_rows = [last]
    for _ in range(n_greedy):
        a, b, m = top2(last)
        greedy.append(a)
        runner_up.append(b)
        margins.append(m)
        last = ref.forward_step(a, cache)
        all_rows.append(last)
    full = ref.forward_batched(prompt + greedy)
    err = np.abs(full[len(prompt) - 1 :] - np.stack(all_rows)).max()
    assert err < 1e-12, f"greedy decode and batched pass of the whole sequence differ by {err}"
    return logits, greedy, runner_up, margins, full


def main():
    s = SETTINGS
    os.makedirs(OUT_DIR, exist_ok=True)
    t = make_weights(s)
    write_gguf(s, t, GGUF_PATH)
    check_gguf_roundtrip(GGUF_PATH, t)
    size = os.path.getsize(GGUF_PATH)
    assert size < 400_000, f"{GGUF_PATH} is {size} bytes"

    ref = Ref(s, t)

    # RoPE two ways.
    xr = np.random.default_rng(1).standard_normal((5, 3, s["head_dim"]))
    rp = np.arange(5) + 3
    err = np.abs(rope_neox(xr, rp, s["rope_freq_base"]) - rope_neox_complex(xr, rp, s["rope_freq_base"])).max()
    assert err < 1e-12, f"NeoX RoPE: pairwise and complex forms differ by {err}"

    logits, greedy, runner_up, margins, full = prefill_and_greedy(ref, PROMPT, s["n_greedy"])

    # The rounding oato's attention does, and what plausible bugs would do to the logits.
    f16 = ref.forward_batched(PROMPT, f16=True)
    f16_dev = float(np.abs(f16 - logits).max())
    f16_dev_seq = float(np.abs(ref.forward_batched(PROMPT + greedy, f16=True) - full).max())
    sens = {
        "normal_rope": Ref(s, t, rope="normal").forward_batched(PROMPT),
        "no_qkv_bias": Ref(s, t, biases=False).forward_batched(PROMPT),
        "kv_head_mod": Ref(s, t, kv_map="mod").forward_batched(PROMPT),
    }
    sens = {k: float(np.abs(v - logits).max()) for k, v in sens.items()}

    out = {
        "about": "float64 numpy reference for tests/data/qwen2/tiny-qwen2.gguf, by scripts/make-qwen2-fixture.py",
        "settings": s,
        "prompt": PROMPT,
        "logits": [[sig(v) for v in row] for row in logits],
        "greedy": greedy,
        "greedy_runner_up": runner_up,
        "greedy_margins": [sig(m, 6) for m in margins],
        "f16_emulated": {
            "about": "the prefill with q, k, v and softmax weights rounded to f16, as oato's CPU attention",
            "logits": [[sig(v) for v in row] for row in f16],
            "max_abs_dev_from_exact": sig(f16_dev, 6),
            "max_abs_dev_from_exact_prompt_and_greedy": sig(f16_dev_seq, 6),
        },
    }
    finish(out, sens, logits, GGUF_PATH, REF_PATH)
    print(f"prompt {PROMPT} -> greedy {greedy}")
    print(f"greedy top-2 margins {[round(m, 4) for m in margins]}")
    print(f"f16 rounding moves the logits by at most {f16_dev:.3e} (prefill), {f16_dev_seq:.3e} (prompt + greedy)")
    return 0


def finish(out, sens, logits, gguf_path, ref_path):
    """Adds the sensitivity figures and the logits' statistics to `out`, writes it to `ref_path` and
    says what was written."""
    out["sensitivity"] = {
        "about": "max |logit change| over the prefill under each plausible engine bug",
        **{k: sig(v, 6) for k, v in sens.items()},
    }
    out["stats"] = {
        "max_abs_logit": sig(float(np.abs(logits).max()), 6),
        "logit_std": sig(float(logits.std()), 6),
    }
    with open(ref_path, "w") as f:
        f.write(dump_json(out))
    print(f"wrote {gguf_path} ({os.path.getsize(gguf_path)} bytes) and {ref_path}")
    print(f"logits: max |.| {np.abs(logits).max():.3f}, std {logits.std():.3f}")
    print("sensitivity (max |logit change|): " + ", ".join(f"{k} {v:.3f}" for k, v in sens.items()))


if __name__ == "__main__":
    sys.exit(main())
