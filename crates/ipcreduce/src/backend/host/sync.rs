//! Flags in shared memory and bounded waits on them.
//!
//! A [`Signal`] is a monotonically increasing u64 written by one process and read by others.
//! Waiting spins briefly (latency of a few hundred ns when the peer is running on another
//! core), then yields the CPU (more ranks than cores), then sleeps on a futex on the flag's
//! low 32 bits. The writer only makes the FUTEX_WAKE syscall when a waiter announced itself
//! in `sleepers`, so the fast path has no syscall at all.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[cfg(not(target_endian = "little"))]
compile_error!("the futex waits on the low 32 bits of a u64 flag, which assumes little endian");

/// A one-writer flag. `sleepers` counts processes blocked (or about to block) in FUTEX_WAIT.
#[repr(C)]
pub(crate) struct Signal {
    pub value: AtomicU64,
    pub sleepers: AtomicU32,
    _pad: AtomicU32,
}

impl Signal {
    #[inline]
    pub fn get(&self) -> u64 {
        self.value.load(Ordering::Acquire)
    }

    /// Stores `v` (release: everything written before is visible to whoever sees `v`) and
    /// wakes sleepers if there are any.
    #[inline]
    pub fn publish(&self, v: u64) {
        // SeqCst store then SeqCst load of `sleepers`, paired with the waiter's SeqCst
        // increment then load of `value`: at least one side sees the other, so a waiter
        // never sleeps through the last change (Dekker). The futex itself re-checks the value.
        self.value.store(v, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            futex_wake(&self.value);
        }
    }

    /// Wakes whoever sleeps on this flag without changing it (so they re-check aborts).
    pub fn wake_all(&self) {
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            futex_wake(&self.value);
        }
    }
}

/// How long a waiter spins and yields before it sleeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpinPolicy {
    /// Busy-poll this long: fine while every rank has a core of its own.
    pub spin: Duration,
    /// Then `sched_yield` until this much has passed since the wait began.
    pub yield_until: Duration,
}

impl SpinPolicy {
    /// With more ranks than cores, spinning steals the core a peer needs, so spin less and
    /// hand the CPU over sooner.
    pub fn for_world(world: usize) -> SpinPolicy {
        let cores = crate::machine_cores();
        if world <= cores {
            SpinPolicy {
                spin: Duration::from_micros(20),
                yield_until: Duration::from_micros(500),
            }
        } else {
            SpinPolicy {
                spin: Duration::from_nanos(500),
                yield_until: Duration::from_micros(200),
            }
        }
    }
}

/// The variable that overrides the policy: `SPIN_NS,YIELD_NS` (spin this long, then yield
/// until this much has passed since the wait began, then sleep), for measuring the policy
/// when ranks outnumber cores (scripts/host/mpi-compare.sh, its wait phase).
pub(crate) const WAIT_ENV: &str = "IPCREDUCE_HOST_WAIT";

impl SpinPolicy {
    /// [`SpinPolicy::for_world`], or what `value` (of [`WAIT_ENV`]) says; an unreadable value
    /// is an error that quotes it.
    pub fn from_env(world: usize, value: Option<&str>) -> Result<SpinPolicy, String> {
        let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
            return Ok(SpinPolicy::for_world(world));
        };
        let parsed: Vec<Option<u64>> = v.split(',').map(|x| x.trim().parse().ok()).collect();
        match parsed[..] {
            [Some(spin), Some(until)] if spin <= until => Ok(SpinPolicy {
                spin: Duration::from_nanos(spin),
                yield_until: Duration::from_nanos(until),
            }),
            _ => Err(format!(
                "{WAIT_ENV}={v}: expected SPIN_NS,YIELD_NS (whole nanoseconds, spin <= yield)"
            )),
        }
    }
}

/// Why a wait ended without the flag reaching its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitError {
    /// The deadline passed; `waited` is how long this wait lasted.
    Timeout { waited: Duration },
    /// `check` asked to stop (abort seen); the caller knows why.
    Stopped { waited: Duration },
}

/// Longest single futex sleep, so a sleeper re-checks aborts and its deadline regularly.
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// Waits until `sig >= target`. `check` runs in the slow phases (never while spinning
/// briefly) and stops the wait by returning true.
#[inline]
pub(crate) fn wait(
    sig: &Signal,
    target: u64,
    timeout: Duration,
    policy: SpinPolicy,
    check: &mut dyn FnMut() -> bool,
) -> Result<(), WaitError> {
    if sig.get() >= target {
        return Ok(());
    }
    wait_slow(sig, target, timeout, policy, check)
}

