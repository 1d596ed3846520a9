//! How the CUDA backend multiplies a quantised weight by a prefill batch: the int8 GEMM of
//! `src/kernels/cuda/mmq.cu` (weights unpacked to 8-bit tiles, activations as Q8_1 quants,
//! `__dp4a`, or tensor cores' `mma.sync` from compute capability 8.0 unless `OATO_CUDA_MMA=0`)
//! or dequantisation to f16 and cuBLAS. `OATO_CUDA_MMQ=0` always takes cuBLAS, `1` the
//! int8 GEMM wherever the weight type has one, `auto` (the default) times both once with CUDA
//! events the first time a (type, n, k, token bucket) is seen and keeps the faster.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// Tokens one mmq thread block computes (mmq.cu's MMQ_TOK).
pub const MMQ_TOK: usize = 64;

/// One int8 GEMM kernel and the weight rows of its thread blocks' tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmqKernel {
    pub name: &'static str,
    pub rows: usize,
    /// A tensor-core kernel (`mmq_mma_`), which can split k ([`mmq_splits`]).
    pub mma: bool,
}

/// Which prefill GEMM quantised weights take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmqMode {
    /// Dequantise to f16, then cuBLAS.
    Off,
    /// The int8 GEMM for every type that has one.
    On,
    /// Per shape, the faster of the two, timed once.
    Auto,
}

static MODE: AtomicU8 = AtomicU8::new(2);

impl MmqMode {
    /// `OATO_CUDA_MMQ`'s value: `0`, `1` or `auto`.
    pub fn parse(v: &str) -> Result<MmqMode> {
        match v.trim() {
            "0" => Ok(MmqMode::Off),
            "1" => Ok(MmqMode::On),
            "auto" | "" => Ok(MmqMode::Auto),
            other => Err(Error::Msg(format!(
                "OATO_CUDA_MMQ={other:?}: expected 0 (dequantise + cuBLAS), 1 (int8 GEMM) or auto"
            ))),
        }
    }
}

/// The prefill GEMM choice of every CUDA backend in the process (`selftest` forces each).
pub fn set_mmq_mode(m: MmqMode) {
    MODE.store(
        match m {
            MmqMode::Off => 0,
            MmqMode::On => 1,
            MmqMode::Auto => 2,
        },
        Ordering::Relaxed,
    );
}

pub fn mmq_mode() -> MmqMode {
    match MODE.load(Ordering::Relaxed) {
        0 => MmqMode::Off,
        1 => MmqMode::On,
        _ => MmqMode::Auto,
    }
}

/// Reads `OATO_CUDA_MMQ` (when set) into the process-wide mode; a value it does not know is an
/// error naming the variable.
pub fn mmq_mode_from_env() -> Result<()> {
    if let Ok(v) = std::env::var("OATO_CUDA_MMQ") {
        set_mmq_mode(MmqMode::parse(&v)?);
    }
    Ok(())
}

/// The int8 GEMM kernels of a weight type, by `[mma][r32]`: mmq.cu's `mmq_<type>` (64-row
/// tiles), `mmq_<type>_r32` (32-row tiles), and the same on tensor cores, `mmq_mma_<type>` /
/// `mmq_mma_<type>_r32` (compute capability 8.0 and later); `None` for a type without them.
macro_rules! mmq_names {
    ($($ty:ident => $s:literal),* $(,)?) => {
        /// The types with int8 GEMM kernels.
        const MMQ_TYPES: &[GgmlType] = &[$(GgmlType::$ty),*];

        fn mmq_names(ty: GgmlType) -> Option<[[&'static str; 2]; 2]> {
            match ty {
                $(GgmlType::$ty => Some([
                    [concat!("mmq_", $s), concat!("mmq_", $s, "_r32")],
                    [concat!("mmq_mma_", $s), concat!("mmq_mma_", $s, "_r32")],
                ]),)*
                _ => None,
            }
        }
    };
}

mmq_names!(Q4_0 => "q4_0", Q4_1 => "q4_1", Q5_0 => "q5_0", Q5_1 => "q5_1", Q8_0 => "q8_0",
    Q4_K => "q4_K", Q5_K => "q5_K", Q6_K => "q6_K");

/// Every int8 GEMM kernel (mmq.cu's exports besides mmq_splitk_sum).
pub fn mmq_kernels() -> impl Iterator<Item = &'static str> {
    MMQ_TYPES
        .iter()
        .filter_map(|&ty| mmq_names(ty))
        .flat_map(|n| n.into_iter().flatten())
}

