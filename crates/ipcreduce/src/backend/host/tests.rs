//! Protocol tests inside one process: each thread is a rank, arenas are real memfds mapped
//! once per rank (so a rank's own arena is mapped twice in the process, as in a real job
//! each peer maps it once).

use super::buffers::AlignedBuf;
use super::*;
use crate::backend::TestBuffers;
use crate::reference;

struct World {
    world: usize,
    workspace: usize,
    heap: usize,
    timeout: Duration,
}

impl World {
    fn new(world: usize) -> World {
        World {
            world,
            workspace: DEFAULT_WORKSPACE_BYTES,
            heap: 16 << 20,
            timeout: Duration::from_secs(20),
        }
    }

    fn comms(&self) -> Vec<HostComm> {
        let layout = Layout::new(self.workspace, self.heap);
        let made: Vec<(OwnedFd, Mapping)> = (0..self.world)
            .map(|r| arena::create(&layout, self.world, r).unwrap())
            .collect();
        let fds: Vec<Vec<OwnedFd>> = (0..self.world)
            .map(|_| made.iter().map(|(fd, _)| fd.try_clone().unwrap()).collect())
            .collect();
        made.into_iter()
            .zip(fds)
            .enumerate()
            .map(|(r, ((_, map), fds))| {
                HostComm::from_parts(
                    r,
                    self.world,
                    AbortState::new(),
                    layout,
                    map,
                    fds,
                    self.timeout,
                )
                .unwrap()
            })
            .collect()
    }

    /// Runs `f(rank, comm)` on one thread per rank and returns the results by rank.
    fn run<R: Send>(&self, f: impl Fn(usize, &mut HostComm) -> R + Sync) -> Vec<R> {
        let comms = self.comms();
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(r, mut c)| {
                    let f = &f;
                    s.spawn(move || f(r, &mut c))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}

fn input(dtype: DType, seed: u64, rank: usize, count: usize) -> Vec<u8> {
    let mut v = vec![0u8; count * dtype.size()];
    reference::fill_input(dtype, seed, rank, &mut v);
    v
}

/// Out-of-place or in-place all-reduce of `count` elements; returns the output.
fn all_reduce(
    c: &mut HostComm,
    dtype: DType,
    op: ReduceOp,
    algo: Algorithm,
    count: usize,
    seed: u64,
    in_place: bool,
) -> Result<Vec<u8>> {
    let mut send = input(dtype, seed, c.rank(), count);
    if in_place {
        let p = send.as_mut_ptr();
        // SAFETY: one live buffer of count elements.
        unsafe { c.all_reduce(p, p, count, dtype, op, algo)? };
        Ok(send)
    } else {
        let mut recv = vec![0xFFu8; send.len()];
        // SAFETY: two live disjoint buffers of count elements.
        unsafe { c.all_reduce(send.as_ptr(), recv.as_mut_ptr(), count, dtype, op, algo)? };
        Ok(recv)
    }
}

const ALGOS: [Algorithm; 2] = [Algorithm::OneShot, Algorithm::TwoShot];

#[test]
fn every_dtype_op_size_and_algorithm_is_right_and_bitwise_equal() {
    for world in [2, 3, 4] {
        let mut w = World::new(world);
        // Small slots so the larger sizes cross many chunk boundaries.
        w.workspace = 2 * 4096;
        let outs = w.run(|_, c| {
            let mut outs = Vec::new();
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    for count in [1, 2, 7, 63, 64, 65, 1000, 4099, 20_001] {
                        let seed = count as u64 ^ 77;
                        for (i, algo) in ALGOS.into_iter().enumerate() {
                            let in_place = (count + i) % 2 == 0;
                            let out =
                                all_reduce(c, dtype, op, algo, count, seed, in_place).unwrap();
                            let wrong = reference::count_wrong(dtype, op, seed, world, &out);
                            assert_eq!(wrong, 0, "{dtype} {op} {algo} n={count} world={world}");
                            outs.push(out);
                        }
                        let n = outs.len();
                        assert_eq!(outs[n - 1], outs[n - 2], "oneshot == twoshot bitwise");
                    }
                }
            }
            outs
        });
        for r in 1..world {
            assert!(
                outs[r] == outs[0],
                "rank {r} differs from rank 0 (world {world})"
            );
        }
    }
}

