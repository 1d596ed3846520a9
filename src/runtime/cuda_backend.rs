//! The CUDA backend: weights uploaded in their GGUF format, decode matmuls as quantised
//! matrix-vector kernels (activations in Q8_1, integer dot products), prefill matmuls as
//! dequantisation to f16 and a cuBLAS GEMM, the other operators as kernels from
//! `src/kernels/cuda`, an f16 KV cache, pinned staging buffers for host transfers, and CUDA
//! events for timing. The libraries are loaded at run time; `probe` says why a GPU cannot be used.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use cudarc::cublas;
use cudarc::cublas::sys::cudaDataType::{CUDA_R_16F, CUDA_R_32F};
use cudarc::driver::sys::{CUevent_flags, CUstream};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError,
};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::cpu::attention::AttnShape;
use crate::kernels::cuda::{self as kc, SOURCES};
use crate::model::{RopeParams, WeightRef};
use crate::quant::GgmlType;
use crate::runtime::backend::{
    AttnCall, Backend, Category, ColCopy, DType, DeviceKind, HostMemory, Ledger, MemInfo,
    Reservation, Stopwatch, Tensor, Usage, Weight, check_tensor, check_weight_bytes,
    next_backend_id, shared_k, storage, weight_storage,
};
use crate::runtime::cuda_graphs::{FlushOnDrop, KernelArg, Launch, Launcher};
use crate::runtime::cuda_host::{HostRegistrations, PageLocked, Pinned, par_copy};
use crate::runtime::cuda_mmq::{
    MMQ_TOK, MmqChoices, MmqKernel, MmqMode, mma_on, mmq_kernel_of, mmq_kernels, mmq_mode,
    mmq_mode_from_env, mmq_splits,
};

/// Batches up to this many tokens use the matrix-vector kernels; larger ones the GEMM.
pub const MMVQ_MAX_TOKENS: usize = 8;
/// f16 scratch for one slice of a dequantised weight in the prefill GEMM.
pub const GEMM_SLICE_BYTES: usize = 64 << 20;
/// Slices of rows at least this tall keep a dequantised prefill GEMM on every multiprocessor
/// (4096 rows by 512 tokens: 128 tiles of 128 x 128); thinner, `gemm_pieces` cuts along k.
const GEMM_ROW_SLICE_MIN: usize = 4096;

/// f16 scratch for one slice of a dequantised weight in the prefill GEMM: `GEMM_SLICE_BYTES`, or
/// less with `OATO_CUDA_GEMM_SLICE` bytes (the stand-in checks use small ones, so that the test
/// model's weights go in pieces; never more, since the plan reserves that much).
static GEMM_SLICE: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
    crate::kernels::cpu::matmul::env_bytes("OATO_CUDA_GEMM_SLICE", GEMM_SLICE_BYTES)
        .clamp(1, GEMM_SLICE_BYTES)
});

/// The pieces (rows, columns) in which `dequant_gemm` takes an [n, k] weight of `block`-element
/// blocks (a multiple of 8, the dequantisation kernels' unit; k slices need k a multiple), each
/// at most `slice_bytes` of f16 (or a single row): the whole weight when it fits;
/// else slices of whole rows when they are at least `GEMM_ROW_SLICE_MIN` tall (an output head, a
/// gate projection); else, where a slice of k still holds a block of every row, slices of k whose
/// products are summed (a down projection: each GEMM keeps the output's full height); else thin
/// slices of rows. Slices of rows alone left LLaMA3-8B's ffn_down (4096 x 14336) two GEMMs of
/// 2340 and 1756 rows: 355 us at 512 tokens on the H200 where the same shape in F16, one GEMM,
/// took 101.
fn gemm_pieces(
    n: usize,
    k: usize,
    block: usize,
    slice_bytes: usize,
) -> Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    if n * k * 2 <= slice_bytes || n == 0 || k == 0 {
        return vec![(0..n, 0..k)];
    }
    let rows = (slice_bytes / (2 * k)).clamp(1, n);
    let kc = slice_bytes / (2 * n) / block * block;
    if rows < GEMM_ROW_SLICE_MIN && kc >= block && k.is_multiple_of(block) {
        return (0..k)
            .step_by(kc)
            .map(|k0| (0..n, k0..(k0 + kc).min(k)))
            .collect();
    }
    (0..n)
        .step_by(rows)
        .map(|r0| (r0..(r0 + rows).min(n), 0..k))
        .collect()
}

/// CUDA's limit on gridDim.y (rope and attention put tokens there).
const MAX_GRID_Y: usize = 65535;
/// Decode attention over at least this many positions is split across thread blocks
/// (flash_decode.cu) unless `OATO_CUDA_ATTN_SPLIT` says otherwise.
const ATTN_SPLIT_MIN_POSITIONS: usize = 256;
/// Positions per split-attention block: at least / at most (the kernel's FD_MAX_CHUNK).
const ATTN_CHUNK_MIN: usize = 32;
const ATTN_CHUNK_MAX: usize = 256;
/// Size of each of the two pinned staging buffers (the path for host memory the driver could not
/// register).
const PINNED_BYTES: usize = 32 << 20;

/// Chunk of a device-to-host read: small enough that the copy out of one pinned buffer overlaps
/// the DMA into the other, large enough that the per-chunk wait is a small part.
const DOWNLOAD_CHUNK: usize = 8 << 20;

pub(crate) fn drv(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Msg(format!("CUDA {what}: {e:?}"))
}

fn blas_err(e: cublas::result::CublasError) -> Error {
    Error::Msg(format!("cuBLAS: {e:?}"))
}

/// Why no CUDA device can be used, or `Ok` with the device count. Checks each library before
/// any call into it (cudarc panics on a missing library).
pub fn probe() -> Result<usize, String> {
    // SAFETY: these only try to open the libraries by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so not found)".into());
    }
    let mut version = 0i32;
    // SAFETY: needs no cuInit; `version` is valid for writes.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(format!("CUDA driver version unknown: {r:?}"));
    }
    // The kernels are compiled by NVRTC 13 and the stopwatch uses CUDA 13 driver calls.
    if version < 13000 {
        return Err(format!(
            "the CUDA driver supports CUDA {}.{}, oato needs 13.0 or newer",
            version / 1000,
            version % 1000 / 10
        ));
    }
    let n = CudaContext::device_count().map_err(|e| format!("CUDA driver: {e:?}"))?;
    if n < 1 {
        return Err("no CUDA device found".into());
    }
    if !kc::nvrtc_present() {
        return Err("libnvrtc not found (needed to compile the kernels)".into());
    }
    // SAFETY: as above.
    if !unsafe { cublas::sys::is_culib_present() } {
        return Err("libcublas not found".into());
    }
    Ok(n as usize)
}

/// The cuBLAS handle. cudarc's `CudaBlas` is not used because its drop panics when
/// cublasDestroy fails, as it can after a device error; this one ignores that at teardown.
struct BlasHandle(cublas::sys::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread (cudarc's CudaBlas is Send + Sync on the
// same grounds); the backend issues its calls on its one compute stream.
unsafe impl Send for BlasHandle {}
unsafe impl Sync for BlasHandle {}

impl BlasHandle {
    fn new(stream: &CudaStream) -> Result<Self> {
        let h = BlasHandle(cublas::result::create_handle().map_err(blas_err)?);
        // SAFETY: a live handle and the backend's stream, which outlives it.
        unsafe { cublas::result::set_stream(h.0, stream.cu_stream() as _) }.map_err(blas_err)?;
        Ok(h)
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once.
        let _ = unsafe { cublas::result::destroy_handle(self.0) };
    }
}

/// Device scratch space reused across calls, grown on demand.
#[derive(Default)]
struct Scratch {
    q8: Option<(CudaSlice<u8>, Reservation)>,
    w16: Option<(CudaSlice<u8>, Reservation)>,
    x16: Option<(CudaSlice<u8>, Reservation)>,
    /// Split attention's partial softmax states.
    attn: Option<(CudaSlice<u8>, Reservation)>,
    /// Prefill activations rounded to 8 bits (for quantised weights), as f16.
    xq16: Option<(CudaSlice<u8>, Reservation)>,
    /// Prefill activations as Q8_1 quants and scales (quantize_q8_1_split), for the int8 GEMM.
    mmq_act: Option<(CudaSlice<u8>, Reservation)>,
    /// The tensor-core int8 GEMM's split-K partial sums.
    mmq_part: Option<(CudaSlice<u8>, Reservation)>,
    pinned: Vec<Pinned>,
    turn: usize,
    /// Decode activations split by quantize_q8_1_split for the split layout's kernels: two
    /// slots, `q8s_at` the current one (the fused gate / up / SwiGLU kernel writes its output's
    /// split into the other while it reads its input's from the current, then swaps them).
    q8s: [Option<(CudaSlice<u8>, Reservation)>; 2],
    q8s_at: usize,
    /// The current `q8s` slot holds the split quants of the `.1` f32 values at address `.0` (as
    /// `q8_holds`).
    q8s_holds: Option<(u64, usize)>,
    /// The counters of split.cu's fused kernels (mmvq_split_glu: one a group of 32 rows;
    /// mmvq_split_qkv_rope: one a head), zero between launches; one buffer, as the launches
    /// run one after another on the stream.
    row_counters: Option<(CudaSlice<u8>, Reservation)>,
    /// `q8` holds `quantize_q8_1`'s blocks of the `.1` f32 values at address `.0` (written by a
    /// fused RMSNorm or SwiGLU, or by the last matrix-vector product's own quantisation), so a
    /// matmul of that input skips the quantisation launch. Every operator but matmul forgets it.
    q8_holds: Option<(u64, usize)>,
}

impl Scratch {
    /// An output of `y.1` f32 at `y.0` over the `x.1` inputs at `x.0` (never in the forward
    /// pass) ends the holds on their quantised copies.
    fn forget_if_written(&mut self, x: (u64, usize), y: (u64, usize)) {
        if y.0 < x.0 + (x.1 * 4) as u64 && x.0 < y.0 + (y.1 * 4) as u64 {
            self.q8_holds = None;
            self.q8s_holds = None;
        }
    }
}

/// Recorded after the last direct copy between the device and page-locked activation memory
/// (`PageLocked`), and whether a host-to-device one may not have run yet.
struct DirectCopies {
    event: CudaEvent,
    pending: bool,
}

struct CudaTensor {
    /// First, so deferred launches that read `buf` are issued before it is freed.
    _flush: FlushOnDrop,
    buf: CudaSlice<u8>,
    _res: Reservation,
}

struct CudaWeight {
    /// As in `CudaTensor`.
    _flush: FlushOnDrop,
    buf: CudaSlice<u8>,
    _res: Reservation,
    /// For a streamed weight: recorded on the copy stream after its upload; kernels that read
    /// it wait for it.
    ready: Option<CudaEvent>,
    /// Held in split.cu's layout (quants of all rows, then their f16 scales).
    split: bool,
}

pub struct CudaBackend {
    id: u64,
    ledger: Arc<Ledger>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Kernel launches on `stream`, replayed as CUDA graphs in decode (cuda_graphs.rs). Every
    /// other operation on `stream` first calls its `flush`.
    launcher: Arc<Launcher>,
    /// Uploads of streamed weights, overlapping the compute stream.
    copy_stream: Arc<CudaStream>,
    blas: BlasHandle,
    name: String,
    pub arch: u32,
    /// Streaming multiprocessors (sizes the split-attention grid).
    sm_count: usize,
    /// The L2 cache's bytes (0 where the driver does not say).
    l2_bytes: usize,
    /// `OATO_CUDA_MMQ=auto`'s choices between the int8 GEMM and cuBLAS, per shape.
    mmq_choices: MmqChoices,
    /// The tensor-core int8 GEMM gave the `__dp4a` kernel's bits on this device at start-up
    /// ([`CudaBackend::check_mma`]); false keeps `__dp4a`.
    mma_ok: AtomicBool,
    /// The tensor-core prefill attention agreed with the f32 one at start-up
    /// ([`CudaBackend::check_flash_mma`]); false keeps the f32 kernel.
    flash_mma_ok: AtomicBool,
    /// A weight in split.cu's layout has been uploaded: the fused RMSNorm, SwiGLU and attention
    /// kernels then also write their output's Q8_1 split (quantize_q8_1_split's layout), which
    /// its matrix-vector kernels read, besides the blocks mmvq.cu's kernels read.
    split_live: AtomicBool,
    funcs: HashMap<String, CudaFunction>,
    scratch: Mutex<Scratch>,
    host: Mutex<HostRegistrations>,
    /// Page-locked memory for the CPU's activation buffers (DESIGN.md rule 8).
    page_locked: Arc<PageLocked>,
    direct: Mutex<DirectCopies>,
    /// Kernel compilation (or cache loading) at start-up, excluded from every measurement.
    pub compile_ms: f64,
    pub kernels_from_cache: usize,
}

/// Launches kernel `$name` with `grid` and `block` (at once, or deferred to the end of a decode
/// segment: cuda_graphs.rs); each argument is typed as the kernel declares it. `launch!(hold
/// ...)` holds the launch back for a fusion with the next one (`Launcher::hold`);
/// `launch!(hold if COND, ...)` holds it when COND is true.
macro_rules! launch {
    (hold if $c:expr, $s:expr, $name:expr, $grid:expr, $block:expr; $($arg:ident : $ty:ty = $val:expr),* $(,)?) => {{
        if $c {
            launch!(@call hold, $s, $name, $grid, $block; $($arg: $ty = $val),*)
        } else {
            launch!(@call launch, $s, $name, $grid, $block; $($arg: $ty = $val),*)
        }
    }};
    (hold $s:expr, $name:expr, $grid:expr, $block:expr; $($arg:ident : $ty:ty = $val:expr),* $(,)?) => {{
        launch!(@call hold, $s, $name, $grid, $block; $($arg: $ty = $val),*)
    }};
    ($s:expr, $name:expr, $grid:expr, $block:expr; $($arg:ident : $ty:ty = $val:expr),* $(,)?) => {{
        launch!(@call launch, $s, $name, $grid, $block; $($arg: $ty = $val),*)
    }};
    (@call $how:ident, $s:expr, $name:expr, $grid:expr, $block:expr; $($arg:ident : $ty:ty = $val:expr),*) => {{
        let f = $s.func($name)?;
        let args = [$({
            let $arg: $ty = $val;
            KernelArg::slot($arg)
        }),*];
        let l = Launch::new(f.cu_function(), $name, $grid, $block, &args);
        // SAFETY: the argument list matches the kernel's signature in src/kernels/cuda, every
        // pointer is a device allocation of the size the kernel reads (kept alive until the
        // launch runs: its owner flushes deferred launches before freeing it), and the launch
        // contract (grid, block) is the one its source documents.
        unsafe { $s.launcher.$how(l) }?;
    }};
}

/// Whether RMSNorm and SwiGLU of decode-sized batches also write the Q8_1 blocks the next
/// matrix-vector product reads (`rms_norm_q8_1`, `swiglu_q8_1`: one launch fewer each), and
/// decode RoPE of q and k runs with the KV store (`rope_store_kv_f16`: two launches fewer). On
/// unless `OATO_CUDA_FUSE=0` at start-up or `set_fuse_q8(false)`; the values are the same either
/// way, bit for bit.
static FUSE_Q8: std::sync::LazyLock<AtomicBool> = std::sync::LazyLock::new(|| {
    AtomicBool::new(crate::kernels::cpu::matmul::env_on("OATO_CUDA_FUSE"))
});

/// Turns the fused RMSNorm / SwiGLU quantisation on or off for every CUDA backend of the
/// process (`selftest --perf` times both).
pub fn set_fuse_q8(on: bool) {
    FUSE_Q8.store(on, Ordering::Relaxed);
}

/// Which kernels run the decode matmuls (1 to `MMVQ_MAX_TOKENS` tokens) on quantised weights.
/// Staged and pipelined give the same bits; direct the same values up to the order of f32 sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmvqMode {
    /// `mmvq_<type>` (and `mmvq_multi_<type>`): a chunk staged in shared memory, then computed;
    /// one grid row per token.
    Staged,
    /// `mmvq_direct_<type>`: no shared-memory staging, every token of the batch per weight load,
    /// on activations split by `quantize_q8_1_split` (so without the fused Q8_1 blocks).
    Direct,
    /// `mmvq_pipe_<type>`: the staged kernels' work, with the next item's loads in flight while
    /// the current one is computed, a few thread blocks per multiprocessor walking the row blocks.
    Pipe,
}

impl MmvqMode {
    /// `OATO_CUDA_MMVQ`'s spelling.
    pub fn name(self) -> &'static str {
        match self {
            MmvqMode::Staged => "staged",
            MmvqMode::Direct => "direct",
            MmvqMode::Pipe => "pipe",
        }
    }

    /// The mode `OATO_CUDA_MMVQ` names (`staged`, `direct`, `pipe`).
    pub fn parse(v: &str) -> Result<Self> {
        [MmvqMode::Staged, MmvqMode::Direct, MmvqMode::Pipe]
            .into_iter()
            .find(|m| m.name() == v)
            .ok_or_else(|| {
                Error::Msg(format!(
                    "OATO_CUDA_MMVQ={v:?}: expected staged, direct or pipe"
                ))
            })
    }
}

/// The decode matrix-vector kernels chosen (`MmvqMode as u8`): staged unless `OATO_CUDA_MMVQ`
/// says otherwise at start-up, or `set_mmvq_mode`.
static MMVQ_MODE: AtomicU8 = AtomicU8::new(MmvqMode::Staged as u8);

/// Chooses the decode matrix-vector kernels for every CUDA backend of the process
/// (`selftest --perf` times each).
pub fn set_mmvq_mode(m: MmvqMode) {
    MMVQ_MODE.store(m as u8, Ordering::Relaxed);
}

/// The decode matrix-vector kernels chosen.
pub fn mmvq_mode() -> MmvqMode {
    match MMVQ_MODE.load(Ordering::Relaxed) {
        1 => MmvqMode::Direct,
        2 => MmvqMode::Pipe,
        _ => MmvqMode::Staged,
    }
}

/// Thread blocks per multiprocessor in a pipelined matrix-vector launch (at most one per row
/// block): `OATO_CUDA_MMVQ_PIPE_BLOCKS` at start-up, else 5 (the kernels' `__launch_bounds__`).
static PIPE_BLOCKS: AtomicUsize = AtomicUsize::new(5);

/// Sets the thread blocks per multiprocessor of pipelined matrix-vector launches (at least 1).
pub fn set_pipe_blocks(b: usize) {
    PIPE_BLOCKS.store(b.max(1), Ordering::Relaxed);
}

/// Thread blocks per multiprocessor of pipelined matrix-vector launches.
pub fn pipe_blocks() -> usize {
    PIPE_BLOCKS.load(Ordering::Relaxed)
}

/// Batches of at most this many tokens take the matrix-vector kernels, larger ones the prefill
/// GEMM (`prefill_path`: the int8 GEMM, on tensor cores where the device has them, or
/// dequantisation + cuBLAS, as `OATO_CUDA_MMQ` and its timing choose): `MMVQ_MAX_TOKENS` unless
/// `OATO_CUDA_MMVQ_MAX_TOKENS` (0 to 8; 0: every batch, decode's single token too, through the
/// GEMM) says otherwise at start-up, or `set_mmvq_max_tokens` (`selftest --perf` times decode
/// batches both ways). Everything else that treats a batch as decode-sized (CUDA graphs, the
/// fused Q8_1 blocks, held RoPE) still goes by `MMVQ_MAX_TOKENS`.
static MMVQ_TOKENS: AtomicUsize = AtomicUsize::new(MMVQ_MAX_TOKENS);

