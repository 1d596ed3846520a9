//! The CPU backend: the SIMD kernels of `kernels::cpu` behind the Backend trait. Weights are a
//! view of the GGUF file's map, or copies in the backend's arena (interleaved Q4_0 and Q4_K, or as the
//! file asks); tensors are host vectors.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use half::f16;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::cpu::attention::attention;
use crate::kernels::cpu::matmul::{Layout, MatRef, QuantizedActs, matmul, matmul_quantized_many};
use crate::kernels::cpu::{isa, ops, pool, repack};
use crate::model::{RopeParams, WeightRef};
use crate::quant::{GgmlType, dequantize_row};
use crate::runtime::backend::{
    AttnCall, Backend, Category, ColCopy, DType, DeviceKind, HostBuf, HostMemory, Ledger, MemInfo,
    Reservation, Stopwatch, Tensor, Usage, Weight, check_tensor, check_weight_bytes,
    next_backend_id, shared_k, storage, storage_mut, weight_storage,
};

/// Elementwise operators split their work in pieces of this many elements.
const ELEMENT_CHUNK: usize = 1024;

/// A host tensor's elements.
pub(crate) enum HostVec {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// f32 elements in a device's page-locked memory (an activation buffer that crosses the link).
    Pinned(HostBuf),
}

impl HostVec {
    /// The f32 elements, wherever they live; `None` for f16.
    fn f32s(&self) -> Option<&[f32]> {
        match self {
            HostVec::F32(v) => Some(v),
            HostVec::Pinned(v) => Some(v),
            HostVec::F16(_) => None,
        }
    }

    fn f32s_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            HostVec::F32(v) => Some(v),
            HostVec::Pinned(v) => Some(v),
            HostVec::F16(_) => None,
        }
    }
}

struct CpuTensor {
    v: HostVec,
    _res: Reservation,
}

/// A weight: a byte range of the memory-mapped file, or its own copy.
enum CpuWeight {
    Mapped {
        file: Arc<GgufFile>,
        start: usize,
        len: usize,
    },
    Owned {
        bytes: Vec<u8>,
        _res: Reservation,
    },
    /// A copy in the backend's arena, in the file's layout or (Q4_0, Q4_K for the AVX-512 kernels)
    /// interleaved by sixteen rows.
    Copied {
        piece: repack::Piece,
        layout: Layout,
        _res: Reservation,
    },
}

impl CpuWeight {
    fn bytes(&self) -> &[u8] {
        match self {
            CpuWeight::Mapped { file, start, len } => &file.bytes()[*start..*start + *len],
            CpuWeight::Owned { bytes, .. } => bytes,
            CpuWeight::Copied { piece, .. } => piece.bytes(),
        }
    }

    fn layout(&self) -> Layout {
        match self {
            CpuWeight::Copied { layout, .. } => *layout,
            _ => Layout::Rows,
        }
    }
}

pub struct CpuBackend {
    id: u64,
    ledger: Arc<Ledger>,
    /// Memory of the weights it copies (interleaved, or as the file has them).
    arena: repack::Arena,
    /// Whether memory ran short for an interleaved copy (said once).
    short: std::sync::atomic::AtomicBool,
    /// Where f32 workspace tensors (activations) come from when a device gave its page-locked
    /// memory ([`CpuBackend::use_host_memory`]).
    host_memory: OnceLock<Arc<dyn HostMemory>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend {
            id: next_backend_id(),
            ledger: Arc::default(),
            arena: repack::Arena::default(),
            short: Default::default(),
            host_memory: OnceLock::new(),
        }
    }

    /// Takes the activation buffers (f32 workspace tensors) allocated from now on from `mem`, a
    /// device's page-locked memory, so that copies between them and that device need no staging
    /// (DESIGN.md rule 8). Falls back to ordinary memory where `mem` has none. Set once; `false`
    /// if another memory was set before.
    pub fn use_host_memory(&self, mem: Arc<dyn HostMemory>) -> bool {
        self.host_memory.set(mem).is_ok()
    }

    fn f32s<'a>(&self, t: &'a Tensor, need: usize, what: &str) -> Result<&'a [f32]> {
        check_tensor(t, self.id, need, what)?;
        let v = storage::<CpuTensor>(t, what)?.v.f32s();
        v.map(|v| &v[..need])
            .ok_or_else(|| Error::Msg(format!("{what}: f16 tensor where f32 expected")))
    }

    fn f32s_mut<'a>(&self, t: &'a mut Tensor, need: usize, what: &str) -> Result<&'a mut [f32]> {
        check_tensor(t, self.id, need, what)?;
        let v = storage_mut::<CpuTensor>(t, what)?.v.f32s_mut();
        v.map(|v| &mut v[..need])
            .ok_or_else(|| Error::Msg(format!("{what}: f16 tensor where f32 expected")))
    }

    fn f16s_mut<'a>(&self, t: &'a mut Tensor, what: &str) -> Result<&'a mut Vec<f16>> {
        check_tensor(t, self.id, 0, what)?;
        match &mut storage_mut::<CpuTensor>(t, what)?.v {
            HostVec::F16(v) => Ok(v),
            HostVec::F32(_) | HostVec::Pinned(_) => {
                Err(Error::Msg(format!("{what}: f32 tensor where f16 expected")))
            }
        }
    }

    fn mat<'a>(&self, w: &'a Weight) -> Result<MatRef<'a>> {
        let s = weight_storage::<CpuWeight>(w, self.id)?;
        Ok(MatRef {
            ty: w.ty,
            k: w.k,
            n: w.n,
            data: s.bytes(),
            layout: s.layout(),
        })
    }
}

