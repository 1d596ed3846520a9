"""test_kernels.py: every CUDA kernel of src/kernels/cuda, run on the CPU emulator and checked
against independent references (refs.py: gguf-py and numpy) and against the stored vectors of
tests/data/quant. Run by scripts/emulate-cuda-kernels.sh, which builds the library first:

    python test_kernels.py --lib target/cuda-emu/release/libcudaemu.so \
        --src src/kernels/cuda --data tests/data/quant [-v]

Each group below states its tolerance and why; data are seeded per check (emu.rng_for) or the
cos pattern. Launch shapes follow the "launch:" comments in the .cu files, plus variations the
kernels promise to handle (misaligned pointers, grid-stride loops, partial blocks and rows). The
last group fails when a kernel in the sources has no check here.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import refs  # noqa: E402
from emu import SAN, Buf, Emu, EmuError, Report, cos_pattern, f32, i32, i64, rng_for  # noqa: E402

E: Emu = None  # set in main
GOLDEN = {}    # (op, ggml type name) -> (input bytes, expected bytes) from tests/data/quant


def cdiv(a, b):
    return (a + b - 1) // b


# ---------------------------------------------------------------------------------------------
# The emulator itself (selftest.cu)


def check_emulator(g):
    y = Buf.out(np.int32, 5 * 64)
    E.launch("emu_shuffles", (1,), (64,), y)
    got = y.get(np.int32).reshape(64, 5)
    tid = np.arange(64)
    lane, base = tid % 32, tid - tid % 32
    want = np.stack([
        100 * (base + (lane ^ 5)),
        100 * np.where(lane + 3 < 32, tid + 3, tid),
        100 * np.where(lane >= 2, tid - 2, tid),
        100 * (base + 31 - lane),
        100 * (base + (lane ^ 4)),
    ], axis=1)
    g.exact("shuffles xor/down/up/idx/xor-width-8 = CUDA's", got, want, dims=("thread", "op"))

    for sync in (1, 0):
        y = Buf.out(np.int32, 2 * 96)
        E.launch("emu_neighbour", (2,), (96,), y, i32(sync))
        got = y.get(np.int32).reshape(2, 96)
        want = 1000 * np.arange(2)[:, None] + (np.arange(96)[None, :] + 1) % 96
        wrong = int((got != want).sum())
        if sync:
            g.exact("shared memory after __syncthreads", got, want, dims=("block", "thread"))
        else:
            g.true("missing __syncthreads gives wrong reads", wrong > 0,
                   f"{wrong}/192 reads saw stale shared memory")

    for name, block, expect in (
            ("bad_divergent_barrier", 64, "divergent __syncthreads"),
            ("bad_barrier_after_return", 64, "returned"),
            ("bad_shuffle_after_return", 32, "lanes returned"),
            ("bad_deadlock", 32, "deadlock")):
        y = Buf.out(np.int32, block)
        try:
            E.launch(name, (1,), (block,), y)
            g.true(f"{name} reported", False, "launch succeeded")
        except EmuError as e:
            g.true(f"{name} reported", expect in str(e), str(e))

    try:
        E.launch("emu_neighbour", (1,), (32,), Buf.out(np.int32, 32), f32(1.0))
        g.true("wrong argument type reported", False, "launch succeeded")
    except EmuError as e:
        g.true("wrong argument type reported", "takes (pi)" in str(e), str(e))

    x = np.array([1e-38, 5e-39], np.float32)
    y = Buf.out(np.float32, 2)
    E.launch("emu_flush", (1,), (1,), Buf.of(x), y)
    g.exact("f32 denormals flushed (-ftz=true)", y.get(np.float32), np.zeros(2, np.float32))

    if not SAN:  # under ASan the write itself aborts the run
        try:
            E.launch("bad_write_past_end", (1,), (32,), Buf.out(np.float32, 8), i32(8))
            g.true("write past the end reported", False, "launch succeeded")
        except EmuError as e:
            g.true("write past the end reported", "after the end" in str(e), str(e))


# ---------------------------------------------------------------------------------------------
# quantize.cu: bit-identical to quantize_row(Q8_1)


def quantize_q8_1(x, off=0):
    nb = x.size // 32
    xb = Buf.of(x.astype(np.float32), off)
    y = Buf.out(np.uint8, nb * 36)
    E.launch("quantize_q8_1", (cdiv(nb, 8),), (256,), xb, y, i32(nb))
    return y.get(np.uint8).reshape(nb, 36)


def check_quantize(g):
    inp, exp = GOLDEN[("quantize", "Q8_1")]
    x = np.frombuffer(inp, np.float32)
    want = np.frombuffer(exp, np.uint8).reshape(-1, 36)
    g.exact("tests/data/quant/quant-Q8_1.bin", quantize_q8_1(x[:want.shape[0] * 32]), want,
            dims=("block", "byte"))

    # 37 blocks (a partial last thread block of 8 warps), an all-zero block, ties.
    x = (rng_for("q8_1 random").standard_normal(37 * 32) * 3).astype(np.float32)
    x[32:64] = 0.0
    x[64:69] = [127.0, 2.5, -3.5, 1.49, -0.5]  # q = 127, 3, -4, 1, -1 (ties away from zero)
    got = quantize_q8_1(x, off=4)
    g.exact("gaussian*3, zero block, ties, 37 blocks vs numpy", got, refs.quantize_q8_1(x),
            dims=("block", "byte"))
    g.exact("ties round half away from zero", got[2, 4:9].view(np.int8),
            np.array([127, 3, -4, 1, -1], np.int8))
    x = cos_pattern(64 * 32, 0.5) * np.repeat(np.geomspace(1e-3, 1e3, 64), 32).astype(np.float32)
    g.exact("cos pattern, scales 1e-3..1e3 vs numpy", quantize_q8_1(x), refs.quantize_q8_1(x),
            dims=("block", "byte"))


def check_round_q8_f16(g):
    # The same 37 blocks as above: f16(f16(d) * q) of quantize_q8_1's own blocks, bit for bit.
    x = (rng_for("q8_1 random").standard_normal(37 * 32) * 3).astype(np.float32)
    x[32:64] = 0.0
    x[64:69] = [127.0, 2.5, -3.5, 1.49, -0.5]
    x = np.concatenate([x, cos_pattern(64 * 32, 0.5) *
                        np.repeat(np.geomspace(1e-3, 1e3, 64), 32).astype(np.float32)])
    nb = x.size // 32
    xb = Buf.of(x, 4)
    y = Buf.out(np.float16, x.size)
    E.launch("round_q8_f16", (cdiv(nb, 8),), (256,), xb, y, i32(nb))
    d, _, q = refs.q8_1_fields(refs.quantize_q8_1(x))
    want = (d.astype(np.float32)[:, None] * q.astype(np.float32)).astype(np.float16).reshape(-1)
    g.exact("f16(d * q) of quantize_q8_1's blocks, 101 blocks", y.get(np.float16).view(np.uint16),
            want.view(np.uint16), dims=("element",))


# ---------------------------------------------------------------------------------------------
# dequant.cu: y == f16(dequantize_row(w)) bit for bit (IQ4_XS too: gguf-py, like dequantize.rs,
# forms d * (ls - 32) in f32 before multiplying by the value)


def dequant(kernel, wbytes, n, w_off, y_off_elems, grid, block=256, k_w=0, k_y=0):
    """Whole rows (k_w == k_y), or the column block of k_y of each row of k_w from wbytes on."""
    wb = Buf.of(wbytes, w_off)
    y = Buf.out(np.float16, n, off=2 * y_off_elems)
    E.launch(kernel, (grid,), (block,), wb, y, i64(n), i32(k_w), i32(k_y))
    return y.get(np.float16)


def column_blocks(g, rows, k, bytes_per_block, qk, run, want):
    """The column blocks [c0, c0 + kc) of a [rows, k] weight by `run(src_offset, n, k_w, k_y,
    grid, block)` (src_offset: c0's block times bytes_per_block) against the same columns of
    `want` ([rows, k] f16), bit for bit: a block in the middle (all but the first and last
    blocks), the first, the last, with a one-thread-block grid (the grid-stride loop). k is at
    least 2 blocks."""
    mid = max(k - 2 * qk, qk)
    for c0, kc, grid, block in ((qk, mid, 2, 256), (0, qk, 1, 32), (k - qk, qk, 1, 256)):
        n = rows * kc
        got = run(c0 // qk * bytes_per_block, n, k, kc, grid, block)
        g.exact(f"columns {c0}..{c0 + kc} of {rows}x{k} grid {grid}x{block}",
                got.reshape(rows, kc), want[:, c0:c0 + kc], dims=("row", "col"))


def check_dequant(g, t):
    qk = refs.QTYPES[t][1]  # elements per block
    rows = 5
    k = qk * (3 if qk == 256 else 12)
    blocks = refs.random_blocks(rng_for(f"dequant {t}"), t, rows * k // qk)
    want = refs.dequantize(t, blocks, rows).reshape(-1).astype(np.float16)
    n = want.size
    # y + 16 bytes: the 16-byte store path; y + 2 bytes: element stores. w + 2: 2-byte aligned
    # blocks. grid 1 with 32 threads: the grid-stride loop.
    for w_off, y_off, grid, block in ((0, 0, cdiv(n, 2048), 256), (2, 0, cdiv(n, 2048), 256),
                                      (0, 1, cdiv(n, 2048), 256), (2, 1, 1, 32)):
        got = dequant(f"dequant_{t}_f16", blocks, n, w_off, y_off, grid, block)
        g.exact(f"random blocks w+{w_off} y+{2 * y_off} grid {grid}x{block}", got, want,
                dims=("elem",))
    # Column blocks (the host's k slices of a GEMM).
    raw = np.frombuffer(blocks, np.uint8)
    column_blocks(g, rows, k, refs.QTYPES[t][2], qk,
                  lambda at, n, k_w, k_y, grid, block: dequant(
                      f"dequant_{t}_f16", raw[at:], n, 0, 0, grid, block, k_w, k_y),
                  want.reshape(rows, k))
    inp, exp = GOLDEN[("dequantize", t.upper())]
    want = np.frombuffer(exp, np.float32).astype(np.float16)
    got = dequant(f"dequant_{t}_f16", np.frombuffer(inp, np.uint8), want.size, 0, 0, 1)
    g.exact(f"tests/data/quant/dequant-{t.upper()}.bin", got, want, dims=("elem",))


def bf16_bits(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def check_dequant_bf16(g):
    bits = bf16_bits(rng_for("bf16").standard_normal(1005) * 10)
    want = bf16_value(bits).astype(np.float16)
    for w_off, grid, block in ((0, 1, 256), (2, 1, 256), (0, 1, 32)):
        got = dequant("dequant_bf16_f16", bits, bits.size, w_off, 0, grid, block)
        g.exact(f"n=1005 w+{w_off} grid {grid}x{block}", got, want, dims=("elem",))
    # Column blocks of 8s of a 5 x 64 weight.
    rows, k = 5, 64
    b2 = bits[:rows * k]
    column_blocks(g, rows, k, 2 * 8, 8,
                  lambda at, n, k_w, k_y, grid, block: dequant(
                      "dequant_bf16_f16", b2.view(np.uint8)[at:], n, 0, 0, grid, block, k_w, k_y),
                  want[:rows * k].reshape(rows, k))
    inp, exp = GOLDEN[("dequantize", "BF16")]
    want = np.frombuffer(exp, np.float32).astype(np.float16)
    got = dequant("dequant_bf16_f16", np.frombuffer(inp, np.uint8), want.size, 0, 0, 1)
    g.exact("tests/data/quant/dequant-BF16.bin (inf, subnormal, zero)", got, want,
            dims=("elem",))


def check_f16_conversions(g, kernel):
    # f32 -> f16 rounds to nearest even (numpy's astype does too); f16 -> f32 is exact.
    if kernel in ("f32_to_f16", "store_kv_f16"):
        inp, exp = GOLDEN[("quantize", "F16")]
        cases = [("tests/data/quant/quant-F16.bin (overflow, subnormal)",
                  np.frombuffer(inp, np.float32), np.frombuffer(exp, np.float16)),
                 ("gaussian*100, n=777", (rng_for(kernel).standard_normal(777) * 100)
                  .astype(np.float32), None)]
        for label, x, want in cases:
            want = x.astype(np.float16) if want is None else want
            y = Buf.out(np.float16, x.size)
            if kernel == "store_kv_f16":
                # V is K reversed: each cache gets its own rows.
                yv = Buf.out(np.float16, x.size)
                E.launch(kernel, (2,), (256,), Buf.of(x), Buf.of(x[::-1].copy()), y, yv,
                         i64(x.size))
                g.exact(label + " (v: reversed)", yv.get(np.float16), want[::-1], dims=("elem",))
            else:
                E.launch(kernel, (2,), (256,), Buf.of(x), y, i64(x.size))
            g.exact(label, y.get(np.float16), want, dims=("elem",))
    else:
        inp, exp = GOLDEN[("dequantize", "F16")]
        x = np.frombuffer(inp, np.float16)
        y = Buf.out(np.float32, x.size)
        E.launch(kernel, (1,), (128,), Buf.of(x, 2), y, i64(x.size))
        g.exact("tests/data/quant/dequant-F16.bin (random bits)", y.get(np.float32),
                np.frombuffer(exp, np.float32), dims=("elem",))


# ---------------------------------------------------------------------------------------------
# mmvq.cu, quantised weights: |y - ref| / (|W| . |A|) <= 1e-5, ref in float64 from the same
# (gguf-dequantised) weights and Q8_1 activations. The kernels' integer sums are exact; what
# remains is f32 rounding of the per-block scale products and of the sums over up to ~150 blocks
# per lane and the warp (~1e-7 relative in practice; 1e-5 leaves room for another summation
# order and the GPU's fused multiply-adds, and still catches a wrong bit, scale or block).
# IQ4_NL / IQ4_XS look their nibbles' values up exactly (byte permutes), so the same holds for
# them: IQ4_NL as Q4_0 (one scale product per 16 elements), IQ4_XS as Q3_K / Q6_K (per group).


def check_mmvq(g, t):
    qk = refs.QTYPES[t][1]  # elements per block
    small = qk == 32
    # 10 rows: 2.5 thread blocks of 4; n_tok > 1. First 40 units per row (not a multiple of 32
    # lanes) with w 16-byte aligned, + 2 and + 4 bytes (the 16-, 2- and 4-byte load paths, as
    # far as the format has them); then 2 chunks with a partial second one, w + 0, 6, 8, .., 14
    # (staging heads and tails; rows of odd block sizes start at varying offsets too); then one
    # row, one token, fewer units than lanes.
    for nblk, rows, n_tok, w_offs in ((20 if small else 5, 10, 3, (0, 2, 4)),
                                      (87 if small else 19, 10, 3, (0, 6, 8, 10, 12, 14)),
                                      (4 if small else 1, 1, 1, (0,))):
        k = qk * nblk
        rng = rng_for(f"mmvq {t} {k}")
        blocks = refs.random_blocks(rng, t, rows * nblk)
        act = refs.quantize_q8_1(rng.standard_normal(n_tok * k).astype(np.float32))
        ref, mag = refs.mmvq(t, blocks, rows, k, act)
        for w_off in w_offs:
            y = Buf.out(np.float32, n_tok * rows)
            E.launch(f"mmvq_{t}", (cdiv(rows, 4), n_tok), (32, 4), Buf.of(blocks, w_off),
                     Buf.of(act), y, i32(k), i32(rows), i32(n_tok))
            g.close(f"k={k} rows={rows} n_tok={n_tok} w+{w_off}",
                    y.get(np.float32).reshape(n_tok, rows), ref, 1e-5, mag,
                    dims=("t", "row"), metric="err/mag")


def multi_weights(g, t, kernel, k, nblk, grid, cases, tag):
    # Two or three weights that read one activation, run by `kernel` (mmvq_multi_<type> or
    # mmvq_pipe_<type>) in one launch: each output exactly as its own mmvq_<type> launch writes
    # it. cases: (rows per weight, n_tok); two weights take the first and third places (the
    # second empty). grid(nn): the launch's thread blocks for the places' rows nn.
    for rows, n_tok in cases:
        rng = rng_for(f"{tag} {t} {len(rows)}")
        ws = [refs.random_blocks(rng, t, n * nblk) for n in rows]
        act = Buf.of(refs.quantize_q8_1(rng.standard_normal(n_tok * k).astype(np.float32)))
        want = []
        for w, n in zip(ws, rows):
            y = Buf.out(np.float32, n_tok * n)
            E.launch(f"mmvq_{t}", (cdiv(n, 4), n_tok), (32, 4), Buf.of(w), act, y, i32(k),
                     i32(n), i32(n_tok))
            want.append(y.get(np.float32))
        places = [0, 1, 2] if len(rows) == 3 else [0, 2]
        # The empty place's buffers are never read.
        wb = [Buf.of(np.zeros(16, np.uint8)) for _ in range(3)]
        yb = [Buf.out(np.float32, 4) for _ in range(3)]
        nn = [0, 0, 0]
        for j, (w, n) in enumerate(zip(ws, rows)):
            wb[places[j]] = Buf.of(w)
            yb[places[j]] = Buf.out(np.float32, n_tok * n)
            nn[places[j]] = n
        E.launch(kernel, (grid(nn), n_tok), (32, 4), *wb, act, *yb, i32(k), i32(nn[0]),
                 i32(nn[1]), i32(nn[2]), i32(n_tok))
        for j, n in enumerate(rows):
            g.exact(f"{len(rows)} weights, rows {rows}, n_tok={n_tok}: weight {j} = mmvq_{t}'s",
                    yb[places[j]].get(np.float32), want[j])


def check_mmvq_multi(g, t):
    # Three weights (8, 4 and 10 rows: the last ends in a partial thread block), then two (12
    # and 6 rows), 1 and 3 tokens; a thread block per row block.
    qk = refs.QTYPES[t][1]
    nblk = 20 if qk == 32 else 5
    multi_weights(g, t, f"mmvq_multi_{t}", qk * nblk, nblk,
                  lambda nn: nn[0] // 4 + nn[1] // 4 + cdiv(nn[2], 4),
                  (((8, 4, 10), 3), ((12, 6), 1)), "mmvq_multi")


def check_mmvq_pipe(g, t):
    # The pipelined kernel: every output exactly as mmvq_<type> writes it. One weight (10 rows:
    # a partial row block; its place is the third, n0 = n1 = 0), k under one item and past one
    # (4096 elements: a second, partial item), w at offsets that take the 16-, 4- and 2-byte
    # paths and staging heads and tails; grids of 1 and 2 thread blocks (each walks several row
    # blocks, item after item, through both shared buffers) and of 5 (more than the 3 row
    # blocks). Then three weights (8, 4 and 10 rows) and two (12 and 6), grid 2, as
    # check_mmvq_multi's.
    qk = refs.QTYPES[t][1]
    small = qk == 32
    for nblk, n_tok, w_offs in ((20 if small else 5, 3, (0, 2, 4)),
                                (150 if small else 19, 2, (0, 6, 14))):
        k = qk * nblk
        rows = 10
        rng = rng_for(f"mmvq_pipe {t} {k}")
        blocks = refs.random_blocks(rng, t, rows * nblk)
        act = Buf.of(refs.quantize_q8_1(rng.standard_normal(n_tok * k).astype(np.float32)))
        for w_off in w_offs:
            w = Buf.of(blocks, w_off)
            want = Buf.out(np.float32, n_tok * rows)
            E.launch(f"mmvq_{t}", (cdiv(rows, 4), n_tok), (32, 4), w, act, want, i32(k),
                     i32(rows), i32(n_tok))
            for grid in (1, 2, 5):
                y = Buf.out(np.float32, n_tok * rows)
                E.launch(f"mmvq_pipe_{t}", (grid, n_tok), (32, 4), w, w, w, act, y, y, y, i32(k),
                         i32(0), i32(0), i32(rows), i32(n_tok))
                g.exact(f"k={k} rows={rows} n_tok={n_tok} w+{w_off} grid {grid} = mmvq_{t}'s",
                        y.get(np.float32), want.get(np.float32))
    nblk = 150 if small else 19
    multi_weights(g, t, f"mmvq_pipe_{t}", qk * nblk, nblk, lambda nn: 2,
                  (((8, 4, 10), 2), ((12, 6), 1)), "mmvq_pipe multi")


# mmvq.cu, direct variant: the same data, metric and tolerance as check_mmvq, all tokens in one
# launch (1, 3 and 8 tokens), activations split by quantize_q8_1_split.


def quantize_q8_1_split(x):
    """(quants [n_blocks * 32] i8 buffer, (d, s) [n_blocks] float2 buffer) of x."""
    nb = x.size // 32
    aq = Buf.out(np.int8, nb * 32)
    ads = Buf.out(np.float32, 2 * nb)
    E.launch("quantize_q8_1_split", (cdiv(nb, 8),), (256,), Buf.of(x.astype(np.float32), 4), aq,
             ads, i32(nb))
    return aq, ads


def check_quantize_split(g):
    # The split layout holds quantize_q8_1's blocks exactly: quants byte for byte, d and s the
    # f16 fields widened.
    x = (rng_for("q8_1 split").standard_normal(37 * 32) * 3).astype(np.float32)
    x[32:64] = 0.0
    aq, ads = quantize_q8_1_split(x)
    want = refs.quantize_q8_1(x)
    d, s, q = refs.q8_1_fields(want)
    g.exact("quants = quantize_q8_1's, 37 blocks", aq.get(np.int8).reshape(-1, 32),
            q.astype(np.int8), dims=("block", "i"))
    g.exact("(d, s) = f32(quantize_q8_1's f16 fields)", ads.get(np.float32).reshape(-1, 2),
            np.stack([d, s], axis=1).astype(np.float32), dims=("block", "field"))


def split_act_case(tag, t, nblk, rows, n_tok):
    """k, random weight blocks of type t (rows x nblk blocks), n_tok tokens of activations split
    by quantize_q8_1_split (aq, ads), and the float64 reference with its magnitude; seeded by tag,
    t and k."""
    k = refs.QTYPES[t][1] * nblk
    rng = rng_for(f"{tag} {t} {k}")
    blocks = refs.random_blocks(rng, t, rows * nblk)
    x = rng.standard_normal(n_tok * k).astype(np.float32)
    ref, mag = refs.mmvq(t, blocks, rows, k, refs.quantize_q8_1(x))
    aq, ads = quantize_q8_1_split(x)
    return k, blocks, aq, ads, ref, mag


def check_mmvq_direct(g, t):
    qk = refs.QTYPES[t][1]
    small = qk == 32
    for nblk, rows, n_tok, w_offs in ((20 if small else 5, 10, 3, (0, 2, 4)),
                                      (87 if small else 19, 6, 8, (0, 6, 14)),
                                      (4 if small else 1, 1, 1, (0,))):
        k, blocks, aq, ads, ref, mag = split_act_case("mmvq direct", t, nblk, rows, n_tok)
        for w_off in w_offs:
            y = Buf.out(np.float32, n_tok * rows)
            E.launch(f"mmvq_direct_{t}", (cdiv(rows, 4),), (32, 4), Buf.of(blocks, w_off), aq, ads,
                     y, i32(k), i32(rows), i32(n_tok))
            g.close(f"k={k} rows={rows} n_tok={n_tok} w+{w_off}",
                    y.get(np.float32).reshape(n_tok, rows), ref, 1e-5, mag,
                    dims=("t", "row"), metric="err/mag")
    # More than 8 tokens: nothing written.
    y = Buf(4 * 9, fill=0)
    E.launch(f"mmvq_direct_{t}", (1,), (32, 4), Buf.of(blocks), aq, ads, y, i32(qk), i32(1), i32(9))
    g.exact("n_tok=9: nothing written", y.get(np.float32), np.zeros(9, np.float32))


# split.cu: weights in the split layout (all rows' quants, 16-byte aligned, then their f16
# scales). split_blocks must give numpy's split of the file's blocks byte for byte; the
# matrix-vector kernels the reference within check_mmvq's tolerance (the same per-block values,
# another order of f32 sums); the dequantisation dequant_<type>_f16's bits.

# Rewritten into the split layout: (split_blocks kernel, scale bytes a block).
SPLIT = {"q4_0": ("split_blocks_16", 2), "q4_1": ("split_blocks_16m", 4),
         "iq4_nl": ("split_blocks_16", 2), "q8_0": ("split_blocks_32", 2),
         "q6_K": ("split_blocks_208", 2)}
SPLIT_TYPES = tuple(SPLIT)
SPLIT_MMVQ_TYPES = SPLIT_TYPES + ("q4_K", "q5_K")  # Q4_K / Q5_K: the file's layout as it is


def split_layout(blocks, t):
    """The split layout of [n_blocks, SB + QB] file blocks of type t (scales first, or d last for
    Q6_K): (quants, scales) as u8 arrays."""
    if t == "q6_K":  # ql, qh, scales, then d
        return blocks[:, :208].reshape(-1).copy(), blocks[:, 208:].reshape(-1).copy()
    sb = SPLIT[t][1]
    return blocks[:, sb:].reshape(-1).copy(), blocks[:, :sb].reshape(-1).copy()


def split_weight(blocks, t):
    """A weight buffer in the split layout (quants then scales), 16-byte aligned; Q4_K and Q5_K
    as the file's blocks."""
    if t not in SPLIT_TYPES:
        return Buf.of(blocks)
    qs, ds = split_layout(blocks, t)
    return Buf.of(np.concatenate([qs, ds]))


def check_split_blocks(g):
    for t, (kernel, sb) in SPLIT.items():
        qb = refs.QTYPES[t][2] - sb
        for n_blocks, src_off, grid, block in ((37, 0, 1, 256), (300, 2, 1, 64), (513, 6, 3, 256)):
            blocks = refs.random_blocks(rng_for(f"split {t} {n_blocks}"), t, n_blocks)
            qs = Buf.out(np.uint8, n_blocks * qb)
            ds = Buf.out(np.uint8, n_blocks * sb)
            E.launch(kernel, (grid,), (block,), Buf.of(blocks, src_off), qs, ds, i64(n_blocks))
            want_q, want_d = split_layout(blocks, t)
            g.exact(f"{t}: {n_blocks} blocks src+{src_off} grid {grid}x{block}: quants",
                    qs.get(np.uint8), want_q, dims=("byte",))
            g.exact(f"{t}: {n_blocks} blocks src+{src_off} grid {grid}x{block}: scales",
                    ds.get(np.uint8), want_d, dims=("byte",))


def check_mmvq_split(g, t):
    # One weight: rows not a multiple of 4 (a partial thread block), k under one lane's unrolled
    # step (20 blocks), past it (150: partial second step) and the 8B shapes' kind of row (448
    # blocks, 14336 elements), 1, 3 and 8 tokens. Then three weights (5, 4 and 7 rows: thread
    # blocks straddle weights) and two (the second place empty), each output checked.
    qk = refs.QTYPES[t][1]
    cases = (((20, 6, 3), (150, 5, 8), (448, 3, 1), (1, 1, 1)) if qk == 32 else
             ((3, 6, 3), (19, 5, 8), (56, 3, 1), (1, 1, 1)))
    for nblk, rows, n_tok in cases:
        k, blocks, aq, ads, ref, mag = split_act_case("mmvq split", t, nblk, rows, n_tok)
        w = split_weight(blocks, t)
        dummy = Buf.out(np.float32, 4)
        for kern in [f"mmvq_split_{t}"] + ([f"mmvq_split1_{t}"] if n_tok == 1 else []):
            y = Buf.out(np.float32, n_tok * rows)
            E.launch(kern, (cdiv(rows, 4),), (32, 4), w, w, w, aq, ads, dummy, dummy, y, i32(k),
                     i32(0), i32(0), i32(rows), i32(n_tok))
            g.close(f"{kern} k={k} rows={rows} n_tok={n_tok}",
                    y.get(np.float32).reshape(n_tok, rows), ref, 1e-5, mag, dims=("t", "row"),
                    metric="err/mag")
    nblk = 40 if qk == 32 else 5
    k = qk * nblk
    for rows, n_tok, kern in (((5, 4, 7), 2, f"mmvq_split_{t}"), ((6, 0, 3), 1, f"mmvq_split_{t}"),
                              ((5, 4, 7), 1, f"mmvq_split1_{t}")):
        rng = rng_for(f"mmvq split multi {t} {rows}")
        x = rng.standard_normal(n_tok * k).astype(np.float32)
        aq, ads = quantize_q8_1_split(x)
        act = refs.quantize_q8_1(x)
        ws, ys, refs_ = [], [], []
        for n in rows:
            blocks = refs.random_blocks(rng, t, max(n, 1) * nblk)
            ws.append(split_weight(blocks, t))
            ys.append(Buf.out(np.float32, max(n_tok * n, 1)))
            refs_.append(refs.mmvq(t, blocks, n, k, act) if n else None)
        E.launch(kern, (cdiv(sum(rows), 4),), (32, 4), *ws, aq, ads, *ys, i32(k),
                 *(i32(n) for n in rows), i32(n_tok))
        for j, (n, r) in enumerate(zip(rows, refs_)):
            if n:
                ref, mag = r
                g.close(f"{kern} weights {rows}, n_tok={n_tok}: weight {j}",
                        ys[j].get(np.float32).reshape(n_tok, n), ref, 1e-5, mag,
                        dims=("t", "row"), metric="err/mag")
            else:
                g.exact(f"weights {rows}: the empty place's output untouched",
                        ys[j].u8, np.full(4, 0xFF, np.uint8))
    # More than 8 tokens (more than 1 for mmvq_split1): nothing written.
    w = split_weight(refs.random_blocks(rng_for("split 9"), t, 1), t)
    for kern, nt in ((f"mmvq_split_{t}", 9), (f"mmvq_split1_{t}", 2)):
        y = Buf(4 * nt, fill=0)
        E.launch(kern, (1,), (32, 4), w, w, w, aq, ads, y, y, y, i32(qk), i32(0), i32(0), i32(1),
                 i32(nt))
        g.exact(f"{kern} n_tok={nt}: nothing written", y.get(np.float32), np.zeros(nt, np.float32))


def check_mmvq_split_glu(g, t):
    # Gate, up and SwiGLU in one launch = mmvq_split_<t> of (gate, up), then swiglu_q8_1 of the
    # two outputs: g, u, the Q8_1 blocks and the split quants bit for bit; the counters back at
    # zero, and a second launch on them the same. Rows 32 to 96 (groups of 32 spanning thread
    # blocks), k as check_mmvq_split's, 1, 3 and 8 tokens; one case with the blocks' pointer null.
    qk = refs.QTYPES[t][1]
    cases = (((20, 64, 3), (150, 32, 8), (448, 96, 1), (1, 32, 1)) if qk == 32 else
             ((3, 64, 3), (19, 32, 8), (56, 32, 1), (1, 32, 1)))
    for nblk, n, n_tok in cases:
        k = qk * nblk
        rng = rng_for(f"mmvq split glu {t} {k} {n}")
        wg = split_weight(refs.random_blocks(rng, t, n * nblk), t)
        wu = split_weight(refs.random_blocks(rng, t, n * nblk), t)
        x = rng.standard_normal(n_tok * k).astype(np.float32)
        aq, ads = quantize_q8_1_split(x)
        nb = n_tok * n // 32
        dummy = Buf.out(np.float32, 4)
        kernels = [("", "mmvq_split")] + ([("1", "mmvq_split1")] if n_tok == 1 else [])
        for one, plain_kern in kernels:
            # The two launches it replaces.
            yg, yu = Buf.out(np.float32, n_tok * n), Buf.out(np.float32, n_tok * n)
            E.launch(f"{plain_kern}_{t}", (cdiv(2 * n, 4),), (32, 4), wg, wu, wg, aq, ads, yg, yu,
                     dummy, i32(k), i32(n), i32(n), i32(0), i32(n_tok))
            want_u = yu.get(np.float32)
            want_q = Buf.out(np.uint8, nb * 36)
            want_aq, want_ads = split_sink(n_tok * n)
            E.launch("swiglu_q8_1", (cdiv(nb, 8),), (256,), yg, yu, want_q, want_aq, want_ads,
                     i32(nb))
            kern = f"mmvq_split{one}_glu_{t}"
            only_split = (nblk, n, n_tok) == cases[-1]
            counters = Buf.of(np.zeros(n // 32, np.uint32))
            for launch in (1, 2):
                gb, ub = Buf.out(np.float32, n_tok * n), Buf.out(np.float32, n_tok * n)
                q = None if only_split else Buf.out(np.uint8, nb * 36)
                saq, sads = split_sink(n_tok * n)
                E.launch(kern, (cdiv(n, 4),), (32, 4), wg, wu, aq, ads, gb, ub, q, saq, sads,
                         counters, i32(k), i32(n), i32(n_tok))
                label = f"{kern} k={k} n={n} n_tok={n_tok} launch {launch}"
                g.exact(label + ": g = swiglu of the products", gb.get(np.float32),
                        yg.get(np.float32))
                g.exact(label + ": u = up's product", ub.get(np.float32), want_u)
                if q is not None:
                    g.exact(label + ": blocks = swiglu_q8_1's", q.get(np.uint8),
                            want_q.get(np.uint8), dims=("byte",))
                g.exact(label + ": split quants = swiglu_q8_1's", saq.get(np.int8),
                        want_aq.get(np.int8), dims=("i",))
                g.exact(label + ": split (d, s) = swiglu_q8_1's", sads.get(np.float32),
                        want_ads.get(np.float32), dims=("i",))
                g.exact(label + ": counters back at zero", counters.get(np.uint32),
                        np.zeros(n // 32, np.uint32))
    # Rows not a multiple of 32, or more tokens than the kernel takes: nothing written.
    w = split_weight(refs.random_blocks(rng_for("split glu bad"), t, 40), t)
    x = rng_for("split glu bad x").standard_normal(2 * qk).astype(np.float32)
    aq, ads = quantize_q8_1_split(x)
    for kern, n, nt in ((f"mmvq_split_glu_{t}", 40, 1), (f"mmvq_split_glu_{t}", 32, 9),
                        (f"mmvq_split1_glu_{t}", 32, 2)):
        gb = Buf(4 * nt * n, fill=0)
        saq, sads = split_sink(nt * 64)
        counters = Buf.of(np.zeros(2, np.uint32))
        E.launch(kern, (cdiv(n, 4),), (32, 4), w, w, aq, ads, gb, gb, None, saq, sads, counters,
                 i32(qk), i32(n), i32(nt))
        g.exact(f"{kern} n={n} n_tok={nt}: nothing written", gb.get(np.float32),
                np.zeros(nt * n, np.float32))


def check_mmvq_split_qkv_rope(g, t):
    # q, k, v, RoPE and the KV store in one launch = mmvq_split_<t> of (q, k, v), then
    # rope_store_kv_f16: q, k, v and both caches bit for bit, the counters back at zero, and a
    # second launch on them the same. Heads of 32 to 128 rows (spanning thread blocks), neox or
    # not, freq factors, a partial rotation at an offset, 1 and 3 tokens (8 for one case).
    qk = refs.QTYPES[t][1]
    nblk = 3 if qk == 32 else 1
    k = qk * nblk
    cases = [  # neox, freq factors, n_tok, n_head, n_head_kv, head_dim, n_dims, pos0, offset
        (0, False, 1, 4, 2, 64, 64, 0, 0),
        (1, True, 3, 2, 1, 128, 128, 37, 0),
        (1, False, 8, 3, 1, 64, 32, 500, 32),
        # rope_head_warp's widest heads (four pairs a lane), then past them (rope_head's loop),
        # and store_head_f16's widest (eight values a lane), then past it (its loop).
        (0, True, 1, 1, 1, 256, 256, 9, 0),
        (1, False, 2, 1, 1, 288, 288, 3000, 0),
    ]
    for neox, use_ff, n_tok, nh, nkv, hd, n_dims, pos0, off in cases:
        label = (f"{t} neox={neox} ff={int(use_ff)} n_tok={n_tok} heads={nh}/{nkv} hd={hd} "
                 f"n_dims={n_dims} pos0={pos0}" + (f" offset={off}" if off else ""))
        rng = rng_for("split qkv rope " + label)
        nq, nkvr = nh * hd, nkv * hd
        ws = [split_weight(refs.random_blocks(rng, t, r * nblk), t) for r in (nq, nkvr, nkvr)]
        x = rng.standard_normal(n_tok * k).astype(np.float32)
        aq, ads = quantize_q8_1_split(x)
        ff = rng.uniform(1.0, 8.0, n_dims // 2).astype(np.float32) if use_ff else None
        rope = (i32(n_dims), i32(pos0), f32(10000.0), f32(0.5), i32(neox),
                Buf.of(ff) if ff is not None else None, i32(off))
        n = n_tok * nkvr
        kernels = [("", "mmvq_split")] + ([("1", "mmvq_split1")] if n_tok == 1 else [])
        for one, plain_kern in kernels:
            # The two launches it replaces.
            qa, ka, va = (Buf.out(np.float32, n_tok * r) for r in (nq, nkvr, nkvr))
            E.launch(f"{plain_kern}_{t}", (cdiv(nq + 2 * nkvr, 4),), (32, 4), *ws, aq, ads, qa,
                     ka, va, i32(k), i32(nq), i32(nkvr), i32(nkvr), i32(n_tok))
            cka, cva = Buf.out(np.float16, n), Buf.out(np.float16, n)
            E.launch("rope_store_kv_f16", (nh + nkv, n_tok), (128,), qa, ka, va, cka, cva,
                     i32(n_tok), i32(nh), i32(nkv), i32(hd), *rope)
            kern = f"mmvq_split{one}_qkv_rope_{t}"
            counters = Buf.of(np.zeros(nh + 2 * nkv, np.uint32))
            for launch in (1, 2):
                qb, kb, vb = (Buf.out(np.float32, n_tok * r) for r in (nq, nkvr, nkvr))
                ckb, cvb = Buf.out(np.float16, n), Buf.out(np.float16, n)
                E.launch(kern, (cdiv(nq + 2 * nkvr, 4),), (32, 4), *ws, aq, ads, qb, kb, vb, ckb,
                         cvb, counters, i32(k), i32(nh), i32(nkv), i32(hd), i32(n_tok), *rope)
                for what, got, want, dt in (("q", qb, qa, np.float32), ("k", kb, ka, np.float32),
                                            ("v", vb, va, np.float32),
                                            ("k cache", ckb, cka, np.float16),
                                            ("v cache", cvb, cva, np.float16)):
                    g.exact(f"{kern} {label} launch {launch}: {what}", got.get(dt), want.get(dt))
                g.exact(f"{kern} {label} launch {launch}: counters back at zero",
                        counters.get(np.uint32), np.zeros(nh + 2 * nkv, np.uint32))
    # A head size not a multiple of 32, or too many tokens: nothing written.
    w = split_weight(refs.random_blocks(rng_for("split qkv bad"), t, 48 * nblk), t)
    x = rng_for("split qkv bad x").standard_normal(k).astype(np.float32)
    aq, ads = quantize_q8_1_split(x)
    for kern, hd, nt in ((f"mmvq_split_qkv_rope_{t}", 16, 1), (f"mmvq_split_qkv_rope_{t}", 32, 9),
                         (f"mmvq_split1_qkv_rope_{t}", 32, 2)):
        y = Buf(4 * nt * 48, fill=0)
        c = Buf(2 * nt * 16, fill=0)
        E.launch(kern, (12,), (32, 4), w, w, w, aq, ads, y, y, y, c, c,
                 Buf.of(np.zeros(3, np.uint32)), i32(k), i32(1), i32(1), i32(hd), i32(nt),
                 i32(hd), i32(0), f32(10000.0), f32(1.0), i32(0), None, i32(0))
        g.exact(f"{kern} hd={hd} n_tok={nt}: nothing written", y.get(np.float32),
                np.zeros(nt * 48, np.float32))


def check_dequant_split(g, t):
    # Rows r0.. of a 7-row weight (the host's GEMM slices): the same f16 bits as dequant_<t>_f16
    # of those rows in the file's layout; y + 2 bytes takes the element stores, grid 1 x 32 the
    # grid-stride loop.
    qk = refs.QTYPES[t][1]
    rows, nblk = 7, (12 if qk == 32 else 2)
    k = qk * nblk
    blocks = refs.random_blocks(rng_for(f"dequant split {t}"), t, rows * nblk)
    qs, ds = split_layout(blocks, t)
    sb = SPLIT[t][1]
    qb = refs.QTYPES[t][2] - sb
    for r0, r, y_off, grid, block in ((0, 7, 0, 2, 256), (3, 2, 1, 1, 32), (6, 1, 0, 1, 256)):
        n = r * k
        want = dequant(f"dequant_{t}_f16", blocks[r0 * nblk:(r0 + r) * nblk], n, 0, 0,
                       cdiv(n, 2048))
        y = Buf.out(np.float16, n, off=2 * y_off)
        E.launch(f"dequant_split_{t}_f16", (grid,), (block,),
                 Buf.of(qs[r0 * nblk * qb:(r0 + r) * nblk * qb]),
                 Buf.of(ds[r0 * nblk * sb:(r0 + r) * nblk * sb]), y, i64(n), i32(k), i32(k))
        g.exact(f"rows {r0}..{r0 + r} y+{2 * y_off} grid {grid}x{block} = dequant_{t}_f16's",
                y.get(np.float16), want, dims=("elem",))
    # Column blocks: the quants and the scales from the block's first block on.
    full = dequant(f"dequant_{t}_f16", blocks, rows * k, 0, 0, cdiv(rows * k, 2048))

    def run(b0, n, k_w, k_y, grid, block):
        y = Buf.out(np.float16, n)
        E.launch(f"dequant_split_{t}_f16", (grid,), (block,), Buf.of(qs[b0 * qb:]),
                 Buf.of(ds[b0 * sb:]), y, i64(n), i32(k_w), i32(k_y))
        return y.get(np.float16)
    column_blocks(g, rows, k, 1, qk, run, full.reshape(rows, k))


# mmq.cu: the prefill GEMM on int8 (64- and 32-row tiles), against the same float64 reference
# (exact activation sums for the min term), metric and tolerance as check_mmvq. Shapes: one whole
# 64 x 64 tile; a partial last step of k (32-element formats) with partial row and token tiles;
# several tiles each way with 2-byte aligned weights; one row and one token.

MMQ_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K")


def check_mmq(g, t):
    qk = refs.QTYPES[t][1]
    small = qk == 32
    for nblk, rows, n_tok, w_offs in ((8 if small else 1, 64, 64, (0,)),
                                      (13 if small else 2, 70, 9, (0, 2)),
                                      (20 if small else 3, 130, 70, (2,)),
                                      (1, 1, 1, (0,))):
        k = qk * nblk
        rng = rng_for(f"mmq {t} {k} {rows} {n_tok}")
        blocks = refs.random_blocks(rng, t, rows * nblk)
        x = (rng.standard_normal(n_tok * k) * rng.uniform(0.1, 10, n_tok * k // 32).repeat(32))
        x = x.astype(np.float32)
        ref, mag = refs.mmvq(t, blocks, rows, k, refs.quantize_q8_1(x), min_from_s=False)
        aq, ads = quantize_q8_1_split(x)
        for tile, w_off in ((tl, o) for tl in (64, 32) for o in w_offs):
            got = {}
            for mma in ("", "mma_"):
                kernel = f"mmq_{mma}{t}" + ("_r32" if tile == 32 else "")
                y = Buf.out(np.float32, n_tok * rows)
                E.launch(kernel, (cdiv(rows, tile), cdiv(n_tok, 64)), (32, 8),
                         Buf.of(blocks, w_off), aq, ads, y, i32(k), i32(rows), i32(n_tok))
                got[mma] = y.get(np.float32).reshape(n_tok, rows)
                g.close(f"{kernel} k={k} rows={rows} n_tok={n_tok} w+{w_off}", got[mma], ref,
                        1e-5, mag, dims=("t", "row"), metric="err/mag")
            # The tensor-core kernel takes the same per-group steps in the same order.
            g.exact(f"{kernel} k={k} rows={rows} n_tok={n_tok} w+{w_off} = the dp4a kernel's",
                    got["mma_"], got[""], dims=("t", "row"))
            # Split-K: S blocks along k (with k's 256-element steps, 2 or 3 of them here, one
            # split may get none), their partials summed in split order by mmq_splitk_sum.
            steps = cdiv(k, 256)
            for splits in (2, 3) if steps >= 2 else ():
                part = Buf.out(np.float32, splits * n_tok * rows)
                E.launch(kernel, (cdiv(rows, tile), cdiv(n_tok, 64), splits), (32, 8),
                         Buf.of(blocks, w_off), aq, ads, part, i32(k), i32(rows), i32(n_tok))
                parts = part.get(np.float32).reshape(splits, n_tok, rows)
                y = Buf.out(np.float32, n_tok * rows)
                E.launch("mmq_splitk_sum", (3,), (256,), part, y, i64(n_tok * rows), i32(splits))
                want = parts[0].copy()
                for z in range(1, splits):
                    want = (want + parts[z]).astype(np.float32)
                got_s = y.get(np.float32).reshape(n_tok, rows)
                g.exact(f"mmq_splitk_sum of {kernel} x{splits} k={k}: the partials in order",
                        got_s, want, dims=("t", "row"))
                g.close(f"{kernel} split-K x{splits} k={k} rows={rows} n_tok={n_tok} w+{w_off}",
                        got_s, ref, 1e-5, mag, dims=("t", "row"), metric="err/mag")
    # Launch contract broken: a block of 128 threads, or k not a multiple of the block size:
    # nothing written.
    k_bad = qk + 32 if not small else 48
    for kernel in (f"mmq_{t}", f"mmq_{t}_r32", f"mmq_mma_{t}", f"mmq_mma_{t}_r32"):
        for block, k, why in (((32, 4), qk, "block (32, 4)"), ((32, 8), k_bad, f"k={k_bad}")):
            y = Buf(4 * 2, fill=0)
            E.launch(kernel, (1, 1), block, Buf.of(blocks), aq, ads, y, i32(k), i32(1), i32(2))
            g.exact(f"{kernel} {why}: nothing written", y.get(np.float32),
                    np.zeros(2, np.float32))


# mmvq.cu, float weights: same metric and tolerance (f32 products and sums).
def check_mmv(g, wname):
    rows, n_tok = 6, 3
    # k = 416 aligned: 16-byte loads; x + 4 bytes or w + 2 / 4 bytes: scalar loads; k = 100: a
    # k % 8 tail; k = 1024: several 256-element steps per lane.
    for k, w_off, x_off in ((416, 0, 0), (416, 0, 4), (416, 4 if wname == "f32" else 2, 0),
                            (100, 0, 0), (1024, 0, 0)):
        rng = rng_for(f"mmv {wname} {k} {w_off} {x_off}")
        wf = rng.standard_normal((rows, k)).astype(np.float32)
        if wname == "bf16":
            wdata = bf16_bits(wf)
            wval = bf16_value(wdata)
        else:
            wdata = wf.astype(np.float16 if wname == "f16" else np.float32)
            wval = wdata.astype(np.float32)
        x = cos_pattern(n_tok * k, 0.25 * k)
        y = Buf.out(np.float32, n_tok * rows)
        E.launch(f"mmv_{wname}w", (cdiv(rows, 4), n_tok), (32, 4), Buf.of(wdata, w_off),
                 Buf.of(x, x_off), y, i32(k), i32(rows), i32(n_tok))
        a = x.astype(np.float64).reshape(n_tok, k)
        w64 = wval.astype(np.float64)
        g.close(f"k={k} w+{w_off} x+{x_off}", y.get(np.float32).reshape(n_tok, rows), a @ w64.T,
                1e-5, np.abs(a) @ np.abs(w64).T, dims=("t", "row"), metric="err/mag")


# ---------------------------------------------------------------------------------------------
# ops.cu


def check_rms_norm(g):
    # f32 sums of squares and IEEE sqrt / division: relative error ~1e-7; tol 1e-5 of max |y|.
    # Rows inside wider ones (x_stride > n): latent attention's compressed kv, normed where its
    # projection wrote it. Rows of up to 8 x block values go through registers (the host's
    # blocks, cuda_backend.rs norm_block: 4096 at 1024 threads, 5120 and 8192 at 1024, 576 at
    # 160), longer ones (4096 at 64 or 128 threads, 8192 at 256, 8200 at 1024) through the loops.
    for n, n_rows, block, inplace, stride in ((300, 3, 256, True, 300), (300, 3, 64, False, 300),
                                              (4096, 2, 128, False, 4096),
                                              (256, 3, 256, False, 288),
                                              (4096, 2, 64, True, 4096),
                                              (8192, 1, 256, False, 8192),
                                              (4096, 2, 1024, False, 4096),
                                              (4096, 1, 1024, True, 4096),
                                              (576, 2, 160, False, 576),
                                              (5120, 1, 1024, False, 5120),
                                              (8192, 1, 1024, False, 8192),
                                              (8200, 1, 1024, False, 8200),
                                              (8200, 1, 256, False, 8200)):
        rng = rng_for(f"rms {n} {block}" + (f" stride {stride}" if stride != n else ""))
        xs = (rng.standard_normal((n_rows, stride)) * 3).astype(np.float32)
        x = xs[:, :n]
        w = cos_pattern(n)
        xb = Buf.of(xs)
        y = xb if inplace else Buf.out(np.float32, x.size)
        E.launch("rms_norm_f32", (n_rows,), (block,), xb, Buf.of(w), y, i32(n), f32(1e-5),
                 i32(stride))
        want = refs.rms_norm(x, w, 1e-5)
        g.close(f"n={n} rows={n_rows} block={block}{' in place' if inplace else ''}"
                + (f" stride={stride}" if stride != n else ""),
                y.get(np.float32).reshape(n_rows, n), want, 1e-5, np.abs(want).max(),
                dims=("row", "i"), metric="err/max|y|")


def split_sink(n_values):
    """Output buffers for a fused kernel's Q8_1 split (quants, (d, s)) of n_values values."""
    return Buf.out(np.int8, n_values), Buf.out(np.float32, n_values // 32 * 2)


def check_split_sink(g, label, aq, ads, y):
    """The fused kernel's split = quantize_q8_1_split of its f32 output y, bit for bit."""
    want_q, want_d = quantize_q8_1_split(y)
    g.exact(label + ": split quants = quantize_q8_1_split's", aq.get(np.int8),
            want_q.get(np.int8), dims=("i",))
    g.exact(label + ": split (d, s) = quantize_q8_1_split's", ads.get(np.float32),
            want_d.get(np.float32), dims=("i",))


def check_fused_q8_1(g, kernel):
    # The fused kernels write exactly what the plain kernel and then quantize_q8_1 write: the
    # f32 output and the Q8_1 blocks, bit for bit; and the split quants and (d, s) as
    # quantize_q8_1_split writes them (also with the blocks' pointer null, in the last case).
    if kernel == "rms_norm_q8_1":
        cases = ((4096, 2, 256, False), (4096, 1, 128, True), (96, 3, 64, False),
                 (4096, 2, 1024, False), (4096, 1, 1024, True), (576, 3, 160, False),
                 (8192, 1, 1024, False), (4096, 2, 64, True))
    else:
        cases = ((14336, 1, 256, False), (96, 5, 256, False), (3 * 32, 1, 256, False))
    for n, n_rows, block, inplace in cases:
        rng = rng_for(f"{kernel} {n} {n_rows}")
        x = (rng.standard_normal((n_rows, n)) * 3).astype(np.float32)
        u = rng.standard_normal((n_rows, n)).astype(np.float32)
        nb = n_rows * n // 32
        only_split = (n, n_rows, block, inplace) == cases[-1]
        q = None if only_split else Buf.out(np.uint8, nb * 36)
        aq, ads = split_sink(n_rows * n)
        if kernel == "rms_norm_q8_1":
            w = cos_pattern(n)
            plain = Buf.out(np.float32, x.size)
            E.launch("rms_norm_f32", (n_rows,), (block,), Buf.of(x), Buf.of(w), plain, i32(n),
                     f32(1e-5), i32(n))
            xb = Buf.of(x)
            y = xb if inplace else Buf.out(np.float32, x.size)
            E.launch(kernel, (n_rows,), (block,), xb, Buf.of(w), y, q, aq, ads, i32(n), f32(1e-5),
                     i32(n))
        else:
            plain = Buf.of(x)
            E.launch("swiglu_f32", (cdiv(x.size, 256),), (256,), plain, Buf.of(u), i64(x.size))
            y = Buf.of(x)
            E.launch(kernel, (cdiv(nb, 8),), (block,), y, Buf.of(u), q, aq, ads, i32(nb))
        want_y = plain.get(np.float32)
        label = f"n={n} rows={n_rows} block={block}{' in place' if inplace else ''}"
        g.exact(label + ": f32 output = plain kernel's", y.get(np.float32), want_y)
        if q is not None:
            g.exact(label + ": blocks = quantize_q8_1 of it", q.get(np.uint8).reshape(nb, 36),
                    quantize_q8_1(want_y), dims=("block", "byte"))
        check_split_sink(g, label, aq, ads, want_y)


def check_add_rms_norm_q8_1(g):
    # The residual add and the RMSNorm after it in one launch: x, y and the Q8_1 blocks exactly
    # as add_f32 and then rms_norm_q8_1 write them; y apart from x, on x, or on the added rows.
    for n, n_rows, block, y_is in ((4096, 1, 256, "apart"), (4096, 3, 128, "x"),
                                   (96, 2, 64, "r"), (4096, 2, 64, "r"), (4096, 1, 64, "x"),
                                   (4096, 1, 1024, "apart"), (4096, 2, 1024, "x"),
                                   (576, 2, 160, "r"), (8192, 1, 1024, "r")):
        rng = rng_for(f"add_rms_norm_q8_1 {n} {n_rows} {y_is}")
        x = (rng.standard_normal((n_rows, n)) * 3).astype(np.float32)
        r = rng.standard_normal((n_rows, n)).astype(np.float32)
        w = cos_pattern(n)
        nb = n_rows * n // 32
        # The plain pair.
        px = Buf.of(x)
        E.launch("add_f32", (cdiv(x.size, 1024),), (256,), px, Buf.of(r), i64(x.size))
        py = Buf.out(np.float32, x.size)
        pq = Buf.out(np.uint8, nb * 36)
        E.launch("rms_norm_q8_1", (n_rows,), (block,), px, Buf.of(w), py, pq, None, None, i32(n),
                 f32(1e-5), i32(n))
        # The fused kernel.
        fx, fr = Buf.of(x), Buf.of(r)
        fy = {"apart": Buf.out(np.float32, x.size), "x": fx, "r": fr}[y_is]
        fq = Buf.out(np.uint8, nb * 36)
        aq, ads = split_sink(n_rows * n)
        E.launch("add_rms_norm_q8_1", (n_rows,), (block,), fx, fr, Buf.of(w), fy, fq, aq, ads,
                 i32(n), f32(1e-5))
        label = f"n={n} rows={n_rows} block={block} y {y_is}"
        if y_is != "x":
            g.exact(label + ": x = add_f32's", fx.get(np.float32), px.get(np.float32))
        g.exact(label + ": y = rms_norm_q8_1's", fy.get(np.float32), py.get(np.float32))
        g.exact(label + ": blocks = rms_norm_q8_1's", fq.get(np.uint8).reshape(nb, 36),
                pq.get(np.uint8).reshape(nb, 36), dims=("block", "byte"))
        check_split_sink(g, label, aq, ads, py.get(np.float32))


def check_rope(g):
    # The angles follow the kernel's written spec exactly (refs.rope), so what remains is the
    # f32 rounding of cos / sin and of the rotation: a few ulp of |x| <= ~4. tol 1e-5 absolute.
    cases = [  # neox, freq factors, n_tok, n_heads, head_dim, n_dims, pos0, block, dim_offset
        (0, False, 3, 4, 64, 64, 0, 128, 0),
        (1, False, 3, 4, 64, 64, 7, 128, 0),
        (0, True, 2, 2, 128, 128, 1000, 16, 0),
        (1, True, 2, 3, 128, 128, 1000, 128, 0),
        (0, False, 3, 4, 64, 48, 30000, 128, 0),  # partial n_dims: dims 48..63 untouched
        (1, True, 3, 4, 64, 32, 30000, 8, 0),
        (1, True, 3, 4, 96, 32, 500, 128, 64),  # latent attention's q: each head's last 32
        (1, True, 3, 1, 288, 32, 500, 128, 256),  # and its shared key after the compressed kv
    ]
    for neox, use_ff, n_tok, nh, hd, n_dims, pos0, block, off in cases:
        label = f"neox={neox} ff={int(use_ff)} n_tok={n_tok} hd={hd} n_dims={n_dims} pos0={pos0}"
        label += f" offset={off}" if off else ""
        rng = rng_for("rope " + label)
        x = rng.standard_normal(n_tok * nh * hd).astype(np.float32)
        ff = rng.uniform(1.0, 8.0, n_dims // 2).astype(np.float32) if use_ff else None
        xb = Buf.of(x)
        E.launch("rope_f32", (nh, n_tok), (block,), xb, i32(n_tok), i32(nh), i32(hd),
                 i32(n_dims), i32(pos0), f32(10000.0), f32(0.5), i32(neox),
                 Buf.of(ff) if ff is not None else None, i32(off))
        x3 = x.reshape(n_tok, nh, hd)
        want = x3.astype(np.float64).copy()
        part = np.ascontiguousarray(x3[:, :, off:off + n_dims])
        want[:, :, off:off + n_dims] = refs.rope(part, n_tok, nh, n_dims, n_dims, pos0, 10000.0,
                                                 0.5, neox, ff)
        got = xb.get(np.float32).reshape(n_tok, nh, hd)
        g.close(label, got, want, 1e-5, dims=("t", "head", "i"), metric="abs err")
        if n_dims < hd:
            rest = np.concatenate([got[:, :, :off], got[:, :, off + n_dims:]], axis=2)
            orig = np.concatenate([x3[:, :, :off], x3[:, :, off + n_dims:]], axis=2)
            g.exact(f"n_dims={n_dims} from {off}: the other dims of {hd} untouched", rest, orig)
    x = cos_pattern(64)
    xb = Buf.of(x)
    E.launch("rope_f32", (1, 1), (128,), xb, i32(1), i32(1), i32(64), i32(80), i32(5),
             f32(10000.0), f32(1.0), i32(0), None, i32(0))
    g.exact("n_dims > head_dim: nothing written", xb.get(np.float32), x)
    E.launch("rope_f32", (1, 1), (128,), xb, i32(1), i32(1), i32(64), i32(32), i32(5),
             f32(10000.0), f32(1.0), i32(0), None, i32(40))
    g.exact("dim_offset + n_dims > head_dim: nothing written", xb.get(np.float32), x)


def check_rope_store_kv(g):
    # rope_store_kv_f16 against what it fuses, run here: rope_f32 on q, rope_f32 on k,
    # store_kv_f16 of k and v. The same arithmetic in the same order, so bit for bit, caches
    # included (guard bytes: nothing outside the stored rows).
    cases = [  # neox, freq factors, n_tok, n_head, n_head_kv, head_dim, n_dims, pos0, offset, block
        (0, False, 1, 4, 2, 64, 64, 0, 0, 128),
        (1, False, 1, 8, 2, 128, 128, 1023, 0, 128),
        (1, True, 3, 6, 2, 64, 64, 37, 0, 128),
        (0, True, 8, 4, 4, 128, 96, 30000, 0, 64),   # partial n_dims: dims 96..127 stored as is
        (1, False, 2, 4, 1, 96, 32, 500, 64, 128),   # rotated dims at an offset
        (1, False, 1, 2, 1, 64, 80, 5, 0, 128),      # n_dims > head_dim: no rotation, store only
    ]
    for neox, use_ff, n_tok, nh, nkv, hd, n_dims, pos0, off, block in cases:
        label = (f"neox={neox} ff={int(use_ff)} n_tok={n_tok} heads={nh}/{nkv} hd={hd} "
                 f"n_dims={n_dims} pos0={pos0}" + (f" offset={off}" if off else "") +
                 (f" block={block}" if block != 128 else ""))
        rng = rng_for("rope_store_kv " + label)
        q = rng.standard_normal(n_tok * nh * hd).astype(np.float32)
        k = rng.standard_normal(n_tok * nkv * hd).astype(np.float32)
        v = rng.standard_normal(n_tok * nkv * hd).astype(np.float32)
        ff = rng.uniform(1.0, 8.0, max(n_dims // 2, 1)).astype(np.float32) if use_ff else None
        rope = (i32(n_dims), i32(pos0), f32(10000.0), f32(0.5), i32(neox),
                Buf.of(ff) if ff is not None else None, i32(off))
        n = n_tok * nkv * hd
        # The unfused steps.
        qa, ka = Buf.of(q), Buf.of(k)
        cka, cva = Buf.out(np.float16, n), Buf.out(np.float16, n)
        for x, heads in ((qa, nh), (ka, nkv)):
            E.launch("rope_f32", (heads, n_tok), (128,), x, i32(n_tok), i32(heads), i32(hd), *rope)
        E.launch("store_kv_f16", (cdiv(n, 1024),), (256,), ka, Buf.of(v), cka, cva, i64(n))
        # The fused kernel.
        qb, kb = Buf.of(q), Buf.of(k)
        ckb, cvb = Buf.out(np.float16, n), Buf.out(np.float16, n)
        E.launch("rope_store_kv_f16", (nh + nkv, n_tok), (block,), qb, kb, Buf.of(v), ckb, cvb,
                 i32(n_tok), i32(nh), i32(nkv), i32(hd), *rope)
        for what, got, want, dt in (("q", qb, qa, np.float32), ("k", kb, ka, np.float32),
                                    ("k cache", ckb, cka, np.float16),
                                    ("v cache", cvb, cva, np.float16)):
            g.exact(f"{label}: {what}", got.get(dt), want.get(dt))


def check_elementwise(g, kernel):
    # One f32 operation per element (add, add_bias), or a rounding to f16: bit-exact against
    # numpy's f32 arithmetic / astype. SwiGLU uses expf (the GPU's __expf under fast math is a
    # few ulp off): relative error <= 1e-5.
    n = 1000
    rng = rng_for(kernel)
    a = (rng.standard_normal(n) * 3).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    for grid in (1, cdiv(n, 256)):
        label = f"n={n} grid {grid}x256"
        if kernel == "add_f32":
            xb = Buf.of(a)
            E.launch(kernel, (grid,), (256,), xb, Buf.of(b), i64(n))
            g.exact(label, xb.get(np.float32), a + b)
        elif kernel == "add_bias_f32":
            bias = b[:40]
            xb = Buf.of(a)
            E.launch(kernel, (grid,), (256,), xb, Buf.of(bias), i32(40), i64(n))
            g.exact(label + " width 40", xb.get(np.float32), a + np.tile(bias, n // 40))
        elif kernel == "scale_f32":
            xb = Buf.of(a)
            E.launch(kernel, (grid,), (256,), xb, f32(0.17677669), i64(n))
            g.exact(label, xb.get(np.float32), a * np.float32(0.17677669))
        elif kernel == "swiglu_f32":
            xb = Buf.of(a)
            E.launch(kernel, (grid,), (256,), xb, Buf.of(b), i64(n))
            want = refs.silu_mul(a, b)
            g.close(label, xb.get(np.float32), want, 1e-5, np.abs(want) + 1e-30,
                    dims=("i",), metric="rel err")


def check_gpu_sleep(g):
    # No output: the stopwatch's lead-in (the emulator's sleep is a no-op; on a GPU it waits
    # about `us` microseconds). It takes one int, as the host passes it: launched so it runs on
    # any launch shape, and a 64-bit argument is refused (the emulator checks the signature).
    def runs(grid, block, arg):
        try:
            E.launch("gpu_sleep", grid, block, arg)
            return True
        except EmuError:
            return False
    for grid, block in (((1,), (32,)), ((2,), (64,))):
        g.true(f"gpu_sleep(i32 3) on {grid[0]} x {block[0]} runs", runs(grid, block, i32(3)))
    g.true("gpu_sleep(i64 3) refused: its parameter is an int", not runs((1,), (32,), i64(3)))


def check_copy_cols(g):
    # A copy: bit-exact. Latent attention's key assembly: each head's non-RoPE columns, then the
    # token's shared RoPE key repeated into every head (src_rep = n_head); its value, padded.
    n_tok, nh, nope, rope, v, lora = 3, 5, 16, 8, 12, 20
    hd = nope + rope
    rng = rng_for("copy_cols")
    kv = rng.standard_normal(n_tok * nh * (nope + v)).astype(np.float32)
    kva = rng.standard_normal(n_tok * (lora + rope)).astype(np.float32)
    k = Buf.out(np.float32, n_tok * nh * hd)
    rows = n_tok * nh
    for src, width, ss, sc, rep, dc in ((kv, nope, nope + v, 0, 1, 0),
                                        (kva, rope, lora + rope, lora, nh, nope)):
        n = rows * width
        for grid in (1, cdiv(n, 256)):
            E.launch("copy_cols_f32", (grid,), (256,), Buf.of(src), k, i32(width), i32(ss),
                     i32(sc), i32(rep), i32(hd), i32(dc), i64(n))
    want = np.concatenate([kv.reshape(n_tok, nh, nope + v)[:, :, :nope],
                           np.repeat(kva.reshape(n_tok, 1, lora + rope)[:, :, lora:], nh, axis=1)],
                          axis=2)
    g.exact(f"{n_tok} tokens x {nh} heads of {nope}+{rope}", k.get(np.float32).reshape(want.shape),
            want)


def check_attention(g):
    # Online softmax in f32 with expf (the GPU's __expf: ~2 + 1.2|x| ulp) and f32 sums, against
    # an exact float64 softmax: abs error <= 2e-5 of max |v| (in practice ~1e-7).
    cases = [  # head_dim, n_tok, pos0, n_head, n_head_kv
        (64, 5, 40, 6, 2),     # GQA 3:1, pos0 > 0, n_tok > 1, 41..45 positions
        (96, 2, 70, 4, 4),     # head_dim 96 (3 per lane), no GQA
        (128, 3, 0, 4, 1),     # prefill from 0: warps 1..3 see no position for t = 0
        (256, 1, 33, 2, 1),    # largest head_dim
        (32, 1, 0, 2, 2),      # one position
        (128, 1, 299, 8, 2),   # 300 positions: ~10 rounds of 4 warps x 8-position tiles
        (64, 8, 0, 8, 2),      # prefill of 8 tokens from position 0, GQA 4:1
    ]
    cases = [c + (128,) for c in cases] + [(64, 5, 40, 6, 2, 32), (64, 5, 40, 6, 2, 96)]
    for hd, n_tok, pos0, nh, nkv, block in cases:
        label = f"hd={hd} n_tok={n_tok} pos0={pos0} heads={nh}/{nkv}"
        label += f" block={block}" if block != 128 else ""
        rng = rng_for("attention " + label)
        n_ctx = pos0 + n_tok
        q = rng.standard_normal(n_tok * nh * hd).astype(np.float32)
        kc = (rng.standard_normal(n_ctx * nkv * hd) * 0.5).astype(np.float16)
        vc = rng.standard_normal(n_ctx * nkv * hd).astype(np.float16)
        scale = 1.0 / np.sqrt(hd)
        out = Buf.out(np.float32, q.size)
        E.launch("attention_f16kv", (nh, n_tok), (block,), Buf.of(q), Buf.of(kc), Buf.of(vc), out,
                 None, None, None, i32(n_tok), i32(nh), i32(nkv), i32(hd), i32(pos0), f32(scale))
        want = refs.attention(q, kc, vc, n_tok, nh, nkv, hd, pos0, scale)
        g.close(label, out.get(np.float32).reshape(n_tok, nh, hd), want, 2e-5,
                np.abs(vc.astype(np.float32)).max(), dims=("t", "head", "d"), metric="err/max|v|")
        # With out_q: the same output, and its Q8_1 blocks as quantize_q8_1 writes them (and its
        # split as quantize_q8_1_split does).
        out2 = Buf.out(np.float32, q.size)
        oq = Buf.out(np.uint8, q.size // 32 * 36)
        aq, ads = split_sink(q.size)
        E.launch("attention_f16kv", (nh, n_tok), (block,), Buf.of(q), Buf.of(kc), Buf.of(vc),
                 out2, oq, aq, ads, i32(n_tok), i32(nh), i32(nkv), i32(hd), i32(pos0), f32(scale))
        g.exact(label + ": output with out_q", out2.get(np.float32), out.get(np.float32))
        g.exact(label + ": out_q = quantize_q8_1 of it", oq.get(np.uint8).reshape(-1, 36),
                quantize_q8_1(out.get(np.float32)), dims=("block", "byte"))
        check_split_sink(g, label, aq, ads, out.get(np.float32))
    # Unsupported shapes write NaN rows and touch nothing else (guard bytes): head_dim 48 (not a
    # multiple of 32), 5 warps, a partial warp.
    for hd, block in ((48, 128), (64, 160), (64, 48)):
        out = Buf(4 * 2 * hd, fill=0)
        z = Buf.of(np.zeros(hd, np.float16))
        E.launch("attention_f16kv", (2, 1), (block,), Buf.of(np.zeros(2 * hd, np.float32)), z, z,
                 out, None, None, None, i32(1), i32(2), i32(1), i32(hd), i32(0), f32(1.0))
        g.true(f"head_dim={hd} block={block} -> NaN rows", np.isnan(out.get(np.float32)).all())


# flash_prefill.cu: the tiled prefill kernel, against the same float64 reference and tolerance as
# attention_f16kv (its tiles change only the order of the f32 sums).


def attention_data(seed, hd, n_tok, pos0, nh, nkv, extra=3):
    """q, the K and V caches (with `extra` rows past the last position, never read) and the
    scale of one attention check, seeded by `seed`."""
    rng = rng_for(seed)
    n_ctx = pos0 + n_tok + extra
    q = rng.standard_normal(n_tok * nh * hd).astype(np.float32)
    kc = (rng.standard_normal(n_ctx * nkv * hd) * 0.5).astype(np.float16)
    vc = rng.standard_normal(n_ctx * nkv * hd).astype(np.float16)
    return q, kc, vc, 1.0 / np.sqrt(hd)


def close_attention(g, label, got, q, kc, vc, n_tok, nh, nkv, hd, pos0, scale):
    want = refs.attention(q, kc, vc, n_tok, nh, nkv, hd, pos0, scale)
    g.close(label, got, want, 2e-5, np.abs(vc.astype(np.float32)).max(),
            dims=("t", "head", "d"), metric="err/max|v|")


def check_peaked(g, seed, n_tok, run):
    """Prefill attention by `run` (returning the output buffer) with large scores (q x 40), two
    heads of 64 over one KV head after 50 cached positions: tiles' maxima far apart, so a
    missing rescale would show."""
    hd, nh, nkv, pos0 = 64, 2, 1, 50
    rng = rng_for(seed)
    q = (rng.standard_normal(n_tok * nh * hd) * 40).astype(np.float32)
    kc = rng.standard_normal((pos0 + n_tok) * nkv * hd).astype(np.float16)
    vc = rng.standard_normal((pos0 + n_tok) * nkv * hd).astype(np.float16)
    out = run(q, kc, vc, n_tok, nh, nkv, hd, pos0, 0.125)
    close_attention(g, "peaked scores (q x 40)", out.get(np.float32).reshape(n_tok, nh, hd), q,
                    kc, vc, n_tok, nh, nkv, hd, pos0, 0.125)


def check_flash_prefill(g):
    cases = [  # head_dim, n_tok, pos0, n_head, n_head_kv
        (64, 16, 0, 4, 2),     # one full query tile from position 0
        (64, 17, 0, 4, 2),     # a second tile of one query
        (128, 40, 100, 8, 2),  # three tiles after 100 cached positions, GQA 4:1
        (96, 21, 5, 3, 3),     # head_dim 96 (3 dims per lane), no GQA
        (256, 9, 30, 2, 1),    # largest head_dim, a partial tile
        (32, 70, 0, 2, 1),     # smallest head_dim, 5 tiles, causal masks in every K/V tile
        (128, 1, 299, 4, 4),   # a single query over 300 positions
        (64, 17, 40, 4, 2, 2), # caches 2 bytes past 16-byte alignment: element loads
    ]
    for hd, n_tok, pos0, nh, nkv, *off in cases:
        off = off[0] if off else 0
        label = f"hd={hd} n_tok={n_tok} pos0={pos0} heads={nh}/{nkv}"
        label += f" kv+{off}" if off else ""
        q, kc, vc, scale = attention_data("flash prefill " + label, hd, n_tok, pos0, nh, nkv)
        out = Buf.out(np.float32, q.size)
        E.launch("attention_flash_f16kv", (cdiv(n_tok, 16), nh), (128,), Buf.of(q),
                 Buf.of(kc, off), Buf.of(vc, off), out, i32(n_tok), i32(nh), i32(nkv), i32(hd),
                 i32(pos0), f32(scale))
        close_attention(g, label, out.get(np.float32).reshape(n_tok, nh, hd), q, kc, vc, n_tok,
                        nh, nkv, hd, pos0, scale)
    # Large scores (q x 40): tiles' maxima far apart, so a missing rescale would show.
    def run(q, kc, vc, n_tok, nh, nkv, hd, pos0, scale):
        out = Buf.out(np.float32, q.size)
        E.launch("attention_flash_f16kv", (cdiv(n_tok, 16), nh), (128,), Buf.of(q), Buf.of(kc),
                 Buf.of(vc), out, i32(n_tok), i32(nh), i32(nkv), i32(hd), i32(pos0), f32(scale))
        return out
    check_peaked(g, "flash prefill peaked", 20, run)
    # Unsupported: head_dim 48, 64 threads, head_dim 288: NaN rows, nothing else touched.
    for hd, block in ((48, 128), (64, 64), (288, 128)):
        out = Buf(4 * 3 * 2 * hd, fill=0)
        z = Buf.of(np.zeros(4 * hd, np.float16))
        E.launch("attention_flash_f16kv", (1, 2), (block,), Buf.of(np.zeros(3 * 2 * hd, np.float32)),
                 z, z, out, i32(3), i32(2), i32(1), i32(hd), i32(0), f32(1.0))
        g.true(f"head_dim={hd} block={block} -> NaN rows", np.isnan(out.get(np.float32)).all())


# attention_flash_mma_f16kv: the tiled prefill kernel on tensor cores (mma_f16_16x8x16, emulated
# as the hardware's fragments define it), the weights in two f16 parts (hi + lo), against the
# same float64 reference and tolerance; grid (n_head, ceil(n_tok / 64)).


def flash_mma(q, kc, vc, n_tok, nh, nkv, hd, pos0, scale, block=128, k_off=0, out=None):
    out = out if out is not None else Buf.out(np.float32, q.size)
    E.launch("attention_flash_mma_f16kv", (nh, cdiv(n_tok, 64)), (block,), Buf.of(q),
             Buf.of(kc, k_off), Buf.of(vc), out, i32(n_tok), i32(nh), i32(nkv), i32(hd), i32(pos0),
             f32(scale))
    return out


def check_flash_mma(g):
    cases = [  # head_dim, n_tok, pos0, n_head, n_head_kv
        (64, 16, 0, 4, 2),     # one warp's rows from position 0, the other warps idle
        (64, 64, 0, 2, 1),     # one full query tile, the diagonal K/V tile
        (128, 130, 0, 4, 1),   # three query tiles (the last of 2 rows), GQA 4:1
        (128, 40, 100, 8, 2),  # after 100 cached positions: a partial second K/V tile
        (96, 21, 5, 3, 3),     # head_dim 96, no GQA
        (16, 70, 3, 2, 1),     # smallest head_dim, two query tiles
        (48, 9, 30, 2, 2),     # head_dim 48, one warp
        (80, 33, 64, 2, 1),    # head_dim 80, a K/V tile boundary at the first query
        (112, 65, 0, 2, 2),    # head_dim 112, a query tile of one row
        (128, 1, 299, 4, 4),   # a single query over 300 positions
    ]
    for hd, n_tok, pos0, nh, nkv in cases:
        label = f"hd={hd} n_tok={n_tok} pos0={pos0} heads={nh}/{nkv}"
        q, kc, vc, scale = attention_data("flash mma " + label, hd, n_tok, pos0, nh, nkv)
        out = flash_mma(q, kc, vc, n_tok, nh, nkv, hd, pos0, scale)
        close_attention(g, label, out.get(np.float32).reshape(n_tok, nh, hd), q, kc, vc, n_tok,
                        nh, nkv, hd, pos0, scale)
    # Large scores: also weights over many orders of magnitude (f16 subnormals among the lo
    # parts), two query tiles.
    check_peaked(g, "flash mma peaked", 90, flash_mma)
    # Unsupported: head_dim 40 (not a multiple of 16), 144 (over 128), 64 threads, a K cache 2
    # bytes past 16-byte alignment: NaN rows, nothing else touched.
    for hd, block, k_off in ((40, 128, 0), (144, 128, 0), (64, 64, 0), (64, 128, 2)):
        out = Buf(4 * 3 * 2 * hd, fill=0)
        z = np.zeros(4 * hd, np.float16)
        flash_mma(np.zeros(3 * 2 * hd, np.float32), z, z, 3, 2, 1, hd, 0, 1.0, block, k_off, out)
        g.true(f"head_dim={hd} block={block} k+{k_off} -> NaN rows",
               np.isnan(out.get(np.float32)).all())


# flash_decode.cu: attention_split_f16kv then attention_merge_f32, against the same float64
# reference and tolerance as attention_f16kv (the chunks change only the order of the f32 sums).


def flash_decode(g, label, q, kc, vc, n_tok, nh, nkv, hd, pos0, scale, gq, chunk, k_off=0):
    """The split kernels' output; with head_dim a multiple of 32 also checks in `g` that the
    merge with out_q writes the same output and its Q8_1 blocks."""
    n_split = cdiv(pos0 + n_tok, chunk)
    part = Buf.out(np.float32, n_tok * nh * n_split * (hd + 2))
    E.launch("attention_split_f16kv", (nh // gq, n_split, n_tok), (128,), Buf.of(q),
             Buf.of(kc, k_off), Buf.of(vc), part, i32(n_tok), i32(nh), i32(nkv), i32(hd),
             i32(pos0), f32(scale), i32(gq), i32(chunk), i32(n_split))
    out = Buf.out(np.float32, n_tok * nh * hd)
    E.launch("attention_merge_f32", (nh, n_tok), (128,), part, out, None, None, None, i32(n_tok),
             i32(nh), i32(hd), i32(n_split))
    if hd % 32 == 0:
        # With out_q: the same output, and its Q8_1 blocks as quantize_q8_1 writes them.
        out2 = Buf.out(np.float32, n_tok * nh * hd)
        oq = Buf.out(np.uint8, n_tok * nh * hd // 32 * 36)
        aq, ads = split_sink(n_tok * nh * hd)
        E.launch("attention_merge_f32", (nh, n_tok), (128,), part, out2, oq, aq, ads, i32(n_tok),
                 i32(nh), i32(hd), i32(n_split))
        got = out.get(np.float32)
        g.true(label + ": output with out_q",
               np.array_equal(out2.get(np.float32), got, equal_nan=True))
        g.exact(label + ": out_q = quantize_q8_1 of it", oq.get(np.uint8).reshape(-1, 36),
                quantize_q8_1(got), dims=("block", "byte"))
        if np.isfinite(got).all():
            check_split_sink(g, label, aq, ads, got)
    return out.get(np.float32).reshape(n_tok, nh, hd)


def check_flash_decode(g):
    cases = [  # head_dim, n_tok, pos0, n_head, n_head_kv, heads per block, chunk
        (128, 1, 299, 8, 2, 4, 64),    # decode, GQA 4:1 in one block, a partial last chunk
        (128, 1, 299, 8, 2, 2, 32),    # two blocks per KV head
        (64, 3, 100, 6, 2, 3, 40),     # 3 tokens: token 0 does not reach the last chunk's end
        (256, 2, 130, 4, 1, 4, 256),   # largest head_dim, one chunk holding everything
        (32, 1, 70, 2, 2, 1, 16),      # smallest head_dim, no GQA, 5 chunks
        (128, 8, 0, 4, 4, 1, 3),       # 8 tokens from position 0: chunks no token reaches
        (64, 1, 0, 8, 1, 8, 1),        # one position, 8 heads per block, chunk of 1
        (64, 2, 1000, 2, 1, 2, 4),     # 251 chunks: the merge's threads take two each
    ]
    for hd, n_tok, pos0, nh, nkv, gq, chunk in cases:
        label = f"hd={hd} n_tok={n_tok} pos0={pos0} heads={nh}/{nkv} gq={gq} chunk={chunk}"
        q, kc, vc, scale = attention_data("flash decode " + label, hd, n_tok, pos0, nh, nkv, 2)
        got = flash_decode(g, label, q, kc, vc, n_tok, nh, nkv, hd, pos0, scale, gq, chunk)
        close_attention(g, label, got, q, kc, vc, n_tok, nh, nkv, hd, pos0, scale)
    # Large scores (q * 40): the chunks' maxima differ by far more than exp's range, so a merge
    # that forgot to rescale would be off by orders of magnitude.
    hd, nh, nkv, pos0 = 64, 4, 2, 200
    rng = rng_for("flash decode peaked")
    q = (rng.standard_normal(nh * hd) * 40).astype(np.float32)
    kc = rng.standard_normal((pos0 + 1) * nkv * hd).astype(np.float16)
    vc = rng.standard_normal((pos0 + 1) * nkv * hd).astype(np.float16)
    got = flash_decode(g, "peaked", q, kc, vc, 1, nh, nkv, hd, pos0, 0.125, 2, 32)
    want = refs.attention(q, kc, vc, 1, nh, nkv, hd, pos0, 0.125)
    g.close("peaked scores (q x 40), 7 chunks", got, want, 2e-5, np.abs(vc.astype(np.float32)).max(),
            dims=("t", "head", "d"), metric="err/max|v|")
    # Unsupported: head_dim 96 (not 32/64/128/256), gq not dividing the group, gq * head_dim over
    # 1024, a K cache off 16-byte alignment: every output of the call is NaN.
    for hd, nh, nkv, gq, k_off, why in ((96, 2, 1, 2, 0, "head_dim 96"),
                                        (64, 6, 2, 2, 0, "gq 2 of group 3"),
                                        (256, 8, 1, 8, 0, "gq x head_dim 2048"),
                                        (64, 2, 1, 2, 8, "k cache + 8 bytes")):
        z = np.zeros(4 * nkv * hd, np.float16)
        got = flash_decode(g, why, np.ones(nh * hd, np.float32), z, z, 1, nh, nkv, hd, 3, 1.0,
                           gq, 2, k_off)
        g.true(f"{why} -> NaN rows", np.isnan(got).all())


# ---------------------------------------------------------------------------------------------


def check_coverage(g, src_dir):
    """Every kernel in src/kernels/cuda was launched above; every .cu there was built."""
    ours = {n for n, (src, _) in E.kernels.items() if os.path.exists(os.path.join(src_dir, src))}
    sources = {f for f in os.listdir(src_dir) if f.endswith(".cu")}
    built = {src for src, _ in E.kernels.values()}
    g.true(f"every .cu in {src_dir} built", sources <= built,
           f"missing: {sorted(sources - built)}" if not sources <= built else
           f"{len(sources)} sources")
    missing = sorted(ours - E.launched)
    g.true("every kernel has a check", not missing,
           f"no check for: {missing}" if missing else f"{len(ours)} kernels")


def load_golden(data_dir):
    with open(os.path.join(data_dir, "manifest.json")) as f:
        manifest = json.load(f)
    for c in manifest["cases"]:
        with open(os.path.join(data_dir, c["input"]), "rb") as f:
            inp = f.read()
        with open(os.path.join(data_dir, c["expected"]), "rb") as f:
            exp = f.read()
        GOLDEN[(c["op"], c["type"])] = (inp, exp)


def main():
    global E
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--only", help="run the check groups whose names match this regex")
    args = ap.parse_args()
    E = Emu(args.lib)
    load_golden(args.data)
    np.seterr(over="ignore")  # f32 -> f16 overflows to inf in the reference conversions
    r = Report(args.verbose, args.only)
    r.run("emulator", check_emulator)
    r.run("quantize_q8_1", check_quantize)
    r.run("round_q8_f16", check_round_q8_f16)
    for t in refs.QTYPES:
        r.run(f"dequant_{t}_f16", check_dequant, t)
    r.run("dequant_bf16_f16", check_dequant_bf16)
    for k in ("f32_to_f16", "f16_to_f32", "store_kv_f16"):
        r.run(k, check_f16_conversions, k)
    for t in refs.QTYPES:
        r.run(f"mmvq_{t}", check_mmvq, t)
    for t in refs.QTYPES:
        r.run(f"mmvq_multi_{t}", check_mmvq_multi, t)
    for t in refs.QTYPES:
        r.run(f"mmvq_pipe_{t}", check_mmvq_pipe, t)
    r.run("quantize_q8_1_split", check_quantize_split)
    for t in refs.QTYPES:
        r.run(f"mmvq_direct_{t}", check_mmvq_direct, t)
    r.run("split_blocks", check_split_blocks)
    for t in SPLIT_MMVQ_TYPES:
        r.run(f"mmvq_split_{t}", check_mmvq_split, t)
        r.run(f"mmvq_split_glu_{t}", check_mmvq_split_glu, t)
        r.run(f"mmvq_split_qkv_rope_{t}", check_mmvq_split_qkv_rope, t)
    for t in SPLIT_TYPES:
        r.run(f"dequant_split_{t}_f16", check_dequant_split, t)
    for w in ("f32", "f16", "bf16"):
        r.run(f"mmv_{w}w", check_mmv, w)
    for t in MMQ_TYPES:
        r.run(f"mmq_{t}", check_mmq, t)
    r.run("rms_norm_f32", check_rms_norm)
    for k in ("rms_norm_q8_1", "swiglu_q8_1"):
        r.run(k, check_fused_q8_1, k)
    r.run("add_rms_norm_q8_1", check_add_rms_norm_q8_1)
    r.run("rope_f32", check_rope)
    r.run("rope_store_kv_f16", check_rope_store_kv)
    for k in ("add_f32", "add_bias_f32", "scale_f32", "swiglu_f32"):
        r.run(k, check_elementwise, k)
    r.run("copy_cols_f32", check_copy_cols)
    r.run("gpu_sleep", check_gpu_sleep)
    r.run("attention_f16kv", check_attention)
    r.run("flash_decode", check_flash_decode)
    r.run("attention_flash_f16kv", check_flash_prefill)
    r.run("attention_flash_mma_f16kv", check_flash_mma)
    r.run("coverage", check_coverage, args.src)
    if not r.groups:
        print(f"cuda-emu: --only {args.only!r} matches no check group")
        return 1
    return 0 if r.summary() else 1


if __name__ == "__main__":
    sys.exit(main())