/// The int8 GEMM kernel of a weight type for `n` rows and `n_tok` tokens on a device with
/// `sm_count` multiprocessors, if the type has one: tiles of 64 rows, or of 32 rows (the `_r32`
/// kernels) when 64-row tiles would give fewer thread blocks than multiprocessors; on tensor
/// cores (`mma`, the `mmq_mma_` kernels) or with `__dp4a`.
pub fn mmq_kernel_of(
    ty: GgmlType,
    n: usize,
    n_tok: usize,
    sm_count: usize,
    mma: bool,
) -> Option<MmqKernel> {
    let names = mmq_names(ty)?[mma as usize];
    Some(if n.div_ceil(64) * n_tok.div_ceil(MMQ_TOK) < sm_count {
        MmqKernel {
            name: names[1],
            rows: 32,
            mma,
        }
    } else {
        MmqKernel {
            name: names[0],
            rows: 64,
            mma,
        }
    })
}

/// Splits of k (split-K) for a tensor-core int8 GEMM of `blocks` thread blocks over `steps`
/// 256-element steps of k on `sm_count` multiprocessors: as many as keep the grid within one wave
/// of two blocks a multiprocessor (the kernels' occupancy), at most 8 and at least two steps a
/// split, and no more than keep the partial sums (`part_bytes` each: n_tok x n f32) within
/// [`MMQ_PART_BYTES`]; 1 (no split) for a grid that fills the device already, where even two
/// parts would not fit, or with `OATO_CUDA_MMQ_SPLITK=0`. A prefill of 64 tokens on an H100 /
/// H200 (132 multiprocessors): 4096 x 1024 (k / v, 32 blocks) 8 splits of 2 steps, 4096 x 4096
/// and 14336 x 4096 (128 blocks) 2, 4096 x 14336 (224 blocks) none.
pub fn mmq_splits(blocks: usize, steps: usize, sm_count: usize, part_bytes: usize) -> usize {
    if !SPLITK.load(Ordering::Relaxed) {
        return 1;
    }
    let splits = (2 * sm_count / blocks.max(1))
        .clamp(1, (steps / 2).clamp(1, MMQ_MAX_SPLITS))
        .min(MMQ_PART_BYTES / part_bytes.max(1));
    if splits >= 2 { splits } else { 1 }
}

/// Most parts a split-K GEMM's k is cut into.
pub const MMQ_MAX_SPLITS: usize = 8;

/// Most bytes the split-K partial sums may take (`splits × n_tok × n` f32); the plan's
/// workspace counts them ([`crate::scheduler::workspace_for`]). An H100 / H200 needs at most
/// 2 × 132 blocks × 64 rows × 64 tokens × 4 bytes, 4.1 MiB.
pub const MMQ_PART_BYTES: usize = 8 << 20;

/// Whether the tensor-core int8 GEMM may split k: on unless `OATO_CUDA_MMQ_SPLITK=0` (read once)
/// or `set_mmq_splitk(false)`.
static SPLITK: std::sync::LazyLock<std::sync::atomic::AtomicBool> =
    std::sync::LazyLock::new(|| {
        std::sync::atomic::AtomicBool::new(crate::kernels::cpu::matmul::env_on(
            "OATO_CUDA_MMQ_SPLITK",
        ))
    });

/// Lets the tensor-core int8 GEMM split k, or not, in every CUDA backend of the process
/// (`selftest --perf` times both).
pub fn set_mmq_splitk(on: bool) {
    SPLITK.store(on, Ordering::Relaxed);
}

/// Whether split-K is allowed.
pub fn mmq_splitk() -> bool {
    SPLITK.load(Ordering::Relaxed)
}

/// Whether the int8 GEMM may run on tensor cores: on unless `OATO_CUDA_MMA=0` (read once) or
/// `set_mma(false)`.
static MMA: std::sync::LazyLock<std::sync::atomic::AtomicBool> = std::sync::LazyLock::new(|| {
    std::sync::atomic::AtomicBool::new(crate::kernels::cpu::matmul::env_on("OATO_CUDA_MMA"))
});

/// Turns the tensor-core int8 GEMM on or off for every CUDA backend of the process (`selftest`
/// checks and times both).
pub fn set_mma(on: bool) {
    MMA.store(on, Ordering::Relaxed);
}

/// Whether the tensor-core int8 GEMM is used on a device of compute capability `arch` (major *
/// 10 + minor): from 8.0 (`mma.sync` on int8), unless switched off.
pub fn mma_on(arch: u32) -> bool {
    arch >= 80 && MMA.load(Ordering::Relaxed)
}

