//! A CPU-backed stand-in for a GPU, for tests of the placement pipeline on machines without one:
//! it has its own buffers (its own backend id, so tensors cannot silently mix with the CPU's),
//! reports itself as a GPU, moves data only through `write`/`read` as a GPU does, counts the
//! matmuls it runs per weight, and reports the memory size it is given. Like a GPU it hands the
//! CPU backend host memory for its activation buffers, and it checks what a real device's DMA
//! needs of that memory: bytes a `write` took from it stay unchanged until `host_reads_done`.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::{RopeParams, WeightRef};
use crate::quant::GgmlType;
use crate::runtime::backend::{
    AttnCall, Backend, Category, ColCopy, DType, DeviceKind, HostMemory, HostRanges, MemInfo,
    Stopwatch, Tensor, Usage, Weight,
};
use crate::runtime::cpu_backend::CpuBackend;

pub struct TestDevice {
    inner: CpuBackend,
    total: usize,
    /// Matmuls run, by weight name.
    matmuls: Mutex<HashMap<String, usize>>,
    /// Streamed-weight copies made, by weight name.
    prefetches: Mutex<HashMap<String, usize>>,
    host: Arc<TestHostMemory>,
}

/// Heap memory standing in for a GPU's page-locked memory, with the live allocations and the
/// bytes `write`s took from them that a real device might not have read yet ("lent").
#[derive(Default)]
pub struct TestHostMemory {
    ranges: HostRanges,
    /// Each lent range: its address and its elements when the `write` took them.
    lent: Mutex<Vec<(usize, Vec<f32>)>>,
}

impl TestHostMemory {
    /// An error if a lent range changed since its `write` (the host wrote it before
    /// `host_reads_done`: a real device's DMA could have read the new bytes). `release` also
    /// forgets the ranges.
    fn check(&self, release: bool) -> Result<()> {
        let mut lent = self
            .lent
            .lock()
            .map_err(|_| Error::Msg("test device: lock".into()))?;
        for (addr, was) in lent.iter() {
            // SAFETY: the range lies in a live allocation: `free` drops the lent ranges inside
            // the memory it frees (after checking them) before giving it back.
            let now = unsafe { std::slice::from_raw_parts(*addr as *const f32, was.len()) };
            if now.iter().zip(was).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(Error::Msg(format!(
                    "test device: host memory at {addr:#x} ({} floats) changed before the \
                     device had read it (no host_reads_done in between)",
                    was.len()
                )));
            }
        }
        if release {
            lent.clear();
        }
        Ok(())
    }
}

/// Alignment of the test device's host allocations (a page, as page-locked memory has).
const HOST_ALIGN: usize = 4096;

impl HostMemory for TestHostMemory {
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), HOST_ALIGN).ok()?;
        // SAFETY: a non-zero size.
        let p = NonNull::new(unsafe { std::alloc::alloc(layout) })?;
        self.ranges.insert(p, bytes);
        Some(p)
    }

    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        let start = ptr.as_ptr() as usize;
        // A device's free waits for its DMA, so the lent bytes inside are checked, then forgotten.
        if let Err(e) = self.check(false) {
            eprintln!("{e}");
        }
        if let Ok(mut lent) = self.lent.lock() {
            lent.retain(|(a, _)| *a < start || *a >= start + bytes);
        }
        self.ranges.remove(ptr);
        if let Ok(layout) = std::alloc::Layout::from_size_align(bytes.max(1), HOST_ALIGN) {
            // SAFETY: allocated in `alloc` with this layout (the caller's contract).
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        }
    }
}

impl TestDevice {
    /// A device with `total_bytes` of memory.
    pub fn new(total_bytes: usize) -> Self {
        TestDevice {
            inner: CpuBackend::new(),
            total: total_bytes,
            matmuls: Mutex::default(),
            prefetches: Mutex::default(),
            host: Arc::default(),
        }
    }

