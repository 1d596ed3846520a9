//! One persistent thread pool for the CPU kernels. Workers spin briefly between jobs (a decode step
//! is hundreds of small back-to-back operators, where waking sleeping threads would dominate),
//! then yield, then park. The calling thread takes part in every job, so `n` threads means `n - 1`
//! workers. Work is handed out in chunks from an atomic counter.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::{self, JoinHandle, Thread};

/// A job: called once on every thread with that thread's index.
type Job<'a> = dyn Fn(usize) + Sync + 'a;

struct Shared {
    /// Incremented to publish a job.
    generation: AtomicUsize,
    /// The current job: a thin pointer to a `&Job` on the caller's stack, valid while
    /// `pending > 0`.
    job: AtomicPtr<()>,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleeping: Vec<AtomicBool>,
    threads: Mutex<Vec<Thread>>,
}

pub struct Pool {
    shared: Arc<Shared>,
    n_threads: usize,
    handles: Vec<JoinHandle<()>>,
    /// Serialises `run` calls from different threads.
    lock: Mutex<()>,
}

thread_local! {
    /// Set while this thread runs a pool job: nested `run` calls then run inline.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// Spins before yielding, and yields before parking.
const SPINS: usize = 1 << 14;
const YIELDS: usize = 1 << 10;

impl Pool {
    pub fn new(n_threads: usize) -> Pool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleeping: (0..n_threads).map(|_| AtomicBool::new(false)).collect(),
            threads: Mutex::new(Vec::new()),
        });
        let handles: Vec<_> = (1..n_threads)
            .map(|idx| {
                let s = shared.clone();
                thread::Builder::new()
                    .name(format!("oato-cpu-{idx}"))
                    .spawn(move || worker(s, idx))
                    .expect("spawning a pool thread")
            })
            .collect();
        *shared.threads.lock().unwrap() = handles.iter().map(|h| h.thread().clone()).collect();
        Pool { shared, n_threads, handles, lock: Mutex::new(()) }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(thread_index)` on every thread of the pool and returns when all are done.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.n_threads == 1 || IN_JOB.with(|j| j.get()) {
            for i in 0..self.n_threads {
                f(i);
            }
            return;
        }
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // Workers dereference this pointer only between the generation bump below and their
        // decrement of `pending`; this function does not return (so `f` and `fat` outlive every
        // use) until `pending` is back to 0.
        let fat: &Job<'_> = f;
        s.job.store(&fat as *const &Job<'_> as *mut (), Ordering::Relaxed);
        s.pending.store(self.n_threads - 1, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        for (i, t) in s.threads.lock().unwrap().iter().enumerate() {
            if s.sleeping[i + 1].load(Ordering::Acquire) {
                t.unpark();
            }
        }
        IN_JOB.with(|j| j.set(true));
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        IN_JOB.with(|j| j.set(false));
        let mut spins = 0usize;
        while s.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU pool worker panicked");
        }
    }

    /// Splits `0..n` into chunks of `chunk` and runs `f(range)` for each, spread over the pool.
    pub fn for_chunks(&self, n: usize, chunk: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
        let chunk = chunk.max(1);
        let n_chunks = n.div_ceil(chunk);
        if n_chunks <= 1 || self.n_threads == 1 {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        let next = AtomicUsize::new(0);
        self.run(&|_| {
            loop {
                let c = next.fetch_add(1, Ordering::Relaxed);
                if c >= n_chunks {
                    break;
                }
                f(c * chunk..((c + 1) * chunk).min(n));
            }
        });
    }
}

fn worker(s: Arc<Shared>, idx: usize) {
    let mut seen = 0usize;
    loop {
        let mut waited = 0usize;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            waited += 1;
            if waited < SPINS {
                std::hint::spin_loop();
            } else if waited < SPINS + YIELDS {
                thread::yield_now();
            } else {
                s.sleeping[idx].store(true, Ordering::Release);
                // Re-check after announcing sleep: `run` unparks sleepers after bumping the
                // generation, and an unpark before this park makes it return at once.
                if s.generation.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Acquire) {
                    thread::park();
                }
                s.sleeping[idx].store(false, Ordering::Release);
                waited = 0;
            }
        }
        let job = s.job.load(Ordering::Relaxed) as *const &Job<'_>;
        IN_JOB.with(|j| j.set(true));
        // SAFETY: `run` stored a pointer to a live `&Job` and keeps it alive until `pending`
        // reaches 0, which happens only after this call returns and we decrement below.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(idx) }));
        IN_JOB.with(|j| j.set(false));
        if r.is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        for h in &self.handles {
            h.thread().unpark();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

static GLOBAL: RwLock<Option<Arc<Pool>>> = RwLock::new(None);

fn default_threads() -> usize {
    thread::available_parallelism().map_or(1, |n| n.get())
}

/// Makes the global pool `n_threads` wide (replacing it when its size differs); returns the size.
pub fn set_threads(n_threads: usize) -> usize {
    let n = n_threads.max(1);
    let mut g = GLOBAL.write().unwrap_or_else(|e| e.into_inner());
    if g.as_ref().is_none_or(|p| p.n_threads() != n) {
        *g = Some(Arc::new(Pool::new(n)));
    }
    n
}

/// The global pool: as [`set_threads`] left it, else one thread per core.
pub fn global() -> Arc<Pool> {
    if let Some(p) = GLOBAL.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        return p.clone();
    }
    let mut g = GLOBAL.write().unwrap_or_else(|e| e.into_inner());
    g.get_or_insert_with(|| Arc::new(Pool::new(default_threads()))).clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_is_done_once_across_many_jobs() {
        let pool = Pool::new(3);
        for n in [0usize, 1, 7, 100, 1001] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_chunks(n, 16, |r| {
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
        let seen = Mutex::new(Vec::new());
        pool.run(&|i| seen.lock().unwrap().push(i));
        let mut seen = seen.into_inner().unwrap();
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2]);
    }

    #[test]
    fn nested_runs_complete_inline() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            pool.run(&|_| {
                count.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(count.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = Pool::new(2);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_panicking_job_panics_the_caller_not_the_pool() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(&|i| assert!(i == 0, "worker fails"))));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }
}
