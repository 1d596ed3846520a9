//! F16 and BF16 prefill on AVX-512 CPUs. The half-precision activations are laid out once per
//! operator in the order the tile reads them, and each panel of weight rows once per block of
//! tokens into a buffer that stays in L2: BF16 widened to f32 (both types' products are exact in
//! f32, so the tiles are the same), F16 kept as f16 and widened by the tile's own loads
//! (`vcvtph2ps`, which Zen 5 runs beside the FMAs: half the bytes from L2 per FMA, 1B shape F16
//! pp64 +4-5%, its ffn_down 97-101 -> 87-89 ms a forward, alternated); every
//! row of a panel runs against one group of eight tokens before the next group (the group's
//! activations and output lines stay in L1), and while a panel's tiles run, the next panel's
//! weight rows are prefetched a cache line per step.
//!
//! Every output is computed as `avx2::vec_dot_f16` (`vec_dot_bf16`) computes it
//! (`scalar::dot_wide`'s order): lane (c, l) of four 8-lane FMA chains takes the elements
//! `i % 32 == 8c + l` as `fma(w, a, acc)`, then `(c0 + c1) + (c2 + c3)` lane-wise, `hsum8`, then
//! the `k % 32` tail elements by FMA in order. The chains are independent, so the tile runs them
//! one after the other: a 512-bit register holds two tokens' 8 lanes of one chain, and one chain
//! of six rows x eight tokens is 24 accumulators, each weight load feeding four FMAs and each
//! activation load six. The lane sums of a tile are taken across registers with `hsum8`'s
//! pairings ([`reduce_pair`]) and stored six rows at a time. Tiled and single-row results are
//! bit-identical.
//!
//! BF16 on CPUs with AVX512-BF16 runs the same chains two steps per instruction: weights and
//! activations laid out as bf16 pairs of consecutive steps of each lane ([`WideActs::dp`],
//! [`dp_rows`]), `vdpbf16ps` adds the first step's product and rounds, then the second's, as the
//! chain's two FMAs do, wherever its flushing of subnormals cannot act ([`dp_outside`]; panels and
//! operators with other values take the f32 tiles).

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::cell::Cell;
use std::mem::MaybeUninit;
use std::ops::Range;

use crate::kernels::cpu::matmul::{Out, QuantizedActs};
use crate::kernels::cpu::spare::Spared;
use crate::kernels::cpu::{LinePrefetch, pool};
use crate::quant::GgmlType;
use crate::quant::blocks::{bf16_to_f32, f16_bits_to_f32};

/// Sixteen f32 lanes, aligned as a 512-bit register.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct Lanes16([f32; 16]);

/// Sixteen f16 values, aligned as a 256-bit register.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub struct Halves16([u16; 16]);

/// Eight f32 lanes, aligned as a 256-bit register.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Lanes8([f32; 8]);

/// Weight rows per tile.
const MAX_ROWS: usize = 6;

/// Token pairs per tile: six rows x four pairs is 24 accumulators of the 32 registers.
const MAX_PAIRS: usize = 4;

/// Bytes of widened activations per block of tokens: each weight row block is widened once per
/// token block and runs against every pair in it, the pairs streaming from L3. 1B shape F16,
/// pp64 / pp512, one EPYC thread, t/s by block: 256 KiB 36.4 / -, 512 KiB 41.8 / 41.0, 2 MiB
/// 45.6 / 45.0, 4 MiB 44.4 / -, 8 MiB - / 46.5, 32 MiB - / 41.4 (smaller blocks re-widen the
/// weights too often, larger ones leave L3).
const TOKEN_BLOCK_BYTES: usize = 4 << 20;

/// F16 or BF16 activations laid out for the tiles, two tokens (a pair) at a time:
/// `[pair][chain][step]`, where entry (c, s) holds elements 32s + 8c..32s + 8c + 8 of token 2q
/// (lanes 0..8) and of token 2q + 1 (lanes 8..16), as f32 ([`Lanes16`], BF16) or f16
/// ([`Halves16`], F16); pairs [`pair_stride`] entries apart. A token after the last whole pair and
/// elements after the last whole step are not laid out.
pub struct WideActs {
    /// F16 or BF16: the activations' type, and the weights' these tiles take.
    ty: GgmlType,
    /// BF16: the pairs widened to f32 ([`Lanes16`]). F16: the pairs in the same order but kept
    /// as f16 ([`Halves16`]: entry (c, s) holds token 2q's eight elements then token 2q + 1's),
    /// widened by the tile's loads (`vcvtph2ps`), which halves the bytes the tiles read.
    data: Pairs,
    /// BF16 on a CPU with AVX512-BF16, every value within [`dp_exact`]'s range: the pairs again
    /// as bf16 pairs of steps (`[pair][chain][step pair]`: entry (c, t) holds, in 32-bit lane l
    /// of each token's half, element `32 (2t) + 8c + l` in the high 16 bits and `32 (2t + 1) +
    /// 8c + l` (0 past the last step) in the low), for `vdpbf16ps`.
    dp: Option<Spared<Lanes16>>,
    steps: usize,
    n_pairs: usize,
}

impl WideActs {
    /// Lays out F16 or BF16 activations when the AVX-512 tiles will use them (`None` otherwise:
    /// another type, another instruction set, or fewer than four tokens).
    pub fn new(acts: &QuantizedActs) -> Option<WideActs> {
        use crate::kernels::cpu::{Isa, isa};
        if !half(acts.ty) || acts.n_tok < 4 || isa() != Isa::Avx512 {
            return None;
        }
        Some(Self::widen(acts))
    }

