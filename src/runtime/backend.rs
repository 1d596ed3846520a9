//! The Backend trait: every operation the forward pass needs, on one device with its own memory,
//! plus memory queries, accounted allocation and a stopwatch. The CPU engine is one backend
//! (`cpu_backend`), CUDA another (`cuda_backend`); the executor moves activations between them.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::cpu::attention::AttnShape;
use crate::model::{RopeParams, WeightRef};
use crate::quant::GgmlType;

/// What kind of device a backend drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

/// Element type of an activation tensor or cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
        }
    }
}

/// What an allocation is for; memory is accounted per category.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    Weights,
    KvCache,
    Workspace,
}

/// Free and total memory of a device, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub free: usize,
    pub total: usize,
}

impl MemInfo {
    /// The host's available (`MemAvailable`) and total memory from /proc/meminfo (0 when it
    /// cannot be read).
    pub fn host() -> MemInfo {
        let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| -> usize {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<usize>().ok())
                .map_or(0, |kib| kib * 1024)
        };
        MemInfo {
            free: field("MemAvailable:"),
            total: field("MemTotal:"),
        }
    }
}

/// Bytes a backend holds now, per category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub weights: usize,
    pub kv_cache: usize,
    pub workspace: usize,
}

impl Usage {
    pub fn total(&self) -> usize {
        self.weights + self.kv_cache + self.workspace
    }
}

/// Per-category byte counters shared by a backend and everything it allocated.
#[derive(Default, Debug)]
pub struct Ledger {
    bytes: [AtomicUsize; 3],
}

impl Ledger {
    fn slot(cat: Category) -> usize {
        match cat {
            Category::Weights => 0,
            Category::KvCache => 1,
            Category::Workspace => 2,
        }
    }

    pub fn usage(&self) -> Usage {
        let get = |c| self.bytes[Self::slot(c)].load(Ordering::Relaxed);
        Usage {
            weights: get(Category::Weights),
            kv_cache: get(Category::KvCache),
            workspace: get(Category::Workspace),
        }
    }

    /// Counts `bytes` under `cat` until the returned guard is dropped.
    pub fn reserve(self: &Arc<Self>, cat: Category, bytes: usize) -> Reservation {
        self.bytes[Self::slot(cat)].fetch_add(bytes, Ordering::Relaxed);
        Reservation {
            ledger: self.clone(),
            cat,
            bytes,
        }
    }
}

/// Keeps an allocation counted in its backend's ledger while it lives.
#[derive(Debug)]
pub struct Reservation {
    ledger: Arc<Ledger>,
    cat: Category,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.ledger.bytes[Ledger::slot(self.cat)].fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A fresh id for a backend instance, so tensors can be checked against the backend given them.
pub fn next_backend_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A tensor in one backend's memory: `len` elements of `dtype`. Only its backend reads `data`.
pub struct Tensor {
    pub device: u64,
    pub dtype: DType,
    pub len: usize,
    pub(crate) data: Box<dyn Any + Send + Sync>,
}

/// A weight matrix held by one backend in its GGUF format: `n` rows of `k` (`y = W x`).
pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    pub k: usize,
    pub n: usize,
    pub bytes: usize,
    pub device: u64,
    pub(crate) data: Box<dyn Any + Send + Sync>,
}

/// Times work on a backend: wall clock on the CPU, events on a GPU stream.
pub trait Stopwatch {
    fn start(&mut self) -> Result<()>;
    /// Microseconds since `start`, after the work queued in between has finished.
    fn stop(&mut self) -> Result<f64>;
}

/// Arguments of one attention call: the batch's tokens sit at positions `pos0..pos0 + n_tok`.
#[derive(Clone, Copy, Debug)]
pub struct AttnCall {
    pub shape: AttnShape,
    pub n_tok: usize,
    pub pos0: usize,
}

