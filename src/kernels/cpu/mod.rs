//! CPU kernels: weight matmuls, attention, and the small operators between them.
//!
//! The instruction set is chosen once at start-up by run-time detection ([`isa`]); the scalar path
//! is always built, and `OATO_CPU_ISA=scalar|avx2|avx512` forces a variant. Every variant computes
//! bit-identical results: the SIMD kernels follow the lane order that `scalar` spells out.

pub mod attention;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod scalar;

use std::sync::OnceLock;

use crate::quant::blocks::Block;
use crate::quant::{GgmlType, as_blocks};

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

static ISA: OnceLock<Isa> = OnceLock::new();

/// The variant in use: chosen on first call from `OATO_CPU_ISA` or detection. A forced variant the
/// CPU lacks is reported once on stderr and the best supported one is used instead.
pub fn isa() -> Isa {
    *ISA.get_or_init(|| {
        let forced = std::env::var("OATO_CPU_ISA").ok();
        resolve_isa(forced.as_deref()).unwrap_or_else(|e| {
            let best = Isa::detect();
            eprintln!("warning: {e}; using {}", best.name());
            best
        })
    })
}

/// Checks `OATO_CPU_ISA` up front so the command line can refuse a bad value with an error.
pub fn check_isa_env() -> Result<Isa, String> {
    let forced = std::env::var("OATO_CPU_ISA").ok();
    let isa = resolve_isa(forced.as_deref())?;
    Ok(*ISA.get_or_init(|| isa))
}

/// A row dot product: weight row, activation row (in the weight type's `vec_dot_type`), length.
///
/// Unsafe to call only because SIMD variants need their instruction set; [`dot_fn`] hands out
/// a variant only when the CPU supports it.
pub type DotFn = unsafe fn(&[u8], &[u8], usize) -> f32;

fn blocks<B: Block>(b: &[u8]) -> &[B] {
    as_blocks(b).unwrap_or(&[])
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
        GgmlType::Q2_K => |w, a, n| scalar::vec_dot(GgmlType::Q2_K, w, a, n),
        GgmlType::Q3_K => |w, a, n| scalar::vec_dot(GgmlType::Q3_K, w, a, n),
        GgmlType::Q4_K => |w, a, n| scalar::vec_dot(GgmlType::Q4_K, w, a, n),
        GgmlType::Q5_K => |w, a, n| scalar::vec_dot(GgmlType::Q5_K, w, a, n),
        GgmlType::Q6_K => |w, a, n| scalar::vec_dot(GgmlType::Q6_K, w, a, n),
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
                other => scalar_dot(other),
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
simd_dots!(avx2_dot, avx2);
#[cfg(target_arch = "x86_64")]
simd_dots!(avx512_dot, avx512);

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