/// Whether the tensor-core int8 GEMM is switched on (whatever the device).
pub fn mma_enabled() -> bool {
    MMA.load(Ordering::Relaxed)
}

/// Whether a weight type has int8 GEMM kernels.
pub fn has_mmq(ty: GgmlType) -> bool {
    mmq_names(ty).is_some()
}

/// The token bucket a batch's choice is kept under: the next power of two.
pub fn token_bucket(n_tok: usize) -> usize {
    n_tok.next_power_of_two()
}

/// What `auto` measured for one shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MmqChoice {
    pub mmq: bool,
    pub mmq_us: f64,
    pub cublas_us: f64,
    /// The int8 kernel timed, and in how many parts it split k.
    pub kernel: &'static str,
    pub splits: usize,
}

/// A shape `auto` chooses for: (type, n, k, token bucket).
type ShapeKey = (GgmlType, usize, usize, usize);

/// `auto`'s choices by shape.
#[derive(Default)]
pub struct MmqChoices(Mutex<HashMap<ShapeKey, MmqChoice>>);

impl MmqChoices {
    fn key(ty: GgmlType, n: usize, k: usize, n_tok: usize) -> ShapeKey {
        (ty, n, k, token_bucket(n_tok))
    }

    pub fn get(&self, ty: GgmlType, n: usize, k: usize, n_tok: usize) -> Result<Option<MmqChoice>> {
        Ok(self.lock()?.get(&Self::key(ty, n, k, n_tok)).copied())
    }

    /// Records the two times for a shape and returns the choice (the int8 GEMM when faster).
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        ty: GgmlType,
        n: usize,
        k: usize,
        n_tok: usize,
        (kernel, splits): (&'static str, usize),
        mmq_us: f64,
        cublas_us: f64,
    ) -> Result<MmqChoice> {
        let c = MmqChoice {
            mmq: mmq_us < cublas_us,
            mmq_us,
            cublas_us,
            kernel,
            splits,
        };
        self.lock()?.insert(Self::key(ty, n, k, n_tok), c);
        Ok(c)
    }