/// A strided copy of columns within one device: for each of `rows` rows `r`,
/// `dst[r * dst_stride + dst_col ..][..width] = src[(r / src_rep) * src_stride + src_col ..][..width]`
/// (`src_rep` > 1 repeats each source row: latent attention's shared RoPE key, to every head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColCopy {
    pub rows: usize,
    pub width: usize,
    pub src_stride: usize,
    pub src_col: usize,
    pub src_rep: usize,
    pub dst_stride: usize,
    pub dst_col: usize,
}

impl ColCopy {
    /// Elements `src` and `dst` must hold, after checking that the columns fit their rows.
    pub fn extents(&self) -> Result<(usize, usize)> {
        let fits = |col: usize, stride: usize| col + self.width <= stride;
        if self.rows == 0 || self.width == 0 {
            return Ok((0, 0));
        }
        if self.src_rep == 0
            || !fits(self.src_col, self.src_stride)
            || !fits(self.dst_col, self.dst_stride)
        {
            return Err(Error::Msg(format!("copy_cols: bad shape {self:?}")));
        }
        let src_rows = self.rows.div_ceil(self.src_rep);
        Ok((
            (src_rows - 1) * self.src_stride + self.src_col + self.width,
            (self.rows - 1) * self.dst_stride + self.dst_col + self.width,
        ))
    }

    /// The copy on host slices (the CPU backend's, and the reference for the others').
    pub fn run(&self, src: &[f32], dst: &mut [f32]) {
        for r in 0..self.rows {
            let s = (r / self.src_rep) * self.src_stride + self.src_col;
            let d = r * self.dst_stride + self.dst_col;
            dst[d..d + self.width].copy_from_slice(&src[s..s + self.width]);
        }
    }
}

/// The operations of the forward pass. Activations are f32 row-major `[n_tok, width]`; a tensor
/// may be longer than an operation uses. Every method checks that its tensors belong to it.
pub trait Backend: Send + Sync {
    fn id(&self) -> u64;
    fn kind(&self) -> DeviceKind;
    /// One line: the device and how it runs (ISA and threads, or GPU name).
    fn describe(&self) -> String;
    /// The device's own name ("cpu", or the GPU's name).
    fn device_name(&self) -> String;
    /// Whether the int8 prefill GEMM can run on tensor cores here (a CUDA device of compute
    /// capability 8.0 or later; `cuda_mmq::set_mma` chooses).
    fn int8_tensor_cores(&self) -> bool {
        false
    }
    /// Whether the start-up check found the tensor-core int8 GEMM giving the `__dp4a` kernel's
    /// bits (`None`: not checked, as without tensor cores or with them switched off).
    fn int8_mma_agrees(&self) -> Option<bool> {
        None
    }
    /// Bytes of the device's last-level cache that data read again soon may still be found in
    /// (a GPU's L2), so a timing that reads the same weight over and over measures that cache and
    /// not the memory: `selftest --perf` cycles through copies whose bytes together pass twice
    /// this. 0 (the default) where there is none to allow for.
    fn cache_bytes(&self) -> usize {
        0
    }
    fn memory(&self) -> Result<MemInfo>;
    fn usage(&self) -> Usage;

