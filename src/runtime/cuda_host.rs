//! Host memory of the CUDA backend: page-locked staging buffers, the model's memory map
//! registered with the driver (weights travel by DMA from it), page-locked activation buffers
//! handed to the CPU backend (activations cross by one DMA, no staging copy: DESIGN.md rule 8),
//! and the threaded host copy into and out of staging.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent};

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::runtime::backend::{HostMemory, HostRanges};
use crate::runtime::cuda_backend::drv;

/// Host copies into pinned staging at least this large are split over threads.
const PAR_COPY_BYTES: usize = 256 << 10;
/// Bytes per task of a threaded host copy.
const PAR_COPY_CHUNK: usize = 128 << 10;

/// Page-locked host memory with an event marking the last copy that used it.
pub(crate) struct Pinned {
    ptr: *mut u8,
    len: usize,
    pub(crate) event: CudaEvent,
}

// SAFETY: the buffer is owned by this struct and only used under the backend's mutex.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.event.synchronize();
        // SAFETY: `ptr` came from malloc_host and is freed once.
        unsafe {
            let _ = cudarc::driver::result::free_host(self.ptr.cast());
        }
    }
}

impl Pinned {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        // SAFETY: a fresh page-locked allocation of `len` bytes.
        let ptr = unsafe { cudarc::driver::result::malloc_host(len, 0) }
            .map_err(drv("pinned allocation"))?;
        Ok(Pinned {
            ptr: ptr.cast(),
            len,
            event: ctx.new_event(None).map_err(drv("event"))?,
        })
    }

    /// The buffer, once the copies that used it have finished.
    pub(crate) fn slice(&mut self) -> Result<&mut [u8]> {
        self.event.synchronize().map_err(drv("event wait"))?;
        // SAFETY: `ptr` holds `len` bytes owned by this struct and no copy is in flight.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

/// Host memory ranges registered with the driver (the model's memory map), so weights are copied
/// from them by DMA with no staging copy (DESIGN.md rule 8). Each keeps its file alive; dropped
/// after the device has finished every copy.
pub(crate) struct HostRegistrations {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) files: Vec<(Arc<GgufFile>, bool)>,
}

impl HostRegistrations {
    /// Whether `file`'s mapping is registered, trying once per file
    /// (`OATO_CUDA_REGISTER=0` turns registration off, for tests of the staged path).
    pub(crate) fn ensure(&mut self, file: &Arc<GgufFile>) -> bool {
        if let Some((_, ok)) = self.files.iter().find(|(f, _)| Arc::ptr_eq(f, file)) {
            return *ok;
        }
        let bytes = file.bytes();
        let off = std::env::var("OATO_CUDA_REGISTER").is_ok_and(|v| v == "0");
        let ok = !off
            && !bytes.is_empty()
            // SAFETY: the range is the file's live read-only mapping, kept alive by the Arc
            // stored next to it until it is unregistered in `drop`.
            && unsafe {
                cudarc::driver::sys::cuMemHostRegister_v2(
                    bytes.as_ptr() as *mut c_void,
                    bytes.len(),
                    cudarc::driver::sys::CU_MEMHOSTREGISTER_READ_ONLY,
                )
            } == cudarc::driver::sys::CUresult::CUDA_SUCCESS;
        self.files.push((file.clone(), ok));
        ok
    }
}

impl Drop for HostRegistrations {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        for (f, ok) in &self.files {
            if *ok {
                // SAFETY: registered in `ensure`, unregistered once, after the device is idle.
                unsafe {
                    cudarc::driver::sys::cuMemHostUnregister(f.bytes().as_ptr() as *mut c_void);
                }
            }
        }
    }
}

/// `dst.copy_from_slice(src)`, over the CPU pool's threads when it is large (pageable memory to
/// or from pinned staging: one core copies well below the link's speed). The pool's workers are
/// awake between a forward call's operators, so this costs no thread start.
pub(crate) fn par_copy(dst: &mut [u8], src: &[u8]) {
    if src.len() < PAR_COPY_BYTES {
        dst.copy_from_slice(src);
        return;
    }
    struct Out(*mut u8);
    // SAFETY: the chunks below write disjoint ranges of `dst`, which outlives the loop.
    unsafe impl Sync for Out {}
    let out = Out(dst.as_mut_ptr());
    let n = src.len().min(dst.len());
    crate::kernels::cpu::pool::global().for_chunks(n, PAR_COPY_CHUNK, |r| {
        let out = &out;
        // SAFETY: `r` lies inside both slices and no other chunk writes it.
        unsafe {
            std::ptr::copy_nonoverlapping(src[r.clone()].as_ptr(), out.0.add(r.start), r.len())
        };
    });
}

/// Page-locked host memory for the CPU backend's activation buffers
/// ([`crate::runtime::cpu_backend::CpuBackend::use_host_memory`]), with the ranges it handed out,
/// so the CUDA backend copies between them and the device directly.
pub(crate) struct PageLocked {
    ctx: Arc<CudaContext>,
    pub(crate) ranges: HostRanges,
}

impl PageLocked {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        PageLocked {
            ctx,
            ranges: HostRanges::default(),
        }
    }
}

impl HostMemory for PageLocked {
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>> {
        self.ctx.bind_to_thread().ok()?;
        // SAFETY: a fresh page-locked allocation of `bytes` bytes.
        let p = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }.ok()?;
        let p = NonNull::new(p.cast::<u8>())?;
        self.ranges.insert(p, bytes);
        Some(p)
    }

    unsafe fn free(&self, ptr: NonNull<u8>, _bytes: usize) {
        self.ranges.remove(ptr);
        let _ = self.ctx.bind_to_thread();
        // The device may still be reading it (a `write` returns before its DMA has run).
        let _ = self.ctx.synchronize();
        // SAFETY: from `malloc_host` in `alloc`, freed once (the caller's contract), after the
        // device has finished with it.
        let _ = unsafe { cudarc::driver::result::free_host(ptr.as_ptr().cast()) };
    }
}
