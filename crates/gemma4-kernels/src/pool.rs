//! The threads products split their rows over.
//!
//! A decode step runs a hundred or more products, each a few tens of
//! microseconds, with short single-threaded work between them. A pool whose
//! idle workers go to sleep at once pays a wake-up (a futex call and a
//! thread switch) per product; that overhead is what kept a second thread
//! from paying on two cores. Here the caller always takes a share of the
//! work itself, and idle workers spin for a short while before they park,
//! so back-to-back products find them awake. The pool has one worker fewer
//! than its thread count (the caller is the last thread), so spinning never
//! takes a core from the thread that runs the model.
//!
//! A worker that finds itself preempted for a time slice while working
//! (another busy process shares its core) stops spinning for a while: spinning kept it
//! runnable, so three threads shared two cores and the caller's
//! single-threaded work between products ran on two thirds of one; two
//! threads were then no faster than one.
//!
//! An idle worker also reads ahead: between two products the caller runs
//! that short single-threaded work while the memory bus sits idle, so a
//! worker that knows the next product's weights ([`Pool::read_ahead`])
//! pulls their first bytes toward the caches until the product starts.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The chunk index of a job that takes no more claims.
const CLOSED: u32 = u32::MAX;

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(200);

/// How long an idle worker parks at once, without spinning, after it was
/// preempted while working for [`PREEMPTED`] or more: another busy process
/// wants its core. (Shorter preemptions, by this process's own threads or
/// the system's, are routine and say nothing.)
const YIELD_AFTER_PREEMPTION: Duration = Duration::from_millis(50);
const PREEMPTED: Duration = Duration::from_millis(1);

/// Memory runs an idle worker reads ahead, at most.
pub const READ_AHEAD_RUNS: usize = 4;

/// `(address, length)` runs of memory to read ahead. Only runs inside the
/// weight arena's live mappings are read (see [`crate::arena::read_ahead`]),
/// so a run whose memory has since been freed is skipped.
pub type ReadAhead = [(usize, usize); READ_AHEAD_RUNS];

/// One job: `f(i)` for every chunk `i` below its count.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
}

struct Shared {
    /// `epoch << 32 | next chunk`: workers claim chunks of the current
    /// epoch's job by compare-and-swap, so a worker late from an earlier job
    /// can never claim a chunk of a later one.
    state: AtomicU64,
    /// Chunks of the current job.
    count: AtomicUsize,
    /// Chunks finished; the caller returns when it reaches `count`, and
    /// until then the job (on the caller's stack) stays alive.
    done: AtomicUsize,
    job: AtomicPtr<Job<'static>>,
    /// A panic of a chunk run by a worker, re-raised in the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// The runs to read ahead (taken by the first idle worker to see them,
    /// so that one reads them), and a count bumped each time they are set.
    ahead: Mutex<ReadAhead>,
    ahead_serial: AtomicU64,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    park: Mutex<()>,
    wake: Condvar,
}

/// A fixed set of worker threads plus the calling thread.
pub struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    /// One job at a time; a second caller meanwhile runs its chunks itself.
    caller: Mutex<()>,
    /// Jobs a second caller ran alone that way.
    contended: AtomicU64,
}

