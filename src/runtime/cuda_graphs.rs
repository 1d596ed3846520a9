//! Kernel launches of the CUDA backend, and their replay as CUDA graphs. While a decode-sized
//! batch runs (at most `MMVQ_MAX_TOKENS` tokens), launches are not issued at once but collected
//! into a *segment*; the segment ends at the backend's next stream operation that is not a kernel
//! (a host copy, a cuBLAS call, an allocation or free, an event, a wait for a streamed weight, a
//! synchronisation), where it is issued before that operation, so the stream sees the same work in
//! the same order. A segment whose kernel sequence was issued before runs as one graph launch:
//! the graph is built the second time a sequence is seen (`cuGraphAddKernelNode` in a chain,
//! `cuGraphInstantiate`) and kept; on later segments only the kernel nodes whose arguments or grid
//! changed (the position, the KV store's address, the split-attention grid that grows with the
//! context) are updated (`cuGraphExecKernelNodeSetParams`) before `cuGraphLaunch`. A new placement,
//! or a context crossing into split attention, is a new sequence and builds its own graph. One
//! sequence may recur with different buffers (every layer of a hybrid placement): it keeps up to
//! `GRAPHS_PER_SEQUENCE` graphs and replays the one that needs the fewest updates.
//!
//! `OATO_CUDA_GRAPHS=0` (or `set_graphs(false)`) issues every launch at once, as before.
//!
//! A launch may also be *held* (`hold`) for a fusion with the next one: RoPE of q and k, taken by
//! the attention that follows to run as one kernel with the KV store. Anything else issues it
//! first, so the stream's order never changes.

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUfunction, CUgraph, CUgraphExec, CUgraphNode, CUstream};

use crate::error::{Error, Result};

/// Shorter segments launch their kernels one by one.
const GRAPH_MIN_KERNELS: usize = 4;

/// Launches a segment collects before it is issued as it stands (`OATO_CUDA_GRAPH_SPLIT`, 0 for
/// no limit): the GPU waits while the host records a segment, so a decode step that is one
/// segment (all on the GPU: 9 launches a layer, 272 a step for the 30-layer test model, recorded
/// in 147-176 us on a Zen 5 core through the stand-in driver) would start only when the host has
/// walked the whole model. Cut every 64 launches, the GPU runs each part while the host records
/// the next; the parts recur at the same launches every step, so each replays as a graph of its
/// own. The stream sees the same work in the same order either way. Not yet timed on a GPU.
const GRAPH_SPLIT_DEFAULT: usize = 64;

fn graph_split() -> usize {
    static N: LazyLock<usize> = LazyLock::new(|| {
        crate::kernels::cpu::matmul::env_bytes("OATO_CUDA_GRAPH_SPLIT", GRAPH_SPLIT_DEFAULT)
    });
    *N
}

/// Graphs kept per kernel sequence, and in all.
const GRAPHS_PER_SEQUENCE: usize = 64;
const GRAPHS_MAX: usize = 512;
/// Kernel sequences remembered as seen once (forgotten all at once past this).
const SEEN_MAX: usize = 4096;

/// Whether decode segments run as graphs. On unless `OATO_CUDA_GRAPHS=0` at start-up or
/// `set_graphs(false)`; the values are the same either way, bit for bit.
static GRAPHS: LazyLock<AtomicBool> =
    LazyLock::new(|| AtomicBool::new(crate::kernels::cpu::matmul::env_on("OATO_CUDA_GRAPHS")));

/// Turns graph replay of decode segments on or off for every CUDA backend of the process.
pub fn set_graphs(on: bool) {
    GRAPHS.store(on, Ordering::Relaxed);
}

/// Whether graph replay is on.
pub fn graphs_on() -> bool {
    GRAPHS.load(Ordering::Relaxed)
}

static BUILT: AtomicU64 = AtomicU64::new(0);
static REPLAYS: AtomicU64 = AtomicU64::new(0);
static NODE_UPDATES: AtomicU64 = AtomicU64::new(0);
static PLAIN_SEGMENTS: AtomicU64 = AtomicU64::new(0);

/// Counters over the process (every backend): graphs instantiated, graph launches, kernel nodes
/// updated before a launch, deferred segments issued as plain launches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub built: u64,
    pub launches: u64,
    pub node_updates: u64,
    pub plain_segments: u64,
}

pub fn graph_stats() -> GraphStats {
    GraphStats {
        built: BUILT.load(Ordering::Relaxed),
        launches: REPLAYS.load(Ordering::Relaxed),
        node_updates: NODE_UPDATES.load(Ordering::Relaxed),
        plain_segments: PLAIN_SEGMENTS.load(Ordering::Relaxed),
    }
}

