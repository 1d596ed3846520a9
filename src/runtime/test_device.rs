//! A CPU-backed stand-in for a GPU, for tests of the placement pipeline on machines without one:
//! it has its own buffers (its own backend id, so tensors cannot silently mix with the CPU's),
//! reports itself as a GPU, moves data only through `write`/`read` as a GPU does, counts the
//! matmuls it runs per weight, and reports the memory size it is given.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::{RopeParams, WeightRef};
use crate::quant::GgmlType;
use crate::runtime::backend::{
    AttnCall, Backend, Category, ColCopy, DType, DeviceKind, MemInfo, Stopwatch, Tensor, Usage,
    Weight,
};
use crate::runtime::cpu_backend::CpuBackend;

pub struct TestDevice {
    inner: CpuBackend,
    total: usize,
    /// Matmuls run, by weight name.
    matmuls: Mutex<HashMap<String, usize>>,
    /// Streamed-weight copies made, by weight name.
    prefetches: Mutex<HashMap<String, usize>>,
}

impl TestDevice {
    /// A device with `total_bytes` of memory.
    pub fn new(total_bytes: usize) -> Self {
        TestDevice {
            inner: CpuBackend::new(),
            total: total_bytes,
            matmuls: Mutex::default(),
            prefetches: Mutex::default(),
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
        self.inner.write(dst, at, src)
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
        self.inner.read(src, at, dst)
    }
    fn matmul(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
    ) -> Result<()> {
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
        Ok(())
    }
    fn stopwatch(&self) -> Result<Box<dyn Stopwatch + '_>> {
        self.inner.stopwatch()
    }
}