#[test]
fn large_messages_with_default_workspace() {
    let world = 2;
    let count = (3 << 20) / 4 + 5; // > MAX_CHUNK_BYTES: several chunks
    let outs = World::new(world).run(|_, c| {
        let a = all_reduce(
            c,
            DType::F32,
            ReduceOp::Sum,
            Algorithm::OneShot,
            count,
            3,
            false,
        );
        let b = all_reduce(
            c,
            DType::F32,
            ReduceOp::Sum,
            Algorithm::TwoShot,
            count,
            3,
            true,
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(
            reference::count_wrong(DType::F32, ReduceOp::Sum, 3, world, &a),
            0
        );
        assert!(a == b);
        a
    });
    assert!(outs[0] == outs[1]);
}

#[test]
fn many_back_to_back_calls_of_changing_shape() {
    // Exercises slot reuse without end barriers: sizes and algorithms change every call.
    let world = 3;
    let mut w = World::new(world);
    w.workspace = 4 * 4096;
    w.run(|_, c| {
        for i in 0..300usize {
            let count = [1, 5, 3000, 17, 9000, 6][i % 6];
            let algo = ALGOS[(i / 6) % 2];
            let dtype = DType::ALL[i % 3];
            let out =
                all_reduce(c, dtype, ReduceOp::Sum, algo, count, i as u64, i % 4 == 0).unwrap();
            assert_eq!(
                reference::count_wrong(dtype, ReduceOp::Sum, i as u64, world, &out),
                0,
                "call {i}"
            );
        }
    });
}

#[test]
fn zero_copy_buffers_in_and_out_of_place_match_plain_ones() {
    let world = 3;
    let mut w = World::new(world);
    w.workspace = 2 * 4096;
    let dtype = DType::F32;
    w.run(|r, c| {
        for count in [3, 1000, 5000] {
            for algo in ALGOS {
                let seed = count as u64;
                let want = all_reduce(c, dtype, ReduceOp::Sum, algo, count, seed, false).unwrap();
                assert_eq!(
                    reference::count_wrong(dtype, ReduceOp::Sum, seed, world, &want),
                    0
                );
                // Allocated like a collective: the same offset on every rank, as the stamp
                // requires.
                let mut buf = c.host_buffer::<f32>(count).unwrap();
                let inp = input(dtype, seed, r, count);
                crate::element::as_bytes_mut(&mut buf[..]).copy_from_slice(&inp);
                let mut out = vec![0u8; count * 4];
                // SAFETY: buffers of count f32.
                unsafe {
                    c.all_reduce(
                        buf.as_ptr().cast(),
                        out.as_mut_ptr(),
                        count,
                        dtype,
                        ReduceOp::Sum,
                        algo,
                    )
                }
                .unwrap();
                assert_eq!(
                    crate::element::as_bytes(&buf[..]),
                    &inp[..],
                    "input untouched"
                );
                assert!(out == want, "out-of-place zero-copy {algo} n={count}");
                // In place in the heap.
                let p = buf.as_mut_ptr().cast::<u8>();
                // SAFETY: one buffer of count f32.
                unsafe { c.all_reduce(p, p, count, dtype, ReduceOp::Sum, algo) }.unwrap();
                assert!(
                    crate::element::as_bytes(&buf[..]) == &want[..],
                    "in-place zero-copy {algo} n={count}"
                );
                // The caller may overwrite its buffer as soon as the call returns.
                buf.fill(f32::NAN);
            }
        }
    });
}

#[test]
fn an_arena_buffer_against_a_plain_one_or_another_offset_is_a_mismatch() {
    // What each rank's error says differs, rank 0's view first.
    for (case, want) in [
        (
            "plain",
            [
                " vs not in the arena (",
                ": input not in the arena vs in the arena at offset ",
            ],
        ),
        (
            "offset",
            [" vs in the arena at offset ", " vs in the arena at offset "],
        ),
        (
            "in place",
            [
                ": out of place vs in place (",
                ": in place vs out of place (",
            ],
        ),
    ] {
        let world = 2;
        let res = World::new(world).run(|r, c| {
            let count = 1000;
            let mut a = c.host_buffer::<f32>(count).unwrap();
            let mut b = c.host_buffer::<f32>(count).unwrap();
            let mut out = vec![0u8; count * 4];
            let plain = vec![0u8; count * 4];
            let (send, recv) = match (case, r) {
                ("plain", 1) => (plain.as_ptr(), out.as_mut_ptr()),
                ("offset", 1) => (b.as_ptr().cast::<u8>(), out.as_mut_ptr()),
                ("in place", 1) => (a.as_ptr().cast::<u8>(), a.as_mut_ptr().cast::<u8>()),
                _ => (a.as_ptr().cast::<u8>(), out.as_mut_ptr()),
            };
            let _ = &mut b;
            // SAFETY: buffers of count f32, live to the end of the closure.
            let e = unsafe {
                c.all_reduce(
                    send,
                    recv,
                    count,
                    DType::F32,
                    ReduceOp::Sum,
                    Algorithm::OneShot,
                )
            };
            e.expect_err("mismatched placement must fail").to_string()
        });
        for (r, e) in res.iter().enumerate() {
            assert!(
                e.contains("does not match peer rank"),
                "{case}, rank {r}: {e}"
            );
            assert!(e.contains(want[r]), "{case}, rank {r}: {e}");
        }
    }
}

#[test]
fn mismatched_count_fails_on_every_rank_then_stays_aborted() {
    let world = 3;
    let res = World::new(world).run(|r, c| {
        let count = if r == 1 { 200 } else { 100 };
        let first = all_reduce(
            c,
            DType::F32,
            ReduceOp::Sum,
            Algorithm::OneShot,
            count,
            1,
            false,
        );
        let later = all_reduce(
            c,
            DType::F32,
            ReduceOp::Sum,
            Algorithm::OneShot,
            100,
            1,
            false,
        );
        (first.unwrap_err(), later.unwrap_err())
    });
    for (r, (first, later)) in res.iter().enumerate() {
        match first {
            Error::Mismatch {
                rank,
                peer,
                detail,
                seq,
                ..
            } => {
                assert_eq!(*rank, r);
                assert_eq!(*seq, 1);
                if r == 1 {
                    assert!(detail.contains("count 200 vs 100"), "{detail}");
                } else {
                    assert_eq!(*peer, 1);
                    assert!(detail.contains("count 100 vs 200"), "{detail}");
                }
            }
            e => panic!("rank {r}: expected a mismatch, got {e}"),
        }
        assert!(matches!(later, Error::Aborted { .. }), "rank {r}: {later}");
    }
}

#[test]
fn mismatched_algorithm_and_dtype_are_named() {
    let res = World::new(2).run(|r, c| {
        let (dtype, algo) = if r == 0 {
            (DType::F32, Algorithm::OneShot)
        } else {
            (DType::F16, Algorithm::TwoShot)
        };
        all_reduce(c, dtype, ReduceOp::Sum, algo, 64, 1, false).unwrap_err()
    });
    // Each rank finds the difference itself (a peer's mismatch verdict is not taken over at
    // the start of a call) and words it from its own side, naming the other rank.
    let want = [
        (1, ["dtype float vs half", "algorithm oneshot vs twoshot"]),
        (0, ["dtype half vs float", "algorithm twoshot vs oneshot"]),
    ];
    for (r, (e, (want_peer, parts))) in res.iter().zip(want).enumerate() {
        match e {
            Error::Mismatch {
                rank,
                peer,
                seq,
                detail,
                ..
            } => {
                assert_eq!((*rank, *peer, *seq), (r, want_peer, 1), "rank {r}: {e}");
                for p in parts {
                    assert!(detail.contains(p), "rank {r}: no {p:?} in {detail:?}");
                }
                assert!(e.to_string().starts_with(&format!("rank {r}: ")), "{e}");
            }
            e => panic!("rank {r}: expected a mismatch, got {e}"),
        }
    }
}

#[test]
fn a_rank_that_skips_a_call_is_named_in_the_others_timeouts() {
    let world = 3;
    let mut w = World::new(world);
    w.timeout = Duration::from_millis(300);
    // Ranks 0 and 2 say when they have given up; rank 1 makes its late call only then, so
    // the order is the handshake's, not a sleep's that a stalled machine could outlast.
    let gave_up = std::sync::atomic::AtomicUsize::new(0);
    let t0 = Instant::now();
    let res = w.run(|r, c| {
        let run = |c: &mut HostComm| {
            all_reduce(
                c,
                DType::F32,
                ReduceOp::Sum,
                Algorithm::TwoShot,
                10,
                1,
                false,
            )
        };
        run(c).unwrap();
        if r == 1 {
            // Skip call #2; come back after everyone gave up.
            let until = Instant::now() + Duration::from_secs(5);
            while gave_up.load(std::sync::atomic::Ordering::SeqCst) < world - 1 {
                assert!(Instant::now() < until, "the other ranks never gave up");
                std::thread::yield_now();
            }
            return run(c).unwrap_err();
        }
        let e = run(c).unwrap_err();
        gave_up.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        e
    });
    assert!(t0.elapsed() < Duration::from_secs(3));
    for (r, e) in res.iter().enumerate() {
        if r == 1 {
            assert!(
                matches!(e, Error::Aborted { reason, .. } if reason.contains("rank 1")),
                "{e}"
            );
        } else {
            assert!(
                matches!(e, Error::Timeout { peer: 1, seq: 2, rank, .. } if *rank == r),
                "rank {r}: {e}"
            );
        }
    }
}

#[test]
fn external_abort_wakes_everyone_fast() {
    // As the liveness watcher would: rank 0's AbortState is set while all ranks wait for a
    // rank 2 that never comes. Ranks 0 and 1 must leave long before their timeout.
    let world = 3;
    let comms = World::new(world).comms();
    let abort0 = comms[0].abort.clone();
    let (tx, tids) = std::sync::mpsc::channel();
    let t0 = Instant::now();
    let res: Vec<Option<Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                let tx = tx.clone();
                s.spawn(move || {
                    if c.rank() == 2 {
                        return None;
                    }
                    // SAFETY: gettid has no preconditions.
                    tx.send(unsafe { libc::syscall(libc::SYS_gettid) }).unwrap();
                    all_reduce(
                        &mut c,
                        DType::F32,
                        ReduceOp::Sum,
                        Algorithm::OneShot,
                        4,
                        1,
                        false,
                    )
                    .err()
                })
            })
            .collect();
        // Abort only once ranks 0 and 1 sleep in their waits for rank 2 (a futex wait is the
        // only place a collective blocks): an abort that came before the call would be
        // refused at entry, which is not what this test is about.
        let tids: Vec<i64> = (0..2)
            .map(|_| tids.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        let until = Instant::now() + Duration::from_secs(5);
        while !tids
            .iter()
            .all(|&t| matches!(sync::tests::blocked_in(t), Some((nr, _)) if nr == libc::SYS_futex))
        {
            assert!(
                Instant::now() < until,
                "ranks 0 and 1 never blocked in their waits"
            );
            std::thread::yield_now();
        }
        abort0.abort("rank 2 died");
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(
        matches!(&res[0], Some(Error::Aborted { rank: 0, reason }) if reason == "rank 2 died"),
        "{:?}",
        res[0]
    );
    // Rank 1 hears it through rank 0's abort word: named as rank 0's, with the cause.
    assert!(
        matches!(&res[1], Some(Error::Aborted { rank: 1, reason })
            if reason.contains("rank 0") && reason.contains("rank 2 died")),
        "{:?}",
        res[1]
    );
}