/// A kernel argument as the driver reads it: its bytes at the start of an 8-byte slot.
pub trait KernelArg: Copy {
    fn slot(self) -> [u8; 8];
}

macro_rules! kernel_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for $t {
            fn slot(self) -> [u8; 8] {
                let mut s = [0u8; 8];
                let b = self.to_ne_bytes();
                s[..b.len()].copy_from_slice(&b);
                s
            }
        }
    )*};
}
kernel_arg!(u64, i64, i32, u32, f32);

/// An argument passed on as another launch held it.
impl KernelArg for [u8; 8] {
    fn slot(self) -> [u8; 8] {
        self
    }
}

/// One kernel launch: function, grid, block and argument values (no dynamic shared memory).
#[derive(Clone)]
pub(crate) struct Launch {
    func: usize,
    pub(crate) name: &'static str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    pub(crate) args: Vec<[u8; 8]>,
}

impl Launch {
    pub(crate) fn new(
        func: CUfunction,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[[u8; 8]],
    ) -> Self {
        Launch {
            func: func as usize,
            name,
            grid,
            block,
            args: args.to_vec(),
        }
    }

    fn same(&self, o: &Launch) -> bool {
        self.func == o.func && self.grid == o.grid && self.block == o.block && self.args == o.args
    }

    /// The `void**` the driver reads the arguments through (into `self.args`, which must stay
    /// put while it is used).
    fn ptrs(&self) -> Vec<*mut c_void> {
        self.args
            .iter()
            .map(|a| a.as_ptr() as *mut c_void)
            .collect()
    }

    fn node_params(&self, ptrs: &mut [*mut c_void]) -> sys::CUDA_KERNEL_NODE_PARAMS {
        sys::CUDA_KERNEL_NODE_PARAMS {
            func: self.func as CUfunction,
            gridDimX: self.grid.0,
            gridDimY: self.grid.1,
            gridDimZ: self.grid.2,
            blockDimX: self.block.0,
            blockDimY: self.block.1,
            blockDimZ: self.block.2,
            sharedMemBytes: 0,
            kernelParams: ptrs.as_mut_ptr(),
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        }
    }
}

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    r.result()
        .map_err(|e| Error::Msg(format!("CUDA {what}: {e:?}")))
}

/// An instantiated graph of one segment: its kernel nodes in launch order and the launches they
/// were last set to.
struct Graph {
    graph: usize,
    exec: usize,
    nodes: Vec<usize>,
    last: Vec<Launch>,
}

#[derive(Default)]
struct State {
    /// Held launches (`hold`): issued before any other launch or stream operation, unless the
    /// next launch takes them (`take_held`) to replace them with a fused kernel.
    held: Vec<Launch>,
    pending: Vec<Launch>,
    /// The running batch is decode-sized: launches wait for the end of their segment.
    defer: bool,
    seen: HashSet<Vec<usize>>,
    graphs: HashMap<Vec<usize>, Vec<Graph>>,
    n_graphs: usize,
    /// A graph call failed: plain launches from then on.
    broken: bool,
}

/// The backend's launches on its compute stream, deferred and replayed as described above.
pub(crate) struct Launcher {
    ctx: Arc<CudaContext>,
    stream: usize,
    state: Mutex<State>,
}

// SAFETY: the raw handles (stream, functions, graphs) are plain driver handles usable from any
// thread with the context bound; all mutable state sits behind the mutex.
unsafe impl Send for Launcher {}
unsafe impl Sync for Launcher {}