/// Sets the largest batch the matrix-vector kernels take (at most `MMVQ_MAX_TOKENS`).
pub fn set_mmvq_max_tokens(n: usize) {
    MMVQ_TOKENS.store(n.min(MMVQ_MAX_TOKENS), Ordering::Relaxed);
}

/// The largest batch the matrix-vector kernels take.
pub fn mmvq_max_tokens() -> usize {
    MMVQ_TOKENS.load(Ordering::Relaxed)
}

/// `OATO_CUDA_MMVQ_MAX_TOKENS`'s value: 0 to `MMVQ_MAX_TOKENS`.
pub fn parse_mmvq_max_tokens(v: &str) -> Result<usize> {
    parse_env_count(
        "OATO_CUDA_MMVQ_MAX_TOKENS",
        v,
        |n| n <= MMVQ_MAX_TOKENS,
        &format!("the largest batch the matrix-vector kernels take, 0 to {MMVQ_MAX_TOKENS}"),
    )
}

/// `OATO_CUDA_MMVQ_PIPE_BLOCKS`'s value: 1 to 64.
fn parse_pipe_blocks(v: &str) -> Result<usize> {
    parse_env_count(
        "OATO_CUDA_MMVQ_PIPE_BLOCKS",
        v,
        |b| (1..=64).contains(&b),
        "thread blocks per multiprocessor, 1 to 64",
    )
}

/// Environment variable `name`'s value `v` as a whole number that `ok` accepts (surrounding
/// spaces allowed), else an error naming the variable, the value and what was `expected`.
fn parse_env_count(
    name: &str,
    v: &str,
    ok: impl Fn(usize) -> bool,
    expected: &str,
) -> Result<usize> {
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| ok(n))
        .ok_or_else(|| Error::Msg(format!("{name}={v:?}: expected {expected}")))
}

/// Whether prefill attention (more than `MMVQ_MAX_TOKENS` tokens) runs as the tiled kernel of
/// flash_prefill.cu (query tiles sharing K/V tiles) rather than one block per (head, token)
/// (attention_f16kv). On unless `OATO_CUDA_FLASH_PREFILL=0` at start-up or
/// `set_flash_prefill(false)`; the two agree to rounding (the order of the softmax sums).
static FLASH_PREFILL: std::sync::LazyLock<AtomicBool> = std::sync::LazyLock::new(|| {
    AtomicBool::new(crate::kernels::cpu::matmul::env_on(
        "OATO_CUDA_FLASH_PREFILL",
    ))
});

/// Chooses the tiled (true) or per-token (false) prefill attention for every CUDA backend of the
/// process (`selftest --perf` times both).
pub fn set_flash_prefill(on: bool) {
    FLASH_PREFILL.store(on, Ordering::Relaxed);
}

/// Whether prefill attention runs as the tiled kernel.
pub fn flash_prefill() -> bool {
    FLASH_PREFILL.load(Ordering::Relaxed)
}

/// Whether the tiled prefill attention runs on tensor cores (`attention_flash_mma_f16kv`, sm_80
/// and later, head sizes that are multiples of 16 up to 128, where the start-up check agreed)
/// rather than on the f32 lanes (`attention_flash_f16kv`). On unless `OATO_CUDA_FLASH_MMA=0` at
/// start-up or `set_flash_mma(false)`; the two agree to rounding.
static FLASH_MMA: std::sync::LazyLock<AtomicBool> = std::sync::LazyLock::new(|| {
    AtomicBool::new(crate::kernels::cpu::matmul::env_on("OATO_CUDA_FLASH_MMA"))
});

/// Chooses the tensor-core (true) or f32 (false) tiled prefill attention for every CUDA backend
/// of the process (`selftest --perf` times both).
pub fn set_flash_mma(on: bool) {
    FLASH_MMA.store(on, Ordering::Relaxed);
}

/// Whether the tiled prefill attention may run on tensor cores.
pub fn flash_mma() -> bool {
    FLASH_MMA.load(Ordering::Relaxed)
}

/// Microseconds of `gpu_sleep` (ops.cu) the stopwatch queues before its start event: the GPU
/// is busy that long while the host queues the work being timed, so the time is the GPU's alone
/// and not the host's launch latency (a single small kernel timed from an idle GPU measured
/// several microseconds of host time). 50, or `OATO_CUDA_TIMER_LEAD_US` (0: none, the GPU idle
/// at the start event as before).
static TIMER_LEAD_US: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
    crate::kernels::cpu::matmul::env_bytes("OATO_CUDA_TIMER_LEAD_US", 50).min(100_000)
});

/// The stopwatch's lead-in in microseconds ([`TIMER_LEAD_US`]; 0: none).
pub fn timer_lead_us() -> usize {
    *TIMER_LEAD_US
}

/// The most bytes of a weight in the file's layout held on the GPU at once while it is rewritten
/// into the split layout (whole rows, at least one; a weight's upload needs that much beyond its
/// own size): 32 MiB, or `OATO_CUDA_SPLIT_STAGE` bytes (the stand-in checks use small ones, so
/// that a weight goes in many slices).
static SPLIT_STAGE_BYTES: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
    crate::kernels::cpu::matmul::env_bytes("OATO_CUDA_SPLIT_STAGE", 32 << 20).max(1)
});

/// Whether weights of the formats split.cu handles (Q4_0, Q4_1, IQ4_NL, Q8_0, Q6_K) are held in its
/// split layout when they are uploaded to stay (quants 16-byte aligned, scales apart; the same
/// bytes), so decode reads them with the `mmvq_split_*` kernels; Q4_K and Q5_K (blocks 16-byte
/// multiples already) keep their layout and take the `mmvq_split_*` kernels too. Streamed
/// weights keep the file's layout and kernels.
/// Off unless `OATO_CUDA_SPLIT=1` at start-up or `set_weight_split(true)`: the kernels have not
/// been timed on a GPU yet. The values agree with the file layout's kernels up to the order of
/// f32 sums (as the direct kernels do).
static WEIGHT_SPLIT: std::sync::LazyLock<AtomicBool> = std::sync::LazyLock::new(|| {
    AtomicBool::new(std::env::var("OATO_CUDA_SPLIT").is_ok_and(|v| v.trim() == "1"))
});

/// Chooses, for weights uploaded from now on by every CUDA backend of the process, the split
/// layout (true) or the file's (false).
pub fn set_weight_split(on: bool) {
    WEIGHT_SPLIT.store(on, Ordering::Relaxed);
}

/// Whether weights uploaded now take the split layout where their format has one.
pub fn weight_split() -> bool {
    WEIGHT_SPLIT.load(Ordering::Relaxed)
}

/// split.cu's kernels for a weight type: its matrix-vector kernels (1 to 8 tokens; exactly 1),
/// and for the types it rewrites, how (None: Q4_K and Q5_K, read in the file's layout).
struct SplitKernels {
    mmvq: &'static str,
    mmvq1: &'static str,
    /// Gate, up and SwiGLU in one launch (`mmvq_split_glu_<type>`, one token: `glu1`).
    glu: &'static str,
    glu1: &'static str,
    /// q, k, v, RoPE and the KV store in one launch (`mmvq_split_qkv_rope_<type>`, `qkv1`).
    qkv: &'static str,
    qkv1: &'static str,
    rewrite: Option<SplitRewrite>,
}

impl SplitKernels {
    /// The decode kernels: mmvq, mmvq1, glu, glu1, qkv, qkv1.
    fn names(&self) -> [&'static str; 6] {
        [
            self.mmvq, self.mmvq1, self.glu, self.glu1, self.qkv, self.qkv1,
        ]
    }
}

/// A type split.cu rewrites: each block's `sb` scale bytes go to an array after all the quants,
/// by `repack`; `dequant` reads the result.
#[derive(Clone, Copy)]
struct SplitRewrite {
    ty: GgmlType,
    sb: usize,
    repack: &'static str,
    dequant: &'static str,
}

impl SplitRewrite {
    /// Quant bytes a block.
    fn qb(&self) -> usize {
        self.ty.type_size() - self.sb
    }

    /// The quants and the scales from element `k0` (a block boundary) of row `r0` on, in an
    /// `n`-row weight of `k` columns at `base`.
    fn at(&self, base: u64, k: usize, n: usize, r0: usize, k0: usize) -> (u64, u64) {
        let bs = self.ty.block_size();
        let (nb, b) = (k / bs, r0 * (k / bs) + k0 / bs);
        let (qb, sb) = (self.qb(), self.sb);
        (base + (b * qb) as u64, base + (n * nb * qb + b * sb) as u64)
    }
}

/// Whether weights of type `ty` have the split layout (`set_weight_split`).
pub fn split_kernels(ty: GgmlType) -> bool {
    split_kernels_of(ty).is_some()
}

/// split.cu's decode kernels of the type whose kernel names end in `$s` (its
/// SPLIT_DECODE_KERNELS), in `SplitKernels::names`' order.
macro_rules! split_decode_names {
    ($s:literal) => {
        [
            concat!("mmvq_split_", $s),
            concat!("mmvq_split1_", $s),
            concat!("mmvq_split_glu_", $s),
            concat!("mmvq_split1_glu_", $s),
            concat!("mmvq_split_qkv_rope_", $s),
            concat!("mmvq_split1_qkv_rope_", $s),
        ]
    };
}

/// The types split.cu takes (its SPLIT_DECODE_KERNELS).
const SPLIT_TYPES: [GgmlType; 7] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::IQ4_NL,
    GgmlType::Q8_0,
    GgmlType::Q6_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
];

fn split_kernels_of(ty: GgmlType) -> Option<SplitKernels> {
    use GgmlType as T;
    // (decode kernels, (scale bytes, repack, dequantisation) when rewritten)
    let (names, rewrite) = match ty {
        T::Q4_0 => (
            split_decode_names!("q4_0"),
            Some((2, "split_blocks_16", "dequant_split_q4_0_f16")),
        ),
        T::Q4_1 => (
            split_decode_names!("q4_1"),
            Some((4, "split_blocks_16m", "dequant_split_q4_1_f16")),
        ),
        T::IQ4_NL => (
            split_decode_names!("iq4_nl"),
            Some((2, "split_blocks_16", "dequant_split_iq4_nl_f16")),
        ),
        T::Q8_0 => (
            split_decode_names!("q8_0"),
            Some((2, "split_blocks_32", "dequant_split_q8_0_f16")),
        ),
        T::Q6_K => (
            split_decode_names!("q6_K"),
            Some((2, "split_blocks_208", "dequant_split_q6_K_f16")),
        ),
        T::Q4_K => (split_decode_names!("q4_K"), None),
        T::Q5_K => (split_decode_names!("q5_K"), None),
        _ => return None,
    };
    let [mmvq, mmvq1, glu, glu1, qkv, qkv1] = names;
    Some(SplitKernels {
        mmvq,
        mmvq1,
        glu,
        glu1,
        qkv,
        qkv1,
        rewrite: rewrite.map(|(sb, repack, dequant)| SplitRewrite {
            ty,
            sb,
            repack,
            dequant,
        }),
    })
}

/// Whether decode's gate and up products in the split layout and the SwiGLU of their outputs run
/// as one kernel (`mmvq_split_glu_<type>`: the same bits, one launch fewer a layer). On unless
/// `OATO_CUDA_GLU=0` at start-up.
static GLU: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| crate::kernels::cpu::matmul::env_on("OATO_CUDA_GLU"));

/// A held split matrix-vector launch (mmvq_split_<type>, mmvq_split1_<type>) as it was made:
/// the fused kernel `pick` gives for its type (for eight tokens, for one), its weights,
/// activations (quants, scales) and k as passed on, and its outputs, rows and tokens to match.
struct HeldSplit {
    fused: &'static str,
    w: [[u8; 8]; 3],
    aq: [u8; 8],
    ads: [u8; 8],
    k: [u8; 8],
    y: [[u8; 8]; 3],
    rows: [[u8; 8]; 3],
    n_tok: [u8; 8],
}

impl HeldSplit {
    fn of(
        l: &Launch,
        pick: impl Fn(&SplitKernels) -> (&'static str, &'static str),
    ) -> Option<Self> {
        let fused = SPLIT_TYPES
            .into_iter()
            .filter_map(split_kernels_of)
            .find_map(|sk| {
                let (many, one) = pick(&sk);
                (l.name == sk.mmvq)
                    .then_some(many)
                    .or((l.name == sk.mmvq1).then_some(one))
            })?;
        // mmvq_split's arguments: w0 w1 w2 aq ads y0 y1 y2 k n0 n1 n2 n_tok.
        let a: &[[u8; 8]; 13] = l.args.as_slice().try_into().ok()?;
        Some(HeldSplit {
            fused,
            w: [a[0], a[1], a[2]],
            aq: a[3],
            ads: a[4],
            y: [a[5], a[6], a[7]],
            k: a[8],
            rows: [a[9], a[10], a[11]],
            n_tok: a[12],
        })
    }

    /// Whether it wrote `y` (the first places, in order) with `rows` rows each (0: an empty
    /// place) for `n_tok` tokens.
    fn wrote(&self, y: &[u64], rows: [usize; 3], n_tok: usize) -> bool {
        y.iter().zip(&self.y).all(|(p, s)| p.slot() == *s)
            && rows.map(|r| (r as i32).slot()) == self.rows
            && (n_tok as i32).slot() == self.n_tok
    }
}

/// Whether decode's q, k and v products in the split layout (one launch), their RoPE and the
/// KV store run as one kernel (`mmvq_split_qkv_rope_<type>`: the same bits, one launch fewer a
/// layer). On unless `OATO_CUDA_QKV_ROPE=0` at start-up.
static QKV_ROPE: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| crate::kernels::cpu::matmul::env_on("OATO_CUDA_QKV_ROPE"));

/// The held q / k / v launch that mmvq_split_qkv_rope takes over with the two held RoPEs after
/// it, and the RoPE arguments as `fused_rope` gives them: when `held` is exactly one split
/// matrix-vector launch of three weights writing `q`, `k` and `v` (the attention's rows for
/// `n_tok` tokens of shape `s`), then the RoPE of q and k that `fused_rope` takes.
fn qkv_rope_of(
    held: &[Launch],
    q: u64,
    k: u64,
    v: u64,
    n_tok: usize,
    s: AttnShape,
) -> Option<(HeldSplit, [[u8; 8]; 7])> {
    let [l, ropes @ ..] = held else { return None };
    let rope = fused_rope(ropes, q, k, n_tok, s)?;
    let h = HeldSplit::of(l, |sk| (sk.qkv, sk.qkv1))?;
    let (nq, nkv) = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
    (s.head_dim.is_multiple_of(32) && h.wrote(&[q, k, v], [nq, nkv, nkv], n_tok))
        .then_some((h, rope))
}

/// The held gate / up launch that mmvq_split_glu takes over: when `held` is exactly one split
/// matrix-vector launch of two weights of `width` rows writing `g` and `u` for `n_tok` tokens.
fn glu_of(held: &[Launch], g: u64, u: u64, width: usize, n_tok: usize) -> Option<HeldSplit> {
    let [l] = held else { return None };
    let h = HeldSplit::of(l, |sk| (sk.glu, sk.glu1))?;
    h.wrote(&[g, u], [width, width, 0], n_tok).then_some(h)
}

/// Whether the decode matmuls of two or three quantised weights of one type that read one input
/// (q, k and v; gate and up) run as one launch (`mmvq_multi_<type>`) rather than one each; the
/// values are the same bits either way. On unless `OATO_CUDA_MMVQ_MULTI=0` at start-up or
/// `set_mmvq_multi(false)`.
static MMVQ_MULTI: std::sync::LazyLock<AtomicBool> = std::sync::LazyLock::new(|| {
    AtomicBool::new(crate::kernels::cpu::matmul::env_on("OATO_CUDA_MMVQ_MULTI"))
});

/// Turns the one-launch matrix-vector products of weights sharing an input on or off for every
/// CUDA backend of the process.
pub fn set_mmvq_multi(on: bool) {
    MMVQ_MULTI.store(on, Ordering::Relaxed);
}

/// Whether weights that share an input take one matrix-vector launch.
pub fn mmvq_multi() -> bool {
    MMVQ_MULTI.load(Ordering::Relaxed)
}

/// The one-launch matrix-vector kernel for two or three weights of a quantised type.
fn multi_kernel_of(ty: GgmlType) -> Option<&'static str> {
    use GgmlType as T;
    Some(match ty {
        T::Q4_0 => "mmvq_multi_q4_0",
        T::Q4_1 => "mmvq_multi_q4_1",
        T::Q5_0 => "mmvq_multi_q5_0",
        T::Q5_1 => "mmvq_multi_q5_1",
        T::Q8_0 => "mmvq_multi_q8_0",
        T::Q2_K => "mmvq_multi_q2_K",
        T::Q3_K => "mmvq_multi_q3_K",
        T::Q4_K => "mmvq_multi_q4_K",
        T::Q5_K => "mmvq_multi_q5_K",
        T::Q6_K => "mmvq_multi_q6_K",
        T::IQ4_NL => "mmvq_multi_iq4_nl",
        T::IQ4_XS => "mmvq_multi_iq4_xs",
        _ => return None,
    })
}

/// The pipelined matrix-vector kernel of a quantised weight type.
fn pipe_kernel_of(ty: GgmlType) -> Option<&'static str> {
    use GgmlType as T;
    Some(match ty {
        T::Q4_0 => "mmvq_pipe_q4_0",
        T::Q4_1 => "mmvq_pipe_q4_1",
        T::Q5_0 => "mmvq_pipe_q5_0",
        T::Q5_1 => "mmvq_pipe_q5_1",
        T::Q8_0 => "mmvq_pipe_q8_0",
        T::Q2_K => "mmvq_pipe_q2_K",
        T::Q3_K => "mmvq_pipe_q3_K",
        T::Q4_K => "mmvq_pipe_q4_K",
        T::Q5_K => "mmvq_pipe_q5_K",
        T::Q6_K => "mmvq_pipe_q6_K",
        T::IQ4_NL => "mmvq_pipe_iq4_nl",
        T::IQ4_XS => "mmvq_pipe_iq4_xs",
        _ => return None,
    })
}

/// The direct matrix-vector kernel of a quantised weight type.
fn direct_kernel_of(ty: GgmlType) -> Option<&'static str> {
    use GgmlType as T;
    Some(match ty {
        T::Q4_0 => "mmvq_direct_q4_0",
        T::Q4_1 => "mmvq_direct_q4_1",
        T::Q5_0 => "mmvq_direct_q5_0",
        T::Q5_1 => "mmvq_direct_q5_1",
        T::Q8_0 => "mmvq_direct_q8_0",
        T::Q2_K => "mmvq_direct_q2_K",
        T::Q3_K => "mmvq_direct_q3_K",
        T::Q4_K => "mmvq_direct_q4_K",
        T::Q5_K => "mmvq_direct_q5_K",
        T::Q6_K => "mmvq_direct_q6_K",
        T::IQ4_NL => "mmvq_direct_iq4_nl",
        T::IQ4_XS => "mmvq_direct_iq4_xs",
        _ => return None,
    })
}