    /// The weights' type these activations go with (F16 or BF16).
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Lays out the whole pairs of `acts` (F16 or BF16, on a CPU with AVX-512).
    fn widen(acts: &QuantizedActs) -> WideActs {
        assert!(half(acts.ty) && crate::kernels::cpu::Isa::Avx512.supported());
        let bf16 = acts.ty == GgmlType::BF16;
        let steps = acts.k / 32;
        let n_pairs = acts.n_tok / 2;
        if !bf16 {
            return WideActs {
                ty: acts.ty,
                data: Pairs::Half(Self::half_pairs(acts, steps, n_pairs)),
                dp: None,
                steps,
                n_pairs,
            };
        }
        thread_local! {
            static SPARE: Cell<Vec<Lanes16>> = const { Cell::new(Vec::new()) };
        }
        let (data, _) = lay_out_pairs(&SPARE, n_pairs, steps * 4, |q, dst| {
            // SAFETY: this CPU has AVX-512 (asserted above); `lay_pair` writes every entry.
            unsafe { lay_pair::<true, _>([acts.row(2 * q), acts.row(2 * q + 1)], dst) };
            true
        });
        let data = Pairs::Wide(data);
        let dp = if dp_supported() {
            Self::dp_pairs(acts, steps, n_pairs)
        } else {
            None
        };
        WideActs {
            ty: acts.ty,
            data,
            dp,
            steps,
            n_pairs,
        }
    }

    /// The whole pairs of F16 `acts` in the tiles' order, as f16 ([`WideActs::data`]).
    fn half_pairs(acts: &QuantizedActs, steps: usize, n_pairs: usize) -> Spared<Halves16> {
        thread_local! {
            static SPARE: Cell<Vec<Halves16>> = const { Cell::new(Vec::new()) };
        }
        lay_out_pairs(&SPARE, n_pairs, steps * 4, |q, dst| {
            // SAFETY: this CPU has AVX-512 (`widen` asserted it); `lay_pair` writes every entry.
            unsafe { lay_pair::<false, _>([acts.row(2 * q), acts.row(2 * q + 1)], dst) };
            true
        })
        .0
    }

    /// The whole pairs of BF16 `acts` as bf16 pairs of steps ([`WideActs::dp`]), or `None` when
    /// a value is outside [`dp_exact`]'s range.
    fn dp_pairs(acts: &QuantizedActs, steps: usize, n_pairs: usize) -> Option<Spared<Lanes16>> {
        thread_local! {
            static SPARE: Cell<Vec<Lanes16>> = const { Cell::new(Vec::new()) };
        }
        let (data, ok) = lay_out_pairs(&SPARE, n_pairs, steps.div_ceil(2) * 4, |q, dst| {
            // SAFETY: `dp_supported` checked AVX512-BF16 (and `widen` AVX-512); `dp_pair` writes
            // every entry.
            unsafe { dp_pair([acts.row(2 * q), acts.row(2 * q + 1)], steps, dst) }
        });
        ok.then_some(data)
    }

    /// Tokens the tiles cover: 0..2 * n_pairs.
    pub fn n_tok(&self) -> usize {
        2 * self.n_pairs
    }

    /// Pair q widened to f32 (BF16 activations).
    fn pair(&self, q: usize) -> &[Lanes16] {
        let n = self.steps * 4;
        let at = q * pair_stride(n);
        match &self.data {
            Pairs::Wide(d) => &d[at..at + n],
            Pairs::Half(_) => panic!("F16 pairs are kept as f16"),
        }
    }

    /// Pair q as f16 (F16 activations).
    fn pair_half(&self, q: usize) -> &[Halves16] {
        let n = self.steps * 4;
        let at = q * pair_stride(n);
        match &self.data {
            Pairs::Half(d) => &d[at..at + n],
            Pairs::Wide(_) => panic!("BF16 pairs are widened"),
        }
    }

    /// Pair q in the bf16 pairs' layout (when there is one).
    fn pair_dp(&self, q: usize) -> &[Lanes16] {
        let n = self.steps.div_ceil(2) * 4;
        let at = q * pair_stride(n);
        &self.dp.as_ref().expect("bf16 pairs")[at..at + n]
    }
}

/// The activations' pairs as the tiles read them ([`WideActs::data`]).
enum Pairs {
    Wide(Spared<Lanes16>),
    Half(Spared<Halves16>),
}

/// Output pointer for tasks that write disjoint pairs.
struct SharedPairs<T>(*mut MaybeUninit<T>);
// SAFETY: tasks write disjoint ranges of the buffer, which outlives the parallel loop.
unsafe impl<T: Send> Sync for SharedPairs<T> {}