    /// Every choice so far, by type, then n, k and token bucket: one line each.
    pub fn lines(&self) -> Result<Vec<String>> {
        let mut all: Vec<(ShapeKey, MmqChoice)> =
            self.lock()?.iter().map(|(k, c)| (*k, *c)).collect();
        all.sort_by_key(|((ty, n, k, b), _)| (ty.name(), *n, *k, *b));
        Ok(all
            .into_iter()
            .map(|((ty, n, k, b), c)| {
                format!(
                    "prefill GEMM {} {k}x{n}, batches up to {b}: int8 ({}{}) {:.1} us, \
                     dequantise + cuBLAS {:.1} us: {}",
                    ty.name(),
                    c.kernel,
                    if c.splits > 1 {
                        format!(", k in {} parts", c.splits)
                    } else {
                        String::new()
                    },
                    c.mmq_us,
                    c.cublas_us,
                    if c.mmq { "int8" } else { "cuBLAS" }
                )
            })
            .collect())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, HashMap<ShapeKey, MmqChoice>>> {
        self.0
            .lock()
            .map_err(|_| Error::Msg("CUDA mmq choices lock poisoned".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_parses_the_three_values_and_rejects_others() {
        assert_eq!(MmqMode::parse("0").unwrap(), MmqMode::Off);
        assert_eq!(MmqMode::parse("1").unwrap(), MmqMode::On);
        assert_eq!(MmqMode::parse("auto").unwrap(), MmqMode::Auto);
        let e = MmqMode::parse("yes").unwrap_err().to_string();
        assert!(e.contains("OATO_CUDA_MMQ") && e.contains("yes"), "{e}");
    }

    #[test]
    fn choices_are_kept_per_type_shape_and_bucket() {
        let c = MmqChoices::default();
        let q = GgmlType::Q4_0;
        assert_eq!(c.get(q, 4096, 4096, 64).unwrap(), None);
        assert!(
            c.record(q, 4096, 4096, 64, ("mmq_q4_0", 1), 10.0, 20.0)
                .unwrap()
                .mmq
        );
        assert!(
            !c.record(q, 4096, 4096, 512, ("mmq_q4_0", 1), 30.0, 20.0)
                .unwrap()
                .mmq
        );
        // 33..64 tokens share the 64 bucket; 65 is in the next; another type or shape is new.
        assert!(c.get(q, 4096, 4096, 33).unwrap().unwrap().mmq);
        assert!(!c.get(q, 4096, 4096, 300).unwrap().unwrap().mmq);
        assert_eq!(c.get(q, 4096, 4096, 65).unwrap(), None);
        assert_eq!(c.get(GgmlType::Q8_0, 4096, 4096, 64).unwrap(), None);
        assert_eq!(c.get(q, 14336, 4096, 64).unwrap(), None);
        assert!(has_mmq(GgmlType::Q5_K) && !has_mmq(GgmlType::Q3_K));
        // IQ4_NL / IQ4_XS prefill always dequantises (no int8 GEMM kernels for them).
        assert!(!has_mmq(GgmlType::IQ4_NL) && !has_mmq(GgmlType::IQ4_XS));
        assert_eq!(mmq_kernel_of(GgmlType::IQ4_XS, 4096, 64, 132, false), None);
    }

    #[test]
    fn every_type_has_four_distinct_gemm_kernels() {
        let names: Vec<_> = mmq_kernels().collect();
        assert_eq!(names.len(), 4 * MMQ_TYPES.len());
        let distinct: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "{names:?}");
        assert!(names.contains(&"mmq_mma_q6_K_r32") && names.contains(&"mmq_q4_0"));
    }

    #[test]
    fn split_k_fills_one_wave_of_two_blocks_a_multiprocessor() {
        // 64 tokens on 132 multiprocessors: k / v, q / o and down, gate / up.
        let part = |n: usize| n * 64 * 4;
        assert_eq!(mmq_splits(32, 16, 132, part(1024)), 8);
        assert_eq!(mmq_splits(128, 16, 132, part(4096)), 2);
        assert_eq!(mmq_splits(128, 56, 132, part(4096)), 2);
        assert_eq!(mmq_splits(224, 16, 132, part(14336)), 1);
        // At least two steps a split; a one-step k is not split.
        assert_eq!(mmq_splits(4, 6, 132, part(128)), 3);
        assert_eq!(mmq_splits(4, 1, 132, part(128)), 1);
        assert_eq!(mmq_splits(0, 16, 132, 0), 8);
    }

    #[test]
    fn split_k_partials_stay_within_their_bound() {
        let part = |n: usize, n_tok: usize| n * n_tok * 4;
        // The H200's largest split (14336 x 4096 at 64 tokens: 2 parts of 1 MiB each) is kept.
        assert_eq!(mmq_splits(128, 16, 132, part(4096, 64)), 2);
        assert_eq!(mmq_splits(32, 16, 132, part(1024, 64)), 8);
        // 8 parts of 2 MiB would be 16 MiB: cut to 4; 2 parts of 6 MiB: no split.
        assert_eq!(mmq_splits(32, 16, 132, part(8192, 64)), 4);
        assert_eq!(mmq_splits(128, 16, 132, part(24576, 64)), 1);
        assert_eq!(mmq_splits(224, 16, 132, part(0, 0)), 1);
        // Whatever the device, the partials mmq_splits allows fit in MMQ_PART_BYTES.
        for sm in [1, 46, 132, 170, 1000] {
            for n in [32usize, 1024, 4096, 14336, 152064] {
                for n_tok in [1usize, 8, 64, 65, 512] {
                    let blocks = n.div_ceil(32) * n_tok.div_ceil(MMQ_TOK);
                    let s = mmq_splits(blocks, 56, sm, part(n, n_tok));
                    assert!(
                        s == 1 || s * n * n_tok * 4 <= MMQ_PART_BYTES,
                        "{sm} {n} {n_tok}"
                    );
                }
            }
        }
    }

    #[test]
    fn small_grids_take_32_row_tiles() {
        // 4096 rows x 64 tokens: 64 tiles of 64 rows, under an H100's 132 multiprocessors.
        let k = mmq_kernel_of(GgmlType::Q4_0, 4096, 64, 132, false).unwrap();
        assert_eq!((k.name, k.rows), ("mmq_q4_0_r32", 32));
        let k = mmq_kernel_of(GgmlType::Q4_0, 4096, 64, 132, true).unwrap();
        assert_eq!((k.name, k.rows), ("mmq_mma_q4_0_r32", 32));
        // 512 tokens: 512 tiles of 64 rows.
        let k = mmq_kernel_of(GgmlType::Q4_0, 4096, 512, 132, false).unwrap();
        assert_eq!((k.name, k.rows), ("mmq_q4_0", 64));
        let k = mmq_kernel_of(GgmlType::Q6_K, 4096, 512, 132, true).unwrap();
        assert_eq!((k.name, k.rows), ("mmq_mma_q6_K", 64));
        assert_eq!(mmq_kernel_of(GgmlType::Q2_K, 4096, 512, 132, true), None);
    }
}