/// How decode attention over the KV cache is launched: split across thread blocks
/// (flash_decode.cu) or one block per (head, token) (attention_f16kv).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AttnSplit {
    /// Query heads per block (all of one KV head).
    gq: usize,
    /// Positions per block.
    chunk: usize,
    /// Blocks along the positions: ceil(positions / chunk).
    n_split: usize,
}

/// The split for `n_tok` query tokens over `n_kv` positions (the last token's), or None for the
/// one-block-per-head kernel: prefill batches (more than `MMVQ_MAX_TOKENS`), head sizes the
/// split kernel lacks (it needs 32, 64, 128 or 256), contexts under `ATTN_SPLIT_MIN_POSITIONS`
/// unless `force` is Some(true), and everything when `force` is Some(false). The chunk gives
/// about four blocks per multiprocessor, within `ATTN_CHUNK_MIN..=ATTN_CHUNK_MAX` positions.
fn attn_split(
    s: AttnShape,
    n_tok: usize,
    n_kv: usize,
    sm_count: usize,
    force: Option<bool>,
) -> Option<AttnSplit> {
    let supported = matches!(s.head_dim, 32 | 64 | 128 | 256)
        && s.n_head_kv > 0
        && s.n_head.is_multiple_of(s.n_head_kv)
        && n_tok <= MMVQ_MAX_TOKENS
        && n_kv > 0;
    let wanted = force.unwrap_or(n_kv >= ATTN_SPLIT_MIN_POSITIONS);
    if !supported || !wanted {
        return None;
    }
    // The largest divisor of the group with gq <= 8 and gq * head_dim <= 1024 (FD_MAX_G, FD_MAX_GE).
    let group = s.n_head / s.n_head_kv;
    let gq = (1..=group.min(8))
        .rev()
        .find(|g| group.is_multiple_of(*g) && g * s.head_dim <= 1024)?;
    let blocks = (s.n_head / gq) * n_tok;
    let want_splits = (4 * sm_count).div_ceil(blocks).max(1);
    let chunk = n_kv
        .div_ceil(want_splits)
        .clamp(ATTN_CHUNK_MIN, ATTN_CHUNK_MAX);
    Some(AttnSplit {
        gq,
        chunk,
        n_split: n_kv.div_ceil(chunk),
    })
}

/// Whether decode attention is split (flash_decode.cu), as `split_code` encodes the choice:
/// from `OATO_CUDA_ATTN_SPLIT` at start-up (`1` always, `0` never, else the context length
/// decides) or `set_attn_split`.
static ATTN_SPLIT: std::sync::LazyLock<std::sync::atomic::AtomicU8> =
    std::sync::LazyLock::new(|| {
        let force = match std::env::var("OATO_CUDA_ATTN_SPLIT").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        };
        std::sync::atomic::AtomicU8::new(split_code(force))
    });

/// `ATTN_SPLIT`'s value for a choice: 0 the context length decides, 1 split, 2 never.
fn split_code(force: Option<bool>) -> u8 {
    match force {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    }
}

/// Forces decode attention split (`Some(true)`), one block per head (`Some(false)`), or lets the
/// context length decide (`None`), for every CUDA backend of the process (`selftest --perf`
/// times both at short contexts).
pub fn set_attn_split(force: Option<bool>) {
    ATTN_SPLIT.store(split_code(force), Ordering::Relaxed);
}

/// The decode attention split choice `set_attn_split` last set.
pub fn attn_split_force() -> Option<bool> {
    match ATTN_SPLIT.load(Ordering::Relaxed) {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    }
}

/// The shared RoPE arguments (n_dims, pos0, base, scale, neox, freq factors, offset, as
/// rope_f32 takes them) when `held` is exactly rope_f32 on the query at `q` (`s.n_head` heads)
/// and on the key at `k` (`s.n_head_kv` heads), in either order, over the same `n_tok` tokens of
/// `s.head_dim` with the same arguments: what rope_store_kv_f16 does with the store.
fn fused_rope(held: &[Launch], q: u64, k: u64, n_tok: usize, s: AttnShape) -> Option<[[u8; 8]; 7]> {
    let [a, b] = held else { return None };
    let (qr, kr) = if a.args.first() == Some(&q.slot()) {
        (a, b)
    } else {
        (b, a)
    };
    let is = |l: &Launch, x: u64, heads: usize| {
        l.name == "rope_f32"
            && l.args.len() == 11
            && l.args[0] == x.slot()
            && l.args[1] == (n_tok as i32).slot()
            && l.args[2] == (heads as i32).slot()
            && l.args[3] == (s.head_dim as i32).slot()
    };
    if !is(qr, q, s.n_head) || !is(kr, k, s.n_head_kv) || qr.args[4..] != kr.args[4..] {
        return None;
    }
    qr.args[4..].try_into().ok()
}

/// The address of what `held` adds to `x` when it is exactly one add_f32 of `len` floats into
/// `x` (`add`'s held launch): what add_rms_norm_q8_1 takes for the add.
fn fused_add(held: &[Launch], x: u64, len: usize) -> Option<u64> {
    let [a] = held else { return None };
    let ok = a.name == "add_f32"
        && a.args.len() == 3
        && a.args[0] == x.slot()
        && a.args[2] == (len as i64).slot();
    ok.then(|| u64::from_ne_bytes(a.args[1]))
}

/// A grid for a grid-stride kernel over `n` items with 256 threads per block, `per_thread` items
/// a thread; decode-sized counts (`MMVQ_MAX_TOKENS` tokens of a 14336-wide FFN at most) get a
/// thread an item: a grid-stride loop's later loads can wait for its earlier stores (the kernels'
/// pointers may alias), four round trips where one would do (read from the code, not timed).
fn stride_grid(n: usize, per_thread: usize) -> (u32, u32, u32) {
    let per_thread = if n <= MMVQ_MAX_TOKENS * 14336 {
        1
    } else {
        per_thread
    };
    let blocks = n.div_ceil(256 * per_thread).clamp(1, 65535);
    (blocks as u32, 1, 1)
}

const B256: (u32, u32, u32) = (256, 1, 1);

/// The thread block of an RMSNorm row of `n` values (ops.cu's rms_norm kernels, one row a
/// block): four values a thread, in whole warps, at most 1024 threads (up to 8192 values the
/// kernels hold a row in registers, eight a thread). A decode row is one block on one
/// multiprocessor, so fewer values a thread is a shorter chain of dependent steps: the Q8_1
/// blocks' reductions are taken 4 times a thread for a row of 4096, not 16 as at 256 threads.
/// The bits follow the block size (each thread's sum of squares); the plain and the fused
/// kernels get the same block for a row of `n`, so they agree bit for bit.
/// `OATO_CUDA_NORM_THREADS` (or `set_norm_threads`) fixes the block instead (what 256 threads
/// did before, for `selftest --perf`'s comparison).
fn norm_block(n: usize) -> (u32, u32, u32) {
    let threads = match NORM_THREADS.load(Ordering::Relaxed) {
        0 => n.div_ceil(4).next_multiple_of(32).clamp(32, 1024),
        t => t,
    };
    (threads as u32, 1, 1)
}

/// The RMSNorm kernels' threads a block: 0 for `norm_block`'s choice by the row's width.
static NORM_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Fixes the RMSNorm kernels' block at `threads` (a multiple of 32 up to 1024; 0: by the row's
/// width, the default) for every CUDA backend of the process; the values change only by the
/// order of each row's f32 sum of squares.
pub fn set_norm_threads(threads: usize) {
    NORM_THREADS.store(threads, Ordering::Relaxed);
}

/// The RMSNorm kernels' fixed block size, 0 when chosen by the row's width.
pub fn norm_threads() -> usize {
    NORM_THREADS.load(Ordering::Relaxed)
}

/// `OATO_CUDA_NORM_THREADS`'s value: 0, or a multiple of 32 from 32 to 1024.
pub fn parse_norm_threads(v: &str) -> Result<usize> {
    parse_env_count(
        "OATO_CUDA_NORM_THREADS",
        v,
        |t| t <= 1024 && t.is_multiple_of(32),
        "the RMSNorm kernels' threads a block, a multiple of 32 up to 1024 (0: four values a \
         thread, the default)",
    )
}

/// How one weight is multiplied by a prefill batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prefill {
    /// A float weight: cuBLAS (BF16 converted to f16 first).
    Float,
    /// A quantised weight dequantised to f16, then cuBLAS.
    Dequant,
    /// A quantised weight by its int8 GEMM kernel (mmq.cu).
    Mmq(MmqKernel),
    /// `OATO_CUDA_MMQ=auto` has not seen the shape: time both, keep the faster.
    Measure(MmqKernel),
}

/// The matrix-vector kernel and the dequantisation kernel of a weight type.
fn kernels_of(ty: GgmlType) -> Option<(&'static str, Option<&'static str>)> {
    use GgmlType as T;
    Some(match ty {
        T::Q4_0 => ("mmvq_q4_0", Some("dequant_q4_0_f16")),
        T::Q4_1 => ("mmvq_q4_1", Some("dequant_q4_1_f16")),
        T::Q5_0 => ("mmvq_q5_0", Some("dequant_q5_0_f16")),
        T::Q5_1 => ("mmvq_q5_1", Some("dequant_q5_1_f16")),
        T::Q8_0 => ("mmvq_q8_0", Some("dequant_q8_0_f16")),
        T::Q2_K => ("mmvq_q2_K", Some("dequant_q2_K_f16")),
        T::Q3_K => ("mmvq_q3_K", Some("dequant_q3_K_f16")),
        T::Q4_K => ("mmvq_q4_K", Some("dequant_q4_K_f16")),
        T::Q5_K => ("mmvq_q5_K", Some("dequant_q5_K_f16")),
        T::Q6_K => ("mmvq_q6_K", Some("dequant_q6_K_f16")),
        T::IQ4_NL => ("mmvq_iq4_nl", Some("dequant_iq4_nl_f16")),
        T::IQ4_XS => ("mmvq_iq4_xs", Some("dequant_iq4_xs_f16")),
        T::F32 => ("mmv_f32w", None),
        T::F16 => ("mmv_f16w", None),
        T::BF16 => ("mmv_bf16w", Some("dequant_bf16_f16")),
        _ => return None,
    })
}

/// Every kernel the backend launches, by source file (the compile-only selftest checks that
/// each is in its CUBIN).
pub const KERNELS: &[(&str, &[&str])] = &[
    (
        "quantize.cu",
        &["quantize_q8_1", "quantize_q8_1_split", "round_q8_f16"],
    ),
    (
        "mmvq.cu",
        &[
            "mmvq_q4_0",
            "mmvq_q4_1",
            "mmvq_q5_0",
            "mmvq_q5_1",
            "mmvq_q8_0",
            "mmvq_q2_K",
            "mmvq_q3_K",
            "mmvq_q4_K",
            "mmvq_q5_K",
            "mmvq_q6_K",
            "mmvq_iq4_nl",
            "mmvq_iq4_xs",
            "mmvq_multi_q4_0",
            "mmvq_multi_q4_1",
            "mmvq_multi_q5_0",
            "mmvq_multi_q5_1",
            "mmvq_multi_q8_0",
            "mmvq_multi_q2_K",
            "mmvq_multi_q3_K",
            "mmvq_multi_q4_K",
            "mmvq_multi_q5_K",
            "mmvq_multi_q6_K",
            "mmvq_multi_iq4_nl",
            "mmvq_multi_iq4_xs",
            "mmvq_direct_q4_0",
            "mmvq_direct_q4_1",
            "mmvq_direct_q5_0",
            "mmvq_direct_q5_1",
            "mmvq_direct_q8_0",
            "mmvq_direct_q2_K",
            "mmvq_direct_q3_K",
            "mmvq_direct_q4_K",
            "mmvq_direct_q5_K",
            "mmvq_direct_q6_K",
            "mmvq_direct_iq4_nl",
            "mmvq_direct_iq4_xs",
            "mmvq_pipe_q4_0",
            "mmvq_pipe_q4_1",
            "mmvq_pipe_q5_0",
            "mmvq_pipe_q5_1",
            "mmvq_pipe_q8_0",
            "mmvq_pipe_q2_K",
            "mmvq_pipe_q3_K",
            "mmvq_pipe_q4_K",
            "mmvq_pipe_q5_K",
            "mmvq_pipe_q6_K",
            "mmvq_pipe_iq4_nl",
            "mmvq_pipe_iq4_xs",
            "mmv_f32w",
            "mmv_f16w",
            "mmv_bf16w",
        ],
    ),
    (
        "split.cu",
        // And every split type's decode kernels (`kernels_in`).
        &[
            "split_blocks_16",
            "split_blocks_16m",
            "split_blocks_32",
            "split_blocks_208",
            "dequant_split_q4_0_f16",
            "dequant_split_q4_1_f16",
            "dequant_split_iq4_nl_f16",
            "dequant_split_q8_0_f16",
            "dequant_split_q6_K_f16",
        ],
    ),
    // Every int8 GEMM kernel (`kernels_in`).
    ("mmq.cu", &["mmq_splitk_sum"]),
    (
        "dequant.cu",
        &[
            "dequant_q4_0_f16",
            "dequant_q4_1_f16",
            "dequant_q5_0_f16",
            "dequant_q5_1_f16",
            "dequant_q8_0_f16",
            "dequant_q2_K_f16",
            "dequant_q3_K_f16",
            "dequant_q4_K_f16",
            "dequant_q5_K_f16",
            "dequant_q6_K_f16",
            "dequant_iq4_nl_f16",
            "dequant_iq4_xs_f16",
            "dequant_bf16_f16",
            "f32_to_f16",
            "f16_to_f32",
        ],
    ),
    (
        "ops.cu",
        &[
            "rms_norm_f32",
            "rms_norm_q8_1",
            "add_rms_norm_q8_1",
            "rope_f32",
            "add_f32",
            "add_bias_f32",
            "swiglu_f32",
            "swiglu_q8_1",
            "scale_f32",
            "copy_cols_f32",
            "gpu_sleep",
            "store_kv_f16",
            "rope_store_kv_f16",
            "attention_f16kv",
        ],
    ),
    (
        "flash_decode.cu",
        &["attention_split_f16kv", "attention_merge_f32"],
    ),
    (
        "flash_prefill.cu",
        &["attention_flash_f16kv", "attention_flash_mma_f16kv"],
    ),
];

/// The kernels of source file `source`: those `KERNELS` lists, and for split.cu every split
/// type's decode kernels (`split_kernels_of`), for mmq.cu every int8 GEMM (`mmq_kernels`).
fn kernels_in(source: &str) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = KERNELS
        .iter()
        .find(|(s, _)| *s == source)
        .map_or(&[][..], |(_, n)| *n)
        .to_vec();
    match source {
        "split.cu" => names.extend(
            SPLIT_TYPES
                .into_iter()
                .filter_map(split_kernels_of)
                .flat_map(|sk| sk.names()),
        ),
        "mmq.cu" => names.extend(mmq_kernels()),
        _ => {}
    }
    names
}

