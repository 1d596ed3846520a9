#!/usr/bin/env python3
"""Write the quantisation test vectors under tests/data/quant/ (read by tests/quant_vectors.rs).

The expected values come from the `gguf` Python package (llama.cpp's gguf-py, a numpy port of
ggml's reference code): `gguf.quants.dequantize` and `gguf.quants.quantize`. Where the package has
no implementation (Q8_1 and Q8_K, which ggml uses only for activations) this script computes the
expected values itself with numpy, following ggml's `quantize_row_q8_1_ref`, `quantize_row_q8_K_ref`
and `dequantize_row_q8_K`; those cases are marked "source": "script" in the manifest, the others
"source": "gguf".

Usage:  python3 scripts/gen-quant-vectors.py [--out tests/data/quant]
Needs:  pip install gguf numpy   (made with gguf 0.19, numpy 2.4)
Output is deterministic: running it again rewrites identical files.

Format (all binary files little-endian, no headers):
  manifest.json   {"generator", "gguf_version", "numpy_version", "cases": [case, ...]}
  case            {"op": "dequantize" | "quantize", "type": ggml type name, "n": elements,
                   "input": file, "expected": file, "source": "gguf" | "script", "note": text}
  op dequantize   input = raw row bytes of `type` (n elements); expected = n f32
  op quantize     input = n f32;  expected = raw row bytes of `type`
  quant-input.f32 the row every quantize case reads (it may read only a prefix of n elements):
                  0.1 + 2*cos(i) for 512 elements (ggml's test pattern), 256 gaussians with a
                  per-32 scale from 1e-3 to 1e2, one 256-element super-block of edge cases (ties,
                  zeros, constants, subnormal and f16-overflowing magnitudes), 256 zeros and
                  a super-block of exact ties for Q8_K (127 first, then k + 0.5).

Raw blocks for the dequantize cases are seeded random bytes whose scale fields are overwritten
with finite values of sane size (one block per type has a subnormal f16 scale); F32/F16/BF16
rows are random bit patterns with NaNs excluded (so infinities, zeros and subnormals occur).
"""

import argparse
import json
import os

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

QK_K = 256
SEED = 20240521

# (elements, bytes) per block as ggml-common.h declares them. Not gguf.GGML_QUANT_SIZES: gguf 0.19
# still lists Q8_1 as 40 bytes (f32 d and s), while ggml's block_q8_1 holds two f16 (36 bytes).
BLOCK = {T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q5_0: (32, 22), T.Q5_1: (32, 24),
         T.Q8_0: (32, 34), T.Q8_1: (32, 36), T.Q2_K: (256, 84), T.Q3_K: (256, 110),
         T.Q4_K: (256, 144), T.Q5_K: (256, 176), T.Q6_K: (256, 210), T.Q8_K: (256, 292),
         T.IQ4_NL: (32, 18), T.IQ4_XS: (256, 136)}


SUBNORMAL_F16 = np.array([0x37, 0x02], dtype=np.uint8)  # f16 bits 0x0237, about 3.4e-5


def f16_bytes(values):
    """f32 values rounded to f16 (ties to even, overflow to infinity as ggml), as bytes."""
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint8)


def random_scales(rng, count, lo_exp, hi_exp, signed=True):
    """Finite f32 scales of magnitude 10**U(lo_exp, hi_exp), random sign when signed."""
    mag = 10.0 ** rng.uniform(lo_exp, hi_exp, size=count)
    sign = np.where(rng.random(count) < 0.5, -1.0, 1.0) if signed else 1.0
    return (mag * sign).astype(np.float32)


