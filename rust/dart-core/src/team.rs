//! A fixed team of helper threads for short data-parallel loops in which the calling thread works too.
//!
//! Why not rayon here: in serving, each linear layer's product is a loop of 0.1-1 ms separated from the
//! next by 0.1-0.3 ms of other (torch) work, so rayon's workers have gone to sleep by the next call and
//! waking them cost 150-250 us per call on the 2-core VM measured (more than a one-row product itself).
//! Here the caller starts on the loop at once and the helpers join when they wake, claiming indices
//! from a shared counter, so a late helper costs nothing and an early one shares the work.
//! After a loop, helpers may keep polling (yielding the core) for `SGLANG_DART_GEMM_SPIN_US`
//! microseconds before they park. The default, [`DEFAULT_SPIN_US`], is no polling, which costs no CPU
//! when idle; the SGLang plugin sets 1 ms where torch's own workers sleep through small forwards
//! (`sglang_dart/cpu/small_step_threads.py`; benchmarks/results/throughput.md, runs 15-16).
//!
//! One loop runs at a time; a second caller meanwhile runs its loop alone rather than wait.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, TryLockError};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long helpers poll for the next loop before parking, unless `SGLANG_DART_GEMM_SPIN_US` says
/// otherwise.
pub const DEFAULT_SPIN_US: u64 = 0;
/// Threads of the team (caller included) unless `SGLANG_DART_GEMM_THREADS` says otherwise: the CPU count.
const THREADS_ENV: &str = "SGLANG_DART_GEMM_THREADS";
const SPIN_ENV: &str = "SGLANG_DART_GEMM_SPIN_US";

/// One loop: `body(i)` for each `i` in `0..count`, each index claimed by exactly one thread.
struct Job<'a> {
    body: &'a (dyn Fn(usize) + Sync),
    count: usize,
    next: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    fn work(&self) {
        loop {
            let index = self.next.fetch_add(1, Ordering::Relaxed);
            if index >= self.count {
                return;
            }
            (self.body)(index);
        }
    }
}

struct Team {
    /// The loop being run, or null. Helpers may only dereference it between their increment and
    /// decrement of `busy` (see `for_each_index` for why that keeps it alive).
    job: AtomicPtr<Job<'static>>,
    /// Bumped for every published loop: what helpers wait on.
    epoch: AtomicU64,
    /// Helpers currently between "announce" and "done" for some loop.
    busy: AtomicUsize,
    sleeping: Vec<AtomicBool>,
    handles: OnceLock<Vec<Thread>>,
    caller: Mutex<()>,
    spin: Duration,
    /// The process that started the helpers: a forked child has none of them (and may have inherited
    /// a mid-loop `busy` count), so it runs its loops alone.
    process: u32,
}

fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

fn team() -> &'static Team {
    static TEAM: OnceLock<&'static Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let threads = env_number(THREADS_ENV)
            .map(|n| n.max(1) as usize)
            .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()));
        let helpers = threads - 1;
        // Leaked once per process: the helpers live as long as the process and refer to it.
        let team: &'static Team = Box::leak(Box::new(Team {
            job: AtomicPtr::new(ptr::null_mut()),
            epoch: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            sleeping: (0..helpers).map(|_| AtomicBool::new(false)).collect(),
            handles: OnceLock::new(),
            caller: Mutex::new(()),
            spin: Duration::from_micros(env_number(SPIN_ENV).unwrap_or(DEFAULT_SPIN_US)),
            process: std::process::id(),
        }));
        let handles = (0..helpers)
            .filter_map(|me| {
                thread::Builder::new()
                    .name(format!("dart-gemm-{me}"))
                    .spawn(move || team.serve(me))
                    .ok()
                    .map(|handle| handle.thread().clone())
            })
            .collect();
        let _ = team.handles.set(handles);
        team
    })
}

