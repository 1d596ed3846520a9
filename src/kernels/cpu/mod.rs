//! CPU kernels: weight matmuls, attention, and the small operators between them.
//!
//! The instruction set is chosen once at start-up by run-time detection ([`isa`]); the scalar path
//! is always built, and `OATO_CPU_ISA=scalar|avx2|avx512` forces a variant. Every variant computes
//! bit-identical results: the SIMD kernels follow the lane order that `scalar` spells out.

pub mod attention;
#[cfg(target_arch = "x86_64")]
pub mod attention_decode;
#[cfg(target_arch = "x86_64")]
pub mod attention_tiled;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod f16tile_avx2;
#[cfg(target_arch = "x86_64")]
pub mod f16wide;
pub mod kquants;
#[cfg(target_arch = "x86_64")]
pub mod kwide;
pub mod matmul;
pub mod ops;
pub mod pool;
#[cfg(target_arch = "x86_64")]
pub(crate) mod q8tile_avx2;
#[cfg(target_arch = "x86_64")]
pub mod qwide;
pub mod repack;
#[cfg(target_arch = "x86_64")]
pub(crate) mod repack_avx2;
pub mod scalar;
mod spare;
#[cfg(target_arch = "x86_64")]
pub mod tile;

use std::sync::atomic::{AtomicU8, Ordering};

use crate::quant::GgmlType;
use crate::quant::blocks::Block;

/// A CPU kernel variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2's kernels plus AVX-512 (F, BW, VL) with VNNI integer dot products.
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn from_name(s: &str) -> Option<Isa> {
        match s.to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            _ => None,
        }
    }

    /// Whether this CPU can run the variant.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best variant this CPU supports.
    pub fn detect() -> Isa {
        [Isa::Avx512, Isa::Avx2]
            .into_iter()
            .find(|i| i.supported())
            .unwrap_or(Isa::Scalar)
    }

    /// Every variant this CPU supports, scalar first.
    pub fn all_supported() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.supported())
            .collect()
    }
}

/// Resolves `OATO_CPU_ISA` (if set) against what the CPU supports.
pub fn resolve_isa(forced: Option<&str>) -> Result<Isa, String> {
    match forced {
        None | Some("") => Ok(Isa::detect()),
        Some(name) => {
            let isa = Isa::from_name(name).ok_or_else(|| {
                format!("OATO_CPU_ISA={name:?} is not one of scalar, avx2, avx512")
            })?;
            if isa.supported() {
                Ok(isa)
            } else {
                Err(format!(
                    "OATO_CPU_ISA={name} is not supported by this CPU (best: {})",
                    Isa::detect().name()
                ))
            }
        }
    }
}

/// The variant in use, once chosen (0: not yet).
static ISA: AtomicU8 = AtomicU8::new(0);

fn code(isa: Isa) -> u8 {
    match isa {
        Isa::Scalar => 1,
        Isa::Avx2 => 2,
        Isa::Avx512 => 3,
    }
}

fn from_code(c: u8) -> Option<Isa> {
    match c {
        1 => Some(Isa::Scalar),
        2 => Some(Isa::Avx2),
        3 => Some(Isa::Avx512),
        _ => None,
    }
}

/// The variant in use: chosen on first call from `OATO_CPU_ISA` or detection. A forced variant the
/// CPU lacks is reported once on stderr and the best supported one is used instead.
pub fn isa() -> Isa {
    if let Some(isa) = from_code(ISA.load(Ordering::Relaxed)) {
        return isa;
    }
    let forced = std::env::var("OATO_CPU_ISA").ok();
    let isa = resolve_isa(forced.as_deref()).unwrap_or_else(|e| {
        let best = Isa::detect();
        eprintln!("warning: {e}; using {}", best.name());
        best
    });
    ISA.store(code(isa), Ordering::Relaxed);
    isa
}