#[test]
fn eight_ranks_on_few_cores_make_progress() {
    let world = 8;
    let mut w = World::new(world);
    w.workspace = 2 * 4096;
    w.run(|_, c| {
        for i in 0..40usize {
            let count = [1, 100, 3000][i % 3];
            let out =
                all_reduce(c, DType::Bf16, ReduceOp::Max, ALGOS[i % 2], count, 9, false).unwrap();
            assert_eq!(
                reference::count_wrong(DType::Bf16, ReduceOp::Max, 9, world, &out),
                0
            );
        }
        c.barrier().unwrap();
    });
}

#[test]
fn backend_ops_buffers_and_timing() {
    let world = 2;
    World::new(world).run(|r, c| {
        let count = 1000;
        let dtype = DType::F16;
        let (s, d) = (c.alloc(count * 2).unwrap(), c.alloc(count * 2).unwrap());
        c.write(s, &input(dtype, 4, r, count)).unwrap();
        let call = Call {
            send: s,
            recv: d,
            count,
            dtype,
            op: ReduceOp::Min,
            algo: Algorithm::TwoShot,
            offset: 0,
        };
        c.run(&call).unwrap();
        let mut out = vec![0u8; count * 2];
        c.read(d, &mut out).unwrap();
        assert_eq!(
            reference::count_wrong(dtype, ReduceOp::Min, 4, world, &out),
            0
        );
        // The per-call figure against this thread's own clock around the whole timing (its
        // warm-up and barrier included), and a floor no two-rank exchange gets under.
        let t = Instant::now();
        let us = c.time(&call, 2, 10, None).unwrap();
        let outer_us = t.elapsed().as_secs_f64() * 1e6;
        assert!(
            (0.05..=outer_us / 10.0).contains(&us),
            "{us} us per call; the 12 calls and a barrier took {outer_us} us"
        );
        assert!(matches!(
            c.time(&call, 0, 1, Some(3)),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(
            c.unavailable(Algorithm::Nccl).as_deref(),
            Some("NCCL is cuda-only")
        );
        assert!(c.meta().devices[0].starts_with("host: "));
        c.free(s);
        c.free(d);
        for id in [s, d] {
            match c.write(id, &[0]) {
                Err(e @ Error::InvalidArgument { rank, .. }) => {
                    assert_eq!(rank, r, "{e}");
                    assert!(e.to_string().contains(&format!("no buffer {id}")), "{e}");
                }
                other => panic!("rank {r}: write to freed buffer {id}: {other:?}"),
            }
        }
    });
}

/// Quick micro-benchmark (threads as ranks, same shared-memory paths as processes):
/// `cargo test --release --lib host::tests::bench -- --ignored --nocapture`
/// (`BENCH_WORLD=4` for more ranks). Best of 5 runs, slowest rank of each.
#[test]
#[ignore]
fn bench() {
    let world: usize = std::env::var("BENCH_WORLD").map_or(2, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("BENCH_WORLD={v} is not a number"))
    });
    let comms = std::sync::Mutex::new(World::new(world).comms());
    for bytes in [8usize, 4096, 64 << 10, 512 << 10, 2 << 20, 8 << 20] {
        let count = bytes / 4;
        let iters = (50_000_000 / (bytes + 2000)).clamp(10, 100_000);
        let mut line = format!("{world} ranks {bytes:>9} B:");
        for algo in ALGOS {
            let mut best = f64::MAX;
            for _ in 0..5 {
                let cs: Vec<HostComm> = std::mem::take(&mut *comms.lock().unwrap());
                let (us, back): (Vec<f64>, Vec<HostComm>) = std::thread::scope(|s| {
                    let hs: Vec<_> = cs
                        .into_iter()
                        .map(|mut c| {
                            s.spawn(move || {
                                // Like the CLI benchmark: 64-byte aligned plain buffers.
                                let (sendb, recvb) = (
                                    AlignedBuf::new(bytes).unwrap(),
                                    AlignedBuf::new(bytes).unwrap(),
                                );
                                let (send, recv) = (sendb.ptr.as_ptr(), recvb.ptr.as_ptr());
                                let inp = input(DType::F32, 1, c.rank(), count);
                                // SAFETY: sendb holds `bytes`.
                                unsafe { std::ptr::copy_nonoverlapping(inp.as_ptr(), send, bytes) };
                                let call = |c: &mut HostComm| {
                                    // SAFETY: two live buffers of count f32.
                                    unsafe {
                                        c.all_reduce(
                                            send,
                                            recv,
                                            count,
                                            DType::F32,
                                            ReduceOp::Sum,
                                            algo,
                                        )
                                    }
                                    .unwrap()
                                };
                                for _ in 0..iters / 10 + 3 {
                                    call(&mut c);
                                }
                                c.barrier().unwrap();
                                let t0 = Instant::now();
                                for _ in 0..iters {
                                    call(&mut c);
                                }
                                (t0.elapsed().as_secs_f64() * 1e6 / iters as f64, c)
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).unzip()
                });
                *comms.lock().unwrap() = back;
                best = best.min(us.iter().cloned().fold(0.0, f64::max));
            }
            let busbw = bytes as f64 / best / 1e3 * 2.0 * (world - 1) as f64 / world as f64;
            line += &format!("  {algo} {best:9.2} us ({busbw:5.2} GB/s)");
        }
        println!("{line}");
    }
}