    /// Matmuls run so far, by weight name.
    pub fn matmul_counts(&self) -> HashMap<String, usize> {
        self.matmuls.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Streamed-weight copies made so far, by weight name.
    pub fn prefetch_counts(&self) -> HashMap<String, usize> {
        self.prefetches
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }
}

impl Backend for TestDevice {
    fn id(&self) -> u64 {
        self.inner.id()
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Gpu
    }
    fn describe(&self) -> String {
        "test device (CPU-backed)".into()
    }
    fn device_name(&self) -> String {
        "oato test device".into()
    }
    fn memory(&self) -> Result<MemInfo> {
        let used = self.inner.usage().total();
        Ok(MemInfo {
            free: self.total.saturating_sub(used),
            total: self.total,
        })
    }
    fn usage(&self) -> Usage {
        self.inner.usage()
    }
    fn alloc(&self, dtype: DType, len: usize, cat: Category) -> Result<Tensor> {
        self.inner.alloc(dtype, len, cat)
    }
    fn upload_weight(
        &self,
        name: &str,
        ty: GgmlType,
        k: usize,
        n: usize,
        bytes: &[u8],
    ) -> Result<Weight> {
        self.inner.upload_weight(name, ty, k, n, bytes)
    }
    fn prefetch_weight(&self, file: &Arc<GgufFile>, w: &WeightRef) -> Result<Weight> {
        if let Ok(mut m) = self.prefetches.lock() {
            *m.entry(w.name.clone()).or_default() += 1;
        }
        self.load_weight(file, w)
    }
    fn write(&self, dst: &mut Tensor, at: usize, src: &[f32]) -> Result<()> {
        self.host.check(false)?;
        if self.host.ranges.holds(src.as_ptr().cast(), src.len() * 4)
            && let Ok(mut lent) = self.host.lent.lock()
        {
            lent.push((src.as_ptr() as usize, src.to_vec()));
        }
        self.inner.write(dst, at, src)
    }
    fn host_memory(&self) -> Option<Arc<dyn HostMemory>> {
        Some(self.host.clone())
    }
    fn host_reads_done(&self) -> Result<()> {
        self.host.check(true)
    }
    /// A plain host copy stands in for the pinned-memory copy of a real device.
    fn pinned_copy_gbps(&self, bytes: usize) -> Result<Option<(f64, f64)>> {
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        let t0 = std::time::Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        let g = bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9) / 1e9;
        Ok(Some((g, g)))
    }
    fn read(&self, src: &Tensor, at: usize, dst: &mut [f32]) -> Result<()> {
        // Like a GPU's, a read is ordered after the writes before it: they have run.
        self.host.check(true)?;
        self.inner.read(src, at, dst)
    }
    fn matmul(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
    ) -> Result<()> {
        self.host.check(false)?;
        if let Ok(mut m) = self.matmuls.lock() {
            for w in ws {
                *m.entry(w.name.clone()).or_default() += 1;
            }
        }
        self.inner.matmul(ws, x, n_tok, ys)
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
        self.inner.rms_norm(x, row0, n_rows, x_stride, w, eps, y)
    }
    fn add_bias(&self, x: &mut Tensor, b: &Tensor, n_tok: usize) -> Result<()> {
        self.inner.add_bias(x, b, n_tok)
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
        self.inner
            .rope(x, n_tok, n_heads, head_dim, pos0, p, freq_factors)
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
        self.inner.attention(call, q, k, v, cache_k, cache_v, out)
    }
    fn swiglu(&self, g: &mut Tensor, u: &Tensor, n_tok: usize, width: usize) -> Result<()> {
        self.inner.swiglu(g, u, n_tok, width)
    }
    fn add(&self, x: &mut Tensor, y: &Tensor, n: usize) -> Result<()> {
        self.inner.add(x, y, n)
    }

    fn scale(&self, x: &mut Tensor, s: f32, n: usize) -> Result<()> {
        self.inner.scale(x, s, n)
    }

    fn copy_cols(&self, src: &Tensor, dst: &mut Tensor, c: ColCopy) -> Result<()> {
        self.inner.copy_cols(src, dst, c)
    }
    fn embed_rows(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()> {
        self.inner.embed_rows(table, ids, out)
    }
    fn synchronize(&self) -> Result<()> {
        self.host.check(true)
    }
    fn stopwatch(&self) -> Result<Box<dyn Stopwatch + '_>> {
        Ok(Box::new(Faster(self.inner.stopwatch()?)))
    }
}

/// How many times faster than its own (the CPU's) work the test device reports its work to
/// the profiler, as a GPU would be.
const TEST_DEVICE_SPEEDUP: f64 = 4.0;

/// The test device's stopwatch: the CPU's wall clock divided by [`TEST_DEVICE_SPEEDUP`]. At
/// its real speed (the CPU's), whether a plan put anything on it hung on noise: on a 2-core CI
/// machine every operator's benefit came out negative (the activations' copies on top of equal
/// times) and the plans placed nothing, while tests need the placements a GPU gets.
struct Faster<'a>(Box<dyn Stopwatch + 'a>);

impl Stopwatch for Faster<'_> {
    fn start(&mut self) -> Result<()> {
        self.0.start()
    }
    fn stop(&mut self) -> Result<f64> {
        Ok(self.0.stop()? / TEST_DEVICE_SPEEDUP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::backend::HostBuf;

    /// Host bytes a `write` took from the device's host memory may change only after
    /// `host_reads_done`; a change before is an error at the device's next call, and freeing
    /// the memory forgets it.
    #[test]
    fn lent_host_memory_must_not_change_before_the_device_has_read_it() {
        let dev = TestDevice::new(1 << 20);
        let mem = dev.host_memory().unwrap();
        let mut t = dev.alloc(DType::F32, 8, Category::Workspace).unwrap();
        let mut h = HostBuf::new(&mem, 8).unwrap();
        assert!(h.iter().all(|&v| v == 0.0));
        h[3] = 1.5;
        dev.write(&mut t, 0, &h).unwrap();
        dev.host_reads_done().unwrap();
        h[3] = 2.5; // after the wait: fine
        dev.write(&mut t, 0, &h).unwrap();
        h[4] = 7.0; // before the wait: the next call says so
        let e = dev.synchronize().unwrap_err().to_string();
        assert!(e.contains("changed before the device had read it"), "{e}");
        // Ordinary memory is copied at once and never lent.
        let dev = TestDevice::new(1 << 20);
        let mut t = dev.alloc(DType::F32, 8, Category::Workspace).unwrap();
        let mut plain = vec![1.0f32; 8];
        dev.write(&mut t, 0, &plain).unwrap();
        plain[0] = 3.0;
        dev.synchronize().unwrap();
        // A read is ordered after the writes before it, as on a GPU's stream: they have run.
        let mut h = HostBuf::new(&dev.host_memory().unwrap(), 8).unwrap();
        dev.write(&mut t, 0, &h).unwrap();
        let mut back = [0f32; 8];
        dev.read(&t, 0, &mut back).unwrap();
        h[0] = 4.0;
        dev.synchronize().unwrap();
    }
}
