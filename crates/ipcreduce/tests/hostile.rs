//! Hostile calls on the host backend, ranks as processes: one rank (the last, "the odd rank")
//! makes a different call from its peers, or a bad one, or aborts. Every rank must fail fast
//! (well within the timeout) with an error that names the odd rank and both calls or the
//! reason; no call may return Ok with wrong data; later calls on the dead communicator fail
//! with `Aborted` carrying the root cause.
//!
//! Each rank makes call 0 (a good all-reduce: it also brings the ranks into the hostile call
//! together, so elapsed times measure the failure, not a late start), call 1 (the hostile
//! one) and calls 2 and 3 (good ones again). It reports each on stdout as
//! `@@ CALL <i> <outcome> <ms> <text>`; the parent judges.

mod common;

use common::{say, Job, Rank, Spawn};
use ipcreduce::element::load_f64;
use ipcreduce::{
    reference, Algorithm, BackendChoice, Communicator, Config, DType, Error, ReduceOp,
};
use std::ffi::c_void;
use std::io::{Read, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const ROLE: &str = "IPCREDUCE_HOSTILE_ROLE";
const CASE: &str = "HOSTILE_CASE";
/// The communicator's timeout: failures must come long before it.
const TIMEOUT_MS: u64 = 10_000;
/// How fast every rank must see a hostile call fail (liveness relays and host waits take
/// milliseconds; the bound leaves room for a loaded 2-core machine, and is a fifth of the
/// timeout, so waiting the timeout out cannot pass).
const FAST: Duration = Duration::from_millis(2000);
/// Elements per rank of the small (one-shot) and large (two-shot) cases.
const SMALL: usize = 256;
const LARGE: usize = 65_536;

// ---------------------------------------------------------------------------------------
// Rank side

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum What {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// One call a rank makes. `n`: the all-reduce's count, the reduce-scatter's recvcount or the
/// all-gather's sendcount.
#[derive(Clone, Copy, Debug)]
struct CallSpec {
    what: What,
    n: usize,
    dtype: DType,
    op: ReduceOp,
    /// A null send pointer (an argument error on this rank only).
    null_send: bool,
    /// The input in the arena: which of the two buffers every rank allocated.
    arena: Option<usize>,
}

impl CallSpec {
    fn all_reduce(n: usize) -> CallSpec {
        CallSpec {
            what: What::AllReduce,
            n,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            null_send: false,
            arena: None,
        }
    }
}

/// A byte buffer aligned for any element type.
struct Buf(Vec<u32>, usize);

impl Buf {
    fn new(bytes: usize) -> Buf {
        Buf(vec![0u32; bytes.div_ceil(4).max(1)], bytes)
    }
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.0)[..self.1]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.1;
        &mut bytemuck::cast_slice_mut(&mut self.0)[..n]
    }
}

/// What the hostile call (call 1) is on `rank`, and how many arena buffers to allocate.
fn hostile_call(case: &str, rank: usize, world: usize) -> CallSpec {
    let odd = rank == world - 1;
    let (size, kind) = case.split_once(':').unwrap_or((case, ""));
    let n = if size == "large" { LARGE } else { SMALL };
    let mut c = CallSpec::all_reduce(world * n);
    let as_op = |what| CallSpec { what, n, ..c };
    match kind {
        "ar-rs" if odd => c = as_op(What::ReduceScatter),
        "ar-ag" if odd => c = as_op(What::AllGather),
        "rs-ag" => {
            c = as_op(if odd {
                What::AllGather
            } else {
                What::ReduceScatter
            })
        }
        "op" if odd => c.op = ReduceOp::Max,
        "dtype" if odd => c.dtype = DType::F16,
        "count" if odd => c.n += 1,
        "null" if odd => c.null_send = true,
        "zero" if odd => c.n = 0,
        "arena" => c.arena = Some(odd as usize),
        "abort" | "ar-rs" | "ar-ag" | "op" | "dtype" | "count" | "null" | "zero" => {}
        other => panic!("unknown case {other}"),
    }
    c
}