/// Kernels of `KERNELS` for `source` that the CUBIN does not define (looked up as the
/// `.text.<name>` section each kernel gets).
pub fn missing_kernels(source: &str, cubin: &[u8]) -> Vec<&'static str> {
    kernels_in(source)
        .iter()
        .filter(|n| {
            let pat = format!(".text.{n}\0");
            !cubin.windows(pat.len()).any(|w| w == pat.as_bytes())
        })
        .copied()
        .collect()
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles (or loads from the cache) every kernel for its
    /// architecture and creates the cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<Self> {
        probe().map_err(Error::Msg)?;
        // The host spins while it waits for the device (an activation crossing waits for a few
        // microseconds of GPU work; a yielding or sleeping wait costs far more than that).
        cudarc::driver::result::init().map_err(drv("init"))?;
        let dev = cudarc::driver::result::device::get(ordinal as i32).map_err(drv("device"))?;
        // SAFETY: a valid device handle; the flags only choose how the host waits. A failure
        // (a context already active with other flags) leaves the driver's default.
        let _ = unsafe {
            cudarc::driver::sys::cuDevicePrimaryCtxSetFlags_v2(
                dev,
                cudarc::driver::sys::CUctx_flags::CU_CTX_SCHED_SPIN as u32,
            )
        };
        let ctx = CudaContext::new(ordinal).map_err(drv("context"))?;
        // One stream and explicit events: cudarc's per-buffer event tracking is not needed.
        // SAFETY: called before any allocation on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        // Non-blocking, so its copies overlap kernels on the (legacy) default stream.
        let copy_stream = ctx.new_stream().map_err(drv("copy stream"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("compute capability"))?;
        let arch = (major * 10 + minor) as u32;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(drv("multiprocessor count"))?
            .max(1) as usize;
        let l2_bytes = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_or(0, |v| v.max(0) as usize);
        if let Ok(v) = std::env::var("OATO_CUDA_MMVQ") {
            set_mmvq_mode(MmvqMode::parse(&v)?);
        }
        if let Ok(v) = std::env::var("OATO_CUDA_MMVQ_PIPE_BLOCKS") {
            set_pipe_blocks(parse_pipe_blocks(&v)?);
        }
        if let Ok(v) = std::env::var("OATO_CUDA_MMVQ_MAX_TOKENS") {
            set_mmvq_max_tokens(parse_mmvq_max_tokens(&v)?);
        }
        if let Ok(v) = std::env::var("OATO_CUDA_NORM_THREADS") {
            set_norm_threads(parse_norm_threads(&v)?);
        }
        mmq_mode_from_env()?;
        let name = ctx.name().map_err(drv("device name"))?;
        let t0 = Instant::now();
        let mut funcs = HashMap::new();
        let mut from_cache = 0;
        // Every source's CUBIN first, on a thread a source (the longest first): a first start
        // compiles them all, and one after the other they took 23 s of an H200 machine's host
        // (2026-11-28), mmvq.cu and split.cu most of it. Then the modules load in order.
        let bins = kc::parallel_map(
            SOURCES.len(),
            kc::compile_threads(),
            |i| SOURCES[i].code.len(),
            |i| kc::compile_cached(&SOURCES[i], arch),
        );
        for (src, bin) in SOURCES.iter().zip(bins) {
            let (bin, cached) = bin?;
            from_cache += cached as usize;
            let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin)) {
                Ok(m) => m,
                // A stale or damaged cache file: compile afresh once.
                Err(_) if cached => {
                    from_cache -= 1;
                    let bin = kc::compile_fresh(src, arch)?;
                    ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin))
                        .map_err(drv(src.name))?
                }
                Err(e) => return Err(drv(src.name)(e)),
            };
            for n in kernels_in(src.name) {
                let f = module
                    .load_function(n)
                    .map_err(|e| Error::Msg(format!("kernel {n} in {}: {e:?}", src.name)))?;
                funcs.insert(n.to_string(), f);
            }
        }
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        let blas = BlasHandle::new(&stream)?;
        let pinned = vec![
            Pinned::new(&ctx, PINNED_BYTES)?,
            Pinned::new(&ctx, PINNED_BYTES)?,
        ];
        let host_ctx = ctx.clone();
        let ctx_event = ctx.new_event(None).map_err(drv("event"))?;
        let launcher = Launcher::new(ctx.clone(), stream.cu_stream());
        let be = CudaBackend {
            id: next_backend_id(),
            ledger: Arc::default(),
            ctx,
            stream,
            launcher,
            copy_stream,
            blas,
            name,
            arch,
            sm_count,
            l2_bytes,
            mmq_choices: MmqChoices::default(),
            mma_ok: AtomicBool::new(true),
            flash_mma_ok: AtomicBool::new(true),
            split_live: AtomicBool::new(false),
            funcs,
            scratch: Mutex::new(Scratch {
                pinned,
                ..Default::default()
            }),
            host: Mutex::new(HostRegistrations {
                ctx: host_ctx.clone(),
                files: Vec::new(),
            }),
            page_locked: Arc::new(PageLocked::new(host_ctx)),
            direct: Mutex::new(DirectCopies {
                event: ctx_event,
                pending: false,
            }),
            compile_ms,
            kernels_from_cache: from_cache,
        };
        be.check_mma()?;
        be.check_flash_mma()?;
        Ok(be)
    }

    /// Whether the int8 prefill GEMM runs on tensor cores here: the device has them, they are
    /// switched on, and the start-up check agreed.
    fn mma_here(&self) -> bool {
        mma_on(self.arch) && self.mma_ok.load(Ordering::Relaxed)
    }

    /// Start-up check of the tensor-core int8 GEMM (sm_80 and later, unless switched off): one
    /// 32-row x 256 Q4_0 tile by 8 tokens of seeded random quants (two m-tiles of one n-tile:
    /// every fragment register) through `mmq_mma_q4_0_r32` and `mmq_q4_0_r32`, which give the
    /// same bits (the same exact sums, the same f32 steps; checked in
    /// the CPU emulator). If they differ (a fragment layout this device does not share), the
    /// backend keeps `__dp4a` and says so on stderr. Returns whether they agreed, `None` where
    /// nothing was checked.
    fn check_mma(&self) -> Result<Option<bool>> {
        if !mma_on(self.arch) {
            return Ok(None);
        }
        const ROWS: usize = 32;
        const K: usize = 256;
        const TOK: usize = 8;
        let ty = GgmlType::Q4_0;
        let kernel = |mma| mmq_kernel_of(ty, ROWS, TOK, usize::MAX, mma).map(|k| k.name);
        let (Some(dp4a), Some(mma)) = (kernel(false), kernel(true)) else {
            return Ok(None);
        };
        let mut rng = crate::rng::SplitMix64::new(0x6d6d61);
        let mut w = vec![0u8; ROWS * K / ty.block_size() * ty.type_size()];
        rng.fill_bytes(&mut w);
        for b in w.chunks_mut(ty.type_size()) {
            // A finite scale: f16 between 2^-8 and 2^-7.
            let d = half::f16::from_f32((1.0 + rng.next_f32()) / 256.0);
            b[..2].copy_from_slice(&d.to_le_bytes());
        }
        let mut aq = vec![0u8; TOK * K];
        rng.fill_bytes(&mut aq);
        let ads: Vec<u8> = (0..TOK * K / 32)
            .flat_map(|_| [rng.next_f32() / 64.0, 0.0])
            .flat_map(f32::to_le_bytes)
            .collect();
        let out = ROWS * TOK * 4;
        let total = w.len().next_multiple_of(256) + aq.len() + ads.len() + 2 * out;
        // SAFETY: every byte read below is written first (uploads, then the kernels' outputs).
        let buf = unsafe { self.stream.alloc::<u8>(total) }.map_err(drv("mma check allocation"))?;
        let base = self.ptr_of(&buf);
        let (wp, ap) = (base, base + w.len().next_multiple_of(256) as u64);
        let (dp, y0) = (ap + aq.len() as u64, ap + (aq.len() + ads.len()) as u64);
        let y1 = y0 + out as u64;
        self.upload(wp, &w)?;
        self.upload(ap, &aq)?;
        self.upload(dp, &ads)?;
        for (name, y) in [(dp4a, y0), (mma, y1)] {
            launch!(self, name, (1, 1, 1), (32, 8, 1);
                wq: u64 = wp, a: u64 = ap, d: u64 = dp, yq: u64 = y, k_: i32 = K as i32,
                n_: i32 = ROWS as i32, t_: i32 = TOK as i32);
        }
        let mut got = vec![0u8; 2 * out];
        self.download(y0, &mut got)?;
        let agree = got[..out] == got[out..];
        if !agree {
            eprintln!(
                "warning: the tensor-core int8 GEMM ({mma}) differs from __dp4a's ({dp4a}) on {} \
                 (sm_{}); prefill keeps __dp4a",
                self.name, self.arch
            );
        }
        self.mma_ok.store(agree, Ordering::Relaxed);
        Ok(Some(agree))
    }

    /// Whether prefill attention of this shape over caches at `kp`, `vp` runs on tensor cores:
    /// switched on, a device with them whose start-up check agreed, head_dim a multiple of 16 up
    /// to 128, 16-byte aligned caches (attention_flash_mma_f16kv's requirements).
    fn flash_mma_for(&self, s: AttnShape, kp: u64, vp: u64) -> bool {
        flash_mma()
            && self.arch >= 80
            && self.flash_mma_ok.load(Ordering::Relaxed)
            && s.head_dim.is_multiple_of(16)
            && s.head_dim <= 128
            && (kp | vp).is_multiple_of(16)
    }

    /// Tiled prefill attention of `n` tokens after `pos0` cached positions (flash_prefill.cu):
    /// q at `qp`, the caches at `kp` and `vp`, the output at `op`; on tensor cores with `mma`.
    fn launch_flash_prefill(
        &self,
        mma: bool,
        s: AttnShape,
        n: usize,
        pos0: usize,
        [qp, kp, vp, op]: [u64; 4],
    ) -> Result<()> {
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let (name, grid) = if mma {
            // 64 query tokens (FLM_BQ) a block, the heads along x.
            let g = (s.n_head as u32, n.div_ceil(64) as u32, 1);
            ("attention_flash_mma_f16kv", g)
        } else {
            // Tiles of 16 query tokens (FLP_BQ) sharing each K/V tile.
            (
                "attention_flash_f16kv",
                (n.div_ceil(16) as u32, s.n_head as u32, 1),
            )
        };
        launch!(self, name, grid, (128, 1, 1);
            a: u64 = qp, b: u64 = kp, c: u64 = vp, d: u64 = op, nt: i32 = n as i32,
            nh: i32 = s.n_head as i32, nkv: i32 = s.n_head_kv as i32,
            hd: i32 = s.head_dim as i32, p0: i32 = pos0 as i32, sc: f32 = scale);
        Ok(())
    }

    /// Start-up check of the tensor-core prefill attention (sm_80 and later, unless switched
    /// off): 70 query tokens of two heads of 64 over one KV head, seeded random values, through
    /// `attention_flash_mma_f16kv` and `attention_flash_f16kv`, which agree to rounding (about
    /// 1e-6 of the values; checked in the CPU emulator against a float64 reference). If they
    /// differ by more than 1e-3 of the largest value (a fragment layout this device does not
    /// share), prefill keeps the f32 kernel and says so on stderr. Returns whether they agreed,
    /// `None` where nothing was checked.
    fn check_flash_mma(&self) -> Result<Option<bool>> {
        if !flash_mma() || self.arch < 80 {
            return Ok(None);
        }
        let s = AttnShape {
            n_head: 2,
            n_head_kv: 1,
            head_dim: 64,
        };
        let n = 70;
        let mut rng = crate::rng::SplitMix64::new(0x666c61);
        let mut vals = |len: usize, f16: bool| -> Vec<u8> {
            (0..len)
                .flat_map(|_| {
                    let v = 2.0 * rng.next_f32() - 1.0;
                    if f16 {
                        half::f16::from_f32(v).to_le_bytes().to_vec()
                    } else {
                        (3.0 * v).to_le_bytes().to_vec()
                    }
                })
                .collect()
        };
        let qd = s.n_head * s.head_dim;
        let (q, k, v) = (vals(n * qd, false), vals(n * 64, true), vals(n * 64, true));
        let out = n * qd * 4;
        let total = q.len() + k.len() + v.len() + 2 * out;
        // SAFETY: every byte read below is written first (uploads, then the kernels' outputs).
        let buf = unsafe { self.stream.alloc::<u8>(total) }.map_err(drv("attention check"))?;
        let qp = self.ptr_of(&buf);
        let (kp, vp) = (qp + q.len() as u64, qp + (q.len() + k.len()) as u64);
        let o0 = vp + v.len() as u64;
        let o1 = o0 + out as u64;
        self.upload(qp, &q)?;
        self.upload(kp, &k)?;
        self.upload(vp, &v)?;
        self.launch_flash_prefill(false, s, n, 0, [qp, kp, vp, o0])?;
        self.launch_flash_prefill(true, s, n, 0, [qp, kp, vp, o1])?;
        let mut got = vec![0u8; 2 * out];
        self.download(o0, &mut got)?;
        let f = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let worst = got[..out]
            .chunks(4)
            .zip(got[out..].chunks(4))
            .map(|(a, b)| (f(a) - f(b)).abs())
            .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m });
        // |v| < 1: the outputs are averages of values below 1.
        let agree = worst <= 1e-3;
        if !agree {
            eprintln!(
                "warning: the tensor-core prefill attention (attention_flash_mma_f16kv) differs \
                 from the f32 kernel's by {worst:e} on {} (sm_{}); prefill keeps the f32 kernel",
                self.name, self.arch
            );
        }
        self.flash_mma_ok.store(agree, Ordering::Relaxed);
        Ok(Some(agree))
    }

    fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| Error::Msg(format!("CUDA kernel {name} is not loaded")))
    }

    fn cu_stream(&self) -> CUstream {
        self.stream.cu_stream()
    }

    fn scratch(&self) -> Result<MutexGuard<'_, Scratch>> {
        self.scratch
            .lock()
            .map_err(|_| Error::Msg("CUDA scratch lock poisoned".into()))
    }

    fn ptr_of(&self, buf: &CudaSlice<u8>) -> u64 {
        // Event tracking is off, so the guard does nothing.
        buf.device_ptr(&self.stream).0
    }

    /// Device address of element `at` of `t` after checking it belongs here and holds `need`.
    fn tptr(&self, t: &Tensor, at: usize, need: usize, what: &str) -> Result<u64> {
        check_tensor(t, self.id, at + need, what)?;
        let s = storage::<CudaTensor>(t, what)?;
        Ok(self.ptr_of(&s.buf) + (at * t.dtype.size()) as u64)
    }

    fn f32ptr(&self, t: &Tensor, need: usize, what: &str) -> Result<u64> {
        if t.dtype != DType::F32 {
            return Err(Error::Msg(format!("{what}: f16 tensor where f32 expected")));
        }
        self.tptr(t, 0, need, what)
    }

    /// A weight's device address; kernels queued after this wait for a streamed weight's copy.
    fn wptr(&self, w: &Weight) -> Result<u64> {
        let cw = weight_storage::<CudaWeight>(w, self.id)?;
        if let Some(ev) = &cw.ready {
            self.launcher.flush()?;
            self.stream
                .wait(ev)
                .map_err(drv("wait for a streamed weight"))?;
        }
        Ok(self.ptr_of(&cw.buf))
    }

    /// split.cu's kernels when weight `w` is held in their layout.
    fn split_of(&self, w: &Weight) -> Result<Option<SplitKernels>> {
        let cw = weight_storage::<CudaWeight>(w, self.id)?;
        Ok(if cw.split {
            split_kernels_of(w.ty)
        } else {
            None
        })
    }

    /// How weight `w` was rewritten into split.cu's layout, if it was.
    fn rewrite_of(&self, w: &Weight) -> Result<Option<SplitRewrite>> {
        Ok(self.split_of(w)?.and_then(|sk| sk.rewrite))
    }

    /// Decode activations `xp` ([n_tok, k] f32) split by quantize_q8_1_split for the split
    /// layout's kernels, in the scratch (kept there for the next product of the same input).
    fn split_acts(&self, s: &mut Scratch, xp: u64, n_tok: usize, k: usize) -> Result<(u64, u64)> {
        let len = n_tok * k;
        let at = s.q8s_at;
        if s.q8s_holds == Some((xp, len)) {
            return self.split_slot(&mut s.q8s[at], len);
        }
        let acts = self.quantize_split(&mut s.q8s[at], xp, n_tok, k)?;
        s.q8s_holds = Some((xp, len));
        Ok(acts)
    }

    /// Where a fused kernel writing the `len` f32 values at `yp` also writes their Q8_1 split for
    /// split.cu's kernels (quants, scales; held in the scratch as `split_acts` would make them),
    /// or (0, 0) while no weight is held split.
    fn split_sink(&self, s: &mut Scratch, yp: u64, len: usize) -> Result<(u64, u64)> {
        if !self.split_live.load(Ordering::Relaxed) {
            return Ok((0, 0));
        }
        s.q8s_holds = Some((yp, len));
        let at = s.q8s_at;
        self.split_slot(&mut s.q8s[at], len)
    }

    /// `count` counters for split.cu's fused kernels: zeroed when (re)allocated, and each
    /// launch leaves them zero.
    fn row_counters(&self, s: &mut Scratch, count: usize) -> Result<u64> {
        let fresh = s
            .row_counters
            .as_ref()
            .is_none_or(|(b, _)| b.len() < count * 4);
        let p = self.grow(&mut s.row_counters, count * 4)?;
        if fresh {
            let len = s.row_counters.as_ref().map_or(0, |(b, _)| b.len());
            // After the launches issued so far (grow flushed them before allocating) and before
            // the ones that follow on this stream.
            // SAFETY: `p` is the start of a live allocation of `len` bytes on this context.
            unsafe { cudarc::driver::result::memset_d8_async(p, 0, len, self.stream.cu_stream()) }
                .map_err(drv("memset"))?;
        }
        Ok(p)
    }

    /// A scratch buffer of at least `bytes`, grown (and re-counted as workspace) when needed.
    fn grow(&self, slot: &mut Option<(CudaSlice<u8>, Reservation)>, bytes: usize) -> Result<u64> {
        if slot.as_ref().is_none_or(|(b, _)| b.len() < bytes) {
            self.launcher.flush()?;
            *slot = None;
            let bytes = bytes.next_multiple_of(1 << 20);
            // SAFETY: scratch is always written by a kernel before it is read.
            let b = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(drv("scratch allocation"))?;
            *slot = Some((b, self.ledger.reserve(Category::Workspace, bytes)));
        }
        let (b, _) = slot.as_ref().ok_or_else(|| Error::Msg("scratch".into()))?;
        Ok(self.ptr_of(b))
    }

    /// Host bytes to device address `dst`, through the two pinned buffers in turn so the copy
    /// into one overlaps the transfer from the other.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.upload_on(&self.stream, dst, src)
    }

    /// As [`Self::upload`], the copies queued on `stream`.
    fn upload_on(&self, stream: &CudaStream, dst: u64, src: &[u8]) -> Result<()> {
        self.launcher.flush()?;
        let mut s = self.scratch()?;
        for (i, chunk) in src.chunks(PINNED_BYTES).enumerate() {
            let turn = s.turn;
            s.turn ^= 1;
            let p = &mut s.pinned[turn];
            let buf = p.slice()?;
            par_copy(&mut buf[..chunk.len()], chunk);
            let at = dst + (i * PINNED_BYTES) as u64;
            // SAFETY: the pinned buffer stays untouched until its event (recorded next) fires;
            // `at..at + chunk.len()` lies inside the destination allocation.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    at,
                    &buf[..chunk.len()],
                    stream.cu_stream(),
                )
            }
            .map_err(drv("host to device copy"))?;
            p.event.record(stream).map_err(drv("event record"))?;
        }
        Ok(())
    }

    /// `src` (page-locked activation memory of `page_locked`) to device address `dst` by one DMA
    /// queued on the compute stream. It returns before the DMA has run: `host_reads_done` waits.
    fn write_direct(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.launcher.flush()?;
        let mut d = self.direct()?;
        // SAFETY: `dst..dst + src.len()` lies inside the destination allocation; `src` is
        // page-locked and its owner does not change or free it before `host_reads_done` (the
        // executor's `settle`; `PageLocked::free` synchronises).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.cu_stream()) }
            .map_err(drv("host to device copy"))?;
        d.event.record(&self.stream).map_err(drv("event record"))?;
        d.pending = true;
        Ok(())
    }

    /// Device address `src` to `dst` (page-locked activation memory) by one DMA, complete on
    /// return (and so is every direct write before it: same stream).
    fn read_direct(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.launcher.flush()?;
        let mut d = self.direct()?;
        // SAFETY: `src..src + dst.len()` lies inside the source allocation; `dst` is page-locked
        // and is not touched before the event recorded next has fired (waited for below).
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.cu_stream()) }
            .map_err(drv("device to host copy"))?;
        d.event.record(&self.stream).map_err(drv("event record"))?;
        d.event.synchronize().map_err(drv("event wait"))?;
        d.pending = false;
        Ok(())
    }

    fn direct(&self) -> Result<MutexGuard<'_, DirectCopies>> {
        self.direct
            .lock()
            .map_err(|_| Error::Msg("CUDA direct copies: lock poisoned".into()))
    }

    /// Device address `src` to host bytes, complete on return. Large reads go in chunks through
    /// the two pinned buffers in turn: the DMA of one chunk runs while the threads copy the chunk
    /// before it out of the other buffer.
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.launcher.flush()?;
        let mut s = self.scratch()?;
        // The chunk whose bytes wait in a pinned buffer: (buffer, destination).
        let mut pending: Option<(usize, &mut [u8])> = None;
        for (i, chunk) in dst.chunks_mut(DOWNLOAD_CHUNK).enumerate() {
            let b = i % 2;
            let p = &mut s.pinned[b];
            let buf = p.slice()?;
            let at = src + (i * DOWNLOAD_CHUNK) as u64;
            // SAFETY: `at..at + chunk.len()` lies inside the source allocation; the pinned bytes
            // are read only after the event recorded next has fired (`slice` waits for it).
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut buf[..chunk.len()],
                    at,
                    self.cu_stream(),
                )
            }
            .map_err(drv("device to host copy"))?;
            p.event.record(&self.stream).map_err(drv("event record"))?;
            if let Some((pb, d)) = pending.take() {
                let buf = s.pinned[pb].slice()?;
                par_copy(d, &buf[..d.len()]);
            }
            pending = Some((b, chunk));
        }
        if let Some((pb, d)) = pending {
            let buf = s.pinned[pb].slice()?;
            par_copy(d, &buf[..d.len()]);
        }
        Ok(())
    }

    /// Rows `rows` of `y = W x` by cuBLAS over the columns `ks` of W and x (a slice of k past the
    /// first, ks.start > 0, is added to y; the first is written), with `w` pointing at that block
    /// of W (dense: [rows, ks.len()]
    /// row-major) and `x` at the whole input ([n_tok, k] row-major), both of type `ty`; `y` is the
    /// whole output ([n_tok, n] row-major). In column-major terms the [rows, n_tok] block of Y^T
    /// starting at row rows.start (leading dimension n) is W_block X_ks^T.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        w: u64,
        x: u64,
        ty: cublas::sys::cudaDataType,
        y: u64,
        k: usize,
        n: usize,
        (rows, ks): (std::ops::Range<usize>, std::ops::Range<usize>),
        n_tok: usize,
    ) -> Result<()> {
        self.launcher.flush()?;
        let (alpha, beta) = (1f32, if ks.start > 0 { 1f32 } else { 0f32 });
        let elem = if ty == CUDA_R_32F { 4 } else { 2 };
        // SAFETY: w holds rows.len()*ks.len() and x n_tok*k elements of `ty` (read from column
        // ks.start of each row), y n_tok*n f32 (C starts at row rows.start of each column of
        // length n); alpha and beta are host f32 (the default pointer mode).
        unsafe {
            cublas::result::gemm_ex(
                self.blas.0,
                cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                rows.len() as i32,
                n_tok as i32,
                ks.len() as i32,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                ty,
                ks.len() as i32,
                (x + (ks.start * elem) as u64) as *const c_void,
                ty,
                k as i32,
                (&beta as *const f32).cast::<c_void>(),
                (y + (rows.start * 4) as u64) as *mut c_void,
                CUDA_R_32F,
                n as i32,
                cublas::sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }

    /// Makes the context current on the calling thread (the backend may be used from any).
    /// Whether `file`'s memory map is registered with the driver (registering it on first use).
    fn registered(&self, file: &Arc<GgufFile>) -> Result<bool> {
        self.bind()?;
        let mut h = self
            .host
            .lock()
            .map_err(|_| Error::Msg("CUDA host registrations lock poisoned".into()))?;
        Ok(h.ensure(file))
    }

    /// Weight `w` of `file` uploaded on `stream`, by DMA from the registered memory map when the
    /// driver took the registration, else through staging.
    fn file_weight_on(
        &self,
        stream: &Arc<CudaStream>,
        file: &Arc<GgufFile>,
        w: &WeightRef,
    ) -> Result<Weight> {
        let direct = self.registered(file)?;
        self.weight_on(stream, &w.name, w.ty, w.k, w.n, w.bytes(file)?, direct)
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("bind context"))
    }

    /// The launches that follow belong to a batch of `n_tok` tokens (decode-sized ones may run
    /// as CUDA graphs).
    fn batch(&self, n_tok: usize) -> Result<()> {
        self.launcher.batch(n_tok, MMVQ_MAX_TOKENS)
    }

    /// Thread blocks of a pipelined matrix-vector launch over `row_blocks` row blocks: a few
    /// per multiprocessor, each walking several row blocks.
    fn pipe_grid(&self, row_blocks: usize) -> usize {
        (pipe_blocks() * self.sm_count).clamp(1, row_blocks.max(1))
    }

    /// Whether an RMSNorm or SwiGLU over `n_tok` rows of `width` writes the Q8_1 blocks too: a
    /// batch the staged matrix-vector kernels take, whole blocks per row.
    fn fuse_q8(&self, n_tok: usize, width: usize) -> bool {
        FUSE_Q8.load(Ordering::Relaxed)
            && n_tok <= MMVQ_MAX_TOKENS
            && width.is_multiple_of(32)
            && mmvq_mode() != MmvqMode::Direct
    }

    /// Before an operator that writes activations: the quantised copy in the scratch may no
    /// longer match its source.
    fn forget_q8(&self) -> Result<()> {
        let mut s = self.scratch()?;
        s.q8_holds = None;
        s.q8s_holds = None;
        Ok(())
    }

    /// A weight uploaded on `stream`: the compute stream (resident weights), or the copy stream
    /// (streamed ones, which then carry an event that kernels reading them wait for).
    /// `registered`: `bytes` lie in host memory registered with the driver (and stay alive until
    /// the copy has run), so they are copied by DMA directly, without staging.
    #[allow(clippy::too_many_arguments)]
    fn weight_on(
        &self,
        stream: &Arc<CudaStream>,
        name: &str,
        ty: GgmlType,
        k: usize,
        n: usize,
        bytes: &[u8],
        registered: bool,
    ) -> Result<Weight> {
        check_weight_bytes(name, ty, k, n, bytes)?;
        self.bind()?;
        self.launcher.flush()?;
        if kernels_of(ty).is_none() {
            return Err(Error::UnsupportedType(format!(
                "{ty} as a GPU weight ({name:?})"
            )));
        }
        let alloc = |len: usize| {
            // SAFETY: every byte is written by the upload (and repacking) below before any
            // kernel reads it.
            unsafe { stream.alloc::<u8>(len.max(1)) }.map_err(|e| {
                Error::Msg(format!(
                    "GPU allocation of {len} bytes for {name:?} failed: {e:?}"
                ))
            })
        };
        let upload = |dst: u64, src: &[u8]| -> Result<()> {
            if registered {
                // SAFETY: `src` is registered host memory that outlives the copy (see
                // HostRegistrations); the destination holds `src.len()` bytes.
                unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }
                    .map_err(drv("host to device copy"))
            } else {
                self.upload_on(stream, dst, src)
            }
        };
        // A weight that stays (uploaded on the compute stream) may take split.cu's layout.
        let split =
            split_kernels_of(ty).filter(|_| weight_split() && Arc::ptr_eq(stream, &self.stream));
        let buf = alloc(bytes.len())?;
        match split.as_ref().and_then(|sk| sk.rewrite) {
            Some(rw) => {
                // The file's rows go a slice at a time (at most SPLIT_STAGE_BYTES, whole rows)
                // to a temporary buffer, which split_blocks rewrites into the weight's own.
                let row_bytes = bytes.len() / n.max(1);
                let rows = (*SPLIT_STAGE_BYTES / row_bytes.max(1)).clamp(1, n.max(1));
                let raw = alloc(rows * row_bytes)?;
                let (rp, base) = (self.ptr_of(&raw), self.ptr_of(&buf));
                let mut r0 = 0;
                while r0 < n {
                    let r = rows.min(n - r0);
                    upload(rp, &bytes[r0 * row_bytes..(r0 + r) * row_bytes])?;
                    let (qs, ds) = rw.at(base, k, n, r0, 0);
                    let blocks = r * k / ty.block_size();
                    launch!(self, rw.repack, (blocks.div_ceil(256).min(65535) as u32, 1, 1), B256;
                        src: u64 = rp, q: u64 = qs, d: u64 = ds, nb_: i64 = blocks as i64);
                    // Queued now, before the next slice's copy (same stream) overwrites it.
                    self.launcher.flush()?;
                    r0 += r;
                }
                // Freed on the stream, after the last repacking that reads it.
                drop(raw);
            }
            None => upload(self.ptr_of(&buf), bytes)?,
        }
        if split.is_some() {
            self.split_live.store(true, Ordering::Relaxed);
        }
        let ready = if Arc::ptr_eq(stream, &self.stream) {
            None
        } else {
            let ev = self.ctx.new_event(None).map_err(drv("event"))?;
            ev.record(stream).map_err(drv("event record"))?;
            Some(ev)
        };
        Ok(Weight {
            name: name.to_string(),
            ty,
            k,
            n,
            bytes: bytes.len(),
            device: self.id,
            data: Box::new(CudaWeight {
                _flush: FlushOnDrop(self.launcher.clone()),
                buf,
                _res: self.ledger.reserve(Category::Weights, bytes.len()),
                ready,
                split: split.is_some(),
            }),
        })
    }

    /// Activations `xp` ([n_tok, k] f32) rounded to 8 bits per 32-element block by `kernel`
    /// (`quantize_q8_1`: Q8_1 blocks, 36 bytes each; `round_q8_f16`: f16 values, 64 bytes per
    /// block) into the scratch `slot`; returns the scratch's address.
    fn round_q8(
        &self,
        kernel: &'static str,
        slot: &mut Option<(CudaSlice<u8>, Reservation)>,
        bytes_per_block: usize,
        xp: u64,
        n_tok: usize,
        k: usize,
    ) -> Result<u64> {
        if !k.is_multiple_of(32) {
            return Err(Error::Msg(format!("matmul: k={k} is not a multiple of 32")));
        }
        let n_blocks = n_tok * k / 32;
        let out = self.grow(slot, n_blocks * bytes_per_block)?;
        launch!(self, kernel, ((n_blocks.div_ceil(8)) as u32, 1, 1), B256;
            xx: u64 = xp, yy: u64 = out, nb: i32 = n_blocks as i32);
        Ok(out)
    }

    /// Activations `xp` ([n_tok, k] f32) as quantize_q8_1's blocks split in two arrays
    /// (quantize_q8_1_split) in the scratch `slot`: the [n_tok, k] i8 quants at the returned
    /// first address, their [n_tok, k / 32] (d, s) f32 pairs at the second.
    fn quantize_split(
        &self,
        slot: &mut Option<(CudaSlice<u8>, Reservation)>,
        xp: u64,
        n_tok: usize,
        k: usize,
    ) -> Result<(u64, u64)> {
        if !k.is_multiple_of(32) {
            return Err(Error::Msg(format!("matmul: k={k} is not a multiple of 32")));
        }
        let n_blocks = n_tok * k / 32;
        let (aq, ads) = self.split_slot(slot, n_tok * k)?;
        launch!(self, "quantize_q8_1_split", ((n_blocks.div_ceil(8)) as u32, 1, 1), B256;
            xx: u64 = xp, a: u64 = aq, d: u64 = ads, nb: i32 = n_blocks as i32);
        Ok((aq, ads))
    }

    /// Scratch `slot` laid out as quantize_q8_1_split's output for `len` values (grown when
    /// needed): the i8 quants' address and the (d, s) pairs' after them.
    fn split_slot(
        &self,
        slot: &mut Option<(CudaSlice<u8>, Reservation)>,
        len: usize,
    ) -> Result<(u64, u64)> {
        let aq = self.grow(slot, len / 32 * 40)?;
        Ok((aq, aq + len as u64))
    }

    /// How weight `w` is multiplied by a prefill batch of `n_tok` tokens (see [`Prefill`]).
    fn prefill_path(&self, w: &Weight, k: usize, n_tok: usize) -> Result<Prefill> {
        if !w.ty.is_quantized() {
            return Ok(Prefill::Float);
        }
        if self.split_of(w)?.is_some() {
            // The int8 GEMM reads the file's layout.
            return Ok(Prefill::Dequant);
        }
        // (k is whole blocks: `check_weight_bytes` made sure when the weight was loaded.)
        let Some(kernel) = mmq_kernel_of(w.ty, w.n, n_tok, self.sm_count, self.mma_here()) else {
            return Ok(Prefill::Dequant);
        };
        Ok(match mmq_mode() {
            MmqMode::Off => Prefill::Dequant,
            MmqMode::On => Prefill::Mmq(kernel),
            MmqMode::Auto => match self.mmq_choices.get(w.ty, w.n, k, n_tok)? {
                Some(c) if c.mmq => Prefill::Mmq(kernel),
                Some(_) => Prefill::Dequant,
                None => Prefill::Measure(kernel),
            },
        })
    }

    /// The parts the int8 GEMM `kernel` splits k into for `n` rows by `n_tok` tokens.
    fn mmq_splits_of(&self, kernel: MmqKernel, k: usize, n: usize, n_tok: usize) -> usize {
        if kernel.mma {
            let blocks = n.div_ceil(kernel.rows) * n_tok.div_ceil(MMQ_TOK);
            mmq_splits(blocks, k.div_ceil(256), self.sm_count, n * n_tok * 4)
        } else {
            1
        }
    }

    /// `y = W x` for quantised weight `w` at `wp` by the int8 GEMM `kernel` (mmq.cu), the
    /// activations as quantize_q8_1_split's quants `aq` and scales `ads`; a tensor-core kernel
    /// whose grid would leave the device idle splits k ([`mmq_splits`]), its partial sums in
    /// `part` and added up by mmq_splitk_sum.
    #[allow(clippy::too_many_arguments)]
    fn mmq(
        &self,
        part: &mut Option<(CudaSlice<u8>, Reservation)>,
        kernel: MmqKernel,
        wp: u64,
        aq: u64,
        ads: u64,
        yp: u64,
        k: usize,
        n: usize,
        n_tok: usize,
    ) -> Result<()> {
        let tiles = n_tok.div_ceil(MMQ_TOK);
        let row_blocks = n.div_ceil(kernel.rows);
        if tiles > MAX_GRID_Y || row_blocks > u32::MAX as usize {
            return Err(Error::Msg(format!(
                "matmul: {n_tok} tokens x {n} rows is too large a grid for {}",
                kernel.name
            )));
        }
        let splits = self.mmq_splits_of(kernel, k, n, n_tok);
        let out = if splits > 1 {
            self.grow(part, splits * n_tok * n * 4)?
        } else {
            yp
        };
        launch!(self, kernel.name, (row_blocks as u32, tiles as u32, splits as u32), (32, 8, 1);
            wq: u64 = wp, a: u64 = aq, d: u64 = ads, yq: u64 = out, k_: i32 = k as i32,
            n_: i32 = n as i32, t_: i32 = n_tok as i32);
        if splits > 1 {
            let len = n_tok * n;
            launch!(self, "mmq_splitk_sum", stride_grid(len, 4), B256;
                p: u64 = out, yq: u64 = yp, l: i64 = len as i64, s_: i32 = splits as i32);
        }
        Ok(())
    }

    /// `y = W x` for weight `w` at `wp` (quantised or BF16) by dequantisation to f16 in the
    /// scratch `w16` and cuBLAS on the f16 activations `x16`, in the pieces `gemm_pieces` cuts
    /// (so the scratch stays bounded whatever the matrix: an output head can be a GiB in f16):
    /// slices of rows, or for a weight of few rows and long ones, slices of k whose products are
    /// summed into y (every slice then keeps all of the output's rows in one GEMM).
    #[allow(clippy::too_many_arguments)]
    fn dequant_gemm(
        &self,
        w16: &mut Option<(CudaSlice<u8>, Reservation)>,
        w: &Weight,
        wp: u64,
        x16: u64,
        yp: u64,
        k: usize,
        n_tok: usize,
    ) -> Result<()> {
        let (_, deq) = kernels_of(w.ty)
            .ok_or_else(|| Error::UnsupportedType(format!("{} on the GPU", w.ty)))?;
        let deq = deq.ok_or_else(|| Error::UnsupportedType(format!("{} GEMM", w.ty)))?;
        // Rewritten split weights in their own layout (Q4_K / Q5_K keep the file's).
        let split = self.rewrite_of(w)?;
        let bs = w.ty.block_size();
        // BF16 (1-element blocks) is sliced along k in 8s, the kernels' unit.
        let pieces = gemm_pieces(w.n, k, bs.max(8), *GEMM_SLICE);
        let most = pieces
            .iter()
            .map(|(r, c)| r.len() * c.len())
            .max()
            .unwrap_or(0);
        let w16 = self.grow(w16, most * 2)?;
        let row_bytes = w.bytes / w.n;
        for (rows, ks) in pieces {
            let (r0, kc) = (rows.start, ks.len());
            let elems = rows.len() * kc;
            match &split {
                Some(rw) => {
                    let (qs, ds) = rw.at(wp, k, w.n, r0, ks.start);
                    self.dequant_split(rw.dequant, qs, ds, w16, elems, [k, kc])?;
                }
                None => {
                    let src = wp + (r0 * row_bytes + ks.start / bs * w.ty.type_size()) as u64;
                    self.dequant_f16(deq, src, w16, elems, [k, kc])?
                }
            }
            self.gemm(w16, x16, CUDA_R_16F, yp, k, w.n, (rows, ks), n_tok)?;
        }
        Ok(())
    }

    /// The GPU time of the work `f` queues, by CUDA events (waits for it).
    fn time_us(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        let mut clock = self.stopwatch()?;
        clock.start()?;
        f()?;
        clock.stop()
    }

    /// Dequantisation `kernel` of `n_elems` elements from `src` to f16 at `dst`: whole rows when
    /// `k_w == k_y`, else a column block of `k_y` elements of each row of `k_w` (dequant.cu).
    fn dequant_f16(
        &self,
        kernel: &'static str,
        src: u64,
        dst: u64,
        n_elems: usize,
        [k_w, k_y]: [usize; 2],
    ) -> Result<()> {
        launch!(self, kernel, stride_grid(n_elems, 32), B256;
            w: u64 = src, y: u64 = dst, n: i64 = n_elems as i64, kw: i32 = k_w as i32,
            ky: i32 = k_y as i32);
        Ok(())
    }

    /// Split.cu's dequantisation `kernel` of the `n_elems` elements whose quants are at `qs` and
    /// scales at `ds`, to f16 at `dst` (`k_w`, `k_y` as `dequant_f16`'s).
    fn dequant_split(
        &self,
        kernel: &'static str,
        qs: u64,
        ds: u64,
        dst: u64,
        n_elems: usize,
        [k_w, k_y]: [usize; 2],
    ) -> Result<()> {
        launch!(self, kernel, stride_grid(n_elems, 32), B256;
            q: u64 = qs, d: u64 = ds, y: u64 = dst, n: i64 = n_elems as i64,
            kw: i32 = k_w as i32, ky: i32 = k_y as i32);
        Ok(())
    }
}