/// `n_pairs` pairs of `per_pair` entries each, [`pair_stride`] apart, in a buffer from `home`'s
/// spare: `fill(q, dst)` writes every entry of pair q (on the pool; false: a value it cannot
/// take), the padding after each pair is zeroed. Returns the buffer and whether every `fill`
/// returned true.
fn lay_out_pairs<T: Copy + Send + Default + 'static>(
    home: &'static crate::kernels::cpu::spare::Home<T>,
    n_pairs: usize,
    per_pair: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<T>]) -> bool + Sync,
) -> (Spared<T>, bool) {
    let stride = pair_stride(per_pair);
    let mut room = Spared::room(home, n_pairs * stride);
    let out = SharedPairs(room.uninit().as_mut_ptr());
    let bad = std::sync::atomic::AtomicBool::new(false);
    pool::global().for_chunks(n_pairs, 16, |pairs| {
        let out = &out;
        for q in pairs {
            // SAFETY: pair q owns entries q * stride..(q + 1) * stride of the room, disjoint
            // across tasks.
            let all = unsafe { std::slice::from_raw_parts_mut(out.0.add(q * stride), stride) };
            let (dst, pad) = all.split_at_mut(per_pair);
            pad.fill(MaybeUninit::new(T::default()));
            if !fill(q, dst) {
                bad.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    // SAFETY: `fill` wrote every entry of each pair (its contract), the loop the padding.
    (unsafe { room.filled() }, !bad.into_inner())
}

/// Whether the tiles take weights (and activations) of type `ty`.
fn half(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F16 | GgmlType::BF16)
}

/// Entries ([`Lanes16`], [`Halves16`]) from one pair's activations to the next's: `n` and four
/// more, so that the pairs a tile reads at once are not a multiple of 4 KiB apart. With a
/// multiple, the tile's simultaneous loads share their low address bits and collide in L1: a C
/// copy of the f32 tile (24 FMAs, ten loads a step, all in L1) ran at 68% of one Zen 5 core's
/// FMA peak with 4 KiB strides, 87% with 256 bytes more per row and pair. In the model, where the
/// tiles read L2, the padding moved nothing measurable (1B shape F16 pp64 within 1%).
fn pair_stride(n: usize) -> usize {
    n + 4
}

/// Entries ([`Lanes8`]) from one widened weight row of a panel to the next: `n` and a few more,
/// for the reason [`pair_stride`] gives.
fn row_stride(n: usize) -> usize {
    n + 8
}

/// Sixteen bf16 values widened exactly to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn widen16(v: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
}

/// Eight half-precision values from element i of a row of 2-byte values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load8(b: &[u8], i: usize) -> __m128i {
    debug_assert!(2 * (i + 8) <= b.len());
    _mm_loadu_si128(b.as_ptr().add(2 * i).cast())
}

/// Two tokens' rows into `dst` in [`WideActs::data`]'s order, entry (c, s) holding token 0's
/// elements 32s + 8c..+8 then token 1's: `WIDE`, bf16 widened to f32 (`T` = [`Lanes16`]); else
/// as they are, f16 (`T` = [`Halves16`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn lay_pair<const WIDE: bool, T>(rows: [&[u8]; 2], dst: &mut [MaybeUninit<T>]) {
    assert_eq!(size_of::<T>(), if WIDE { 64 } else { 32 });
    let steps = dst.len() / 4;
    assert!(rows.iter().all(|r| r.len() >= 64 * steps));
    for c in 0..4 {
        for s in 0..steps {
            let i = 32 * s + 8 * c;
            let two = _mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(load8(rows[0], i)),
                load8(rows[1], i),
            );
            let at = dst[c * steps + s].as_mut_ptr();
            if WIDE {
                _mm512_store_ps(at.cast(), widen16(two));
            } else {
                _mm256_store_si256(at.cast(), two);
            }
        }
    }
}

/// `R` F16 weight rows into `dst` (viewed as 16-byte entries) as `[row][chain][step]`, rows
/// [`row_stride`] entries apart: entry (r, c, s) holds row r's elements 32s + 8c..+8 as f16.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pack_rows<const R: usize>(rows: [&[u8]; R], steps: usize, dst: &mut [Lanes8]) {
    let rs = row_stride(4 * steps);
    assert!(
        2 * dst.len() >= (R - 1) * rs + 4 * steps && rows.iter().all(|r| r.len() >= 64 * steps)
    );
    let d = dst.as_mut_ptr().cast::<__m128i>();
    for (r, row) in rows.iter().enumerate() {
        let base = d.add(r * rs);
        for s in 0..steps {
            for c in 0..4 {
                let v = _mm_loadu_si128(row.as_ptr().add(64 * s + 16 * c).cast());
                _mm_store_si128(base.add(c * steps + s), v);
            }
        }
    }
}

/// Widens `R` BF16 weight rows into `dst` as `[row][chain][step]` of [`Lanes8`]: entry
/// (r, c, s) holds row r's elements 32s + 8c..32s + 8c + 8.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn widen_rows<const R: usize>(rows: [&[u8]; R], steps: usize, dst: &mut [Lanes8]) {
    let rs = row_stride(4 * steps);
    assert!(dst.len() >= (R - 1) * rs + 4 * steps && rows.iter().all(|r| r.len() >= 64 * steps));
    let d = dst.as_mut_ptr().cast::<f32>();
    for (r, row) in rows.iter().enumerate() {
        let base = d.add(r * 8 * rs);
        for s in 0..steps {
            for h in 0..2 {
                // Elements 32s + 16h..32s + 16h + 16: chains 2h and 2h + 1.
                let x = widen16(_mm256_loadu_si256(row.as_ptr().add(64 * s + 32 * h).cast()));
                let lo = _mm512_castps512_ps256(x);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)));
                _mm256_store_ps(base.add(8 * ((2 * h) * steps + s)), lo);
                _mm256_store_ps(base.add(8 * ((2 * h + 1) * steps + s)), hi);
            }
        }
    }
}

/// Whether this CPU runs BF16 tiles on `vdpbf16ps` (AVX512-BF16), unless `OATO_CPU_BF16DP=0`.
fn dp_supported() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && crate::kernels::cpu::matmul::env_on("OATO_CPU_BF16DP")
    })
}

/// Lanes of sixteen bf16 values `v` that are not zero and not within `2^-56 <= |x| < inf` (as
/// a mask). `vdpbf16ps` treats subnormal inputs and results as zero where an FMA does not; with
/// every input zero or at least `2^-56` in size, each product is a multiple of `2^-126` and so
/// is every sum along a chain, which is then zero or normal: the instruction's two rounded
/// additions per lane are then exactly the FMA chain's two steps (NaN and infinity are left to
/// the FMAs too).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dp_outside(v: __m256i) -> __mmask16 {
    let m = _mm256_and_si256(v, _mm256_set1_epi16(0x7FFF));
    let tiny = _mm256_cmplt_epu16_mask(
        _mm256_sub_epi16(m, _mm256_set1_epi16(1)),
        _mm256_set1_epi16(71 * 128 - 1),
    );
    tiny | _mm256_cmpge_epu16_mask(m, _mm256_set1_epi16(255 * 128))
}