    fn alloc(&self, dtype: DType, len: usize, cat: Category) -> Result<Tensor>;
    /// A weight from raw bytes in its GGUF format (`n` rows of `k` elements of `ty`): a GPU
    /// uploads it through pinned staging, the CPU keeps a copy.
    fn upload_weight(
        &self,
        name: &str,
        ty: GgmlType,
        k: usize,
        n: usize,
        bytes: &[u8],
    ) -> Result<Weight>;
    /// Makes `w` (a tensor of `file`) usable by `matmul` and `embed_rows`: a GPU uploads it, the
    /// CPU keeps a view of the memory map.
    fn load_weight(&self, file: &Arc<GgufFile>, w: &WeightRef) -> Result<Weight> {
        self.upload_weight(&w.name, w.ty, w.k, w.n, w.bytes(file)?)
    }
    /// [`Backend::load_weight`] for a weight that `matmul` will read (every one but the token
    /// embeddings): a backend may keep it in a layout of its own. The default loads it as is.
    fn load_matmul_weight(&self, file: &Arc<GgufFile>, w: &WeightRef) -> Result<Weight> {
        self.load_weight(file, w)
    }
    /// Starts copying weight `w` of `file` for a use soon after (FlexGen-style streaming): the
    /// copy may overlap work already queued, and work queued later that reads the weight waits
    /// for it. The default loads it at once.
    fn prefetch_weight(&self, file: &Arc<GgufFile>, w: &WeightRef) -> Result<Weight> {
        self.load_weight(file, w)
    }
    /// Gives back a streamed weight; a GPU frees it only after the queued work that reads it.
    fn release_weight(&self, w: Weight) -> Result<()> {
        drop(w);
        Ok(())
    }
    /// Host → backend: `dst[at..at + src.len()] = src`.
    fn write(&self, dst: &mut Tensor, at: usize, src: &[f32]) -> Result<()>;
    /// Backend → host: `dst = src[at..at + dst.len()]`, complete when this returns.
    fn read(&self, src: &Tensor, at: usize, dst: &mut [f32]) -> Result<()>;
    /// The tensor's elements when they live in host memory (the CPU backend), for copies
    /// without staging.
    fn host_f32<'a>(&self, _t: &'a Tensor) -> Option<&'a [f32]> {
        None
    }
    fn host_f32_mut<'a>(&self, _t: &'a mut Tensor) -> Option<&'a mut [f32]> {
        None
    }

    /// `ys[i][t] = ws[i] · x[t]` for the `n_tok` rows of `x` ([n_tok, k]); matrices that read
    /// the same input come in one call so the input is prepared (quantised, sent) once.
    fn matmul(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
    ) -> Result<()>;
    /// `y[r] = x[row0 + r] / sqrt(mean(x²) + eps) * w` for `n_rows` rows of width `w.len`; the
    /// rows of `x` start `x_stride` elements apart (at least `w.len`), those of `y` `w.len`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &self,
        x: &Tensor,
        row0: usize,
        n_rows: usize,
        x_stride: usize,
        w: &Tensor,
        eps: f32,
        y: &mut Tensor,
    ) -> Result<()>;
    /// Adds `b` to each of the `n_tok` rows of `x`.
    fn add_bias(&self, x: &mut Tensor, b: &Tensor, n_tok: usize) -> Result<()>;
    /// RoPE in place on `x` = [n_tok, n_heads, head_dim], token t at position `pos0 + t`, on
    /// dimensions `p.dim_offset..p.dim_offset + p.n_dims` of each head.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut Tensor,
        n_tok: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        p: &RopeParams,
        freq_factors: Option<&Tensor>,
    ) -> Result<()>;
    /// Stores `k`, `v` ([n_tok, kv_dim]) into the f16 caches at positions pos0.. and writes the
    /// causal attention of `q` over positions 0..=pos0 + t into `out` ([n_tok, q_dim]).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        call: AttnCall,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache_k: &mut Tensor,
        cache_v: &mut Tensor,
        out: &mut Tensor,
    ) -> Result<()>;
    /// `g = silu(g) * u` over the first `n_tok` rows of `width` elements.
    fn swiglu(&self, g: &mut Tensor, u: &Tensor, n_tok: usize, width: usize) -> Result<()>;
    /// `x += y` over the first `n` elements.
    fn add(&self, x: &mut Tensor, y: &Tensor, n: usize) -> Result<()>;
    /// `x *= s` over the first `n` elements.
    fn scale(&self, x: &mut Tensor, s: f32, n: usize) -> Result<()>;
    /// Copies columns of `src` into `dst` as `c` says (both on this backend).
    fn copy_cols(&self, src: &Tensor, dst: &mut Tensor, c: ColCopy) -> Result<()>;
    /// Rows `ids` of the embedding table `table` as f32 into `out` ([ids.len(), table.k]).
    fn embed_rows(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()>;

    /// Host→device and device→host GB/s of a plain copy between page-locked host memory and
    /// the device (`bytes` each way): the hardware's figure the executor's copies are held to
    /// (DESIGN.md rule 8). `None` where there is no such thing to measure.
    fn pinned_copy_gbps(&self, _bytes: usize) -> Result<Option<(f64, f64)>> {
        Ok(None)
    }

    /// What the backend chose by timing while it ran, one line each, for logs (the CUDA
    /// backend: each quantised weight shape's prefill GEMM, the int8 kernel or dequantisation
    /// + cuBLAS, with both times). Empty where nothing was chosen.
    fn choices(&self) -> Vec<String> {
        Vec::new()
    }

    /// Host memory this device reaches by DMA (page-locked and known to it), for the CPU's
    /// activation buffers: a copy between such a buffer and the device is one DMA, no staging
    /// copy (DESIGN.md rule 8). `None` (the default) where copies need no such thing.
    fn host_memory(&self) -> Option<Arc<dyn HostMemory>> {
        None
    }
    /// Waits until the device has read the host memory that earlier `write`s took from its
    /// [`Backend::host_memory`]: a `write` from there returns before the DMA has run, so the
    /// host must not change those bytes before this. The default has nothing to wait for.
    fn host_reads_done(&self) -> Result<()> {
        Ok(())
    }

    /// Waits for all queued work.
    fn synchronize(&self) -> Result<()>;
    fn stopwatch(&self) -> Result<Box<dyn Stopwatch + '_>>;
}