#[cold]
#[inline(never)]
fn wait_slow(
    sig: &Signal,
    target: u64,
    timeout: Duration,
    policy: SpinPolicy,
    check: &mut dyn FnMut() -> bool,
) -> Result<(), WaitError> {
    let start = Instant::now();
    // Phase 1: spin. Reading the clock costs ~20 ns, so only every few polls.
    loop {
        for _ in 0..32 {
            if sig.get() >= target {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= policy.spin {
            break;
        }
    }
    loop {
        let waited = start.elapsed();
        if check() {
            return Err(WaitError::Stopped { waited });
        }
        if waited >= timeout {
            return Err(WaitError::Timeout { waited });
        }
        if waited < policy.yield_until {
            // Phase 2: let a rank that shares our core run.
            // SAFETY: sched_yield has no preconditions.
            unsafe { libc::sched_yield() };
            if sig.get() >= target {
                return Ok(());
            }
            continue;
        }
        // Phase 3: sleep until the writer wakes us, bounded so aborts are noticed.
        sig.sleepers.fetch_add(1, Ordering::SeqCst);
        let seen = sig.value.load(Ordering::SeqCst);
        if seen < target {
            futex_wait(&sig.value, seen as u32, MAX_SLEEP.min(timeout - waited));
        }
        sig.sleepers.fetch_sub(1, Ordering::SeqCst);
        if sig.get() >= target {
            return Ok(());
        }
    }
}

/// Blocks while the low 32 bits of `word` equal `expected`, at most `timeout`.
/// Not FUTEX_PRIVATE: the word lives in memory shared between processes.
fn futex_wait(word: &AtomicU64, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, 8-byte aligned atomic; the kernel reads its first 4 bytes
    // (the low half on little endian). EINTR, EAGAIN and ETIMEDOUT all just mean "re-check".
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr().cast::<u32>(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process blocked on `word`.
fn futex_wake(word: &AtomicU64) {
    // SAFETY: as in `futex_wait`; FUTEX_WAKE only reads the address as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr().cast::<u32>(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::sync::Arc;

    fn signal() -> Arc<Signal> {
        Arc::new(Signal {
            value: AtomicU64::new(0),
            sleepers: AtomicU32::new(0),
            _pad: AtomicU32::new(0),
        })
    }

    /// The syscall thread `tid` of this process is blocked in, with its first argument, read
    /// from procfs: lets a test see a waiter inside FUTEX_WAIT (the only place `wait`
    /// blocks) without a hook in `wait`.
    pub(in crate::backend::host) fn blocked_in(tid: i64) -> Option<(i64, usize)> {
        let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).ok()?;
        let mut f = text.split_whitespace();
        let nr = f.next()?.parse().ok()?;
        let arg0 = usize::from_str_radix(f.next()?.trim_start_matches("0x"), 16).ok()?;
        Some((nr, arg0))
    }

    #[test]
    fn sleeper_is_woken_by_publish() {
        let s = signal();
        let s2 = s.clone();
        let policy = SpinPolicy {
            spin: Duration::ZERO,
            yield_until: Duration::ZERO,
        };
        let (tx, tid) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::syscall(libc::SYS_gettid) }).unwrap();
            let start = Instant::now();
            wait(&s2, 5, Duration::from_secs(10), policy, &mut || false).unwrap();
            start.elapsed()
        });
        let tid = tid
            .recv_timeout(Duration::from_secs(5))
            .expect("waiter's tid");
        // Publish only once the waiter is blocked in FUTEX_WAIT on this very word (nothing
        // else in `wait` blocks): a wake that is never taken cannot pass as one.
        let word = s.value.as_ptr() as usize;
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            match blocked_in(tid) {
                Some((nr, a)) if nr == libc::SYS_futex && a == word => break,
                None if !std::path::Path::new("/proc/self/task").exists() => {
                    panic!("no /proc/self/task: cannot see the waiter block")
                }
                _ => {}
            }
            assert!(
                Instant::now() < until,
                "the waiter never blocked in FUTEX_WAIT on its flag: {:?}",
                blocked_in(tid)
            );
            std::thread::yield_now();
        }
        assert_eq!(
            s.sleepers.load(Ordering::SeqCst),
            1,
            "a sleeper counts itself"
        );
        let t0 = Instant::now();
        s.publish(5);
        t.join().unwrap();
        // The futex sleep lasts up to MAX_SLEEP (100 ms) before re-checking: waking well
        // before it means FUTEX_WAKE woke the waiter.
        assert!(
            t0.elapsed() < Duration::from_millis(50),
            "woke {:?} after the publish",
            t0.elapsed()
        );
        assert_eq!(
            s.sleepers.load(Ordering::SeqCst),
            0,
            "the sleeper left the count"
        );
    }

    #[test]
    fn the_policy_comes_from_the_variable_when_set() {
        let d = SpinPolicy::for_world(2);
        let p = SpinPolicy::from_env(2, None).unwrap();
        assert_eq!((p.spin, p.yield_until), (d.spin, d.yield_until));
        let p = SpinPolicy::from_env(2, Some(" ")).unwrap();
        assert_eq!((p.spin, p.yield_until), (d.spin, d.yield_until));
        let p = SpinPolicy::from_env(64, Some("0, 5000")).unwrap();
        assert_eq!(p.spin, Duration::ZERO);
        assert_eq!(p.yield_until, Duration::from_micros(5));
        for bad in ["1", "1,2,3", "a,2", "5,1", "-1,2"] {
            let e = SpinPolicy::from_env(2, Some(bad)).unwrap_err();
            assert!(e.contains(&format!("{WAIT_ENV}={bad}")), "{e}");
        }
    }

    #[test]
    fn timeout_and_stop() {
        let s = signal();
        let policy = SpinPolicy::for_world(2);
        let r = wait(&s, 1, Duration::from_millis(30), policy, &mut || false);
        assert!(
            matches!(r, Err(WaitError::Timeout { waited }) if waited >= Duration::from_millis(30))
        );
        let r = wait(&s, 1, Duration::from_secs(10), policy, &mut || true);
        assert!(matches!(r, Err(WaitError::Stopped { .. })));
        s.publish(1);
        assert_eq!(wait(&s, 1, Duration::ZERO, policy, &mut || true), Ok(()));
    }
}