/// Eight 32-bit lanes of bf16 step pairs from eight elements `a` (step 2t, the high halves) and
/// `b` (step 2t + 1, the low halves).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn step_pairs(a: __m128i, b: __m128i) -> __m256i {
    _mm256_inserti128_si256::<1>(
        _mm256_castsi128_si256(_mm_unpacklo_epi16(b, a)),
        _mm_unpackhi_epi16(b, a),
    )
}

/// Eight bf16 values from element i of a row, or zeros at and past element `end`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load8_or_zero(b: &[u8], i: usize, end: usize) -> __m128i {
    if i < end {
        load8(b, i)
    } else {
        _mm_setzero_si128()
    }
}

/// Two tokens' bf16 rows as step pairs ([`WideActs::dp`]) into `dst`; false when a value is
/// outside [`dp_outside`]'s range (`dst` is then written but not to be used).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dp_pair(rows: [&[u8]; 2], steps: usize, dst: &mut [MaybeUninit<Lanes16>]) -> bool {
    let tsteps = steps.div_ceil(2);
    let full = 32 * steps;
    assert!(dst.len() >= 4 * tsteps && rows.iter().all(|r| r.len() >= 2 * full));
    let mut bad: __mmask16 = 0;
    for c in 0..4 {
        for t in 0..tsteps {
            let (i, j) = (64 * t + 8 * c, 64 * t + 32 + 8 * c);
            let half = |r: &[u8]| {
                let (a, b) = (load8(r, i), load8_or_zero(r, j, full));
                (
                    step_pairs(a, b),
                    _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b),
                )
            };
            let ((p0, v0), (p1, v1)) = (half(rows[0]), half(rows[1]));
            bad |= dp_outside(v0) | dp_outside(v1);
            let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(p0), p1);
            _mm512_store_si512(dst[c * tsteps + t].as_mut_ptr().cast(), z);
        }
    }
    bad == 0
}

/// `R` bf16 weight rows into `dst` as step pairs, `[row][chain][step pair]` of [`Lanes8`]
/// (entry (r, c, t): lane l holds row r's elements `32 (2t) + 8c + l` high and `32 (2t + 1) +
/// 8c + l` low); false when a value is outside [`dp_outside`]'s range.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dp_rows<const R: usize>(rows: [&[u8]; R], steps: usize, dst: &mut [Lanes8]) -> bool {
    let tsteps = steps.div_ceil(2);
    let full = 32 * steps;
    let rs = row_stride(4 * tsteps);
    assert!(dst.len() >= (R - 1) * rs + 4 * tsteps && rows.iter().all(|r| r.len() >= 2 * full));
    let d = dst.as_mut_ptr().cast::<__m256i>();
    let mut bad: __mmask16 = 0;
    for (r, row) in rows.iter().enumerate() {
        for c in 0..4 {
            for t in 0..tsteps {
                let a = load8(row, 64 * t + 8 * c);
                let b = load8_or_zero(row, 64 * t + 32 + 8 * c, full);
                bad |= dp_outside(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b));
                _mm256_store_si256(d.add(r * rs + c * tsteps + t), step_pairs(a, b));
            }
        }
    }
    bad == 0
}

/// The four chains' accumulators of a tile (`$chain(c, pf)`, `[pair][row]`) combined as they
/// come, `(c0 + c1) + (c2 + c3)` (so no zeroed array of all four is needed), then reduced to one
/// register per pair ([`reduce_pair`]). A macro, so that it compiles inside each tile's own
/// target features.
macro_rules! combine_chains {
    ($chain:ident, $pf:ident) => {{
        let add = |a: [[__m512; R]; P], b: [[__m512; R]; P]| -> [[__m512; R]; P] {
            std::array::from_fn(|p| std::array::from_fn(|r| _mm512_add_ps(a[p][r], b[p][r])))
        };
        let (c0, c1) = ($chain(0, $pf), $chain(1, $pf));
        let s01 = add(c0, c1);
        let (c2, c3) = ($chain(2, $pf), $chain(3, $pf));
        let sum = add(s01, add(c2, c3));
        std::array::from_fn(|p| reduce_pair(&sum[p]))
    }};
}

/// One tile's four chains, run one after the other over `$steps` steps each (step `$i` of chain
/// c is entry `c * steps + s` of every laid-out row and pair), then [`combine_chains`]: `$y` loads
/// pair `$p`'s entry, `$w` row `$r`'s (broadcast to both tokens' halves), and `$fma` adds
/// `$wz` x `$yp` into `$acc`; `$pf_steps` prefetched lines a step. A macro, so that the three
/// tiles share one loop and each compiles inside its own target features.
macro_rules! tile_chains {
    ($steps:expr, $pf:ident, $pf_steps:expr, |$i:ident, $p:ident| $y:expr, |$r:ident| $w:expr,
     |$acc:ident, $wz:ident, $yp:ident| $fma:expr) => {{
        let chain = |c: usize, pf: &mut LinePrefetch| {
            let mut acc = [[_mm512_setzero_ps(); R]; P];
            for s in 0..$steps {
                let $i = c * $steps + s;
                let y: [_; P] = std::array::from_fn(|$p| $y);
                #[allow(clippy::needless_range_loop)]
                for $r in 0..R {
                    let $wz = $w;
                    for p in 0..P {
                        let ($acc, $yp) = (acc[p][$r], y[p]);
                        acc[p][$r] = $fma;
                    }
                }
                for _ in 0..$pf_steps {
                    pf.step();
                }
            }
            acc
        };
        combine_chains!(chain, $pf)
    }};
}