struct EventClock<'a> {
    b: &'a CudaBackend,
    start: Option<CudaEvent>,
}

impl Stopwatch for EventClock<'_> {
    fn start(&mut self) -> Result<()> {
        let e = self
            .b
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("event"))?;
        self.b.launcher.flush()?;
        let lead = *TIMER_LEAD_US;
        if lead > 0 {
            let b = self.b;
            b.bind()?;
            launch!(b, "gpu_sleep", (1, 1, 1), (32, 1, 1); us: i32 = lead as i32);
            // Issued now, not deferred into a decode segment: the event must follow it.
            b.launcher.flush()?;
        }
        e.record(&self.b.stream).map_err(drv("event record"))?;
        self.start = Some(e);
        Ok(())
    }

    fn stop(&mut self) -> Result<f64> {
        let start = self
            .start
            .as_ref()
            .ok_or_else(|| Error::Msg("stopwatch stopped before it was started".into()))?;
        let end = self
            .b
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("event"))?;
        self.b.launcher.flush()?;
        end.record(&self.b.stream).map_err(drv("event record"))?;
        end.synchronize().map_err(drv("event wait"))?;
        let ms = start.elapsed_ms(&end).map_err(drv("elapsed"))?;
        Ok(ms as f64 * 1e3)
    }
}

impl Backend for CudaBackend {
    fn id(&self) -> u64 {
        self.id
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Gpu
    }

    fn int8_tensor_cores(&self) -> bool {
        self.arch >= 80
    }

    fn int8_mma_agrees(&self) -> Option<bool> {
        mma_on(self.arch).then(|| self.mma_ok.load(Ordering::Relaxed))
    }

    fn cache_bytes(&self) -> usize {
        self.l2_bytes
    }