/// Runs `spec` with inputs from `seed`; Ok(None) when the result is right, Ok(Some(wrong))
/// with the number of elements off the reference otherwise.
fn make_call(
    c: &mut Communicator,
    spec: CallSpec,
    seed: u64,
    arena: &mut [ipcreduce::backend::host::HostBuffer<f32>],
) -> Result<Option<usize>, Error> {
    let (rank, world) = (c.rank(), c.world());
    let size = spec.dtype.size();
    let (send_n, recv_n) = match spec.what {
        What::AllReduce => (spec.n, spec.n),
        What::ReduceScatter => (world * spec.n, spec.n),
        What::AllGather => (spec.n, world * spec.n),
    };
    let mut send = Buf::new(send_n * size);
    reference::fill_input(spec.dtype, seed, rank, send.bytes_mut());
    let mut recv = Buf::new(recv_n * size);
    reference::poison(recv.bytes_mut());
    let mut send_ptr = send.bytes().as_ptr().cast::<c_void>();
    if let Some(which) = spec.arena {
        let buf = &mut arena[which];
        let bytes = ipcreduce::element::as_bytes_mut(&mut buf[..]);
        bytes[..send.1].copy_from_slice(send.bytes());
        send_ptr = buf.as_ptr().cast();
    }
    let mut recv_ptr = recv.bytes_mut().as_mut_ptr().cast::<c_void>();
    if spec.null_send || spec.n == 0 {
        send_ptr = std::ptr::null();
    }
    if spec.n == 0 {
        // A count-0 call needs no buffer.
        recv_ptr = std::ptr::null_mut();
    }
    let null = std::ptr::null_mut();
    // SAFETY: live buffers of the sizes the call needs (or a null pointer, which is refused).
    unsafe {
        match spec.what {
            What::AllReduce => c.all_reduce_raw(
                send_ptr,
                recv_ptr,
                spec.n,
                spec.dtype,
                spec.op,
                Algorithm::Auto,
                null,
            ),
            What::ReduceScatter => {
                c.reduce_scatter_raw(send_ptr, recv_ptr, spec.n, spec.dtype, spec.op, null)
            }
            What::AllGather => c.all_gather_raw(send_ptr, recv_ptr, spec.n, spec.dtype, null),
        }
    }?;
    let out = recv.bytes();
    let wrong = match spec.what {
        What::AllReduce => reference::count_wrong(spec.dtype, spec.op, seed, world, out),
        What::ReduceScatter => (0..spec.n)
            .filter(|&i| {
                let (exact, mag) =
                    reference::reference(spec.dtype, spec.op, seed, world, rank * spec.n + i);
                let got = load_f64(spec.dtype, out, i);
                !reference::acceptable(spec.dtype, spec.op, world, got, exact, mag)
            })
            .count(),
        What::AllGather => (0..world * spec.n)
            .filter(|&j| {
                let (q, i) = (j / spec.n, j % spec.n);
                load_f64(spec.dtype, out, j) != reference::input_value(spec.dtype, seed, q, i)
            })
            .count(),
    };
    Ok((wrong > 0).then_some(wrong))
}

fn rank_hostile() -> i32 {
    let case = std::env::var(CASE).expect("HOSTILE_CASE");
    let config = Config {
        backend: BackendChoice::Host,
        ..Config::default()
    };
    let mut c = Communicator::init(&config).expect("communicator init");
    let (rank, world) = (c.rank(), c.world());
    // Allocated like a collective, so both lie at the same offsets on every rank.
    let len = world * LARGE;
    let mut arena = vec![
        c.host_buffer::<f32>(len).expect("arena buffer"),
        c.host_buffer::<f32>(len).expect("arena buffer"),
    ];
    let hostile = hostile_call(&case, rank, world);
    let good = CallSpec::all_reduce(world * SMALL);
    for i in 0..4u64 {
        let spec = if i == 1 { hostile } else { good };
        let t0 = Instant::now();
        let r = if i >= 1 && case.ends_with("abort") && rank == world - 1 {
            // Aborts instead of making the call and makes no call after it, but stays in the
            // job: the peers, waiting in it, must hear of the abort now, not when this rank
            // leaves or happens to call again.
            c.abort("hostile: given up by the caller");
            Err(c.async_error().expect("aborted"))
        } else {
            make_call(&mut c, spec, 100 + i, &mut arena)
        };
        let ms = t0.elapsed().as_millis();
        let (outcome, text) = match r {
            Ok(None) => ("OK_RIGHT".to_string(), String::new()),
            Ok(Some(wrong)) => (format!("OK_WRONG({wrong})"), String::new()),
            Err(e) => (kind(&e).to_string(), e.to_string().replace('\n', " ")),
        };
        say(format!("CALL {i} {outcome} {ms} {text}"));
    }
    // Stay in the job until the parent heard every rank: a rank that leaves early is
    // reported dead to slower peers, which would then see that instead.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(c);
    let _ = std::io::stdout().flush();
    0
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::InvalidArgument { .. } => "InvalidArgument",
        Error::Mismatch { .. } => "Mismatch",
        Error::Aborted { .. } => "Aborted",
        Error::Timeout { .. } => "Timeout",
        Error::PeerLost { .. } => "PeerLost",
        _ => "Other",
    }
}