/// [`tile`] on bf16 step pairs (`w` as [`dp_rows`] lays them out, `a` as [`WideActs::dp`]) over
/// `tsteps` step pairs: one `vdpbf16ps` per (row, pair) and two steps, each lane adding its
/// high product then its low one, rounded after each as the FMA chain is.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")]
unsafe fn tile_dp<const R: usize, const P: usize>(
    w: &[Lanes8],
    a: [&[Lanes16]; P],
    tsteps: usize,
    pf: &mut LinePrefetch,
) -> [__m512; P] {
    let rs = row_stride(4 * tsteps);
    assert!(w.len() >= (R - 1) * rs + 4 * tsteps && a.iter().all(|a| a.len() >= 4 * tsteps));
    let wp = w.as_ptr().cast::<f32>();
    let ap: [*const f32; P] = std::array::from_fn(|p| a[p].as_ptr().cast::<f32>());
    // SAFETY (all loads): every entry i < 4 * tsteps, inside `a` and `w` (checked above).
    tile_chains!(
        tsteps,
        pf,
        2,
        |i, p| std::mem::transmute::<__m512, __m512bh>(_mm512_load_ps(ap[p].add(16 * i))),
        |r| {
            let w8 = _mm256_load_pd(wp.add(8 * (r * rs + i)).cast());
            std::mem::transmute::<__m512d, __m512bh>(_mm512_broadcast_f64x4(w8))
        },
        |acc, wz, y| _mm512_dpbf16_ps(acc, wz, y)
    )
}

/// `R` widened weight rows (`w`, as [`widen_rows`] lays them out) against `P` widened pairs
/// (`a`), over `steps` whole 32-element steps; the lanes reduced to one sum per (row, token) by
/// [`reduce_pair`]: lane `8j + i` of `out[p]` is row i against token 2p + j of the pairs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<const R: usize, const P: usize>(
    w: &[Lanes8],
    a: [&[Lanes16]; P],
    steps: usize,
    pf: &mut LinePrefetch,
) -> [__m512; P] {
    let rs = row_stride(4 * steps);
    assert!(w.len() >= (R - 1) * rs + 4 * steps && a.iter().all(|a| a.len() >= 4 * steps));
    let wp = w.as_ptr().cast::<f32>();
    let ap: [*const f32; P] = std::array::from_fn(|p| a[p].as_ptr().cast::<f32>());
    // SAFETY (all loads): every entry i < 4 * steps, inside `a` and `w` (checked above).
    tile_chains!(
        steps,
        pf,
        1,
        |i, p| _mm512_load_ps(ap[p].add(16 * i)),
        |r| _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_load_pd(
            wp.add(8 * (r * rs + i)).cast()
        ))),
        |acc, wz, y| _mm512_fmadd_ps(wz, y, acc)
    )
}

/// [`tile`] on f16: `R` rows packed by [`pack_rows`] (16-byte entries of `w`) against `P` f16
/// pairs, each load widened as it comes (`vcvtph2ps`; a row's eight elements broadcast to both
/// tokens' halves first). The same values reach the same FMAs in the same order as in [`tile`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_half<const R: usize, const P: usize>(
    w: &[Lanes8],
    a: [&[Halves16]; P],
    steps: usize,
    pf: &mut LinePrefetch,
) -> [__m512; P] {
    let rs = row_stride(4 * steps);
    assert!(2 * w.len() >= (R - 1) * rs + 4 * steps && a.iter().all(|a| a.len() >= 4 * steps));
    let wp = w.as_ptr().cast::<__m128i>();
    let ap: [*const __m256i; P] = std::array::from_fn(|p| a[p].as_ptr().cast::<__m256i>());
    // SAFETY (all loads): every entry i < 4 * steps, inside `a` and `w` (checked above).
    tile_chains!(
        steps,
        pf,
        1,
        |i, p| _mm512_cvtph_ps(_mm256_load_si256(ap[p].add(i))),
        |r| _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_load_si128(
            wp.add(r * rs + i)
        ))),
        |acc, wz, y| _mm512_fmadd_ps(wz, y, acc)
    )
}

/// Each of up to eight rows' lanes (`s[i]`: row i's eight lanes of token 0 in lanes 0..8, of token
/// 1 in lanes 8..16) summed as `hsum8` sums them, all at once: lane `8j + i` of the result is row
/// i, token j (rows from `s.len()` on are zero). `hsum8` adds the high four lanes to the low
/// four, then lanes 2 and 3 to 0 and 1, then lane 1 to 0; the same pairs are added here across
/// registers, and a sum does not depend on its operands' order, so the results are the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn reduce_pair(s: &[__m512]) -> __m512 {
    use crate::kernels::cpu::avx512::{add_elems, add_quarters, sum_tree8};
    // Quarters of a register: (row a, token 0), (a, 1), (b, 0), (b, 1), each high half + low;
    // then within each quarter elements 0 + 2 and 1 + 3 of one register, then of the other; then
    // 0 + 1 and 2 + 3. Quarter 0 ends as rows 0, 2, 4, 6 of token 0; 1: the same of token 1; 2
    // and 3: rows 1, 3, 5, 7.
    sum_tree8(
        s,
        |a, b| add_quarters::<0b10_00_10_00, 0b11_01_11_01>(a, b),
        |a, b| add_elems::<0b01_00_01_00, 0b11_10_11_10>(a, b),
        |a, b| add_elems::<0b10_00_10_00, 0b11_01_11_01>(a, b),
        _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15),
    )
}