def raw_blocks(qtype, n_blocks, rng):
    """Random blocks of `qtype` with sane scale fields; returns (n_blocks, type_size) uint8."""
    block_size, type_size = BLOCK[qtype]
    b = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)

    def put_f16(offset, lo, hi, signed=True):
        vals = random_scales(rng, n_blocks, lo, hi, signed)
        b[:, offset:offset + 2] = f16_bytes(vals).reshape(n_blocks, 2)

    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL, T.IQ4_XS):
        put_f16(0, -3, 0)
    elif qtype in (T.Q4_1, T.Q5_1):
        put_f16(0, -3, -1)  # d
        put_f16(2, -2, 0)  # m
    elif qtype == T.Q8_1:
        put_f16(0, -3, -1)
        b[-1, 0:2] = SUBNORMAL_F16
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(-1)
        qsum = b[:, 4:].view(np.int8).astype(np.int32).sum(axis=1)
        b[:, 2:4] = f16_bytes(qsum.astype(np.float32) * d).reshape(n_blocks, 2)
    elif qtype == T.Q2_K:
        put_f16(80, -4, -1)  # d
        put_f16(82, -4, -1)  # dmin
    elif qtype == T.Q3_K:
        put_f16(108, -4, -1)
    elif qtype in (T.Q4_K, T.Q5_K):
        put_f16(0, -4, -1, signed=False)
        put_f16(2, -4, -1, signed=False)
    elif qtype == T.Q6_K:
        put_f16(208, -4, -1)
    elif qtype == T.Q8_K:
        d = random_scales(rng, n_blocks, -4, -1)
        b[:, 0:4] = d.view(np.uint8).reshape(n_blocks, 4)
        qs = b[:, 4:4 + QK_K].view(np.int8).astype(np.int16)
        bsums = qs.reshape(n_blocks, QK_K // 16, 16).sum(axis=2).astype("<i2")
        b[:, 4 + QK_K:] = bsums.view(np.uint8).reshape(n_blocks, -1)
    else:
        raise ValueError(qtype)

    # One block with a subnormal f16 scale (the first f16 field of the block's scales).
    first_f16 = {T.Q2_K: 80, T.Q3_K: 108, T.Q6_K: 208}.get(qtype, 0)
    if qtype != T.Q8_K:
        b[-1, first_f16:first_f16 + 2] = SUBNORMAL_F16
    return b


def dequant_expected(qtype, raw):
    """f32 values of raw blocks: from the gguf package, or computed here for Q8_1 / Q8_K."""
    if qtype == T.Q8_1:
        d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
        qs = raw[:, 4:].view(np.int8).astype(np.float32)
        return (qs * d).reshape(-1), "script"
    if qtype == T.Q8_K:
        d = raw[:, 0:4].copy().view(np.float32)
        qs = raw[:, 4:4 + QK_K].view(np.int8).astype(np.float32)
        return (d * qs).reshape(-1), "script"
    return dequantize(raw.reshape(-1), qtype).reshape(-1), "gguf"


def random_plain_bits(qtype, n, rng):
    """Random F32/F16/BF16 bit patterns with NaNs replaced by the largest finite value."""
    if qtype == T.F32:
        u = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        u[nan] = 0x7F7FFFFF
        return u.view(np.uint8)
    u = rng.integers(0, 2**16, size=n, dtype=np.uint32).astype(np.uint16)
    if qtype == T.F16:
        nan = (u & 0x7FFF) > 0x7C00
        u[nan] = 0x7BFF
    else:
        nan = (u & 0x7FFF) > 0x7F80
        u[nan] = 0x7F7F
    return u.view(np.uint8)


def quant_input(rng):
    i = np.arange(512, dtype=np.float64)
    pattern = 0.1 + 2 * np.cos(i)
    gauss = rng.standard_normal(256) * np.repeat(10.0 ** np.linspace(-3, 2, 8), 32)
    edge = np.zeros(256, dtype=np.float64)
    # block 0: amax 127 so Q8 scales are exactly 1 and x.5 values are exact ties
    edge[0:32] = [127, -2.5, 2.5, -0.5, 0.5, 1.5, -1.5, 3.5, 100.5, -100.5, 126.5, -126.5,
                  0.25, -0.75, 7.5, -7.5, 8.5, -8.5, 15.5, -15.5, 31.5, -31.5, 63.5, -63.5,
                  0, 1, -1, 2, -2, 64, -64, 126]
    # block 1: all zeros (d = 0)
    # block 2: constant block (Q4_1/Q5_1 range 0)
    edge[64:96] = 1.5
    # block 3: negative value of largest magnitude comes first, then its positive twin
    edge[96:128] = np.linspace(-3, 2.9, 32)
    edge[96] = -4.0
    edge[127] = 4.0
    # block 4: tiny magnitudes (f16 scale becomes subnormal)
    edge[128:160] = np.linspace(-1e-6, 2e-6, 32)
    # block 5: large magnitudes, one rounding to f16 infinity
    edge[160:192] = np.linspace(-3e4, 6.5e4, 32)
    edge[191] = 65520.0
    # block 6: multiples of 1/8 from -2 to 1.875 (Q4_0 scale d = 0.25: exact ties at +8.5)
    edge[192:224] = np.arange(-16, 16) / 8.0
    # block 7: one outlier among small values
    edge[224:256] = rng.standard_normal(32) * 0.01
    edge[240] = -5.0
    zeros = np.zeros(256)
    # Q8_K ties: max 127 first, so iscale = -1 and every k + 0.5 is an exact tie (to even)
    ties = np.concatenate([[127.0], np.arange(-127, 128) + 0.5])[:256]
    ties[200:256] = np.arange(56) - 28.0
    return np.concatenate([pattern, gauss, edge, zeros, ties]).astype(np.float32)


def q8_1_expected(x):
    """ggml's quantize_row_q8_1_ref: Q8_0's d and qs (from the package) plus s = f16(sum(qs) * d)."""
    q8_0 = quantize(x, T.Q8_0).reshape(-1, 34)
    blocks = x.reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)
    qsum = q8_0[:, 2:].view(np.int8).astype(np.int32).sum(axis=1)
    s = f16_bytes(qsum.astype(np.float32) * d).reshape(-1, 2)
    return np.concatenate([q8_0[:, :2], s, q8_0[:, 2:]], axis=1).reshape(-1)