/// Memory left available after an interleaved copy (below it, weights stay views of the map).
const COPY_HEADROOM: usize = 1 << 30;

/// Whether a copy of `bytes` leaves [`COPY_HEADROOM`] of `free` bytes (0: unknown, so yes).
fn leaves_headroom(free: usize, bytes: usize) -> bool {
    free == 0 || free >= bytes.saturating_add(COPY_HEADROOM)
}

impl CpuBackend {
    /// Whether a copy of `bytes` leaves [`COPY_HEADROOM`] of the host's memory available: a model
    /// larger than the memory still runs from its map (in the file's layout), as before there
    /// were copies; says so once.
    fn copy_fits(&self, bytes: usize) -> bool {
        let free = MemInfo::host().free;
        let fits = leaves_headroom(free, bytes);
        if !fits && !self.short.swap(true, std::sync::atomic::Ordering::Relaxed) {
            eprintln!(
                "oato: {} MiB of memory available: further Q4_0 / Q4_K weights are read from the \
                 map in the file's layout, not interleaved (slower CPU matmuls)",
                free >> 20
            );
        }
        fits
    }

    /// The backend's weight `w` held as `data`.
    fn weight(&self, w: &WeightRef, data: CpuWeight) -> Weight {
        Weight {
            name: w.name.clone(),
            ty: w.ty,
            k: w.k,
            n: w.n,
            bytes: w.n_bytes,
            device: self.id,
            data: Box::new(data),
        }
    }
}

struct WallClock(Option<Instant>);

impl Stopwatch for WallClock {
    fn start(&mut self) -> Result<()> {
        self.0 = Some(Instant::now());
        Ok(())
    }
    fn stop(&mut self) -> Result<f64> {
        let t = self
            .0
            .ok_or_else(|| Error::Msg("stopwatch stopped before it was started".into()))?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    }
}

impl Backend for CpuBackend {
    fn id(&self) -> u64 {
        self.id
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn describe(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            isa().name(),
            pool::global().n_threads()
        )
    }

    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn memory(&self) -> Result<MemInfo> {
        Ok(MemInfo::host())
    }

    fn usage(&self) -> Usage {
        self.ledger.usage()
    }

    fn alloc(&self, dtype: DType, len: usize, cat: Category) -> Result<Tensor> {
        let pinned = match (dtype, cat, self.host_memory.get()) {
            (DType::F32, Category::Workspace, Some(mem)) => HostBuf::new(mem, len),
            _ => None,
        };
        let v = match (dtype, pinned) {
            (_, Some(b)) => HostVec::Pinned(b),
            (DType::F32, None) => HostVec::F32(vec![0.0; len]),
            (DType::F16, None) => HostVec::F16(vec![f16::ZERO; len]),
        };
        Ok(Tensor {
            device: self.id,
            dtype,
            len,
            data: Box::new(CpuTensor {
                v,
                _res: self.ledger.reserve(cat, len * dtype.size()),
            }),
        })
    }

    fn load_weight(&self, file: &Arc<GgufFile>, w: &WeightRef) -> Result<Weight> {
        w.bytes(file)?; // in range
        let start = file.data_offset as usize + w.offset;
        Ok(self.weight(
            w,
            CpuWeight::Mapped {
                file: file.clone(),
                start,
                len: w.n_bytes,
            },
        ))
    }