/// Checks `OATO_CPU_ISA` up front so the command line can refuse a bad value with an error.
pub fn check_isa_env() -> Result<Isa, String> {
    let forced = std::env::var("OATO_CPU_ISA").ok();
    let isa = resolve_isa(forced.as_deref())?;
    ISA.store(code(isa), Ordering::Relaxed);
    Ok(isa)
}

/// Switches the variant for the whole process (tests run the model under each variant; every
/// variant computes identical results, so work already running is unaffected in its numbers).
pub fn set_isa(isa: Isa) -> Result<(), String> {
    if !isa.supported() {
        return Err(format!("{} is not supported by this CPU", isa.name()));
    }
    ISA.store(code(isa), Ordering::Relaxed);
    Ok(())
}

/// A row dot product: weight row, activation row (in the weight type's `vec_dot_type`), length.
///
/// Unsafe to call only because SIMD variants need their instruction set; [`dot_fn`] hands out
/// a variant only when the CPU supports it.
pub type DotFn = unsafe fn(&[u8], &[u8], usize) -> f32;

/// Whole blocks of a byte slice, viewed in place (callers check lengths; a ragged tail is left out).
#[inline(always)]
fn blocks<B: Block>(b: &[u8]) -> &[B] {
    // SAFETY: `Block` types are alignment-1 byte structs without padding for which every byte
    // pattern is valid (see quant::blocks), and the length is rounded down to whole blocks.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len() / size_of::<B>()) }
}

/// Cache lines of weight rows to prefetch a few at a time while other work runs: the prefill
/// kernels ask for the next block of rows while the current one's tiles run, so unpacking or
/// widening those rows does not wait on DRAM (many short row streams at once train the hardware
/// prefetchers badly).
#[cfg(target_arch = "x86_64")]
pub(crate) struct LinePrefetch<'w> {
    rows: Vec<&'w [u8]>,
    row: usize,
    at: usize,
}

#[cfg(target_arch = "x86_64")]
impl<'w> LinePrefetch<'w> {
    /// Every line of `rows`, in order.
    pub(crate) fn new(rows: Vec<&'w [u8]>) -> LinePrefetch<'w> {
        LinePrefetch {
            rows,
            row: 0,
            at: 0,
        }
    }

    /// The block of at most `size` rows of `rows` that follows rows `..done`, to prefetch while
    /// that block runs: the next block, or after the last one the first again when another block
    /// of tokens will run them (`more_tokens`), else none.
    pub(crate) fn next_block(
        rows: &std::ops::Range<usize>,
        done: usize,
        size: usize,
        more_tokens: bool,
        row: impl Fn(usize) -> &'w [u8],
    ) -> LinePrefetch<'w> {
        let next = if done < rows.end {
            done..(done + size).min(rows.end)
        } else if more_tokens {
            rows.start..(rows.start + size).min(rows.end)
        } else {
            0..0
        };
        LinePrefetch::new(next.map(row).collect())
    }

    /// Lines in all the rows.
    pub(crate) fn lines(&self) -> usize {
        self.rows.iter().map(|r| r.len().div_ceil(64)).sum()
    }

    /// Asks for the next line, if any is left.
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        if let Some(row) = self.rows.get(self.row) {
            // SAFETY: `at` < row.len(), inside the row (a prefetch never faults in any case).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().add(self.at).cast()) };
            self.at += 64;
            if self.at >= row.len() {
                self.row += 1;
                self.at = 0;
            }
        }
    }

    /// Asks for the next `n` lines (fewer if fewer are left).
    pub(crate) fn steps(&mut self, n: usize) {
        for _ in 0..n {
            self.step();
        }
    }
}

/// The fewest blocks among the rows `xs` and `ys` (what a tile of them can run over).
#[inline(always)]
pub(crate) fn common_blocks<A, B>(xs: &[&[A]], ys: &[&[B]]) -> usize {
    let lens = xs.iter().map(|x| x.len()).chain(ys.iter().map(|y| y.len()));
    lens.min().unwrap_or(0)
}