def q8_k_expected(x):
    """ggml's quantize_row_q8_K_ref: iscale = -127/max (max = first of largest |x|), quants by
    round-half-even (nearest_int) capped at 127, d = 1/iscale as f32, bsums of 16."""
    out = []
    for blk in x.reshape(-1, QK_K):
        a = np.abs(blk)
        if not a.max() > 0:
            out.append(np.zeros(4 + QK_K + 32, dtype=np.uint8))
            continue
        mx = blk[int(np.argmax(a))]
        iscale = np.float32(-127.0) / mx
        qs = np.minimum(np.rint(iscale * blk), 127).astype(np.int8)  # rint: ties to even
        bsums = qs.astype(np.int16).reshape(16, 16).sum(axis=1).astype("<i2")
        d = np.array([np.float32(1.0) / iscale], dtype="<f4")
        out.append(np.concatenate([d.view(np.uint8), qs.view(np.uint8), bsums.view(np.uint8)]))
    return np.concatenate(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "data", "quant"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(SEED)
    cases = []

    def write(name, data):
        with open(os.path.join(args.out, name), "wb") as f:
            f.write(np.ascontiguousarray(data).tobytes())

    def dequant_case(qtype, rng):
        block_size, _ = BLOCK[qtype]
        n_blocks = 8 if block_size == 32 else 3
        raw = raw_blocks(qtype, n_blocks, rng)
        expected, source = dequant_expected(qtype, raw)
        assert expected.dtype == np.float32 and np.isfinite(expected).all(), qtype.name
        write(f"dequant-{qtype.name}.bin", raw)
        write(f"dequant-{qtype.name}.f32", expected.astype("<f4"))
        cases.append({"op": "dequantize", "type": qtype.name, "n": n_blocks * block_size,
                      "input": f"dequant-{qtype.name}.bin", "expected": f"dequant-{qtype.name}.f32",
                      "source": source, "note": "random blocks, sane scales, last scale subnormal"})

    # Dequantisation of raw blocks.
    block_types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q8_1,
                   T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K]
    for qtype in block_types:
        dequant_case(qtype, rng)
    for qtype in (T.F32, T.F16, T.BF16):
        n = 512
        raw = random_plain_bits(qtype, n, rng)
        if qtype == T.F32:
            expected = raw.view(np.float32)
        else:
            expected = dequantize(raw, qtype).reshape(-1)
        write(f"dequant-{qtype.name}.bin", raw)
        write(f"dequant-{qtype.name}.f32", expected.astype("<f4"))
        cases.append({"op": "dequantize", "type": qtype.name, "n": n,
                      "input": f"dequant-{qtype.name}.bin", "expected": f"dequant-{qtype.name}.f32",
                      "source": "gguf", "note": "random bit patterns without NaNs"})

    # Quantisation of one shared input row.
    x = quant_input(rng)
    write("quant-input.f32", x.astype("<f4"))
    for qtype in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q8_1, T.Q8_K):
        n = len(x)
        if qtype == T.Q8_1:
            out, source = q8_1_expected(x[:n]), "script"
        elif qtype == T.Q8_K:
            out, source = q8_k_expected(x[:n]), "script"
        else:
            with np.errstate(over="ignore"):  # 65520 rounds to f16 infinity, as in ggml
                q = quantize(x[:n], qtype)
            out, source = np.asarray(q).view(np.uint8).reshape(-1), "gguf"
        write(f"quant-{qtype.name}.bin", out)
        cases.append({"op": "quantize", "type": qtype.name, "n": n, "input": "quant-input.f32",
                      "expected": f"quant-{qtype.name}.bin", "source": source,
                      "note": "cos pattern, scaled gaussians, edge cases"})

    # The i-quants, from their own seeded stream (added later: the cases above keep their bytes).
    rng_iq = np.random.default_rng(SEED + 1)
    for qtype in (T.IQ4_NL, T.IQ4_XS):
        dequant_case(qtype, rng_iq)

    manifest = {"generator": "scripts/gen-quant-vectors.py",
                "gguf_version": getattr(gguf, "__version__", None) or _gguf_version(),
                "numpy_version": np.__version__, "cases": cases}
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(args.out, p)) for p in os.listdir(args.out))
    print(f"wrote {len(cases)} cases, {total} bytes, to {os.path.normpath(args.out)}")


def _gguf_version():
    try:
        from importlib.metadata import version
        return version("gguf")
    except Exception:
        return "unknown"


if __name__ == "__main__":
    main()