    /// Q4_0 and Q4_K weights that `repack` handles are kept interleaved by sixteen rows, in a
    /// copy (the output head not where `repack::head_keeps_rows` says its one-token kernel reads
    /// the file's layout faster); the others are copied as they are where the file asks for it
    /// (`GgufFile::host_copies`), else stay a view of the map. Copies sit in the backend's
    /// arena, in huge pages where the kernel gives them: a weight read then crosses a page (and
    /// a TLB entry) every 2 MiB, not 4 KiB.
    fn load_matmul_weight(&self, file: &Arc<GgufFile>, w: &WeightRef) -> Result<Weight> {
        let threads = pool::global().n_threads();
        // The head: `output.weight`, or the tied embeddings, which reach here only as the head.
        let head = matches!(w.name.as_str(), "output.weight" | "token_embd.weight");
        let interleave = repack::repacks(w.ty, w.k, w.n)
            && !(head && repack::head_keeps_rows(w.ty))
            && self.copy_fits(w.n_bytes);
        let (piece, layout) = if interleave {
            let p = repack::pack(w.ty, w.bytes(file)?, w.k, w.n, threads, &self.arena)?;
            (p, Layout::Interleaved)
        } else if file.host_copies() {
            (self.arena.copy(w.bytes(file)?, threads)?, Layout::Rows)
        } else {
            return self.load_weight(file, w);
        };
        let _res = self.ledger.reserve(Category::Weights, w.n_bytes);
        Ok(self.weight(
            w,
            CpuWeight::Copied {
                piece,
                layout,
                _res,
            },
        ))
    }

    fn upload_weight(
        &self,
        name: &str,
        ty: GgmlType,
        k: usize,
        n: usize,
        bytes: &[u8],
    ) -> Result<Weight> {
        check_weight_bytes(name, ty, k, n, bytes)?;
        Ok(Weight {
            name: name.to_string(),
            ty,
            k,
            n,
            bytes: bytes.len(),
            device: self.id,
            data: Box::new(CpuWeight::Owned {
                bytes: bytes.to_vec(),
                _res: self.ledger.reserve(Category::Weights, bytes.len()),
            }),
        })
    }

    fn write(&self, dst: &mut Tensor, at: usize, src: &[f32]) -> Result<()> {
        let d = self.f32s_mut(dst, at + src.len(), "write")?;
        d[at..].copy_from_slice(src);
        Ok(())
    }

    fn read(&self, src: &Tensor, at: usize, dst: &mut [f32]) -> Result<()> {
        let s = self.f32s(src, at + dst.len(), "read")?;
        dst.copy_from_slice(&s[at..]);
        Ok(())
    }