/// Element i of a row of F16 (or BF16) bytes.
fn elem(ty: GgmlType, b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
    if ty == GgmlType::BF16 {
        bf16_to_f32(bits)
    } else {
        f16_bits_to_f32(bits)
    }
}

/// Rows `rows` of an F16 or BF16 weight (`wide.ty()`; `row(r)`: its bytes) against the tokens
/// `wide` covers, written
/// through `out`: token blocks of about [`TOKEN_BLOCK_BYTES`], panels of about
/// [`PANEL_BYTES`] of widened weights.
pub(crate) fn run_rows<'w>(
    wide: &WideActs,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    out: Out,
) {
    // A pair's bytes, and a panel row's: f32 (BF16) or f16 (F16).
    let (pair_bytes, row_bytes) = match wide.data {
        Pairs::Wide(_) => (wide.steps * 4 * size_of::<Lanes16>(), wide.steps * 128),
        Pairs::Half(_) => (wide.steps * 4 * size_of::<Halves16>(), wide.steps * 64),
    };
    let pairs_per_block = TOKEN_BLOCK_BYTES / pair_bytes.max(1);
    let panel_rows = PANEL_BYTES / row_bytes.max(1);
    let panel_rows = (panel_rows / MAX_ROWS * MAX_ROWS).clamp(MAX_ROWS, MAX_PANEL_ROWS);
    run_blocks(
        wide,
        acts,
        row,
        rows,
        pairs_per_block.max(1),
        panel_rows,
        out,
    )
}

/// Bytes of laid-out weight rows per panel (f32 for BF16, f16 for F16): a panel's rows run
/// against each group of pairs before the next group, so the group's activations are read once
/// per panel (from L1/L2) and the group's output lines are filled while they are in L1. Best of
/// 5 / 3 / 2 alternated runs, 2 EPYC threads, t/s by panel of widened f32 rows (six rows; 192,
/// 384, 768 KiB): 135M F16 pp512 632 / 690 / 699 / 689; 1B shape F16 pp64 91.7 / - / 89.7 /
/// 90.3, pp512 97.0 / - / 99.6 / 93.8. F16 rows kept as f16 (2 Zen 5 threads, 1B shape, pp64 /
/// pp512 t/s): 192 KiB 188.9-196.2 / 201-203, 384 KiB 187.1-188.5 / 202, 768 KiB 181.1 / -.
const PANEL_BYTES: usize = 384 << 10;

/// `Lanes8` entries from one block of six packed f16 rows ([`pack_rows`]) to the next.
fn half_block(steps: usize) -> usize {
    (MAX_ROWS * row_stride(4 * steps)).div_ceil(2)
}

/// Most rows in a panel.
const MAX_PANEL_ROWS: usize = 96;

/// [`run_rows`] with `pairs_per_block` pairs per token block and panels of `panel_rows` rows (a
/// multiple of [`MAX_ROWS`]): in each token block, for each panel, for each group of up to four
/// pairs, the panel's rows six at a time (then the rest).
fn run_blocks<'w>(
    wide: &WideActs,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    pairs_per_block: usize,
    panel_rows: usize,
    out: Out,
) {
    thread_local! {
        /// The widened weight rows of a panel, kept per thread across operators.
        static WBUF: std::cell::RefCell<Vec<Lanes8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    debug_assert!(panel_rows >= MAX_ROWS && panel_rows.is_multiple_of(MAX_ROWS));
    WBUF.with_borrow_mut(|wbuf| {
        // Widened f32 rows take a `Lanes8` an entry, packed f16 rows half of one (and BF16 step
        // pairs fit in the f32 rows' room).
        let need = match wide.data {
            Pairs::Wide(_) => panel_rows * row_stride(4 * wide.steps),
            Pairs::Half(_) => panel_rows.div_ceil(MAX_ROWS) * half_block(wide.steps),
        };
        if wbuf.len() < need {
            wbuf.resize(need, Lanes8([0.0; 8]));
        }
        let wbuf = &mut wbuf[..need];
        let mut q0 = 0;
        while q0 < wide.n_pairs {
            let pairs = q0..(q0 + pairs_per_block).min(wide.n_pairs);
            let mut r = rows.start;
            while r < rows.end {
                let panel = r..(r + panel_rows).min(rows.end);
                let more_tokens = pairs.end < wide.n_pairs;
                let mut pf =
                    LinePrefetch::next_block(&rows, panel.end, panel_rows, more_tokens, &row);
                let b = Panel {
                    wide,
                    acts,
                    rows: panel.clone(),
                    raw: panel.clone().map(&row).collect(),
                };
                let form = b.widen(wbuf);
                b.run(&pairs, wbuf, form, &mut pf, &out);
                r = panel.end;
            }
            q0 = pairs.end;
        }
    })
}

/// `$f::<R>(rows, args…)` with the `R` (one to six) rows of the slice `$w` as an array.
macro_rules! with_rows {
    ($w:expr, $f:ident($($arg:expr),*)) => {
        match *$w {
            [a, b, c, d, e, f] => $f::<6>([a, b, c, d, e, f], $($arg),*),
            [a, b, c, d, e] => $f::<5>([a, b, c, d, e], $($arg),*),
            [a, b, c, d] => $f::<4>([a, b, c, d], $($arg),*),
            [a, b, c] => $f::<3>([a, b, c], $($arg),*),
            [a, b] => $f::<2>([a, b], $($arg),*),
            _ => $f::<1>([$w[0]], $($arg),*),
        }
    };
}

/// How a panel's weights lie in its buffer.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Form {
    /// Widened to f32 ([`widen_rows`]).
    Wide,
    /// BF16 step pairs ([`dp_rows`]).
    StepPairs,
    /// F16, packed in the tiles' order ([`pack_rows`]).
    Half,
}