/// Page-locked host memory handed out by a device backend (its [`Backend::host_memory`]).
pub trait HostMemory: Send + Sync {
    /// `bytes` bytes (page-aligned, at least 4-byte aligned), or `None` when the device cannot
    /// give them (the caller then uses ordinary memory).
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>>;
    /// Gives back memory from `alloc` once the device has finished every copy that uses it.
    ///
    /// # Safety
    /// `ptr` came from this `alloc` with the same `bytes`, and is not used afterwards.
    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize);
}

/// The live allocations of a [`HostMemory`] (start address to length in bytes), so its device
/// can tell a host slice inside one from ordinary memory.
#[derive(Default)]
pub struct HostRanges(std::sync::Mutex<std::collections::BTreeMap<usize, usize>>);

impl HostRanges {
    pub fn insert(&self, ptr: NonNull<u8>, bytes: usize) {
        if let Ok(mut r) = self.0.lock() {
            r.insert(ptr.as_ptr() as usize, bytes);
        }
    }

    pub fn remove(&self, ptr: NonNull<u8>) {
        if let Ok(mut r) = self.0.lock() {
            r.remove(&(ptr.as_ptr() as usize));
        }
    }

    /// Whether `bytes` bytes at `ptr` lie inside one allocation.
    pub fn holds(&self, ptr: *const u8, bytes: usize) -> bool {
        let a = ptr as usize;
        self.0.lock().is_ok_and(|r| {
            r.range(..=a)
                .next_back()
                .is_some_and(|(&s, &n)| a.checked_add(bytes).is_some_and(|e| e <= s + n))
        })
    }
}

/// `len` f32 elements in a [`HostMemory`], zeroed when made; given back on drop.
pub struct HostBuf {
    ptr: NonNull<f32>,
    len: usize,
    mem: Arc<dyn HostMemory>,
}

// SAFETY: the buffer owns its elements (no other handle to them exists), as a Vec<f32> would;
// `HostMemory` is Send + Sync.
unsafe impl Send for HostBuf {}
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// `len` zeroed elements from `mem`, or `None` when it has none to give.
    pub fn new(mem: &Arc<dyn HostMemory>, len: usize) -> Option<HostBuf> {
        len.checked_mul(4)?;
        let bytes = Self::bytes(len);
        let ptr = mem.alloc(bytes)?.cast::<f32>();
        if !ptr.as_ptr().is_aligned() {
            // SAFETY: from `alloc` with these bytes, not used again.
            unsafe { mem.free(ptr.cast(), bytes) };
            return None;
        }
        // SAFETY: `bytes` writable bytes at `ptr`, aligned for f32; all zero bits is 0.0.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Some(HostBuf {
            ptr,
            len,
            mem: mem.clone(),
        })
    }

    /// What `len` elements take from the memory (at least one element's worth).
    fn bytes(len: usize) -> usize {
        (len * 4).max(4)
    }
}