/// Random quants in `w` (whole blocks of `ty`: Q4_0, Q8_0, a K-quant, IQ4_NL or IQ4_XS), each
/// block's f16
/// scales (d, and the K-quants' dmin) set to `scale(rng)`: small finite values, so that no sum
/// overflows to inf. For F16, each element `scale(rng)` times a uniform in -1..1. Tests and the
/// out-of-cache experiments (`examples/matmul_dram`, `examples/decode_mix`) make their weights
/// with it.
pub fn random_blocks(
    ty: GgmlType,
    w: &mut [u8],
    rng: &mut crate::rng::SplitMix64,
    mut scale: impl FnMut(&mut crate::rng::SplitMix64) -> f32,
) {
    if ty == GgmlType::F16 {
        for e in w.chunks_exact_mut(2) {
            let v = half::f16::from_f32(scale(rng) * (2.0 * rng.next_f32() - 1.0));
            e.copy_from_slice(&v.to_le_bytes());
        }
        return;
    }
    let scales: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        GgmlType::Q6_K => &[208],
        GgmlType::Q3_K => &[108],
        GgmlType::Q2_K => &[80, 82],
        _ => &[0, 2],
    };
    w.iter_mut().for_each(|b| *b = rng.next_u64() as u8);
    for block in w.chunks_mut(ty.type_size()) {
        for &o in scales {
            let v = half::f16::from_f32(scale(rng));
            block[o..o + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// A plain read of `bytes` (the sum of their whole aligned words), split over the pool's threads
/// in equal parts: the out-of-cache experiments' ceiling (`examples/matmul_dram`,
/// `examples/decode_mix`), read on the same pool as the products it is set against.
pub fn plain_read(bytes: &[u8]) -> u64 {
    // SAFETY: u64 has no invalid bit patterns; `align_to` gives only aligned whole words.
    let (_, words, _) = unsafe { bytes.align_to::<u64>() };
    let pool = pool::global();
    let threads = pool.n_threads().max(1);
    let sums: Vec<std::sync::atomic::AtomicU64> = (0..threads).map(|_| 0.into()).collect();
    let per = words.len().div_ceil(threads).max(1);
    pool.for_chunks(words.len(), per, |g| {
        let s = words[g.clone()]
            .iter()
            .fold(0u64, |a, &w| a.wrapping_add(w));
        sums[g.start / per].fetch_add(s, std::sync::atomic::Ordering::Relaxed);
    });
    sums.iter().fold(0u64, |a, s| {
        a.wrapping_add(s.load(std::sync::atomic::Ordering::Relaxed))
    })
}

/// `n` activations as decode sees them: without a pattern, each the sum of four uniforms in
/// -0.5..0.5 (near normal, sd 0.58). The out-of-cache experiments take these (`ACTS=sin` there
/// gives the smooth sine they used before, whose blocks share one scale: it hid that the
/// kernels' table of f16 scales missed the cache on real activations, 10-15% of decode's time
/// on the 8B Q4_0 file at 1 thread until d4e1905).
pub fn random_acts(n: usize, rng: &mut crate::rng::SplitMix64) -> Vec<f32> {
    (0..n)
        .map(|_| (0..4).map(|_| rng.next_f32() - 0.5).sum())
        .collect()
}

#[cfg(test)]
/// `n` random Q4_0 or K-quant rows of `k` elements (for tests of kernels oato has no quantiser
/// for), with scales between 0.001 and 0.011 ([`random_blocks`]).
pub(crate) fn random_rows(
    ty: GgmlType,
    k: usize,
    n: usize,
    rng: &mut crate::rng::SplitMix64,
) -> Vec<u8> {
    let mut w = vec![0u8; ty.row_bytes(k).unwrap() * n];
    random_blocks(ty, &mut w, rng, |rng| {
        0.001 + (rng.next_u64() % 100) as f32 * 1e-4
    });
    w
}

fn scalar_dot(wty: GgmlType) -> DotFn {
    // Each arm is a plain function item coerced to the fn pointer.
    match wty {
        GgmlType::Q4_0 => |w, a, _| scalar::vec_dot_q4_0_q8_0(blocks(w), blocks(a)),
        GgmlType::Q4_1 => |w, a, _| scalar::vec_dot_q4_1_q8_1(blocks(w), blocks(a)),
        GgmlType::Q5_0 => |w, a, _| scalar::vec_dot_q5_0_q8_0(blocks(w), blocks(a)),
        GgmlType::Q5_1 => |w, a, _| scalar::vec_dot_q5_1_q8_1(blocks(w), blocks(a)),
        GgmlType::Q8_0 => |w, a, _| scalar::vec_dot_q8_0_q8_0(blocks(w), blocks(a)),
        GgmlType::F32 => scalar::vec_dot_f32,
        GgmlType::F16 => scalar::vec_dot_f16,
        GgmlType::BF16 => scalar::vec_dot_bf16,
        GgmlType::Q2_K => |w, a, _| kquants::vec_dot_q2_k_q8_k(blocks(w), blocks(a)),
        GgmlType::Q3_K => |w, a, _| kquants::vec_dot_q3_k_q8_k(blocks(w), blocks(a)),
        GgmlType::Q4_K => |w, a, _| kquants::vec_dot_q4_k_q8_k(blocks(w), blocks(a)),
        GgmlType::Q5_K => |w, a, _| kquants::vec_dot_q5_k_q8_k(blocks(w), blocks(a)),
        GgmlType::Q6_K => |w, a, _| kquants::vec_dot_q6_k_q8_k(blocks(w), blocks(a)),
        GgmlType::IQ4_NL => |w, a, _| scalar::vec_dot_iq4_nl_q8_0(blocks(w), blocks(a)),
        GgmlType::IQ4_XS => |w, a, _| kquants::vec_dot_iq4_xs_q8_k(blocks(w), blocks(a)),
        _ => |_, _, _| f32::NAN,
    }
}

/// Generates the fn-pointer table of one SIMD module.
#[cfg(target_arch = "x86_64")]
macro_rules! simd_dots {
    ($fname:ident, $m:ident) => {
        fn $fname(wty: GgmlType) -> DotFn {
            // SAFETY (of each pointer's callers): `dot_fn` hands these out only when the CPU
            // supports the module's instruction set.
            match wty {
                GgmlType::Q4_0 => |w, a, _| unsafe { $m::vec_dot_q4_0_q8_0(blocks(w), blocks(a)) },
                GgmlType::Q4_1 => |w, a, _| unsafe { $m::vec_dot_q4_1_q8_1(blocks(w), blocks(a)) },
                GgmlType::Q5_0 => |w, a, _| unsafe { $m::vec_dot_q5_0_q8_0(blocks(w), blocks(a)) },
                GgmlType::Q5_1 => |w, a, _| unsafe { $m::vec_dot_q5_1_q8_1(blocks(w), blocks(a)) },
                GgmlType::Q8_0 => |w, a, _| unsafe { $m::vec_dot_q8_0_q8_0(blocks(w), blocks(a)) },
                GgmlType::F32 => |w, a, n| unsafe { avx2::vec_dot_f32(w, a, n) },
                GgmlType::F16 => |w, a, n| unsafe { avx2::vec_dot_f16(w, a, n) },
                GgmlType::BF16 => |w, a, n| unsafe { avx2::vec_dot_bf16(w, a, n) },
                GgmlType::Q2_K => |w, a, _| unsafe { $m::vec_dot_q2_k_q8_k(blocks(w), blocks(a)) },
                GgmlType::Q3_K => |w, a, _| unsafe { $m::vec_dot_q3_k_q8_k(blocks(w), blocks(a)) },
                GgmlType::Q4_K => |w, a, _| unsafe { $m::vec_dot_q4_k_q8_k(blocks(w), blocks(a)) },
                GgmlType::Q5_K => |w, a, _| unsafe { $m::vec_dot_q5_k_q8_k(blocks(w), blocks(a)) },
                GgmlType::Q6_K => |w, a, _| unsafe { $m::vec_dot_q6_k_q8_k(blocks(w), blocks(a)) },
                GgmlType::IQ4_NL => {
                    |w, a, _| unsafe { avx2::vec_dot_iq4_nl_q8_0(blocks(w), blocks(a)) }
                }
                GgmlType::IQ4_XS => {
                    |w, a, _| unsafe { avx2::vec_dot_iq4_xs_q8_k(blocks(w), blocks(a)) }
                }
                other => scalar_dot(other),
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
simd_dots!(avx2_dot, avx2);
#[cfg(target_arch = "x86_64")]
simd_dots!(avx512_block_dot, avx512);

/// AVX-512's table: Q4_0 two blocks per register, the plain floats 16 lanes per register, the
/// rest as generated.
#[cfg(target_arch = "x86_64")]
fn avx512_dot(wty: GgmlType) -> DotFn {
    match wty {
        // SAFETY (of the pointer's callers): handed out only when the CPU has AVX-512 VNNI.
        GgmlType::Q4_0 => |w, a, _| unsafe { avx512::vec_dot_q4_0_q8_0_x2(blocks(w), blocks(a)) },
        GgmlType::F32 => |w, a, n| unsafe { avx512::vec_dot_f32(w, a, n) },
        GgmlType::F16 => |w, a, n| unsafe { avx512::vec_dot_f16(w, a, n) },
        GgmlType::BF16 => |w, a, n| unsafe { avx512::vec_dot_bf16(w, a, n) },
        other => avx512_block_dot(other),
    }
}

/// The dot product for weights of type `wty` under `isa`, or scalar when the CPU lacks `isa`.
/// Types without a dot product (see `quant::has_vec_dot`) give NaN; callers check types first.
pub fn dot_fn(isa: Isa, wty: GgmlType) -> DotFn {
    if !isa.supported() {
        return scalar_dot(wty);
    }
    match isa {
        Isa::Scalar => scalar_dot(wty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2_dot(wty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512_dot(wty),
        #[cfg(not(target_arch = "x86_64"))]
        _ => scalar_dot(wty),
    }
}

/// One dot product with the variant in use ([`isa`]); lengths are the caller's to check.
pub fn vec_dot(wty: GgmlType, w: &[u8], a: &[u8], n: usize) -> f32 {
    // SAFETY: dot_fn only returns variants the CPU supports.
    unsafe { dot_fn(isa(), wty)(w, a, n) }
}

/// The CPU's name as /proc/cpuinfo gives it ("model name"), else the architecture.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim() == "model name")
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    fn pattern(n: usize, offset: f32) -> Vec<f32> {
        (0..n)
            .map(|i| 0.1 + 2.0 * (i as f32 * 0.7 + offset).cos())
            .collect()
    }

    /// Every supported variant gives exactly the scalar result, at the block minimum and at
    /// lengths with a tail.
    #[test]
    fn every_variant_is_bit_identical_to_scalar() {
        let types = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
        ];
        for wty in types {
            for n in [32usize, 64, 96, 576, 1536, 32 * 37] {
                for n in [n, n + 8, n + 13] {
                    let Ok(wb) = wty.row_bytes(n) else { continue };
                    let aty = wty.vec_dot_type();
                    let (mut w, mut a) = (vec![0u8; wb], vec![0u8; aty.row_bytes(n).unwrap()]);
                    quantize_row(wty, &pattern(n, 0.0), &mut w).unwrap();
                    quantize_row(aty, &pattern(n, 2.1), &mut a).unwrap();
                    // SAFETY: dot_fn checks support.
                    let reference = unsafe { dot_fn(Isa::Scalar, wty)(&w, &a, n) };
                    assert!(reference.is_finite() && reference != 0.0);
                    for isa in Isa::all_supported() {
                        let got = unsafe { dot_fn(isa, wty)(&w, &a, n) };
                        assert_eq!(
                            got.to_bits(),
                            reference.to_bits(),
                            "{wty} n={n} {}: {got} vs scalar {reference}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }

    /// Activation rows quantised by the AVX2 build (Q8 blocks and F16 rows vectorised) are byte
    /// for byte the portable quantiser's, at rounding ties, subnormals, overflow and NaN.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_activation_quantiser_is_byte_identical() {
        if !Isa::Avx2.supported() {
            return;
        }
        let mut x = pattern(1536 + 13, 0.3);
        let edges = [
            1.0 + 2f32.powi(-11),       // tie: rounds to even (down)
            1.0 + 3.0 * 2f32.powi(-11), // tie: rounds to even (up)
            2f32.powi(-20),             // f16 subnormal
            2f32.powi(-25),             // tie with zero
            2f32.powi(-26),             // underflows to zero
            -0.0,
            65504.0, // largest f16
            65520.0, // rounds to infinity
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7F80_0001), // signalling NaN
        ];
        for (i, &e) in edges.iter().enumerate() {
            x[7 * i + 3] = e;
            x[1536 + i] = e;
        }
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q8_1,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::F32,
        ] {
            for n in [32usize, 576, 1536, 1536 + 8, 1536 + 13] {
                let Ok(rb) = ty.row_bytes(n) else { continue };
                let mut blocks = pattern(n, 0.3);
                // Q8 blocks: one with a NaN, one of zeros, one with an infinity, one whose
                // multiplier overflows (subnormal maximum), one with exact ties.
                if n >= 5 * 32 {
                    blocks[5] = f32::NAN;
                    blocks[32..64].fill(0.0);
                    blocks[64 + 7] = f32::NEG_INFINITY;
                    for (i, v) in blocks[96..128].iter_mut().enumerate() {
                        *v = f32::from_bits(i as u32 * 3) * if i % 2 == 0 { 1.0 } else { -1.0 };
                    }
                    blocks[128] = 127.0;
                    blocks[129] = 2.5;
                    blocks[130] = -3.5;
                    blocks[131] = -127.0;
                }
                let src = if matches!(ty, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32) {
                    &x[..n]
                } else {
                    &blocks[..]
                };
                let (mut want, mut got) = (vec![0u8; rb], vec![0u8; rb]);
                crate::quant::quantize_act_row(ty, src, &mut want).unwrap();
                // SAFETY: AVX2, FMA and F16C are present (checked above).
                unsafe { avx2::quantize_act_row(ty, src, &mut got) }.unwrap();
                assert_eq!(got, want, "{ty} n={n}");
            }
        }
    }

    /// The K-quants: every supported variant gives exactly the canonical scalar result on random
    /// valid blocks, and that result agrees with ggml's reference order to rounding.
    #[test]
    fn k_quants_every_variant_is_bit_identical_to_scalar() {
        use crate::quant::testdata::*;
        use crate::quant::{dequantize_row, vec_dot as vec_dot_reference};
        let mut rng = Rng(0x0DDB_A11C_AFE5_EED5);
        for wty in K_TYPES {
            for n in [256usize, 512, 256 * 6] {
                for (row, offset) in [0.0f32, 2.1, 5.3].into_iter().enumerate() {
                    let w = random_k_row(wty, n, &mut rng);
                    let a = q8_k_row(n, offset);
                    // SAFETY: dot_fn checks support.
                    let scalar = unsafe { dot_fn(Isa::Scalar, wty)(&w, &a, n) };
                    assert!(scalar.is_finite() && scalar != 0.0, "{wty} n={n}: {scalar}");
                    for isa in Isa::all_supported() {
                        // SAFETY: as above.
                        let got = unsafe { dot_fn(isa, wty)(&w, &a, n) };
                        assert_eq!(
                            got.to_bits(),
                            scalar.to_bits(),
                            "{wty} n={n} row {row} {}: {got} vs scalar {scalar}",
                            isa.name()
                        );
                    }
                    let (mut wf, mut af) = (vec![0f32; n], vec![0f32; n]);
                    dequantize_row(wty, &w, &mut wf).unwrap();
                    dequantize_row(GgmlType::Q8_K, &a, &mut af).unwrap();
                    let scale: f64 = wf.iter().zip(&af).map(|(x, y)| (x * y).abs() as f64).sum();
                    let reference = vec_dot_reference(wty, &w, &a, n);
                    let err = (scalar as f64 - reference as f64).abs() / scale;
                    assert!(
                        err < 1e-6,
                        "{wty} n={n}: {scalar} vs reference {reference} (normalised {err:e})"
                    );
                }
            }
        }
    }

    /// IQ4_NL (random blocks: oato has no quantiser for it): every variant gives the scalar
    /// result's bits, against patterned Q8_0 activations and against every quant byte at -128
    /// and 127.
    #[test]
    fn iq4_nl_every_variant_is_bit_identical_to_scalar() {
        use crate::quant::testdata::*;
        let mut rng = Rng(0x0001_A40F_5EED);
        for n in [32usize, 64, 32 * 37] {
            let w = random_k_row(GgmlType::IQ4_NL, n, &mut rng);
            let mut a = vec![0u8; GgmlType::Q8_0.row_bytes(n).unwrap()];
            quantize_row(GgmlType::Q8_0, &pattern(n, 1.7), &mut a).unwrap();
            let mut acts = vec![a.clone()];
            for fill in [-128i8, 127] {
                let mut e = a.clone();
                for y in crate::quant::as_blocks_mut::<crate::quant::BlockQ8_0>(&mut e).unwrap() {
                    y.qs = [fill; 32];
                }
                acts.push(e);
            }
            for a in &acts {
                // SAFETY: dot_fn checks support.
                let scalar = unsafe { dot_fn(Isa::Scalar, GgmlType::IQ4_NL)(&w, a, n) };
                assert!(scalar.is_finite() && scalar != 0.0, "n={n}: {scalar}");
                for isa in Isa::all_supported() {
                    // SAFETY: as above.
                    let got = unsafe { dot_fn(isa, GgmlType::IQ4_NL)(&w, a, n) };
                    assert_eq!(got.to_bits(), scalar.to_bits(), "n={n} {}", isa.name());
                }
            }
        }
    }

    /// Extreme bytes (quants and scales at their largest, Q6_K scales at -128, activations at -128
    /// and 127) must not saturate any variant's 16-bit intermediates.
    #[test]
    fn k_quants_extremes_are_bit_identical() {
        use crate::quant::testdata::*;
        use crate::quant::{BlockQ8K, F32Le, I16Le, as_blocks_mut};
        let n = 512;
        let mut rng = Rng(99);
        let mut activations = Vec::new();
        for fill in [Some(-128i8), Some(127), None] {
            let mut a = vec![0u8; GgmlType::Q8_K.row_bytes(n).unwrap()];
            for y in as_blocks_mut::<BlockQ8K>(&mut a).unwrap() {
                y.d = F32Le::new(0.5);
                for q in y.qs.iter_mut() {
                    *q = fill.unwrap_or((rng.next() >> 56) as i8);
                }
                for (b, q16) in y.bsums.iter_mut().zip(y.qs.as_chunks::<16>().0) {
                    *b = I16Le::new(q16.iter().map(|&q| q as i16).sum());
                }
            }
            activations.push(a);
        }
        for wty in K_TYPES {
            for fill in [0xFFu8, 0x80, 0x00, 0xAA] {
                // every byte `fill` but the f16 super-block scales, taken from a valid row
                let filled = vec![fill; wty.row_bytes(n).unwrap()];
                let w = restore_scales(wty, &filled, &random_k_row(wty, n, &mut rng));
                for a in &activations {
                    // SAFETY: dot_fn checks support.
                    let scalar = unsafe { dot_fn(Isa::Scalar, wty)(&w, a, n) };
                    assert!(scalar.is_finite(), "{wty} fill {fill:#x}: {scalar}");
                    for isa in Isa::all_supported() {
                        // SAFETY: as above.
                        let got = unsafe { dot_fn(isa, wty)(&w, a, n) };
                        assert_eq!(
                            got.to_bits(),
                            scalar.to_bits(),
                            "{wty} fill {fill:#x} {}: {got} vs scalar {scalar}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }

    /// `w` with the f16 super-block scales of `from` (same type and length).
    fn restore_scales(wty: GgmlType, w: &[u8], from: &[u8]) -> Vec<u8> {
        use crate::quant::*;
        let mut w = w.to_vec();
        macro_rules! copy {
            ($b:ty, $($f:ident),+) => {{
                let src = as_blocks::<$b>(from).unwrap();
                for (x, s) in as_blocks_mut::<$b>(&mut w).unwrap().iter_mut().zip(src) {
                    $(x.$f = s.$f;)+
                }
            }};
        }
        match wty {
            GgmlType::Q2_K => copy!(BlockQ2K, d, dmin),
            GgmlType::Q3_K => copy!(BlockQ3K, d),
            GgmlType::Q4_K => copy!(BlockQ4K, d, dmin),
            GgmlType::Q5_K => copy!(BlockQ5K, d, dmin),
            GgmlType::Q6_K => copy!(BlockQ6K, d),
            GgmlType::IQ4_XS => copy!(BlockIQ4XS, d),
            _ => unreachable!(),
        }
        w
    }

    /// A Q4_K super-block computed by hand: scales and mins (two of each above 16, so their high
    /// bits are packed apart), low nibbles 1 and high nibbles 2, activations 1 in the first half
    /// and 2 in the second.
    #[test]
    fn q4_k_dot_by_hand() {
        use crate::quant::{BlockQ4K, BlockQ8K, F16Le, F32Le, I16Le, blocks_as_bytes};
        let sc: [u8; 8] = [1, 2, 3, 4, 21, 6, 7, 40];
        let m: [u8; 8] = [0, 1, 2, 3, 4, 37, 6, 7];
        let mut scales = [0u8; 12];
        for j in 0..4 {
            scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            scales[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
            scales[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
        }
        assert_eq!(crate::quant::blocks::k4_scales_mins(&scales), (sc, m));
        let x = BlockQ4K {
            d: F16Le::from_f32(0.5),
            dmin: F16Le::from_f32(0.25),
            scales,
            qs: [0x21; 128],
        };
        let mut y = BlockQ8K {
            d: F32Le::new(2.0),
            qs: [1; 256],
            bsums: [I16Le::new(16); 16],
        };
        y.qs[128..].fill(2);
        y.bsums[8..].fill(I16Le::new(32));
        // isum: chunk c pairs sub-blocks 2c (q = 1) and 2c + 1 (q = 2), 32 elements each:
        //   32·[(1·1 + 2·2)·1 + (3·1 + 4·2)·1 + (21·1 + 6·2)·2 + (7·1 + 40·2)·2]
        //   = 32·(5 + 11 + 66 + 174) = 8192
        // imin = Σ_g m_{g/2}·bsum_g = 2·16·(0 + 1 + 2 + 3) + 2·32·(4 + 37 + 6 + 7) = 3648
        // sumf = (2·0.5)·8192 − (2·0.25)·3648 = 6368
        let (w, a) = (
            blocks_as_bytes(&[x]).to_vec(),
            blocks_as_bytes(&[y]).to_vec(),
        );
        for isa in Isa::all_supported() {
            // SAFETY: dot_fn checks support.
            let got = unsafe { dot_fn(isa, GgmlType::Q4_K)(&w, &a, 256) };
            assert_eq!(got, 6368.0, "{}", isa.name());
        }
        assert_eq!(crate::quant::vec_dot(GgmlType::Q4_K, &w, &a, 256), 6368.0);
    }

    #[test]
    fn forced_isa_is_checked() {
        assert_eq!(resolve_isa(Some("scalar")), Ok(Isa::Scalar));
        assert!(
            resolve_isa(Some("neon"))
                .unwrap_err()
                .contains("not one of")
        );
        assert_eq!(resolve_isa(None), Ok(Isa::detect()));
    }
}