impl Team {
    fn serve(&self, me: usize) {
        let mut seen = 0u64;
        loop {
            seen = self.wait_for_epoch_after(seen, me);
            self.busy.fetch_add(1, Ordering::SeqCst);
            let job = self.job.load(Ordering::SeqCst);
            if !job.is_null() {
                // SAFETY: `job` was non-null after this thread's `busy` increment (both SeqCst), so the
                // caller that published it has not yet passed its `busy == 0` wait (see
                // `for_each_index`), and its `Job` on the caller's stack is still alive.
                let job = unsafe { &*job };
                if catch_unwind(AssertUnwindSafe(|| job.work())).is_err() {
                    job.panicked.store(true, Ordering::SeqCst);
                }
            }
            self.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn wait_for_epoch_after(&self, seen: u64, me: usize) -> u64 {
        let polling_until = Instant::now() + self.spin;
        loop {
            let epoch = self.epoch.load(Ordering::SeqCst);
            if epoch != seen {
                return epoch;
            }
            if Instant::now() < polling_until {
                // Yield rather than spin: torch's OpenMP workers may need this core meanwhile.
                thread::yield_now();
                continue;
            }
            // Announce the sleep, then re-check: a caller bumping the epoch after this re-check sees
            // `sleeping` and unparks; one before it is caught by the re-check (all SeqCst).
            self.sleeping[me].store(true, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == seen {
                thread::park();
            }
            self.sleeping[me].store(false, Ordering::SeqCst);
        }
    }
}

/// Withdraws the published job and waits until no helper can still touch it; runs on unwinding too,
/// so the caller's stack frame holding the `Job` never goes away under a helper.
struct Withdraw<'a> {
    team: &'a Team,
}

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        self.team.job.store(ptr::null_mut(), Ordering::SeqCst);
        let mut polls = 0u32;
        while self.team.busy.load(Ordering::SeqCst) != 0 {
            // A helper finishing its last block is usually microseconds away; one that was preempted
            // needs this core, so stop spinning soon.
            polls += 1;
            if polls < 256 {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
    }
}

/// Threads a loop may run on, the caller included.
pub fn threads() -> usize {
    team().handles.get().map_or(0, Vec::len) + 1
}

/// Runs `body(i)` for every `i` in `0..count` on the calling thread and the team's helpers; returns when
/// all have run. A panic in `body` on a helper is re-raised here.
pub fn for_each_index(count: usize, body: &(dyn Fn(usize) + Sync)) {
    let team = team();
    let helpers = team.handles.get().map_or(&[][..], Vec::as_slice);
    let guard = if count > 1 && !helpers.is_empty() && std::process::id() == team.process {
        match team.caller.try_lock() {
            Ok(guard) => Some(guard),
            // A caller's own body panicked earlier; the lock guards nothing but exclusivity.
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    } else {
        None
    };
    if guard.is_none() {
        (0..count).for_each(body);
        return;
    }
    let job = Job {
        body,
        count,
        next: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    };
    let published = (&job as *const Job<'_>).cast_mut().cast::<Job<'static>>();
    team.job.store(published, Ordering::SeqCst);
    // Declared after `job`, so dropped (withdraw + wait) before it.
    let withdraw = Withdraw { team };
    team.epoch.fetch_add(1, Ordering::SeqCst);
    for (me, handle) in helpers.iter().enumerate() {
        if team.sleeping[me].load(Ordering::SeqCst) {
            handle.unpark();
        }
    }
    job.work();
    // Why the helpers' reads stay valid: a helper dereferences the pointer only if it loaded it
    // non-null after incrementing `busy`. In the single order of SeqCst operations, that load comes
    // before `withdraw`'s null store, so the increment does too, and `withdraw`'s wait sees it.
    drop(withdraw);
    drop(guard);
    if job.panicked.load(Ordering::SeqCst) {
        panic!("a dart-gemm helper thread panicked");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_index_runs_exactly_once() {
        for count in [0usize, 1, 2, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..count).map(|_| AtomicU32::new(0)).collect();
            for_each_index(count, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{count}"
            );
        }
    }

    #[test]
    fn concurrent_callers_all_complete() {
        let total = AtomicUsize::new(0);
        thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        for_each_index(37, &|i| {
                            total.fetch_add(i, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * (36 * 37 / 2));
    }

    #[test]
    fn a_panicking_body_reaches_the_caller_and_the_team_still_works() {
        let result = catch_unwind(|| {
            for_each_index(100, &|i| {
                if i == 57 {
                    panic!("boom");
                }
            })
        });
        assert!(result.is_err());
        let hits = AtomicUsize::new(0);
        for_each_index(100, &|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 100);
    }
}