fn play_rank_if_child() {
    if std::env::var_os(ROLE).is_some() {
        let code = rank_hostile();
        let _ = std::io::stdout().flush();
        std::process::exit(code);
    }
}

// ---------------------------------------------------------------------------------------
// Parent side

/// One rank's report of one call.
#[derive(Debug)]
struct Report {
    outcome: String,
    ms: u64,
    text: String,
}

fn parse(line: &str) -> (u64, Report) {
    let parts: Vec<&str> = line.splitn(5, ' ').collect();
    assert!(parts.len() >= 4 && parts[0] == "CALL", "bad report {line}");
    let report = Report {
        outcome: parts[2].to_string(),
        ms: parts[3].parse().unwrap(),
        text: parts.get(4).unwrap_or(&"").to_string(),
    };
    (parts[1].parse().unwrap(), report)
}

/// What every rank's hostile call must give.
struct Expect<'a> {
    /// The outcomes allowed on the odd rank and on the others.
    odd_kinds: &'a [&'a str],
    peer_kinds: &'a [&'a str],
    /// Texts every rank's error (and every later call's) must contain.
    says: Vec<String>,
    /// More texts the other ranks' errors must contain.
    peer_says: Vec<String>,
}

/// The jobs run one at a time: the elapsed-time bounds are about the mechanism, not about
/// four jobs of four ranks sharing two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn run_case(test: &str, case: &str, world: usize, expect: impl Fn(usize) -> Expect<'static>) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let job = Job::new("hostile", &format!("{}-{world}", case.replace(':', "-")));
    let extra = [
        (CASE, case),
        ("IPCREDUCE_TIMEOUT_MS", &*TIMEOUT_MS.to_string()),
    ];
    let spec = Spawn {
        test,
        role_var: ROLE,
        role: "hostile",
        world,
        extra: &extra,
        hold: true,
    };
    let mut ranks: Vec<Rank> = common::spawn_world(&spec, &job);
    let within = Duration::from_millis(TIMEOUT_MS * 3);
    let odd = world - 1;
    let want = expect(world);
    for r in &mut ranks {
        let mut reports = Vec::new();
        for i in 0..4 {
            let (n, rep) = parse(&r.next(within));
            assert_eq!(n, i, "rank {}: calls out of order", r.rank);
            reports.push(rep);
        }
        let ctx = |what: &str| format!("{case} world {world} rank {}: {what}: {reports:?}", r.rank);
        assert_eq!(
            reports[0].outcome,
            "OK_RIGHT",
            "{}",
            ctx("the good call before")
        );
        let h = &reports[1];
        let kinds = if r.rank == odd {
            want.odd_kinds
        } else {
            want.peer_kinds
        };
        assert!(
            kinds.contains(&h.outcome.as_str()),
            "{}",
            ctx(&format!("outcome {} not one of {kinds:?}", h.outcome))
        );
        assert!(
            h.text.starts_with(&format!("rank {}: ", r.rank)),
            "{}",
            ctx("the error names the rank that saw it")
        );
        let extra = if r.rank == odd {
            &[][..]
        } else {
            &want.peer_says[..]
        };
        for s in want.says.iter().chain(extra) {
            assert!(
                h.text.contains(s.as_str()),
                "{}",
                ctx(&format!("lacks '{s}'"))
            );
        }
        assert!(
            h.ms < FAST.as_millis() as u64,
            "{}",
            ctx(&format!("took {} ms (timeout {TIMEOUT_MS} ms)", h.ms))
        );
        for later in &reports[2..] {
            assert_eq!(later.outcome, "Aborted", "{}", ctx("a later call"));
            assert!(
                later.ms < FAST.as_millis() as u64,
                "{}",
                ctx("a later call is slow")
            );
            // The root cause, not some cascade: the last (most specific) text.
            let cause = want.says.last().unwrap();
            assert!(
                later.text.contains(cause.as_str()),
                "{}",
                ctx(&format!("later lacks '{cause}'"))
            );
        }
    }
    for r in &mut ranks {
        r.wait_ok(within);
    }
}