    fn host_f32<'a>(&self, t: &'a Tensor) -> Option<&'a [f32]> {
        if t.device != self.id {
            return None;
        }
        t.data.downcast_ref::<CpuTensor>()?.v.f32s()
    }

    fn host_f32_mut<'a>(&self, t: &'a mut Tensor) -> Option<&'a mut [f32]> {
        if t.device != self.id {
            return None;
        }
        t.data.downcast_mut::<CpuTensor>()?.v.f32s_mut()
    }

    fn matmul(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
    ) -> Result<()> {
        let k = shared_k(ws, ys.len())?;
        let x = self.f32s(x, n_tok * k, "matmul input")?;
        // The input is quantised once for every matrix whose type takes that format; the
        // others run on their own.
        let acts = QuantizedActs::new(ws[0].ty, x, k)?;
        let mut same = Vec::with_capacity(ws.len());
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            let m = self.mat(w)?;
            let y = self.f32s_mut(y, n_tok * w.n, "matmul output")?;
            if w.ty.vec_dot_type() == acts.ty {
                same.push((m, y));
            } else {
                matmul(&m, x, y)?;
            }
        }
        matmul_quantized_many(&mut same, &acts)
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
        let w = self.f32s(w, n, "rms_norm weight")?;
        let x = self.f32s(x, (row0 + n_rows - 1) * x_stride + n, "rms_norm input")?;
        let y = self.f32s_mut(y, n_rows * n, "rms_norm output")?;
        let x = &x[row0 * x_stride..];
        ops::par_rows(y, n, |r0, rows| {
            ops::rms_norm_rows(&x[r0 * x_stride..], x_stride, w, eps, rows)
        });
        Ok(())
    }

    fn add_bias(&self, x: &mut Tensor, b: &Tensor, n_tok: usize) -> Result<()> {
        let b = self.f32s(b, b.len, "bias")?;
        let x = self.f32s_mut(x, n_tok * b.len(), "add_bias")?;
        ops::par_rows(x, b.len(), |_, rows| ops::add_bias(rows, b));
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
            Some(t) => Some(self.f32s(t, p.n_dims / 2, "rope_freqs")?),
            None => None,
        };
        let x = self.f32s_mut(x, n_tok * n_heads * head_dim, "rope")?;
        let width = n_heads * head_dim;
        ops::par_rows(x, width, |t0, rows| {
            ops::rope(rows, n_heads, head_dim, pos0 + t0, p, ff)
        });
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
        let (qd, kvd) = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
        let n = call.n_tok;
        let end = (call.pos0 + n) * kvd;
        for (src, cache, what) in [(k, &mut *cache_k, "k cache"), (v, &mut *cache_v, "v cache")] {
            let src = self.f32s(src, n * kvd, what)?;
            let c = self.f16s_mut(cache, what)?;
            if c.len() < end {
                return Err(Error::Msg(format!(
                    "context full: {} tokens do not fit in a context of {}",
                    call.pos0 + n,
                    c.len() / kvd
                )));
            }
            for (d, s) in c[call.pos0 * kvd..end].iter_mut().zip(src) {
                *d = f16::from_f32(*s);
            }
        }
        let q = self.f32s(q, n * qd, "attention query")?;
        let kc = self.f16s_mut(cache_k, "k cache")?;
        let kc: &[f16] = kc;
        // The two caches are distinct tensors, so these borrows do not overlap.
        let vc: &[f16] = match &storage::<CpuTensor>(cache_v, "v cache")?.v {
            HostVec::F16(v) => v,
            HostVec::F32(_) | HostVec::Pinned(_) => {
                return Err(Error::Msg("v cache: f32 tensor".into()));
            }
        };
        let out = self.f32s_mut(out, n * qd, "attention output")?;
        attention(s, q, kc, vc, call.pos0, out);
        Ok(())
    }

    fn swiglu(&self, g: &mut Tensor, u: &Tensor, n_tok: usize, width: usize) -> Result<()> {
        let n = n_tok * width;
        let u = self.f32s(u, n, "swiglu up")?;
        let g = self.f32s_mut(g, n, "swiglu gate")?;
        ops::par_rows(g, ELEMENT_CHUNK, |r0, rows| {
            ops::swiglu_inplace(rows, &u[r0 * ELEMENT_CHUNK..][..rows.len()])
        });
        Ok(())
    }

    fn add(&self, x: &mut Tensor, y: &Tensor, n: usize) -> Result<()> {
        let y = self.f32s(y, n, "add")?;
        let x = self.f32s_mut(x, n, "add")?;
        ops::par_rows(x, ELEMENT_CHUNK, |r0, rows| {
            ops::add_inplace(rows, &y[r0 * ELEMENT_CHUNK..][..rows.len()])
        });
        Ok(())
    }

    fn scale(&self, x: &mut Tensor, s: f32, n: usize) -> Result<()> {
        let x = self.f32s_mut(x, n, "scale")?;
        ops::par_rows(x, ELEMENT_CHUNK, |_, rows| ops::scale_inplace(rows, s));
        Ok(())
    }

    fn copy_cols(&self, src: &Tensor, dst: &mut Tensor, c: ColCopy) -> Result<()> {
        let (ns, nd) = c.extents()?;
        let src = self.f32s(src, ns, "copy_cols source")?;
        let dst = self.f32s_mut(dst, nd, "copy_cols destination")?;
        c.run(src, dst);
        Ok(())
    }

    fn embed_rows(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()> {
        let s = weight_storage::<CpuWeight>(table, self.id)?;
        let data = s.bytes();
        let (k, rb) = (table.k, table.bytes / table.n);
        let mut plain = Vec::new();
        let out = self.f32s_mut(out, ids.len() * k, "embedding output")?;
        for (row, &id) in out.chunks_mut(k).zip(ids) {
            if id as usize >= table.n {
                return Err(Error::Model(format!(
                    "token id {id} is outside the vocabulary ({})",
                    table.n
                )));
            }
            let bytes = if s.layout() == Layout::Interleaved {
                plain.resize(rb, 0);
                repack::plain_row(table.ty, data, k, id as usize, &mut plain);
                &plain[..]
            } else {
                &data[id as usize * rb..][..rb]
            };
            dequantize_row(table.ty, bytes, row)?;
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn stopwatch(&self) -> Result<Box<dyn Stopwatch + '_>> {
        Ok(Box::new(WallClock(None)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An interleaved copy is made only while it leaves 1 GiB available (or when the memory
    /// available is unknown).
    #[test]
    fn copies_leave_headroom() {
        let gib = 1usize << 30;
        assert!(leaves_headroom(3 * gib, 2 * gib));
        assert!(!leaves_headroom(3 * gib, 2 * gib + 1));
        assert!(!leaves_headroom(gib, 1));
        assert!(leaves_headroom(0, usize::MAX));
        assert!(!leaves_headroom(gib, usize::MAX));
    }
}