    fn describe(&self) -> String {
        format!(
            "gpu ({}, sm_{}; kernels ready in {:.0} ms, {}/{} from the cache{})",
            self.name,
            self.arch,
            self.compile_ms,
            self.kernels_from_cache,
            SOURCES.len(),
            if weight_split() {
                "; split weights"
            } else {
                ""
            }
        )
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn memory(&self) -> Result<MemInfo> {
        let (free, total) = self.ctx.mem_get_info().map_err(drv("memory info"))?;
        Ok(MemInfo { free, total })
    }

    fn usage(&self) -> Usage {
        self.ledger.usage()
    }

    fn alloc(&self, dtype: DType, len: usize, cat: Category) -> Result<Tensor> {
        self.bind()?;
        self.launcher.flush()?;
        self.forget_q8()?;
        let bytes = (len * dtype.size()).max(1);
        let buf = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| Error::Msg(format!("GPU allocation of {bytes} bytes failed: {e:?}")))?;
        Ok(Tensor {
            device: self.id,
            dtype,
            len,
            data: Box::new(CudaTensor {
                _flush: FlushOnDrop(self.launcher.clone()),
                buf,
                _res: self.ledger.reserve(cat, bytes),
            }),
        })
    }

    fn upload_weight(
        &self,
        name: &str,
        ty: GgmlType,
        k: usize,
        n: usize,
        bytes: &[u8],
    ) -> Result<Weight> {
        self.weight_on(&self.stream, name, ty, k, n, bytes, false)
    }

    fn load_weight(&self, file: &Arc<GgufFile>, w: &WeightRef) -> Result<Weight> {
        self.file_weight_on(&self.stream, file, w)
    }

    fn prefetch_weight(&self, file: &Arc<GgufFile>, w: &WeightRef) -> Result<Weight> {
        // Allocated and filled on the copy stream (and freed there: see release_weight).
        self.file_weight_on(&self.copy_stream, file, w)
    }

    fn release_weight(&self, w: Weight) -> Result<()> {
        self.bind()?;
        self.launcher.flush()?;
        // The buffer is freed on the copy stream, which first waits for the kernels queued so
        // far on the compute stream (the ones that read it).
        let done = self.ctx.new_event(None).map_err(drv("event"))?;
        done.record(&self.stream).map_err(drv("event record"))?;
        self.copy_stream.wait(&done).map_err(drv("stream wait"))?;
        drop(w);
        Ok(())
    }

