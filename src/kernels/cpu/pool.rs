//! One persistent thread pool for the CPU kernels. A decode step is hundreds of small back-to-back
//! operators, so workers spin briefly between jobs (waking sleeping threads would dominate), then
//! yield, then park. A hybrid forward pass holds [`Pool::stay_awake`]: its CPU jobs come between
//! waits for the GPU, longer than the spin, and a parked worker costs the next job its wake-up.
//!
//! Work is handed out in chunks from an atomic counter, and the calling thread works too. A job is
//! open until the caller has run out of chunks; a worker that arrives after that does not join,
//! so a worker the OS has descheduled (a busy machine) never holds the caller up beyond the chunk
//! it is already running.

use std::cell::Cell;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::{self, JoinHandle, Thread};

/// The chunk loop of the current job, run by every thread that joins it.
type Job<'a> = dyn Fn() + Sync + 'a;

/// `state` packs the job generation (high 32 bits), a closed flag, and the number of workers
/// inside the job (low 31 bits).
const CLOSED: u64 = 1 << 31;
const ACTIVE: u64 = CLOSED - 1;

fn generation(state: u64) -> u64 {
    state >> 32
}

struct Shared {
    state: AtomicU64,
    /// A thin pointer to the current `&Job` on the caller's stack; valid while the job's
    /// generation is current and either open or has active workers.
    job: AtomicPtr<()>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Live [`Awake`] guards: while any, idle workers go on yielding, never park.
    awake: AtomicUsize,
    sleeping: Vec<AtomicBool>,
    threads: Mutex<Vec<Thread>>,
}

pub struct Pool {
    shared: Arc<Shared>,
    n_threads: usize,
    handles: Vec<JoinHandle<()>>,
    /// Serialises jobs submitted from different threads.
    lock: Mutex<()>,
}