impl Pool {
    /// A pool of `threads` threads in all (`threads − 1` workers).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            count: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            panic: Mutex::new(None),
            ahead: Mutex::new([(0, 0); READ_AHEAD_RUNS]),
            ahead_serial: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut started = 1;
        for i in 1..threads {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("gemma4-kernel-{i}"))
                .spawn(move || worker(&s));
            if spawned.is_err() {
                // Fewer workers: the caller does their share.
                break;
            }
            started += 1;
        }
        Self {
            shared,
            threads: started,
            caller: Mutex::new(()),
            contended: AtomicU64::new(0),
        }
    }

    /// Threads that work on a job, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Jobs that found the pool busy with another caller's and ran on
    /// their own caller's thread alone.
    pub fn contended_jobs(&self) -> u64 {
        self.contended.load(Ordering::Relaxed)
    }

    /// Runs `f(i)` for every `i` in `0..count`, spread over the pool, and
    /// returns when all have run. A panic in any `f(i)` is re-raised here
    /// once every chunk has finished.
    pub fn run(&self, count: usize, f: &(dyn Fn(usize) + Sync)) {
        if count == 0 {
            return;
        }
        let splits = self.threads > 1 && count > 1 && count < CLOSED as usize;
        let guard = match self.caller.try_lock() {
            Ok(g) if splits => g,
            // Single-threaded, a single chunk, or another job in flight.
            busy => {
                if splits && busy.is_err() {
                    self.contended.fetch_add(1, Ordering::Relaxed);
                }
                drop(busy);
                (0..count).for_each(f);
                return;
            }
        };
        let s = &self.shared;
        // Close the previous job before publishing this one: a worker that
        // read its exhausted state and then this job's larger count must
        // not be able to claim a chunk under the old epoch.
        let previous = s.state.load(Ordering::SeqCst) & !u64::from(CLOSED);
        s.state
            .store(previous | u64::from(CLOSED), Ordering::SeqCst);
        let job = Job { f };
        // SAFETY of the lifetime erasure: workers dereference `job` only
        // after claiming a chunk of this epoch, and this function does not
        // return before every claimed chunk has finished.
        let ptr = (&job as *const Job<'_>).cast::<Job<'static>>().cast_mut();
        s.job.store(ptr, Ordering::SeqCst);
        s.count.store(count, Ordering::SeqCst);
        s.done.store(0, Ordering::SeqCst);
        let epoch = (s.state.load(Ordering::SeqCst) >> 32).wrapping_add(1) & 0xffff_ffff;
        s.state.store(epoch << 32, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        claim_all(s, epoch);
        while s.done.load(Ordering::Acquire) < count {
            std::hint::spin_loop();
        }
        s.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        drop(guard);
        let panic = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
    }

    /// Tells an idle worker what the next job will read first, so that it
    /// pulls those bytes toward the caches while the caller does other
    /// work. The worker stops reading ahead as soon as a job arrives; parked
    /// workers are not woken for it.
    pub fn read_ahead(&self, runs: ReadAhead) {
        if self.threads < 2 {
            return;
        }
        let s = &self.shared;
        *s.ahead.lock().unwrap_or_else(|e| e.into_inner()) = runs;
        s.ahead_serial.fetch_add(1, Ordering::Release);
    }
}

impl Pool {
    /// `f(i)` for every `i` in `0..count`, spread over the pool, the results
    /// in index order.
    pub fn map<T: Send>(&self, count: usize, f: &(dyn Fn(usize) -> T + Sync)) -> Vec<T> {
        let slots: Vec<Mutex<Option<T>>> = (0..count).map(|_| Mutex::new(None)).collect();
        self.run(count, &|i| {
            let value = f(i);
            *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
        });
        slots
            .into_iter()
            .map(|slot| {
                slot.into_inner()
                    .unwrap_or_else(|e| e.into_inner())
                    .expect("`run` calls `f` for every index or re-raises its panic")
            })
            .collect()
    }

    /// `f(i, part)` for the parts of `out`, `chunk` elements each (the last
    /// one shorter), spread over the pool.
    pub fn for_each_chunk<T: Send>(
        &self,
        out: &mut [T],
        chunk: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        self.for_each_part(out.chunks_mut(chunk.max(1)).collect(), f);
    }

    /// `f(i, part)` for the `i`-th of `parts` (disjoint slices of any
    /// lengths), spread over the pool.
    pub fn for_each_part<T: Send>(
        &self,
        parts: Vec<&mut [T]>,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let parts: Vec<Mutex<&mut [T]>> = parts.into_iter().map(Mutex::new).collect();
        self.run(parts.len(), &|i| {
            let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
            f(i, &mut part);
        });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let s = &self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        // A new epoch with no chunks: every worker wakes, finds nothing, exits.
        s.count.store(0, Ordering::SeqCst);
        let epoch = (s.state.load(Ordering::SeqCst) >> 32).wrapping_add(1) & 0xffff_ffff;
        s.state.store(epoch << 32, Ordering::SeqCst);
        let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
        s.wake.notify_all();
    }
}

/// Claims and runs chunks of job `epoch` until none is left.
fn claim_all(s: &Shared, epoch: u64) {
    loop {
        let state = s.state.load(Ordering::SeqCst);
        if state >> 32 != epoch {
            return;
        }
        let i = (state & 0xffff_ffff) as usize;
        if i >= s.count.load(Ordering::SeqCst) {
            return;
        }
        if s.state
            .compare_exchange(state, state + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            continue;
        }
        // SAFETY: chunk `i` of this epoch is claimed and not yet done, so the
        // caller of this epoch is still waiting and its job is alive.
        let job = unsafe { &*s.job.load(Ordering::SeqCst) };
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.f)(i))) {
            s.panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(p);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

/// Reads `runs` toward this core's caches until job `epoch` is over (the
/// next job has been published).
fn read_ahead(s: &Shared, epoch: u64, runs: &ReadAhead) {
    let current = || s.state.load(Ordering::Relaxed) >> 32 == epoch;
    for &(start, len) in runs {
        if len > 0 && !crate::arena::read_ahead(start, len, &current) {
            return;
        }
    }
}

/// CPU time the calling thread has run; `None` where the system does not say.
fn thread_cpu_time() -> Option<Duration> {
    #[cfg(target_os = "linux")]
    {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `clock_gettime` only writes the `timespec` it is given.
        if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0 {
            return Some(Duration::new(
                u64::try_from(t.tv_sec).ok()?,
                u32::try_from(t.tv_nsec).ok()?,
            ));
        }
    }
    None
}

fn worker(s: &Shared) {
    let mut seen = s.state.load(Ordering::SeqCst) >> 32;
    let mut ahead_seen = s.ahead_serial.load(Ordering::Acquire);
    let mut spin_again = Instant::now();
    while !s.shutdown.load(Ordering::SeqCst) {
        let now = Instant::now();
        let spin_until = if now < spin_again { now } else { now + SPIN };
        let mut spins = 0u32;
        loop {
            let epoch = s.state.load(Ordering::SeqCst) >> 32;
            if epoch != seen {
                seen = epoch;
                let (started, cpu) = (Instant::now(), thread_cpu_time());
                claim_all(s, epoch);
                let off_cpu = thread_cpu_time()
                    .zip(cpu)
                    .map(|(after, before)| started.elapsed().saturating_sub(after - before));
                if off_cpu.is_some_and(|t| t >= PREEMPTED) {
                    spin_again = Instant::now() + YIELD_AFTER_PREEMPTION;
                }
                break;
            }
            let serial = s.ahead_serial.load(Ordering::Acquire);
            if serial != ahead_seen {
                ahead_seen = serial;
                let runs = std::mem::take(&mut *s.ahead.lock().unwrap_or_else(|e| e.into_inner()));
                read_ahead(s, epoch, &runs);
                continue;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && Instant::now() >= spin_until {
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                let mut g = s.park.lock().unwrap_or_else(|e| e.into_inner());
                while s.state.load(Ordering::SeqCst) >> 32 == seen {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                drop(g);
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
    }
}

static THREADS: OnceLock<usize> = OnceLock::new();
static GLOBAL: OnceLock<Pool> = OnceLock::new();

/// Sets the number of threads of the pool products use (before its first
/// use; later calls have no effect). Default: one per core.
pub fn set_threads(threads: usize) {
    let _ = THREADS.set(threads.max(1));
}

/// The pool products use.
/// [`Pool::contended_jobs`] of the global pool (0 before it starts).
pub fn contended_jobs() -> u64 {
    GLOBAL.get().map_or(0, Pool::contended_jobs)
}

pub fn global() -> &'static Pool {
    GLOBAL.get_or_init(|| {
        let threads = THREADS.get().copied().unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        Pool::new(threads)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job that finds the pool busy runs on its caller alone, and is counted.
    #[test]
    fn a_second_caller_runs_alone_and_is_counted() {
        let pool = Pool::new(2);
        let (started, release) = (AtomicBool::new(false), AtomicBool::new(false));
        std::thread::scope(|s| {
            s.spawn(|| {
                pool.run(2, &|_| {
                    started.store(true, Ordering::SeqCst);
                    while !release.load(Ordering::SeqCst) {
                        std::thread::yield_now();
                    }
                });
            });
            while !started.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            let caller = std::thread::current().id();
            let on_caller = AtomicUsize::new(0);
            pool.run(4, &|_| {
                if std::thread::current().id() == caller {
                    on_caller.fetch_add(1, Ordering::SeqCst);
                }
            });
            assert_eq!(on_caller.load(Ordering::SeqCst), 4);
            assert_eq!(pool.contended_jobs(), 1);
            release.store(true, Ordering::SeqCst);
        });
        pool.run(4, &|_| {});
        assert_eq!(pool.contended_jobs(), 1, "an idle pool takes the job");
    }

    #[test]
    fn every_chunk_runs_once_across_many_jobs() {
        let pool = Pool::new(3);
        for count in [1usize, 2, 7, 64, 1000] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
                pool.run(count, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    /// Jobs of alternating sizes on more threads than cores, so workers are
    /// preempted mid-claim: one that read a finished small job's state and
    /// then the next, larger job's count once claimed a chunk twice (and let
    /// the caller return before its job was done).
    #[test]
    fn a_late_worker_never_claims_a_chunk_of_the_next_job() {
        let pool = Pool::new(6);
        let mut wrong = 0;
        for job in 0..300_000usize {
            let count = if job % 2 == 0 { 2 } else { 3 + job % 61 };
            let hits: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
            pool.run(count, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            wrong += usize::from(!hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        assert_eq!(wrong, 0, "jobs whose chunks did not run exactly once");
    }

    /// Read-ahead posted between jobs (over weight memory, over memory the
    /// arena does not hold, over a freed region) never disturbs the jobs.
    #[test]
    fn jobs_run_whole_between_read_aheads() {
        let pool = Pool::new(3);
        let piece = crate::arena::alloc_zeroed(3 << 20);
        let freed = crate::arena::alloc_zeroed(100 << 20);
        let freed_at = freed.as_slice().as_ptr() as usize;
        drop(freed);
        let heap = vec![0u8; 1 << 20];
        let mut runs = [(0, 0); READ_AHEAD_RUNS];
        runs[0] = (piece.as_slice().as_ptr() as usize, piece.len());
        runs[1] = (heap.as_ptr() as usize, heap.len());
        runs[2] = (freed_at, 100 << 20);
        for count in [2usize, 9, 64] {
            for _ in 0..200 {
                pool.read_ahead(runs);
                let hits: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
                pool.run(count, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    /// The clock that tells a preempted worker from a working one counts
    /// this thread's CPU time: it advances while the thread computes and
    /// stands still while it sleeps.
    #[cfg(target_os = "linux")]
    #[test]
    fn thread_cpu_time_advances_only_while_the_thread_runs() {
        let start = thread_cpu_time().expect("a thread CPU clock");
        let wall = Instant::now();
        let mut x = 1u64;
        while thread_cpu_time().expect("clock") - start < Duration::from_millis(5) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let ran = thread_cpu_time().expect("clock") - start;
        assert!(
            wall.elapsed() >= ran,
            "a thread cannot run longer than the wall clock"
        );
        let before_sleep = thread_cpu_time().expect("clock");
        std::thread::sleep(Duration::from_millis(50));
        let slept = thread_cpu_time().expect("clock") - before_sleep;
        assert!(
            slept < Duration::from_millis(5),
            "sleeping took {slept:?} of CPU"
        );
    }

    #[test]
    fn jobs_after_a_pause_wake_parked_workers() {
        let pool = Pool::new(2);
        std::thread::sleep(SPIN * 5);
        let sum = AtomicUsize::new(0);
        pool.run(100, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }

    #[test]
    fn a_panicking_chunk_reaches_the_caller_and_the_pool_still_works() {
        let pool = Pool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(16, &|i| assert!(i != 5, "chunk five"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(16, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 16);
    }

    #[test]
    fn concurrent_callers_each_get_their_chunks_run() {
        let pool = Arc::new(Pool::new(2));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        let n = AtomicUsize::new(0);
                        pool.run(9, &|_| {
                            n.fetch_add(1, Ordering::Relaxed);
                        });
                        assert_eq!(n.load(Ordering::Relaxed), 9);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("caller thread");
        }
    }
}