/// One panel of weight rows against one token block's activations.
struct Panel<'a, 'w> {
    wide: &'a WideActs,
    acts: &'a QuantizedActs,
    rows: Range<usize>,
    /// The panel's rows' bytes.
    raw: Vec<&'w [u8]>,
}

impl Panel<'_, '_> {
    /// Widens the panel's rows into `wbuf`, six at a time (then the rest); or, BF16 rows against
    /// activations that have step pairs ([`WideActs::dp`]), lays them out as step pairs and
    /// returns true when every value allows it ([`dp_outside`]).
    fn widen(&self, wbuf: &mut [Lanes8]) -> Form {
        if let Pairs::Half(_) = self.wide.data {
            self.pack(wbuf);
            return Form::Half;
        }
        if self.wide.dp.is_some() && self.dp_rows(wbuf) {
            return Form::StepPairs;
        }
        self.widen_bf16(wbuf);
        Form::Wide
    }

    /// The panel's F16 rows packed into `wbuf` ([`pack_rows`]), six at a time (then the rest).
    fn pack(&self, wbuf: &mut [Lanes8]) {
        let steps = self.wide.steps;
        let per_block = half_block(steps);
        for (b, w) in self.raw.chunks(MAX_ROWS).enumerate() {
            let dst = &mut wbuf[b * per_block..];
            // SAFETY (all): `WideActs::new` is `Some` only on CPUs with AVX-512.
            unsafe { with_rows!(w, pack_rows(steps, dst)) }
        }
    }

    /// The panel's rows as bf16 step pairs into `wbuf`, six at a time; false when a value is
    /// outside [`dp_outside`]'s range.
    fn dp_rows(&self, wbuf: &mut [Lanes8]) -> bool {
        let steps = self.wide.steps;
        let per_row = row_stride(4 * steps.div_ceil(2));
        let mut ok = true;
        for (b, w) in self.raw.chunks(MAX_ROWS).enumerate() {
            let dst = &mut wbuf[b * MAX_ROWS * per_row..];
            // SAFETY (all): the step pairs exist only on CPUs with AVX512-BF16 (`dp_supported`).
            ok &= unsafe { with_rows!(w, dp_rows(steps, dst)) };
        }
        ok
    }

    /// [`Panel::widen`] from BF16 rows to f32.
    fn widen_bf16(&self, wbuf: &mut [Lanes8]) {
        let per_row = row_stride(4 * self.wide.steps);
        let steps = self.wide.steps;
        for (b, w) in self.raw.chunks(MAX_ROWS).enumerate() {
            let dst = &mut wbuf[b * MAX_ROWS * per_row..];
            // SAFETY (all): `WideActs::new` is `Some` only on CPUs with AVX-512.
            unsafe { with_rows!(w, widen_rows(steps, dst)) }
        }
    }

    /// The panel's rows (widened in `wbuf`) against pairs `pairs`, four pairs at a time (then
    /// the rest).
    fn run(
        &self,
        pairs: &Range<usize>,
        wbuf: &[Lanes8],
        dp: Form,
        pf: &mut LinePrefetch,
        out: &Out,
    ) {
        let mut q = pairs.start;
        while q < pairs.end {
            let n = (pairs.end - q).min(MAX_PAIRS);
            match n {
                4 => self.group::<4>(wbuf, dp, q, pf, out),
                3 => self.group::<3>(wbuf, dp, q, pf, out),
                2 => self.group::<2>(wbuf, dp, q, pf, out),
                _ => self.group::<1>(wbuf, dp, q, pf, out),
            }
            q += n;
        }
    }

    /// Every row block of the panel against pairs `q..q + P` (`dp`: `wbuf` holds step pairs).
    fn group<const P: usize>(
        &self,
        wbuf: &[Lanes8],
        dp: Form,
        q: usize,
        pf: &mut LinePrefetch,
        out: &Out,
    ) {
        let per_block = match dp {
            Form::Wide => MAX_ROWS * row_stride(4 * self.wide.steps),
            Form::StepPairs => MAX_ROWS * row_stride(4 * self.wide.steps.div_ceil(2)),
            Form::Half => half_block(self.wide.steps),
        };
        for (b, w) in self.raw.chunks(MAX_ROWS).enumerate() {
            let wb = &wbuf[b * per_block..];
            let r = self.rows.start + b * MAX_ROWS;
            // SAFETY: `WideActs::new` is `Some` only on CPUs with AVX-512.
            unsafe {
                match w.len() {
                    6 => self.tile::<6, P>(w, wb, dp, r, q, pf, out),
                    5 => self.tile::<5, P>(w, wb, dp, r, q, pf, out),
                    4 => self.tile::<4, P>(w, wb, dp, r, q, pf, out),
                    3 => self.tile::<3, P>(w, wb, dp, r, q, pf, out),
                    2 => self.tile::<2, P>(w, wb, dp, r, q, pf, out),
                    _ => self.tile::<1, P>(w, wb, dp, r, q, pf, out),
                }
            }
        }
    }