    fn write(&self, dst: &mut Tensor, at: usize, src: &[f32]) -> Result<()> {
        self.bind()?;
        self.forget_q8()?;
        let p = self.f32ptr(dst, at + src.len(), "write")? + (at * 4) as u64;
        // SAFETY: f32 has no padding; viewing it as bytes is sound.
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), src.len() * 4) };
        if self.page_locked.ranges.holds(bytes.as_ptr(), bytes.len()) {
            return self.write_direct(p, bytes);
        }
        self.upload(p, bytes)
    }

    fn read(&self, src: &Tensor, at: usize, dst: &mut [f32]) -> Result<()> {
        self.bind()?;
        let p = self.f32ptr(src, at + dst.len(), "read")? + (at * 4) as u64;
        // SAFETY: every byte pattern is a valid f32.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), dst.len() * 4) };
        if self.page_locked.ranges.holds(bytes.as_ptr(), bytes.len()) {
            return self.read_direct(p, bytes);
        }
        self.download(p, bytes)
    }

    /// Page-locked memory for the CPU's activation buffers, unless `OATO_CUDA_HOST_PINNED=0`
    /// (activations then cross through the staging buffers, as before rule 8's direct path).
    fn host_memory(&self) -> Option<Arc<dyn HostMemory>> {
        let off = std::env::var("OATO_CUDA_HOST_PINNED").is_ok_and(|v| v == "0");
        (!off).then(|| self.page_locked.clone() as Arc<dyn HostMemory>)
    }

    fn host_reads_done(&self) -> Result<()> {
        let mut d = self.direct()?;
        if d.pending {
            self.bind()?;
            d.event.synchronize().map_err(drv("event wait"))?;
            d.pending = false;
        }
        Ok(())
    }

    fn matmul(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
    ) -> Result<()> {
        let k = shared_k(ws, ys.len())?;
        if n_tok == 0 {
            return Ok(());
        }
        self.bind()?;
        self.batch(n_tok)?;
        let xp = self.f32ptr(x, n_tok * k, "matmul input")?;
        let mut s = self.scratch()?;
        if n_tok <= mmvq_max_tokens() {
            let split = ws
                .iter()
                .map(|w| self.split_of(w))
                .collect::<Result<Vec<_>>>()?;
            if split.iter().any(Option::is_some) {
                let (aq, ads) = self.split_acts(&mut s, xp, n_tok, k)?;
                // Runs of up to three split weights of one type: one launch each.
                let mut j = 0;
                while j < ws.len() {
                    let Some(sk) = &split[j] else {
                        j += 1;
                        continue;
                    };
                    let mut end = j + 1;
                    while end < ws.len()
                        && end < j + 3
                        && split[end].is_some()
                        && ws[end].ty == ws[j].ty
                    {
                        end += 1;
                    }
                    let (mut wp, mut yp, mut n) = ([0u64; 3], [0u64; 3], [0i32; 3]);
                    for (i, jj) in (j..end).enumerate() {
                        let w = ws[jj];
                        let p = self.f32ptr(ys[jj], n_tok * w.n, "matmul output")?;
                        s.forget_if_written((xp, n_tok * k), (p, n_tok * w.n));
                        (wp[i], yp[i], n[i]) = (self.wptr(w)?, p, w.n as i32);
                    }
                    // Empty places (0 rows) are never read; they point at the first weight.
                    for i in end - j..3 {
                        (wp[i], yp[i]) = (wp[0], yp[0]);
                    }
                    let rows: usize = ws[j..end].iter().map(|w| w.n).sum();
                    let kernel = if n_tok == 1 { sk.mmvq1 } else { sk.mmvq };
                    let grid = (rows.div_ceil(4) as u32, 1, 1);
                    // Gate and up alone (two weights of one shape): held, so that a SwiGLU of
                    // their outputs next runs with them as one kernel (`swiglu`, glu_of).
                    let glu = *GLU
                        && ws.len() == 2
                        && end - j == 2
                        && ws[0].n == ws[1].n
                        && self.fuse_q8(n_tok, ws[0].n);
                    // q, k and v alone in one launch: held likewise, for the RoPE and KV
                    // store that follow (`attention`, qkv_rope_of).
                    let qkv = *QKV_ROPE
                        && ws.len() == 3
                        && end - j == 3
                        && FUSE_Q8.load(Ordering::Relaxed);
                    launch!(hold if glu || qkv, self, kernel, grid, (32, 4, 1);
                        w0: u64 = wp[0], w1: u64 = wp[1], w2: u64 = wp[2], a: u64 = aq,
                        d: u64 = ads, y0: u64 = yp[0], y1: u64 = yp[1], y2: u64 = yp[2],
                        k_: i32 = k as i32, n0: i32 = n[0], n1: i32 = n[1], n2: i32 = n[2],
                        t_: i32 = n_tok as i32);
                    j = end;
                }
                if split.iter().all(Option::is_some) {
                    return Ok(());
                }
                // The others in the file's layout, as a call of their own.
                drop(s);
                let rest: Vec<&Weight> = ws
                    .iter()
                    .zip(&split)
                    .filter(|(_, sk)| sk.is_none())
                    .map(|(w, _)| *w)
                    .collect();
                let mut rest_ys: Vec<&mut Tensor> = ys
                    .iter_mut()
                    .zip(&split)
                    .filter(|(_, sk)| sk.is_none())
                    .map(|(y, _)| &mut **y)
                    .collect();
                return self.matmul(&rest, x, n_tok, &mut rest_ys);
            }
            let quantized = ws.iter().any(|w| w.ty.is_quantized());
            let mode = mmvq_mode();
            let direct = quantized && mode == MmvqMode::Direct;
            let pipe = mode == MmvqMode::Pipe;
            let (q8, ads) = if direct {
                s.q8_holds = None;
                self.quantize_split(&mut s.q8, xp, n_tok, k)?
            } else if quantized {
                let q8 = if s.q8_holds == Some((xp, n_tok * k)) {
                    // Already there (fused into the RMSNorm or SwiGLU that wrote x): the
                    // scratch is at least that large, so grow only returns its address.
                    self.grow(&mut s.q8, n_tok * k / 32 * 36)?
                } else {
                    s.q8_holds = None;
                    self.round_q8("quantize_q8_1", &mut s.q8, 36, xp, n_tok, k)?
                };
                s.q8_holds = Some((xp, n_tok * k));
                (q8, 0)
            } else {
                (0, 0)
            };
            // Each output's address (an output over its own input, never in the forward pass,
            // ends the hold on the quantised input).
            let mut yps = Vec::with_capacity(ws.len());
            for (w, y) in ws.iter().zip(ys.iter_mut()) {
                let yp = self.f32ptr(y, n_tok * w.n, "matmul output")?;
                s.forget_if_written((xp, n_tok * k), (yp, n_tok * w.n));
                yps.push(yp);
            }
            // Two or three weights of one quantised type, all but the last whole thread blocks
            // of rows: one launch.
            let last = ws.len() - 1;
            let multi = multi_kernel_of(ws[0].ty).filter(|_| {
                !direct
                    && (1..=2).contains(&last)
                    && MMVQ_MULTI.load(Ordering::Relaxed)
                    && ws.iter().all(|w| w.ty == ws[0].ty)
                    && ws[..last].iter().all(|w| w.n.is_multiple_of(4))
            });
            if let Some(kernel) = multi {
                // The last weight in the kernel's third place (its rows need not fill whole
                // blocks); with two weights the second place is empty (0 rows).
                let (mut wp, mut yp, mut n) = ([0u64; 3], [0u64; 3], [0i32; 3]);
                for (j, w) in ws.iter().enumerate() {
                    let i = if j == last { 2 } else { j };
                    (wp[i], yp[i], n[i]) = (self.wptr(w)?, yps[j], w.n as i32);
                }
                let blocks: usize =
                    ws[..last].iter().map(|w| w.n / 4).sum::<usize>() + ws[last].n.div_ceil(4);
                // The pipelined kernel takes the same arguments over a grid of its own.
                let (kernel, blocks) = match pipe_kernel_of(ws[0].ty).filter(|_| pipe) {
                    Some(p) => (p, self.pipe_grid(blocks)),
                    None => (kernel, blocks),
                };
                launch!(self, kernel, (blocks as u32, n_tok as u32, 1), (32, 4, 1);
                    w0: u64 = wp[0], w1: u64 = wp[1], w2: u64 = wp[2], ap: u64 = q8,
                    y0: u64 = yp[0], y1: u64 = yp[1], y2: u64 = yp[2], k_: i32 = k as i32,
                    n0: i32 = n[0], n1: i32 = n[1], n2: i32 = n[2], t_: i32 = n_tok as i32);
                return Ok(());
            }
            for (w, &yp) in ws.iter().zip(&yps) {
                let unsupported = || Error::UnsupportedType(format!("{} on the GPU", w.ty));
                let (wp, kk, nn, nt) = (self.wptr(w)?, k as i32, w.n as i32, n_tok as i32);
                let rows = w.n.div_ceil(4) as u32;
                if let Some(kernel) = pipe_kernel_of(w.ty).filter(|_| pipe) {
                    // One weight: the kernel's third place, the other two empty.
                    let grid = self.pipe_grid(w.n.div_ceil(4)) as u32;
                    launch!(self, kernel, (grid, n_tok as u32, 1), (32, 4, 1);
                        w0: u64 = wp, w1: u64 = wp, w2: u64 = wp, ap: u64 = q8, y0: u64 = yp,
                        y1: u64 = yp, y2: u64 = yp, k_: i32 = kk, n0: i32 = 0, n1: i32 = 0,
                        n2: i32 = nn, t_: i32 = nt);
                } else if direct && w.ty.is_quantized() {
                    let kernel = direct_kernel_of(w.ty).ok_or_else(unsupported)?;
                    launch!(self, kernel, (rows, 1, 1), (32, 4, 1);
                        wq: u64 = wp, ap: u64 = q8, dp: u64 = ads, yq: u64 = yp, k_: i32 = kk,
                        n_: i32 = nn, t_: i32 = nt);
                } else {
                    let (kernel, _) = kernels_of(w.ty).ok_or_else(unsupported)?;
                    let act = if w.ty.is_quantized() { q8 } else { xp };
                    launch!(self, kernel, (rows, n_tok as u32, 1), (32, 4, 1);
                        wq: u64 = wp, ap: u64 = act, yq: u64 = yp, k_: i32 = kk, n_: i32 = nn,
                        t_: i32 = nt);
                }
            }
            return Ok(());
        }
        // Prefill. Each quantised weight takes the int8 GEMM (mmq.cu, on the activations'
        // Q8_1 quants) or dequantisation to f16 and cuBLAS (on the activations rounded to 8 bits
        // and stored as f16, as the matrix-vector kernels see them); float weights take cuBLAS.
        let paths = ws
            .iter()
            .map(|w| self.prefill_path(w, k, n_tok))
            .collect::<Result<Vec<_>>>()?;
        let x16 = if ws
            .iter()
            .any(|w| matches!(w.ty, GgmlType::F16 | GgmlType::BF16))
        {
            let x16 = self.grow(&mut s.x16, n_tok * k * 2)?;
            launch!(self, "f32_to_f16", stride_grid(n_tok * k, 4), B256;
                a: u64 = xp, b: u64 = x16, n: i64 = (n_tok * k) as i64);
            x16
        } else {
            0
        };
        let xq16 = if paths
            .iter()
            .any(|p| matches!(p, Prefill::Dequant | Prefill::Measure(_)))
        {
            self.round_q8("round_q8_f16", &mut s.xq16, 64, xp, n_tok, k)?
        } else {
            0
        };
        let (aq, ads) = if paths
            .iter()
            .any(|p| matches!(p, Prefill::Mmq(_) | Prefill::Measure(_)))
        {
            self.quantize_split(&mut s.mmq_act, xp, n_tok, k)?
        } else {
            (0, 0)
        };
        for ((w, y), path) in ws.iter().zip(ys.iter_mut()).zip(paths) {
            // A shape timed earlier in this call (v after k, up after gate) takes that choice,
            // so it is timed once and every weight of the shape takes the same path.
            let path = match path {
                Prefill::Measure(_) => self.prefill_path(w, k, n_tok)?,
                p => p,
            };
            let yp = self.f32ptr(y, n_tok * w.n, "matmul output")?;
            // A decode-sized batch may come this way (`mmvq_max_tokens`): its output ends the
            // holds on quantised copies as the matrix-vector path's does.
            s.forget_if_written((xp, n_tok * k), (yp, n_tok * w.n));
            let wp = self.wptr(w)?;
            match (path, w.ty) {
                (Prefill::Float, GgmlType::F32) => {
                    self.gemm(wp, xp, CUDA_R_32F, yp, k, w.n, (0..w.n, 0..k), n_tok)?
                }
                (Prefill::Float, GgmlType::F16) => {
                    self.gemm(wp, x16, CUDA_R_16F, yp, k, w.n, (0..w.n, 0..k), n_tok)?
                }
                (Prefill::Float, _) => self.dequant_gemm(&mut s.w16, w, wp, x16, yp, k, n_tok)?,
                (Prefill::Dequant, _) => {
                    self.dequant_gemm(&mut s.w16, w, wp, xq16, yp, k, n_tok)?
                }
                (Prefill::Mmq(kernel), _) => {
                    self.mmq(&mut s.mmq_part, kernel, wp, aq, ads, yp, k, w.n, n_tok)?
                }
                (Prefill::Measure(kernel), _) => {
                    // Each once untimed (first launches load code and pick cuBLAS algorithms),
                    // then once timed; the output is then recomputed by the faster, so every
                    // batch of the shape gets its values from the same path.
                    let mut run = |mmq: bool| -> Result<()> {
                        if mmq {
                            self.mmq(&mut s.mmq_part, kernel, wp, aq, ads, yp, k, w.n, n_tok)
                        } else {
                            self.dequant_gemm(&mut s.w16, w, wp, xq16, yp, k, n_tok)
                        }
                    };
                    run(true)?;
                    run(false)?;
                    let mmq_us = self.time_us(|| run(true))?;
                    let cublas_us = self.time_us(|| run(false))?;
                    let c = self.mmq_choices.record(
                        w.ty,
                        w.n,
                        k,
                        n_tok,
                        (kernel.name, self.mmq_splits_of(kernel, k, w.n, n_tok)),
                        mmq_us,
                        cublas_us,
                    )?;
                    if c.mmq {
                        run(true)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Tensor,
        row0: usize,
        n_rows: usize,
        x_stride: usize,
        w: &Tensor,
        eps: f32,
        y: &mut Tensor,
    ) -> Result<()> {
        let n = w.len;
        if x_stride < n || n_rows == 0 {
            return Err(Error::Msg(format!(
                "rms_norm: rows of {n} at stride {x_stride}, {n_rows} rows"
            )));
        }
        self.bind()?;
        self.batch(n_rows)?;
        let wp = self.f32ptr(w, n, "rms_norm weight")?;
        let xp = self.f32ptr(x, (row0 + n_rows - 1) * x_stride + n, "rms_norm input")?
            + (row0 * x_stride * 4) as u64;
        let yp = self.f32ptr(y, n_rows * n, "rms_norm output")?;
        let mut s = self.scratch()?;
        s.q8_holds = None;
        s.q8s_holds = None;
        if self.fuse_q8(n_rows, n) {
            // A held residual add into these very rows (`add`) runs with the norm.
            let held = self.launcher.take_held()?;
            let add_from = fused_add(&held, xp, n_rows * n).filter(|_| row0 == 0 && x_stride == n);
            if add_from.is_none() {
                self.launcher.unhold(held)?;
            }
            let q = self.grow(&mut s.q8, n_rows * n / 32 * 36)?;
            let (aq, ads) = self.split_sink(&mut s, yp, n_rows * n)?;
            if let Some(rp) = add_from {
                launch!(self, "add_rms_norm_q8_1", (n_rows as u32, 1, 1), norm_block(n);
                    a: u64 = xp, r: u64 = rp, b: u64 = wp, c: u64 = yp, qq: u64 = q,
                    sq: u64 = aq, sd: u64 = ads, nn: i32 = n as i32, e: f32 = eps);
            } else {
                launch!(self, "rms_norm_q8_1", (n_rows as u32, 1, 1), norm_block(n);
                    a: u64 = xp, b: u64 = wp, c: u64 = yp, qq: u64 = q, sq: u64 = aq,
                    sd: u64 = ads, nn: i32 = n as i32, e: f32 = eps, xs: i32 = x_stride as i32);
            }
            s.q8_holds = Some((yp, n_rows * n));
        } else {
            launch!(self, "rms_norm_f32", (n_rows as u32, 1, 1), norm_block(n);
                a: u64 = xp, b: u64 = wp, c: u64 = yp, nn: i32 = n as i32, e: f32 = eps,
                xs: i32 = x_stride as i32);
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut Tensor, b: &Tensor, n_tok: usize) -> Result<()> {
        self.bind()?;
        self.batch(n_tok)?;
        self.forget_q8()?;
        let bp = self.f32ptr(b, b.len, "bias")?;
        let n = n_tok * b.len;
        let xp = self.f32ptr(x, n, "add_bias")?;
        launch!(self, "add_bias_f32", stride_grid(n, 4), B256;
            a: u64 = xp, bb: u64 = bp, width: i32 = b.len as i32, nn: i64 = n as i64);
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Tensor,
        n_tok: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        p: &RopeParams,
        freq_factors: Option<&Tensor>,
    ) -> Result<()> {
        let ff = match freq_factors {
            Some(t) => self.f32ptr(t, p.n_dims / 2, "rope_freqs")?,
            None => 0,
        };
        if p.dim_offset + p.n_dims > head_dim || !p.n_dims.is_multiple_of(2) {
            return Err(Error::UnsupportedType(format!(
                "RoPE over {} of {head_dim} dimensions from {} on the GPU",
                p.n_dims, p.dim_offset
            )));
        }
        self.bind()?;
        self.batch(n_tok)?;
        self.forget_q8()?;
        let xp = self.f32ptr(x, n_tok * n_heads * head_dim, "rope")?;
        if FUSE_Q8.load(Ordering::Relaxed) && n_tok <= MMVQ_MAX_TOKENS {
            // Held for the attention that follows: q's and k's RoPE then run with the KV store
            // as one kernel (rope_store_kv_f16); anything else issues it first.
            launch!(hold self, "rope_f32", (n_heads as u32, n_tok as u32, 1), (128, 1, 1);
                a: u64 = xp, nt: i32 = n_tok as i32, nh: i32 = n_heads as i32,
                hd: i32 = head_dim as i32, nd: i32 = p.n_dims as i32, p0: i32 = pos0 as i32,
                base: f32 = p.freq_base, scale: f32 = p.freq_scale, neox: i32 = p.neox as i32,
                f: u64 = ff, off: i32 = p.dim_offset as i32);
            return Ok(());
        }
        // Tokens go in gridDim.y, which CUDA caps: long batches run in chunks.
        for t0 in (0..n_tok).step_by(MAX_GRID_Y) {
            let len = MAX_GRID_Y.min(n_tok - t0);
            launch!(self, "rope_f32", (n_heads as u32, len as u32, 1), (128, 1, 1);
                a: u64 = xp + (t0 * n_heads * head_dim * 4) as u64, nt: i32 = len as i32,
                nh: i32 = n_heads as i32, hd: i32 = head_dim as i32, nd: i32 = p.n_dims as i32,
                p0: i32 = (pos0 + t0) as i32, base: f32 = p.freq_base, scale: f32 = p.freq_scale,
                neox: i32 = p.neox as i32, f: u64 = ff, off: i32 = p.dim_offset as i32);
        }
        Ok(())
    }

    fn attention(
        &self,
        call: AttnCall,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache_k: &mut Tensor,
        cache_v: &mut Tensor,
        out: &mut Tensor,
    ) -> Result<()> {
        let s = call.shape;
        // The kernel's limits (src/kernels/cuda/ops.cu): it would write NaN outside them.
        if !s.head_dim.is_multiple_of(32)
            || s.head_dim > 256
            || s.n_head_kv == 0
            || !s.n_head.is_multiple_of(s.n_head_kv)
        {
            return Err(Error::UnsupportedType(format!(
                "attention with head size {} ({} heads, {} kv heads) on the GPU: it needs a \
                 multiple of 32 up to 256 and whole query groups",
                s.head_dim, s.n_head, s.n_head_kv
            )));
        }
        self.bind()?;
        self.batch(call.n_tok)?;
        self.forget_q8()?;
        let (qd, kvd) = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
        let n = call.n_tok;
        let mut at = [(0u64, 0u64); 2];
        for (i, (src, cache, what)) in [(k, &*cache_k, "k cache"), (v, &*cache_v, "v cache")]
            .into_iter()
            .enumerate()
        {
            if cache.dtype != DType::F16 {
                return Err(Error::Msg(format!("{what}: f32 tensor where f16 expected")));
            }
            if cache.len < (call.pos0 + n) * kvd {
                return Err(Error::Msg(format!(
                    "context full: {} tokens do not fit in a context of {}",
                    call.pos0 + n,
                    cache.len / kvd
                )));
            }
            at[i] = (
                self.f32ptr(src, n * kvd, what)?,
                self.tptr(cache, call.pos0 * kvd, n * kvd, what)?,
            );
        }
        let [(ks, kc), (vs, vc)] = at;
        let qp = self.f32ptr(q, n * qd, "attention query")?;
        // q's and k's RoPE, held by `rope`, fused with the store when they are exactly that;
        // with the q / k / v products too when the matmul held them as one split launch.
        let mut held = self.launcher.take_held()?;
        if let Some((c, r)) = qkv_rope_of(&held, qp, ks, vs, n, s) {
            let counters = {
                let mut sc = self.scratch()?;
                self.row_counters(&mut sc, s.n_head + 2 * s.n_head_kv)?
            };
            let rows = (s.n_head + 2 * s.n_head_kv) * s.head_dim;
            launch!(self, c.fused, (rows.div_ceil(4) as u32, 1, 1), (32, 4, 1);
                w0: [u8; 8] = c.w[0], w1: [u8; 8] = c.w[1], w2: [u8; 8] = c.w[2],
                a: [u8; 8] = c.aq, d: [u8; 8] = c.ads, y0: u64 = qp, y1: u64 = ks, y2: u64 = vs,
                ck: u64 = kc, cv: u64 = vc, cn: u64 = counters, k_: [u8; 8] = c.k,
                nh: i32 = s.n_head as i32, nkv: i32 = s.n_head_kv as i32,
                hd: i32 = s.head_dim as i32, nt: i32 = n as i32, nd: [u8; 8] = r[0],
                p0: [u8; 8] = r[1], base: [u8; 8] = r[2], scale: [u8; 8] = r[3],
                neox: [u8; 8] = r[4], f: [u8; 8] = r[5], off: [u8; 8] = r[6]);
        } else if let Some(rope) = {
            // Launches held before the two RoPEs (the q / k / v products) are issued first.
            let ropes = held.len().saturating_sub(2);
            if ropes > 0 && fused_rope(&held[ropes..], qp, ks, n, s).is_some() {
                self.launcher.unhold(held.drain(..ropes).collect())?;
            }
            fused_rope(&held, qp, ks, n, s)
        } {
            launch!(self, "rope_store_kv_f16", ((s.n_head + s.n_head_kv) as u32, n as u32, 1),
                (128, 1, 1);
                a: u64 = qp, b: u64 = ks, c: u64 = vs, d: u64 = kc, e: u64 = vc, nt: i32 = n as i32,
                nh: i32 = s.n_head as i32, nkv: i32 = s.n_head_kv as i32,
                hd: i32 = s.head_dim as i32, nd: [u8; 8] = rope[0], p0: [u8; 8] = rope[1],
                base: [u8; 8] = rope[2], scale: [u8; 8] = rope[3], neox: [u8; 8] = rope[4],
                f: [u8; 8] = rope[5], off: [u8; 8] = rope[6]);
        } else {
            self.launcher.unhold(held)?;
            launch!(self, "store_kv_f16", stride_grid(n * kvd, 4), B256;
                a: u64 = ks, b: u64 = vs, c: u64 = kc, d: u64 = vc, nn: i64 = (n * kvd) as i64);
        }
        let kp = self.tptr(cache_k, 0, (call.pos0 + n) * kvd, "k cache")?;
        let vp = self.tptr(cache_v, 0, (call.pos0 + n) * kvd, "v cache")?;
        let op = self.f32ptr(out, n * qd, "attention output")?;
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let n_kv = call.pos0 + n;
        // The split kernel reads 16-byte words of the cache (cudaMalloc bases always allow it).
        let split = if (kp | vp) % 16 == 0 {
            attn_split(s, n, n_kv, self.sm_count, attn_split_force())
        } else {
            None
        };
        // A decode batch's output also as the Q8_1 blocks the attn_output matmul reads next
        // (written by the kernel that writes the output: one launch fewer).
        let mut sc = self.scratch()?;
        sc.q8_holds = None;
        sc.q8s_holds = None;
        let (oq, oaq, oads) = if self.fuse_q8(n, qd) && s.head_dim.is_multiple_of(32) {
            let q = self.grow(&mut sc.q8, n * qd / 32 * 36)?;
            sc.q8_holds = Some((op, n * qd));
            let (aq, ads) = self.split_sink(&mut sc, op, n * qd)?;
            (q, aq, ads)
        } else {
            (0, 0, 0)
        };
        if let Some(p) = split {
            // [n_tok, n_head, n_split] partial states: head_dim sums, then (m, l) pairs.
            let floats = n * s.n_head * p.n_split * (s.head_dim + 2);
            let part = self.grow(&mut sc.attn, floats * 4)?;
            let (nt, nh, hd) = (n as i32, s.n_head as i32, s.head_dim as i32);
            let grid = ((s.n_head / p.gq) as u32, p.n_split as u32, n as u32);
            launch!(self, "attention_split_f16kv", grid, (128, 1, 1);
                a: u64 = qp, b: u64 = kp, c: u64 = vp, d: u64 = part, nt_: i32 = nt,
                nh_: i32 = nh, nkv: i32 = s.n_head_kv as i32, hd_: i32 = hd,
                p0: i32 = call.pos0 as i32, sc_: f32 = scale, gq: i32 = p.gq as i32,
                chunk: i32 = p.chunk as i32, ns: i32 = p.n_split as i32);
            launch!(self, "attention_merge_f32", (s.n_head as u32, n as u32, 1), (128, 1, 1);
                a: u64 = part, b: u64 = op, q_: u64 = oq, sq: u64 = oaq, sd: u64 = oads,
                nt_: i32 = nt, nh_: i32 = nh, hd_: i32 = hd, ns: i32 = p.n_split as i32);
            return Ok(());
        }
        if n > MMVQ_MAX_TOKENS && FLASH_PREFILL.load(Ordering::Relaxed) {
            let mma = self.flash_mma_for(s, kp, vp);
            return self.launch_flash_prefill(mma, s, n, call.pos0, [qp, kp, vp, op]);
        }
        for t0 in (0..n).step_by(MAX_GRID_Y) {
            let len = MAX_GRID_Y.min(n - t0);
            // The sinks from token t0 on (null stays null).
            let at = |p: u64, bytes_per_block: usize| {
                if p == 0 {
                    0
                } else {
                    p + (t0 * qd / 32 * bytes_per_block) as u64
                }
            };
            let (oq_t, oaq_t, oads_t) = (at(oq, 36), at(oaq, 32), at(oads, 8));
            launch!(self, "attention_f16kv", (s.n_head as u32, len as u32, 1), (128, 1, 1);
                a: u64 = qp + (t0 * qd * 4) as u64, b: u64 = kp, c: u64 = vp,
                d: u64 = op + (t0 * qd * 4) as u64, q_: u64 = oq_t, sq: u64 = oaq_t,
                sd: u64 = oads_t, nt: i32 = len as i32,
                nh: i32 = s.n_head as i32, nkv: i32 = s.n_head_kv as i32,
                hd: i32 = s.head_dim as i32, p0: i32 = (call.pos0 + t0) as i32,
                scale: f32 = scale);
        }
        Ok(())
    }

    fn swiglu(&self, g: &mut Tensor, u: &Tensor, n_tok: usize, width: usize) -> Result<()> {
        self.bind()?;
        self.batch(n_tok)?;
        let n = n_tok * width;
        let up = self.f32ptr(u, n, "swiglu up")?;
        let gp = self.f32ptr(g, n, "swiglu gate")?;
        let mut s = self.scratch()?;
        s.q8_holds = None;
        s.q8s_holds = None;
        if self.fuse_q8(n_tok, width) {
            let n_blocks = n / 32;
            let held = self.launcher.take_held()?;
            if let Some(c) = glu_of(&held, gp, up, width, n_tok) {
                // The held gate and up and this SwiGLU as one kernel. Its output's split goes
                // to the other slot (it reads its input's from the current one), which becomes
                // the current one.
                let q = self.grow(&mut s.q8, n_blocks * 36)?;
                let other = 1 - s.q8s_at;
                let (saq, sads) = self.split_slot(&mut s.q8s[other], n)?;
                s.q8s_at = other;
                s.q8s_holds = Some((gp, n));
                let counters = self.row_counters(&mut s, width / 32)?;
                launch!(self, c.fused, (width.div_ceil(4) as u32, 1, 1), (32, 4, 1);
                    wg: [u8; 8] = c.w[0], wu: [u8; 8] = c.w[1], a: [u8; 8] = c.aq,
                    d: [u8; 8] = c.ads, g_: u64 = gp, u_: u64 = up, qq: u64 = q, sq: u64 = saq,
                    sd: u64 = sads, cn: u64 = counters, k_: [u8; 8] = c.k,
                    n_: i32 = width as i32, t_: i32 = n_tok as i32);
                s.q8_holds = Some((gp, n));
                return Ok(());
            }
            self.launcher.unhold(held)?;
            let q = self.grow(&mut s.q8, n_blocks * 36)?;
            let (aq, ads) = self.split_sink(&mut s, gp, n)?;
            launch!(self, "swiglu_q8_1", ((n_blocks.div_ceil(8)) as u32, 1, 1), B256;
                a: u64 = gp, b: u64 = up, qq: u64 = q, sq: u64 = aq, sd: u64 = ads,
                nb: i32 = n_blocks as i32);
            s.q8_holds = Some((gp, n));
        } else {
            launch!(self, "swiglu_f32", stride_grid(n, 4), B256;
                a: u64 = gp, b: u64 = up, nn: i64 = n as i64);
        }
        Ok(())
    }

    fn add(&self, x: &mut Tensor, y: &Tensor, n: usize) -> Result<()> {
        self.bind()?;
        self.forget_q8()?;
        let yp = self.f32ptr(y, n, "add")?;
        let xp = self.f32ptr(x, n, "add")?;
        if FUSE_Q8.load(Ordering::Relaxed) {
            // Held for an RMSNorm of x that follows (decode's residual add, then the next
            // norm): the two then run as one kernel (add_rms_norm_q8_1); anything else issues
            // it first.
            launch!(hold self, "add_f32", stride_grid(n, 4), B256;
                a: u64 = xp, b: u64 = yp, nn: i64 = n as i64);
        } else {
            launch!(self, "add_f32", stride_grid(n, 4), B256;
                a: u64 = xp, b: u64 = yp, nn: i64 = n as i64);
        }
        Ok(())
    }

    fn scale(&self, x: &mut Tensor, s: f32, n: usize) -> Result<()> {
        self.bind()?;
        self.forget_q8()?;
        let xp = self.f32ptr(x, n, "scale")?;
        launch!(self, "scale_f32", stride_grid(n, 4), B256;
            a: u64 = xp, b: f32 = s, nn: i64 = n as i64);
        Ok(())
    }

    fn copy_cols(&self, src: &Tensor, dst: &mut Tensor, c: ColCopy) -> Result<()> {
        let (ns, nd) = c.extents()?;
        let n = c.rows * c.width;
        if n == 0 {
            return Ok(());
        }
        if nd > i32::MAX as usize || ns > i32::MAX as usize {
            return Err(Error::Msg(format!("copy_cols: {c:?} is too large")));
        }
        self.bind()?;
        self.forget_q8()?;
        let sp = self.f32ptr(src, ns, "copy_cols source")?;
        let dp = self.f32ptr(dst, nd, "copy_cols destination")?;
        let i = |v: usize| v as i32;
        launch!(self, "copy_cols_f32", stride_grid(n, 4), B256;
            a: u64 = sp, b: u64 = dp, w: i32 = i(c.width), ss: i32 = i(c.src_stride),
            sc: i32 = i(c.src_col), sr: i32 = i(c.src_rep), ds: i32 = i(c.dst_stride),
            dc: i32 = i(c.dst_col), nn: i64 = n as i64);
        Ok(())
    }

    fn embed_rows(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()> {
        self.bind()?;
        self.batch(ids.len())?;
        self.forget_q8()?;
        let k = table.k;
        let rb = table.bytes / table.n;
        let op = self.f32ptr(out, ids.len() * k, "embedding output")?;
        let tp = self.wptr(table)?;
        let split = self.rewrite_of(table)?;
        let mut s = self.scratch()?;
        let row16 = self.grow(&mut s.w16, k * 2)?;
        for (t, &id) in ids.iter().enumerate() {
            if id as usize >= table.n {
                return Err(Error::Model(format!(
                    "token id {id} is outside the vocabulary ({})",
                    table.n
                )));
            }
            let src = tp + (id as usize * rb) as u64;
            let dst = op + (t * k * 4) as u64;
            let f16_row = match table.ty {
                GgmlType::F32 => {
                    self.launcher.flush()?;
                    // SAFETY: both ranges are k f32 inside their allocations.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(dst, src, k * 4, self.cu_stream())
                    }
                    .map_err(drv("device copy"))?;
                    continue;
                }
                GgmlType::F16 => src,
                _ if let Some(rw) = split => {
                    let (qs, ds) = rw.at(tp, k, table.n, id as usize, 0);
                    self.dequant_split(rw.dequant, qs, ds, row16, k, [k, k])?;
                    row16
                }
                ty => {
                    let (_, deq) = kernels_of(ty)
                        .ok_or_else(|| Error::UnsupportedType(format!("{ty} on the GPU")))?;
                    let deq = deq.ok_or_else(|| Error::UnsupportedType(format!("{ty} rows")))?;
                    self.dequant_f16(deq, src, row16, k, [k, k])?;
                    row16
                }
            };
            launch!(self, "f16_to_f32", stride_grid(k, 4), B256;
                a: u64 = f16_row, b: u64 = dst, n: i64 = k as i64);
        }
        Ok(())
    }

    fn choices(&self) -> Vec<String> {
        self.mmq_choices.lines().unwrap_or_default()
    }

    fn pinned_copy_gbps(&self, bytes: usize) -> Result<Option<(f64, f64)>> {
        self.bind()?;
        self.launcher.flush()?;
        let mut host = Pinned::new(&self.ctx, bytes)?;
        // SAFETY: written by the copies below before it is read.
        let dev = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(drv("link buffer"))?;
        let d = self.ptr_of(&dev);
        let buf = host.slice()?;
        buf.fill(1);
        let mut best = (f64::MAX, f64::MAX);
        for _ in 0..4 {
            let mut sw = self.stopwatch()?;
            sw.start()?;
            // SAFETY: both ranges are `bytes` long and live until the stream is synchronised
            // (the stopwatch waits for the copy).
            unsafe { cudarc::driver::result::memcpy_htod_async(d, &buf[..], self.cu_stream()) }
                .map_err(drv("pinned copy"))?;
            let h2d = sw.stop()?;
            sw.start()?;
            // SAFETY: as above.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut buf[..], d, self.cu_stream()) }
                .map_err(drv("pinned copy"))?;
            let d2h = sw.stop()?;
            best = (best.0.min(h2d), best.1.min(d2h));
        }
        let gbps = |us: f64| bytes as f64 / us.max(1e-3) / 1e3;
        Ok(Some((gbps(best.0), gbps(best.1))))
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.launcher.flush()?;
        // Streamed weights' copies too (the profiler times them).
        self.copy_stream.synchronize().map_err(drv("synchronize"))?;
        self.stream.synchronize().map_err(drv("synchronize"))
    }

    fn stopwatch(&self) -> Result<Box<dyn Stopwatch + '_>> {
        Ok(Box::new(EventClock {
            b: self,
            start: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A split matrix-vector launch `name` with weights 11, 12, 13, activations 14, 15 and
    /// k = 4096, writing `y` (`n` rows each) for `t` tokens, as the matmul makes it.
    fn split_launch(name: &'static str, y: [u64; 3], n: [i32; 3], t: i32) -> Launch {
        let mut a = vec![
            11u64.slot(),
            12u64.slot(),
            13u64.slot(),
            14u64.slot(),
            15u64.slot(),
        ];
        a.extend(y.map(|p| p.slot()));
        a.push(4096i32.slot());
        a.extend(n.map(|r| r.slot()));
        a.push(t.slot());
        Launch::new(std::ptr::null_mut(), name, (1, 1, 1), (32, 4, 1), &a)
    }

    /// The held launches attention fuses with q / k / v: one split matrix-vector launch of three
    /// weights writing its q, k and v rows (n_head and n_head_kv heads), then the two RoPEs
    /// `fused_rope` takes; its weights, activations, k and the RoPE arguments carried over.
    #[test]
    fn qkv_rope_takes_only_the_held_q_k_v_and_their_ropes() {
        let s = AttnShape {
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
        };
        let (q, k, v) = (0x1000u64, 0x2000u64, 0x3000u64);
        let rope = |x: u64, heads: i32, t: i32| {
            let args = [
                x.slot(),
                t.slot(),
                heads.slot(),
                64i32.slot(),
                64i32.slot(),
                7i32.slot(),
                10000f32.slot(),
                1f32.slot(),
                0i32.slot(),
                0u64.slot(),
                0i32.slot(),
            ];
            Launch::new(
                std::ptr::null_mut(),
                "rope_f32",
                (1, 1, 1),
                (128, 1, 1),
                &args,
            )
        };
        let ropes = |m: Launch| vec![m, rope(q, 4, 2), rope(k, 2, 2)];
        // A q / k / v launch and the two RoPEs after it.
        let held3 = |name, y, n, t| ropes(split_launch(name, y, n, t));
        let good = |name| held3(name, [q, k, v], [256, 128, 128], 2);
        let (c, r) = qkv_rope_of(&good("mmvq_split_q8_0"), q, k, v, 2, s).expect("q, k, v, ropes");
        assert_eq!(c.fused, "mmvq_split_qkv_rope_q8_0");
        assert_eq!(c.w, [11u64.slot(), 12u64.slot(), 13u64.slot()]);
        assert_eq!(
            (c.aq, c.ads, c.k),
            (14u64.slot(), 15u64.slot(), 4096i32.slot())
        );
        assert_eq!(r[1], 7i32.slot());
        let one = qkv_rope_of(&good("mmvq_split1_q4_K"), q, k, v, 2, s).map(|c| c.0.fused);
        assert_eq!(one, Some("mmvq_split1_qkv_rope_q4_K"));
        // Anything else stays as it was.
        let bad = [
            vec![
                split_launch("mmvq_split_q8_0", [q, k, v], [256, 128, 128], 2),
                rope(q, 4, 2),
            ],
            held3("mmvq_split_q8_0", [q, v, k], [256, 128, 128], 2),
            held3("mmvq_split_q8_0", [q, k, v], [256, 128, 64], 2),
            held3("mmvq_split_q8_0", [q, k, v], [256, 128, 128], 1),
            held3("mmvq_multi_q8_0", [q, k, v], [256, 128, 128], 2),
            vec![rope(q, 4, 2), rope(k, 2, 2)],
            good("mmvq_split_q8_0")[..1].to_vec(),
        ];
        for held in bad {
            let names: Vec<_> = held.iter().map(|l| l.name).collect();
            assert!(qkv_rope_of(&held, q, k, v, 2, s).is_none(), "{names:?}");
        }
    }

    /// The held gate / up launch swiglu fuses: exactly one split matrix-vector launch of two
    /// weights of the SwiGLU's width writing its g and u for its tokens; its weights,
    /// activations and k carried over, the one-token kernel for the one-token launch.
    #[test]
    fn glu_takes_only_the_held_gate_and_up_of_its_swiglu() {
        let (g, u) = (100u64, 200u64);
        // Gate and up as the matmul launches them: the empty third place points at the first.
        let gate_up = |name, n0: i32, n1: i32, n2: i32, t: i32| {
            split_launch(name, [g, u, g], [n0, n1, n2], t)
        };
        let held = [gate_up("mmvq_split_q4_0", 64, 64, 0, 3)];
        let c = glu_of(&held, g, u, 64, 3).expect("gate and up of this swiglu");
        assert_eq!(c.fused, "mmvq_split_glu_q4_0");
        assert_eq!(
            (c.w[0], c.w[1], c.aq, c.ads),
            (11u64.slot(), 12u64.slot(), 14u64.slot(), 15u64.slot())
        );
        assert_eq!(c.k, 4096i32.slot());
        let one = [gate_up("mmvq_split1_q6_K", 64, 64, 0, 1)];
        assert_eq!(
            glu_of(&one, g, u, 64, 1).map(|c| c.fused),
            Some("mmvq_split1_glu_q6_K")
        );
        // Anything else stays as it was: another u or token count for this swiglu, a third
        // weight, rows of another width, another kernel, other launches held.
        let add = || {
            Launch::new(
                std::ptr::null_mut(),
                "add_f32",
                (1, 1, 1),
                (256, 1, 1),
                &[g.slot(), u.slot(), 64i64.slot()],
            )
        };
        let gu = || gate_up("mmvq_split_q4_0", 64, 64, 0, 3);
        for (held, u_, t) in [
            (vec![gu()], 300, 3),
            (vec![gu()], u, 2),
            (vec![gate_up("mmvq_split_q4_0", 64, 64, 8, 3)], u, 3),
            (vec![gate_up("mmvq_split_q4_0", 64, 32, 0, 3)], u, 3),
            (vec![gate_up("mmvq_multi_q4_0", 64, 64, 0, 3)], u, 3),
            (vec![add()], u, 3),
            (vec![gu(), add()], u, 3),
            (vec![], u, 3),
        ] {
            let names: Vec<_> = held.iter().map(|l| l.name).collect();
            assert!(glu_of(&held, g, u_, 64, t).is_none(), "{names:?}");
        }
    }

    /// split.cu's table: rewritten types put each block's quants (16-byte multiples, for the
    /// kernels' wide loads) first and the scales after all of them, ending at the weight's size;
    /// types read in the file's layout have 16-byte multiple blocks; every kernel named is one
    /// the backend loads from split.cu.
    #[test]
    fn split_kernels_match_the_block_layouts() {
        let loaded = kernels_in("split.cu");
        let mut n = 0;
        use GgmlType as T;
        let types = [
            T::F32,
            T::F16,
            T::BF16,
            T::Q4_0,
            T::Q4_1,
            T::Q5_0,
            T::Q5_1,
            T::Q8_0,
            T::Q2_K,
            T::Q3_K,
            T::Q4_K,
            T::Q5_K,
            T::Q6_K,
            T::IQ4_NL,
            T::IQ4_XS,
        ];
        for ty in types {
            let Some(sk) = split_kernels_of(ty) else {
                continue;
            };
            n += 1;
            let mut names = sk.names().to_vec();
            // The fused kernels are the type's own.
            assert_eq!(sk.glu, sk.mmvq.replace("split_", "split_glu_"), "{ty}");
            assert_eq!(sk.glu1, sk.mmvq1.replace("split1_", "split1_glu_"), "{ty}");
            assert_eq!(sk.qkv, sk.mmvq.replace("split_", "split_qkv_rope_"), "{ty}");
            assert_eq!(
                sk.qkv1,
                sk.mmvq1.replace("split1_", "split1_qkv_rope_"),
                "{ty}"
            );
            match sk.rewrite {
                Some(rw) => {
                    assert!(rw.sb > 0 && rw.qb() > 0, "{ty}");
                    assert_eq!(rw.qb() % 16, 0, "{ty}");
                    // A 3-row weight of two blocks a row: quants from the start, the scales
                    // right after them, the last row's scales ending at the weight's size.
                    let k = 2 * ty.block_size();
                    assert_eq!(rw.at(1000, k, 3, 0, 0), (1000, 1000 + 6 * rw.qb() as u64));
                    let (q2, d2) = rw.at(1000, k, 3, 2, 0);
                    assert_eq!(q2, 1000 + 4 * rw.qb() as u64, "{ty}");
                    assert_eq!(
                        d2 + 2 * rw.sb as u64,
                        1000 + 6 * ty.type_size() as u64,
                        "{ty}"
                    );
                    names.extend([rw.repack, rw.dequant]);
                }
                // Read in the file's layout: its blocks must allow the 16-byte loads.
                None => assert_eq!(ty.type_size() % 16, 0, "{ty}"),
            }
            for k in names {
                assert!(
                    loaded.contains(&k),
                    "{ty}: {k} is not among split.cu's kernels"
                );
            }
        }
        assert_eq!(n, 7);
    }

    /// `OATO_CUDA_MMVQ`'s values name the three modes; anything else is an error that says what
    /// the variable takes.
    #[test]
    fn mmvq_modes_parse_by_name() {
        for m in [MmvqMode::Staged, MmvqMode::Direct, MmvqMode::Pipe] {
            assert_eq!(MmvqMode::parse(m.name()).unwrap(), m);
        }
        for bad in ["", "Pipe", "direct ", "wide"] {
            let e = MmvqMode::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("OATO_CUDA_MMVQ") && e.contains("staged, direct or pipe"),
                "{e}"
            );
        }
    }

    /// The environment's whole numbers: surrounding spaces allowed; a value the rule refuses,
    /// or no number, is an error naming the variable, the value and what it should be.
    #[test]
    fn env_counts_name_the_variable_and_the_rule() {
        assert_eq!(parse_pipe_blocks(" 5 ").unwrap(), 5);
        assert_eq!(parse_pipe_blocks("64").unwrap(), 64);
        for bad in ["0", "65", "", "four", "-1"] {
            let e = parse_pipe_blocks(bad).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "OATO_CUDA_MMVQ_PIPE_BLOCKS={bad:?}: expected thread blocks per \
                     multiprocessor, 1 to 64"
                )
            );
        }
    }

    /// `OATO_CUDA_MMVQ_MAX_TOKENS` takes 0 to 8; anything else is an error naming the variable
    /// and the range.
    #[test]
    fn mmvq_max_tokens_parses_0_to_8() {
        for n in 0..=MMVQ_MAX_TOKENS {
            assert_eq!(parse_mmvq_max_tokens(&n.to_string()).unwrap(), n);
        }
        assert_eq!(parse_mmvq_max_tokens(" 4 ").unwrap(), 4);
        for bad in ["", "9", "-1", "all", "2.5"] {
            let e = parse_mmvq_max_tokens(bad).unwrap_err().to_string();
            assert!(
                e.contains("OATO_CUDA_MMVQ_MAX_TOKENS") && e.contains("0 to 8"),
                "{e}"
            );
        }
    }

    /// `OATO_CUDA_NORM_THREADS` takes 0 or a multiple of 32 up to 1024, else an error naming the
    /// variable; by default a row gets four values a thread in whole warps, at most 1024 threads.
    #[test]
    fn norm_threads_parse_and_the_default_block() {
        for t in [0, 32, 256, 1024] {
            assert_eq!(parse_norm_threads(&t.to_string()).unwrap(), t);
        }
        for bad in ["", "48", "1056", "-32", "many"] {
            let e = parse_norm_threads(bad).unwrap_err().to_string();
            assert!(
                e.contains("OATO_CUDA_NORM_THREADS") && e.contains("1024"),
                "{e}"
            );
        }
        // SmolLM2's 576, Llama-3.2-1B's 2048, LLaMA3-8B's 4096, QwQ's 5120, MiniCPM3's latent
        // 256 and 768; a row of 8192 still fits the kernels' registers (8 a thread).
        for (n, t) in [
            (576, 160),
            (2048, 512),
            (4096, 1024),
            (5120, 1024),
            (8192, 1024),
        ] {
            assert_eq!(norm_block(n), (t, 1, 1), "n = {n}");
        }
        assert_eq!(norm_block(256).0, 64);
        assert_eq!(norm_block(768).0, 192);
        assert_eq!(norm_block(1).0, 32);
    }

    const LLAMA8B: AttnShape = AttnShape {
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
    };

    #[test]
    fn gemm_pieces_cover_the_weight_within_the_scratch() {
        const S: usize = GEMM_SLICE_BYTES;
        // LLaMA3-8B: ffn_down (4096 x 14336) in two slices of k holding every row; ffn_gate
        // (14336 x 4096) in slices of 8192 rows and the rest; q (4096 x 4096) whole; the output
        // head (128256 x 4096) in slices of 8192 rows.
        let down = gemm_pieces(4096, 14336, 32, S);
        assert_eq!(down, vec![(0..4096, 0..8192), (0..4096, 8192..14336)]);
        let gate = gemm_pieces(14336, 4096, 32, S);
        assert_eq!(gate, vec![(0..8192, 0..4096), (8192..14336, 0..4096)]);
        assert_eq!(gemm_pieces(4096, 4096, 32, S), vec![(0..4096, 0..4096)]);
        assert_eq!(gemm_pieces(128256, 4096, 32, S).len(), 16);
        // QwQ-32B's ffn_down (5120 x 27648), K-quant blocks: k slices of 6400 (block multiples).
        let qwq = gemm_pieces(5120, 27648, 256, S);
        assert_eq!(qwq.len(), 5);
        assert!(
            qwq.iter()
                .all(|(r, c)| *r == (0..5120) && c.start % 256 == 0)
        );
        assert_eq!(qwq[0].1, 0..6400);
        // Every case: the pieces tile the weight exactly once, each within the scratch (a single
        // row may exceed it: the least a piece can be), k slices in whole blocks.
        let cases = [
            (128256, 4096, 32, S),
            (1, 1 << 20, 256, S),
            (3, 5, 8, S),
            (3, 5, 8, 16), // BF16 with k = 5: no k slices (not a multiple of 8)
            (70000, 2048, 32, S),
            (576, 1536, 32, 1 << 20), // the test model's ffn_down, a 1 MiB scratch: k slices
            (49152, 576, 32, 1 << 20), // its head: a k slice would be under a block: rows
            (100, 100_000, 256, 1 << 20), // one row is more than the scratch
        ];
        for (n, k, b, s) in cases {
            let p = gemm_pieces(n, k, b, s);
            let mut area = 0;
            for (r, c) in &p {
                assert!(
                    r.len() * c.len() * 2 <= s || r.len() == 1,
                    "{n}x{k}: {r:?} {c:?}"
                );
                assert!(c.len() == k || (c.start % b == 0 && c.len() % b == 0 || c.end == k));
                area += r.len() * c.len();
            }
            assert_eq!(area, n * k, "{n}x{k}");
            let first: usize = p
                .iter()
                .filter(|(_, c)| c.start == 0)
                .map(|(r, _)| r.len())
                .sum();
            assert_eq!(first, n, "{n}x{k}");
        }
        assert_eq!(gemm_pieces(576, 1536, 32, 1 << 20).len(), 2);
        assert!(
            gemm_pieces(49152, 576, 32, 1 << 20)
                .iter()
                .all(|(_, c)| c.len() == 576)
        );
    }

    #[test]
    fn attention_split_sizes_the_grid_to_the_device() {
        // H100 (132 SMs), one token at position 4095: 8 blocks of 4 heads, 528 wanted blocks,
        // so 66 splits of 63 positions.
        let p = attn_split(LLAMA8B, 1, 4096, 132, None).unwrap();
        assert_eq!((p.gq, p.chunk, p.n_split), (4, 63, 66));
        // Short contexts keep the one-block kernel unless forced; the chunk floor then holds.
        assert_eq!(attn_split(LLAMA8B, 1, 255, 132, None), None);
        let p = attn_split(LLAMA8B, 1, 100, 132, Some(true)).unwrap();
        assert_eq!((p.chunk, p.n_split), (32, 4));
        // A long context hits the chunk ceiling.
        let p = attn_split(LLAMA8B, 1, 1 << 20, 132, None).unwrap();
        assert_eq!((p.chunk, p.n_split), (256, 4096));
        // Prefill, a head size the kernel lacks, and OATO_CUDA_ATTN_SPLIT=0: no split.
        assert_eq!(attn_split(LLAMA8B, 9, 4096, 132, None), None);
        let odd = AttnShape {
            head_dim: 96,
            ..LLAMA8B
        };
        assert_eq!(attn_split(odd, 1, 4096, 132, None), None);
        assert_eq!(attn_split(LLAMA8B, 1, 4096, 132, Some(false)), None);
    }

    #[test]
    fn rope_fuses_only_with_exactly_q_and_k_of_the_attention() {
        let (q, k, n) = (0x1000u64, 0x2000u64, 1usize);
        let rope = |name, x: u64, heads: i32, pos0: i32| {
            let args = [
                x.slot(),
                1i32.slot(),
                heads.slot(),
                128i32.slot(),
                128i32.slot(),
                pos0.slot(),
                10000f32.slot(),
                1f32.slot(),
                0i32.slot(),
                0u64.slot(),
                0i32.slot(),
            ];
            Launch::new(std::ptr::null_mut(), name, (1, 1, 1), (128, 1, 1), &args)
        };
        let (rq, rk) = (rope("rope_f32", q, 32, 7), rope("rope_f32", k, 8, 7));
        let got = fused_rope(&[rq.clone(), rk.clone()], q, k, n, LLAMA8B).unwrap();
        assert_eq!(got[0], 128i32.slot());
        assert_eq!(got[1], 7i32.slot());
        // Either order; not with one rope alone, another tensor, other heads, another position
        // or another kernel.
        assert!(fused_rope(&[rk.clone(), rq.clone()], q, k, n, LLAMA8B).is_some());
        assert!(fused_rope(std::slice::from_ref(&rq), q, k, n, LLAMA8B).is_none());
        assert!(fused_rope(&[rq.clone(), rk.clone()], q, k + 4, n, LLAMA8B).is_none());
        assert!(fused_rope(&[rq.clone(), rk.clone()], q, k, 2, LLAMA8B).is_none());
        let rk8 = rope("rope_f32", k, 4, 7);
        assert!(fused_rope(&[rq.clone(), rk8], q, k, n, LLAMA8B).is_none());
        let rk_pos = rope("rope_f32", k, 8, 8);
        assert!(fused_rope(&[rq.clone(), rk_pos], q, k, n, LLAMA8B).is_none());
        let other = rope("scale_f32", k, 8, 7);
        assert!(fused_rope(&[rq, other], q, k, n, LLAMA8B).is_none());
    }

    #[test]
    fn attention_split_heads_per_block_divide_the_group() {
        // Group 5 (40 / 8 heads): 5 per block; group 6 at head_dim 256: 3 (6 * 256 > 1024);
        // group 16: 8 (FD_MAX_G).
        let shape = |n_head, n_head_kv, head_dim| AttnShape {
            n_head,
            n_head_kv,
            head_dim,
        };
        let gq = |s| attn_split(s, 1, 1000, 132, None).unwrap().gq;
        assert_eq!(gq(shape(40, 8, 128)), 5);
        assert_eq!(gq(shape(12, 2, 256)), 3);
        assert_eq!(gq(shape(16, 1, 64)), 8);
        assert_eq!(gq(shape(9, 9, 32)), 1);
    }
}