/// A mismatch: every rank that compared the stamps says Mismatch; at world > 2 a rank may
/// learn the verdict from a peer before it compares, and says Aborted with the same words.
fn mismatch(world: usize, says: Vec<String>) -> Expect<'static> {
    let kinds: &'static [&'static str] = if world == 2 {
        &["Mismatch"]
    } else {
        &["Mismatch", "Aborted"]
    };
    let mut all = vec![format!("rank {}", world - 1)];
    all.extend(says);
    Expect {
        odd_kinds: kinds,
        peer_kinds: kinds,
        says: all,
        peer_says: vec![],
    }
}

/// The two calls' descriptions as the stamps give them ("all_reduce #2 of 512 float, sum").
fn call(what: &str, count: usize, dtype: &str, op: &str) -> String {
    format!("{what} #2 of {count} {dtype}, {op}")
}

macro_rules! cases {
    ($($name:ident: $case:expr => $expect:expr;)*) => {$(
        #[test]
        fn $name() {
            play_rank_if_child();
            for world in [2, 4] {
                run_case(stringify!($name), $case, world, $expect);
            }
        }
    )*};
}

cases! {
    all_reduce_against_reduce_scatter_one_shot: "small:ar-rs" => |w| mismatch(w, vec![
        call("all_reduce", w * SMALL, "float", "sum"),
        call("reduce_scatter", w * SMALL, "float", "sum"),
    ]);
    all_reduce_against_reduce_scatter_two_shot: "large:ar-rs" => |w| mismatch(w, vec![
        call("all_reduce", w * LARGE, "float", "sum"),
        call("reduce_scatter", w * LARGE, "float", "sum"),
    ]);
    all_reduce_against_all_gather_one_shot: "small:ar-ag" => |w| mismatch(w, vec![
        call("all_reduce", w * SMALL, "float", "sum"),
        call("all_gather", w * SMALL, "float", "sum"),
    ]);
    all_reduce_against_all_gather_two_shot: "large:ar-ag" => |w| mismatch(w, vec![
        call("all_reduce", w * LARGE, "float", "sum"),
        call("all_gather", w * LARGE, "float", "sum"),
    ]);
    reduce_scatter_against_all_gather: "small:rs-ag" => |w| mismatch(w, vec![
        call("reduce_scatter", w * SMALL, "float", "sum"),
        call("all_gather", w * SMALL, "float", "sum"),
    ]);
    sum_against_max: "small:op" => |w| mismatch(w, vec![
        call("all_reduce", w * SMALL, "float", "sum"),
        call("all_reduce", w * SMALL, "float", "max"),
    ]);
    float_against_half: "large:dtype" => |w| mismatch(w, vec![
        call("all_reduce", w * LARGE, "float", "sum"),
        call("all_reduce", w * LARGE, "half", "sum"),
    ]);
    count_against_count_plus_one: "large:count" => |w| mismatch(w, vec![
        call("all_reduce", w * LARGE, "float", "sum"),
        call("all_reduce", w * LARGE + 1, "float", "sum"),
    ]);
    count_zero_on_one_rank: "small:zero" => |w| mismatch(w, vec![
        call("all_reduce", w * SMALL, "float", "sum"),
        call("all_reduce", 0, "float", "sum"),
    ]);
    arena_buffers_at_different_offsets: "large:arena" => |w| mismatch(w, vec![
        "input in the arena at offset".to_string(),
        " vs in the arena at offset ".to_string(),
    ]);
    an_argument_error_on_one_rank_aborts_every_rank: "small:null" => |w| Expect {
        odd_kinds: &["InvalidArgument"],
        peer_kinds: &["Aborted"],
        says: vec![format!("rank {}: invalid argument to all_reduce: null buffer pointer", w - 1)],
        peer_says: vec![format!("rank {} aborted: ", w - 1)],
    };
    an_abort_on_one_rank_reaches_every_rank_at_once: "small:abort" => |w| Expect {
        odd_kinds: &["Aborted"],
        peer_kinds: &["Aborted"],
        says: vec!["hostile: given up by the caller".to_string()],
        peer_says: vec![format!("rank {} aborted: ", w - 1)],
    };
}