    /// Rows `r..r + R` (`w`, widened in `wbuf`) against pairs `q..q + P`, with the `k % 32` tail.
    /// Compiled for AVX-512 like the kernels it calls, so that the stores of its sums
    /// (`Out::write_pair`) are inlined into it rather than called per pair.
    ///
    /// # Safety
    /// The CPU has AVX-512 (the panels' callers check it).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const P: usize>(
        &self,
        w: &[&[u8]],
        wbuf: &[Lanes8],
        dp: Form,
        r: usize,
        q: usize,
        pf: &mut LinePrefetch,
        out: &Out,
    ) {
        let (steps, ty) = (self.wide.steps, self.wide.ty);
        let full = 32 * steps;
        // SAFETY: as in `widen`; step pairs only on CPUs with AVX512-BF16 (`dp_supported`).
        let sums = match dp {
            Form::StepPairs => {
                let a = std::array::from_fn(|p| self.wide.pair_dp(q + p));
                unsafe { tile_dp::<R, P>(wbuf, a, steps.div_ceil(2), pf) }
            }
            Form::Half => {
                let a = std::array::from_fn(|p| self.wide.pair_half(q + p));
                unsafe { tile_half::<R, P>(wbuf, a, steps, pf) }
            }
            Form::Wide => {
                let a = std::array::from_fn(|p| self.wide.pair(q + p));
                unsafe { tile::<R, P>(wbuf, a, steps, pf) }
            }
        };
        for (p, v) in sums.iter().enumerate() {
            let t = 2 * (q + p);
            if full < self.acts.k {
                // The `k % 32` tail, element by element after the lanes' sum.
                let mut lanes = [0f32; 16];
                // SAFETY: `lanes` holds sixteen f32.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *v) };
                for j in 0..2 {
                    let a = self.acts.row(t + j);
                    for (i, w) in w.iter().enumerate() {
                        let mut x = lanes[8 * j + i];
                        for e in full..self.acts.k {
                            x = elem(ty, w, e).mul_add(elem(ty, a, e), x);
                        }
                        // SAFETY: t + j < n_tok and r + i < the weight's rows (`Out`'s contract).
                        unsafe { out.write(t + j, r + i, x) };
                    }
                }
            } else {
                // SAFETY: as above, for rows r..r + R of tokens t and t + 1.
                unsafe { out.write_pair::<R>(t, r, *v) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::Isa;
    use crate::quant::{GgmlType, quantize_row};

    /// Every (token, row) over several token blocks, with row blocks of one to six, tiles of one
    /// to four token pairs, an odd token left to the caller and a
    /// `k % 32` tail, equals the single-row F16 (BF16) dot bit for bit.
    #[test]
    fn tiles_equal_single_row_dots() {
        if !Isa::Avx512.supported() {
            return;
        }
        // Magnitudes spread over 2^-8..2^8, so that the chains' sums round (with values of one
        // size, eight-bit products add up exactly and any order gives the same bits).
        let val = |i: usize, o: f32| {
            (0.1 + 2.0 * (i as f32 * 0.37 + o).cos()) * (1u32 << (i * 7 % 17)) as f32 / 256.0
        };
        // (k, tokens, a value of 1e-30: none, in weight row 7, in the activations). BF16 on a
        // CPU with AVX512-BF16 takes `vdpbf16ps` unless a value is that small: in a weight row
        // that panel falls back to the FMAs, in the activations the whole operator.
        let cases = [
            (96, 23, 0),
            (104, 12, 0),
            (64 + 13, 8, 0),
            (32 * 9 + 5, 10, 0),
            (256, 8, 1),
            (256, 8, 2),
        ];
        let types = [GgmlType::F16, GgmlType::BF16];
        for ((k, n_tok, tiny), ty) in cases.into_iter().flat_map(|c| types.map(|t| (c, t))) {
            let n = 12;
            let rb = ty.row_bytes(k).unwrap();
            let mut w = vec![0u8; rb * n];
            for (r, dst) in w.chunks_mut(rb).enumerate() {
                let mut src: Vec<f32> = (0..k).map(|i| val(r * k + i, 0.0)).collect();
                if tiny == 1 && r == 7 {
                    src[40] = 1e-30;
                }
                quantize_row(ty, &src, dst).unwrap();
            }
            let mut x: Vec<f32> = (0..k * n_tok).map(|i| val(i, 1.7)).collect();
            if tiny == 2 {
                x[k + 3] = 1e-30;
            }
            let acts = QuantizedActs::new(ty, &x, k).unwrap();
            let wide = WideActs::widen(&acts);
            assert_eq!(wide.n_tok(), n_tok / 2 * 2);
            let dp = ty == GgmlType::BF16 && dp_supported() && tiny != 2;
            assert_eq!(wide.dp.is_some(), dp, "{ty} k={k}");
            // Row ranges ending in blocks of five, four, six, three, two and one rows; pairs per
            // token block from one to all, so tiles of one to four pairs.
            let ranges = [
                (1..n, 1, 6),
                (1..n - 1, 2, 6),
                (0..n, 100, 6),
                (2..n - 1, 3, 6),
                (0..8, 5, 6),
                (0..7, 100, 6),
                (1..n, 3, 12),
                (0..n, 100, 18),
                (2..n - 1, 1, 12),
            ];
            for (rows, pairs_per_block, panel_rows) in ranges {
                let mut got = vec![f32::NAN; n_tok * n];
                let shared = crate::kernels::cpu::matmul::SharedOut(got.as_mut_ptr());
                run_blocks(
                    &wide,
                    &acts,
                    |r| &w[r * rb..(r + 1) * rb],
                    rows.clone(),
                    pairs_per_block,
                    panel_rows,
                    Out {
                        out: &shared,
                        stride: n,
                    },
                );
                for t in 0..wide.n_tok() {
                    for r in rows.clone() {
                        let dot = if ty == GgmlType::BF16 {
                            crate::kernels::cpu::avx2::vec_dot_bf16
                        } else {
                            crate::kernels::cpu::avx2::vec_dot_f16
                        };
                        // SAFETY: the CPU has AVX2 (it has AVX-512).
                        let want = unsafe { dot(&w[r * rb..(r + 1) * rb], acts.row(t), k) };
                        assert_eq!(
                            got[t * n + r].to_bits(),
                            want.to_bits(),
                            "{ty} k={k} token {t} row {r}: {} vs {want}",
                            got[t * n + r]
                        );
                    }
                }
            }
        }
    }
}