impl Launcher {
    pub(crate) fn new(ctx: Arc<CudaContext>, stream: CUstream) -> Arc<Self> {
        Arc::new(Launcher {
            ctx,
            stream: stream as usize,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::Msg("CUDA launcher lock poisoned".into()))
    }

    /// The next launches belong to a batch of `n_tok` tokens: deferred when that is decode-sized
    /// and graphs are on, else issued at once (after any deferred ones).
    pub(crate) fn batch(&self, n_tok: usize, decode_max: usize) -> Result<()> {
        let mut st = self.lock()?;
        st.defer = graphs_on() && n_tok <= decode_max;
        if !st.defer {
            // Held launches stay held: they come after the segment, and before the next launch.
            self.flush_locked(&mut st)?;
        }
        Ok(())
    }

    /// As `launch`, but held back: issued before the next launch or stream operation, in order,
    /// unless that launch first takes it with `take_held`.
    ///
    /// # Safety
    /// As `launch`.
    pub(crate) unsafe fn hold(&self, l: Launch) -> Result<()> {
        self.lock()?.held.push(l);
        Ok(())
    }

    /// The held launches, now the caller's: it issues what they would have done itself, or
    /// gives them back to `unhold`.
    pub(crate) fn take_held(&self) -> Result<Vec<Launch>> {
        Ok(std::mem::take(&mut self.lock()?.held))
    }

    /// Issues launches taken by `take_held`, in order, as if never taken.
    pub(crate) fn unhold(&self, mut ls: Vec<Launch>) -> Result<()> {
        let mut st = self.lock()?;
        ls.append(&mut st.held);
        st.held = ls;
        self.release_held(&mut st)
    }

    fn release_held(&self, st: &mut State) -> Result<()> {
        for l in std::mem::take(&mut st.held) {
            self.issue(st, l)?;
        }
        Ok(())
    }

    /// `l` into the segment (deferring), or launched now after the segment.
    fn issue(&self, st: &mut State, l: Launch) -> Result<()> {
        if st.defer && !st.broken {
            st.pending.push(l);
            if st.pending.len() == graph_split() {
                self.flush_locked(st)?;
            }
            return Ok(());
        }
        self.flush_locked(st)?;
        self.launch_now(&l)
    }

    /// Launches `l` now or at the end of the segment.
    ///
    /// # Safety
    /// `l`'s arguments must match the kernel's parameters in number and type, every pointer
    /// among them must be a device allocation of the size the kernel reads that stays live until
    /// the launch has run, and its grid and block must be the launch contract the kernel's source
    /// documents.
    pub(crate) unsafe fn launch(&self, l: Launch) -> Result<()> {
        let mut st = self.lock()?;
        self.release_held(&mut st)?;
        self.issue(&mut st, l)
    }

    /// Issues the deferred launches (before a stream operation that is not a kernel).
    pub(crate) fn flush(&self) -> Result<()> {
        let mut st = self.lock()?;
        if st.pending.is_empty() && st.held.is_empty() {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::Msg(format!("CUDA bind context: {e:?}")))?;
        self.release_held(&mut st)?;
        self.flush_locked(&mut st)
    }

    fn launch_now(&self, l: &Launch) -> Result<()> {
        let mut ptrs = l.ptrs();
        // SAFETY: the launch's contract was promised to `launch`; `ptrs` point into `l.args`,
        // which outlive the call (the driver copies the values).
        let r = unsafe {
            sys::cuLaunchKernel(
                l.func as CUfunction,
                l.grid.0,
                l.grid.1,
                l.grid.2,
                l.block.0,
                l.block.1,
                l.block.2,
                0,
                self.stream as CUstream,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(l.name, r)
    }

    fn flush_locked(&self, st: &mut State) -> Result<()> {
        let pending = std::mem::take(&mut st.pending);
        if pending.is_empty() {
            return Ok(());
        }
        if pending.len() >= GRAPH_MIN_KERNELS && !st.broken {
            match self.replay(st, &pending) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    eprintln!("oato: CUDA graphs off for this device after an error: {e}");
                    st.broken = true;
                }
            }
        }
        PLAIN_SEGMENTS.fetch_add(1, Ordering::Relaxed);
        pending.iter().try_for_each(|l| self.launch_now(l))
    }

    /// Runs `pending` as a graph launch; false when its sequence is new (it is remembered, and
    /// the caller launches it plainly).
    fn replay(&self, st: &mut State, pending: &[Launch]) -> Result<bool> {
        let key: Vec<usize> = pending.iter().map(|l| l.func).collect();
        let State {
            seen,
            graphs,
            n_graphs,
            ..
        } = st;
        let entries = match graphs.get_mut(&key) {
            Some(e) => e,
            None if seen.contains(&key) => graphs.entry(key).or_default(),
            None => {
                if seen.len() >= SEEN_MAX {
                    seen.clear();
                }
                seen.insert(key);
                return Ok(false);
            }
        };
        let diff = |g: &Graph| {
            g.last
                .iter()
                .zip(pending)
                .filter(|(a, b)| !a.same(b))
                .count()
        };
        let best = entries.iter().enumerate().map(|(i, g)| (diff(g), i)).min();
        let room = entries.len() < GRAPHS_PER_SEQUENCE && *n_graphs < GRAPHS_MAX;
        let g = match best {
            Some((d, i)) if !(room && d * 2 > pending.len()) => {
                let g = &mut entries[i];
                for (j, l) in pending.iter().enumerate() {
                    if g.last[j].same(l) {
                        continue;
                    }
                    let mut ptrs = l.ptrs();
                    let p = l.node_params(&mut ptrs);
                    // SAFETY: node j of this exec runs l.func (same sequence); the arguments
                    // are copied by the call and obey `launch`'s contract.
                    let r = unsafe {
                        sys::cuGraphExecKernelNodeSetParams_v2(
                            g.exec as CUgraphExec,
                            g.nodes[j] as CUgraphNode,
                            &p,
                        )
                    };
                    check("graph node update", r)?;
                    g.last[j] = l.clone();
                    NODE_UPDATES.fetch_add(1, Ordering::Relaxed);
                }
                g
            }
            _ => {
                entries.push(self.build(pending)?);
                *n_graphs += 1;
                BUILT.fetch_add(1, Ordering::Relaxed);
                entries
                    .last_mut()
                    .ok_or_else(|| Error::Msg("graph".into()))?
            }
        };
        // SAFETY: a live exec whose nodes hold the arguments of `pending`.
        let r = unsafe { sys::cuGraphLaunch(g.exec as CUgraphExec, self.stream as CUstream) };
        check("graph launch", r)?;
        REPLAYS.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// A graph of `pending`'s kernels, each depending on the one before, instantiated.
    fn build(&self, pending: &[Launch]) -> Result<Graph> {
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: `graph` is valid for writes.
        check("graph create", unsafe { sys::cuGraphCreate(&mut graph, 0) })?;
        let mut g = Graph {
            graph: graph as usize,
            exec: 0,
            nodes: Vec::with_capacity(pending.len()),
            last: pending.to_vec(),
        };
        for l in pending {
            let mut ptrs = l.ptrs();
            let p = l.node_params(&mut ptrs);
            let prev = g.nodes.last().map(|n| *n as CUgraphNode);
            let mut node: CUgraphNode = std::ptr::null_mut();
            // SAFETY: a live graph; `prev` (if any) is a node of it; the arguments are copied.
            let r = unsafe {
                sys::cuGraphAddKernelNode_v2(
                    &mut node,
                    graph,
                    prev.as_ref()
                        .map_or(std::ptr::null(), |p| p as *const CUgraphNode),
                    prev.is_some() as usize,
                    &p,
                )
            };
            if let Err(e) = check("graph kernel node", r) {
                destroy(&g);
                return Err(e);
            }
            g.nodes.push(node as usize);
        }
        let mut exec: CUgraphExec = std::ptr::null_mut();
        // SAFETY: a complete graph; `exec` is valid for writes.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        if let Err(e) = check("graph instantiate", r) {
            destroy(&g);
            return Err(e);
        }
        g.exec = exec as usize;
        Ok(g)
    }
}

fn destroy(g: &Graph) {
    // SAFETY: handles made by `build`, destroyed once, after the device finished with them.
    unsafe {
        if g.exec != 0 {
            sys::cuGraphExecDestroy(g.exec as CUgraphExec);
        }
        sys::cuGraphDestroy(g.graph as CUgraph);
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.flush();
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        if let Ok(st) = self.state.get_mut() {
            st.graphs.values().flatten().for_each(destroy);
        }
    }
}

/// Held first by every tensor and weight of the backend: before its memory is freed, the
/// deferred launches (which may read it) are issued.
pub(crate) struct FlushOnDrop(pub(crate) Arc<Launcher>);

impl Drop for FlushOnDrop {
    fn drop(&mut self) {
        let _ = self.0.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_args_fill_their_slots_from_the_start() {
        assert_eq!(7i32.slot(), [7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!((-1i32).slot(), [0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0]);
        assert_eq!(1.0f32.slot()[..4], 1.0f32.to_ne_bytes());
        assert_eq!(
            0x0102_0304_0506_0708u64.slot(),
            0x0102_0304_0506_0708u64.to_ne_bytes()
        );
        let held = 5u64.slot();
        assert_eq!(held.slot(), held);
    }

    #[test]
    fn launches_differ_in_any_argument_grid_or_block() {
        let f = std::ptr::null_mut();
        let a = Launch::new(f, "k", (1, 1, 1), (128, 1, 1), &[1u64.slot(), 2i32.slot()]);
        assert!(a.same(&a.clone()));
        let b = Launch::new(f, "k", (1, 1, 1), (128, 1, 1), &[1u64.slot(), 3i32.slot()]);
        let c = Launch::new(f, "k", (2, 1, 1), (128, 1, 1), &[1u64.slot(), 2i32.slot()]);
        let d = Launch::new(f, "k", (1, 1, 1), (64, 1, 1), &[1u64.slot(), 2i32.slot()]);
        assert!(!a.same(&b) && !a.same(&c) && !a.same(&d));
    }
}