thread_local! {
    /// Set while this thread runs a pool job: nested jobs then run inline.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// Spins before yielding, and yields before parking.
const SPINS: usize = 1 << 14;
const YIELDS: usize = 1 << 10;

impl Pool {
    pub fn new(n_threads: usize) -> Pool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(CLOSED),
            job: AtomicPtr::new(std::ptr::null_mut()),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            awake: AtomicUsize::new(0),
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
        Pool {
            shared,
            n_threads,
            handles,
            lock: Mutex::new(()),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Keeps the workers from parking while the guard lives (past their spin they go on
    /// yielding, so a job finds them running), and wakes any parked now, so they are up before the first
    /// job. For a caller whose jobs come between waits longer than the spin: a hybrid forward
    /// pass, whose CPU jobs sit between the GPU's parts of a layer. Measured on a 2-core VM
    /// (`examples/job_gap`, Q4_0 4096 x 14336 decode, 2 threads; `results/cpu-pool-awake.md`):
    /// after a wait of 0.5-20 ms a job took 30-100 us longer (median) free to park than kept
    /// awake, a parked worker's wake-up.
    pub fn stay_awake(&self) -> Awake {
        let s = &*self.shared;
        s.awake.fetch_add(1, Ordering::SeqCst);
        s.unpark_sleepers();
        Awake {
            shared: self.shared.clone(),
        }
    }

    /// Splits `0..n` into chunks of `chunk` and runs `f(range)` for each, spread over the pool.
    pub fn for_chunks(&self, n: usize, chunk: usize, f: impl Fn(Range<usize>) + Sync) {
        let chunk = chunk.max(1);
        let n_chunks = n.div_ceil(chunk);
        if n_chunks <= 1 || self.n_threads == 1 || IN_JOB.with(|j| j.get()) {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        let next = AtomicUsize::new(0);
        let body = || {
            loop {
                let c = next.fetch_add(1, Ordering::Relaxed);
                if c >= n_chunks {
                    break;
                }
                f(c * chunk..((c + 1) * chunk).min(n));
            }
        };
        self.run(&body);
    }

    fn run(&self, body: &Job<'_>) {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // Workers dereference this pointer only after joining the job (state open, same
        // generation) and before leaving it; this function returns only once the job is closed
        // and no worker is inside, so `body` and `fat` outlive every use.
        let fat: &Job<'_> = body;
        s.job
            .store(&fat as *const &Job<'_> as *mut (), Ordering::Relaxed);
        let g = generation(s.state.load(Ordering::Relaxed)) + 1;
        s.state.store(g << 32, Ordering::Release);
        s.unpark_sleepers();
        IN_JOB.with(|j| j.set(true));
        let mine = catch_unwind(AssertUnwindSafe(body));
        IN_JOB.with(|j| j.set(false));
        // Close the job: late workers stay out; wait for those inside.
        let mut state = s.state.fetch_or(CLOSED, Ordering::AcqRel) | CLOSED;
        let mut spins = 0usize;
        while state & ACTIVE != 0 {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
            state = s.state.load(Ordering::Acquire);
        }
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU pool worker panicked");
        }
    }
}

impl Shared {
    /// Unparks every worker that announced it sleeps (after a new job or guard is published: a
    /// worker announces, then re-checks both, so none sleeps through either).
    fn unpark_sleepers(&self) {
        for (i, t) in self.threads.lock().unwrap().iter().enumerate() {
            if self.sleeping[i + 1].load(Ordering::SeqCst) {
                t.unpark();
            }
        }
    }
}

/// Keeps a pool's workers awake while it lives ([`Pool::stay_awake`]).
pub struct Awake {
    shared: Arc<Shared>,
}

impl Drop for Awake {
    fn drop(&mut self) {
        self.shared.awake.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Joins the job of generation `g` if it is still open.
fn try_join(s: &Shared, g: u64) -> bool {
    let mut cur = s.state.load(Ordering::Acquire);
    loop {
        if generation(cur) != g || cur & CLOSED != 0 {
            return false;
        }
        match s
            .state
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

fn worker(s: Arc<Shared>, idx: usize) {
    let mut seen = 0u64;
    loop {
        let mut waited = 0usize;
        let g = loop {
            let g = generation(s.state.load(Ordering::Acquire));
            if g != seen {
                break g;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            waited += 1;
            if waited < SPINS {
                std::hint::spin_loop();
            } else if waited < SPINS + YIELDS {
                thread::yield_now();
            } else if s.awake.load(Ordering::Relaxed) > 0 {
                // Kept awake: go on yielding rather than park (a yield answers a job within a
                // microsecond or so, and leaves the core to any other thread that wants it).
                waited = SPINS;
            } else {
                s.sleeping[idx].store(true, Ordering::SeqCst);
                // Re-check after announcing sleep: a job published (or a guard taken) meanwhile
                // unparks us, and an unpark before this park makes it return at once.
                if generation(s.state.load(Ordering::Acquire)) == seen
                    && !s.shutdown.load(Ordering::Acquire)
                    && s.awake.load(Ordering::SeqCst) == 0
                {
                    thread::park();
                }
                s.sleeping[idx].store(false, Ordering::Release);
                waited = 0;
            }
        };
        seen = g;
        if !try_join(&s, g) {
            continue;
        }
        let job = s.job.load(Ordering::Relaxed) as *const &Job<'_>;
        IN_JOB.with(|j| j.set(true));
        // SAFETY: we joined generation g while it was open, so its caller is still inside `run`
        // and keeps the job alive until we leave (the decrement below).
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)() }));
        IN_JOB.with(|j| j.set(false));
        if r.is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.state.fetch_sub(1, Ordering::Release);
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
    g.get_or_insert_with(|| Arc::new(Pool::new(default_threads())))
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count_once(pool: &Pool, n: usize, chunk: usize) {
        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool.for_chunks(n, chunk, |r| {
            for i in r {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(
            hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
            "n={n} chunk={chunk}"
        );
    }

    #[test]
    fn every_item_is_done_once_across_many_jobs() {
        let pool = Pool::new(3);
        for n in [0usize, 1, 7, 100, 1001] {
            count_once(&pool, n, 16);
        }
        for _ in 0..2000 {
            count_once(&pool, 64, 1);
        }
    }

    #[test]
    fn more_threads_than_cores_still_complete() {
        let pool = Pool::new(16);
        for _ in 0..200 {
            count_once(&pool, 1000, 3);
        }
    }

    #[test]
    fn nested_jobs_run_inline() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        pool.for_chunks(4, 1, |_| {
            pool.for_chunks(10, 1, |r| {
                count.fetch_add(r.len(), Ordering::Relaxed);
            })
        });
        assert_eq!(count.load(Ordering::Relaxed), 40);
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = Pool::new(2);
        std::thread::sleep(std::time::Duration::from_millis(50));
        count_once(&pool, 100, 1);
    }

    fn parked(pool: &Pool) -> usize {
        let s = &pool.shared.sleeping;
        s.iter().filter(|f| f.load(Ordering::SeqCst)).count()
    }

    /// A guard wakes parked workers, and while it lives none parks again however long the pool
    /// waits for a job; jobs run as ever, with it and after it.
    #[test]
    fn a_guard_keeps_the_workers_awake() {
        let pool = Pool::new(3);
        // Parked once spin and yields are over (on a busy machine the yields take longer).
        let t0 = std::time::Instant::now();
        while parked(&pool) < 2 && t0.elapsed() < std::time::Duration::from_secs(20) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let guard = pool.stay_awake();
        let t0 = std::time::Instant::now();
        while parked(&pool) > 0 {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(20),
                "a guard did not wake the parked workers"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Far past the spin and the yields: still none parked.
        for _ in 0..40 {
            std::thread::sleep(std::time::Duration::from_millis(1));
            assert_eq!(parked(&pool), 0);
        }
        count_once(&pool, 100, 1);
        let second = pool.stay_awake();
        drop(guard);
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(parked(&pool), 0, "one guard of two still keeps them up");
        drop(second);
        count_once(&pool, 100, 1);
    }

    #[test]
    fn a_panicking_job_panics_the_caller_not_the_pool() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.for_chunks(8, 1, |r| assert!(r.start != 5))
        }));
        assert!(r.is_err());
        count_once(&pool, 100, 1);
    }
}