impl std::ops::Deref for HostBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `len` initialised elements owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `mem` with this size in `new`, dropped once.
        unsafe { self.mem.free(self.ptr.cast(), Self::bytes(self.len)) };
    }
}

/// The common `k` of matrices that share one input, after checking that there is one output per
/// matrix.
pub fn shared_k(ws: &[&Weight], n_outputs: usize) -> Result<usize> {
    if ws.is_empty() || ws.len() != n_outputs {
        return Err(Error::Msg(
            "matmul: weights and outputs do not pair up".into(),
        ));
    }
    let k = ws[0].k;
    if ws.iter().any(|w| w.k != k) {
        return Err(Error::Msg(
            "matmul: shared-input weights differ in k".into(),
        ));
    }
    Ok(k)
}

/// Checks that `bytes` is exactly `n` rows of `k` elements of `ty`.
pub fn check_weight_bytes(
    name: &str,
    ty: GgmlType,
    k: usize,
    n: usize,
    bytes: &[u8],
) -> Result<()> {
    let row = ty.row_bytes(k)?;
    if row * n != bytes.len() {
        return Err(Error::Model(format!(
            "weight {name:?}: {} bytes for {n} rows of {k} {ty} elements ({} expected)",
            bytes.len(),
            row * n
        )));
    }
    Ok(())
}

/// Checks that `t` belongs to backend `id` and holds at least `need` elements.
pub fn check_tensor(t: &Tensor, id: u64, need: usize, what: &str) -> Result<()> {
    if t.device != id {
        return Err(Error::Msg(format!(
            "{what}: tensor of device #{} given to device #{id}",
            t.device
        )));
    }
    if t.len < need {
        return Err(Error::Msg(format!(
            "{what}: tensor of {} elements, {need} needed",
            t.len
        )));
    }
    Ok(())
}

/// Downcasts a tensor's storage to the backend's own type.
pub fn storage<'a, T: 'static>(t: &'a Tensor, what: &str) -> Result<&'a T> {
    t.data
        .downcast_ref::<T>()
        .ok_or_else(|| Error::Msg(format!("{what}: tensor storage of another backend")))
}

pub fn storage_mut<'a, T: 'static>(t: &'a mut Tensor, what: &str) -> Result<&'a mut T> {
    t.data
        .downcast_mut::<T>()
        .ok_or_else(|| Error::Msg(format!("{what}: tensor storage of another backend")))
}

pub fn weight_storage<T: 'static>(w: &Weight, id: u64) -> Result<&T> {
    if w.device != id {
        return Err(Error::Msg(format!(
            "weight {:?} is held by device #{}, not #{id}",
            w.name, w.device
        )));
    }
    w.data
        .downcast_ref::<T>()
        .ok_or_else(|| Error::Msg(format!("weight {:?}: storage of another backend", w.name)))
}

/// Copies `n` f32 elements from `src` on `from` to `dst` on `to` (offsets 0), through host
/// memory: direct when either side is host memory, else through `staging`.
pub fn transfer(
    from: &dyn Backend,
    src: &Tensor,
    to: &dyn Backend,
    dst: &mut Tensor,
    n: usize,
    staging: &mut Vec<f32>,
) -> Result<()> {
    if let Some(h) = from.host_f32(src) {
        return to.write(dst, 0, &h[..n]);
    }
    if let Some(h) = to.host_f32_mut(dst) {
        return from.read(src, 0, &mut h[..n]);
    }
    staging.resize(n, 0.0);
    from.read(src, 0, staging)?;
    to.write(dst, 0, staging)
}
