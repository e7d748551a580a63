//! The bootstrap with real processes and real sockets.
//!
//! Each test re-runs this test binary as its ranks (`--exact <test> --nocapture`) with
//! `IPCREDUCE_TEST_ROLE` set; the test function sees the variable and plays the rank instead
//! of the parent. Ranks report on stdout with lines starting `@@ `; their stderr carries the
//! library's log (warnings), which some tests inspect.
//!
//! The tests named `tcp_*` (and the TCP halves of the shared ones) play a job spanning hosts
//! on this one machine: ranks meet over TCP on 127.0.0.1 and claim distinct hosts through
//! `IPCREDUCE_HOST_ID`.

mod common;

use common::{say, Job, Rank, Spawn};
use ipcreduce::bootstrap::{Bootstrap, RankInfo};
use ipcreduce::{BackendChoice, Communicator, Config};
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const ROLE: &str = "IPCREDUCE_TEST_ROLE";
const TIMEOUT_VAR: &str = "IPCREDUCE_TEST_TIMEOUT_MS";

// ---------------------------------------------------------------------------------------
// Rank side

/// Runs the rank's part and exits, when this process is a rank.
fn play_rank_if_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .try_init();
    let code = match role.as_str() {
        "gather" => rank_gather(),
        "fds" => rank_fds(),
        "barrier" => rank_barrier(),
        "kill" => rank_kill(),
        "expect_fail" => rank_expect_fail(),
        "layout" => rank_layout(),
        "group" => rank_group(),
        "notices" => rank_notices(),
        other => panic!("unknown role {other}"),
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

fn rank_timeout() -> Duration {
    let ms = std::env::var(TIMEOUT_VAR).map_or(10_000, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{TIMEOUT_VAR}={v} is not a number of ms"))
    });
    Duration::from_millis(ms)
}

fn join() -> Bootstrap {
    let info = RankInfo::from_env().expect("rank info from the environment");
    match Bootstrap::connect(info, rank_timeout()) {
        Ok(b) => b,
        Err(e) => {
            say(format!("CONNECT_FAILED {e}"));
            std::process::exit(3);
        }
    }
}

/// What rank `k` contributes in round `round`: varied lengths, some empty, one large.
fn payload(k: usize, round: usize) -> Vec<u8> {
    if round == 4 {
        return (0..100_000).map(|i| (i * 7 + k * 13) as u8).collect();
    }
    format!("r{k}.{round};")
        .repeat((k + round) % 4)
        .into_bytes()
}

fn rank_gather() -> i32 {
    let mut b = join();
    gather_rounds(&mut b);
    say("DONE");
    0
}

/// All-gathers of varied payloads, checked, then a barrier.
fn gather_rounds(b: &mut Bootstrap) {
    let (r, n) = (b.rank(), b.world());
    for round in 0..6 {
        let all = b.all_gather(&payload(r, round)).expect("all_gather");
        assert_eq!(all.len(), n);
        for (k, got) in all.iter().enumerate() {
            assert_eq!(got, &payload(k, round), "rank {k}'s part in round {round}");
        }
    }
    b.barrier().expect("barrier");
}

fn memfd() -> std::fs::File {
    let fd = nix::sys::memfd::memfd_create(
        c"ipcreduce-test",
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )
    .expect("memfd_create");
    std::fs::File::from(fd)
}

/// A rank of a job spanning "hosts": reports its layout, exchanges data across nodes, is
/// refused descriptors, and is refused the host backend.
fn rank_layout() -> i32 {
    let mut b = join();
    let l = b.layout().clone();
    let nodes: Vec<String> = (0..l.node_count())
        .map(|n| format!("{:?}", l.node_ranks(n)))
        .collect();
    say(format!(
        "LAYOUT {} {} {} {} {}",
        l.node(),
        l.local_rank(),
        l.local_size(),
        l.host_id(l.node()),
        nodes.join("|")
    ));
    gather_rounds(&mut b);
    use std::os::fd::AsFd;
    match b.all_gather_fds(memfd().as_fd()) {
        Ok(_) => say("FDS_PASSED"),
        Err(e) => say(format!("FDS_REFUSED {e}")),
    }
    // The refusal left the job usable.
    b.barrier()
        .expect("barrier after the refused descriptor exchange");
    drop(b);
    let host = Config {
        backend: BackendChoice::Host,
        ..Config::default()
    };
    let info = RankInfo::from_env().expect("rank info");
    match Communicator::with_rank_info(info, &host) {
        Ok(_) => say("HOST_BACKEND_ACCEPTED"),
        Err(e) => say(format!("HOST_REFUSED {e}")),
    }
    say("DONE");
    0
}

/// A job over TCP whose ranks then meet per node ([`Bootstrap::node_group`], a Unix socket per
/// node): reports the group, exchanges within it (descriptors included, which the job's TCP
/// connections refuse), then waits for the parent to kill a rank and reports the abort both
/// bootstraps share.
fn rank_group() -> i32 {
    let b = join();
    let mut g = b.node_group().expect("the node's group");
    let members = g
        .all_gather(&b.rank().to_le_bytes())
        .expect("gather within the node")
        .iter()
        .map(|v| usize::from_le_bytes(v[..8].try_into().unwrap()))
        .collect::<Vec<_>>();
    say(format!(
        "GROUP {} {} {:?} {}",
        g.rank(),
        g.world(),
        members,
        g.layout().node_count()
    ));
    use std::os::fd::AsFd;
    let fds = g
        .all_gather_fds(memfd().as_fd())
        .expect("descriptors within the node");
    say(format!("FDS {}", fds.len()));
    g.barrier().expect("barrier within the node");
    say("READY");
    // The victim is killed by the parent; everyone else waits for the shared abort.
    let until = Instant::now() + Duration::from_secs(10);
    while !g.abort_state().is_aborted() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    // The job's reason: the group's, if it came first, names the node and its job ranks.
    let reason = b
        .abort_state()
        .reason()
        .unwrap_or_else(|| "not aborted".into());
    say(format!("ABORTED {} {reason}", unix_micros()));
    // Both bootstraps see it: the group's next collective fails at once.
    match g.barrier() {
        Ok(()) => say("GROUP_BARRIER_PASSED"),
        Err(e) => say(format!("GROUP_BARRIER_FAILED {e}")),
    }
    drop(g);
    drop(b);
    0
}

fn rank_fds() -> i32 {
    let mut b = join();
    let (r, n) = (b.rank(), b.world());
    let mine = memfd();
    mine.set_len(4096).expect("ftruncate");
    use std::os::fd::AsFd;
    let fds = b.all_gather_fds(mine.as_fd()).expect("all_gather_fds");
    assert_eq!(fds.len(), n);
    // Written after the exchange: only a shared file lets the others see it.
    mine.write_all_at(format!("from rank {r}").as_bytes(), 0)
        .expect("write");
    b.barrier().expect("barrier");
    for (k, fd) in fds.into_iter().enumerate() {
        let f = std::fs::File::from(fd);
        let mut buf = vec![0u8; 64];
        let len = f.read_at(&mut buf, 0).expect("read through the passed fd");
        let text = String::from_utf8_lossy(&buf[..len]);
        let want = format!("from rank {k}");
        assert!(text.starts_with(&want), "via fd {k}: {text:?}");
    }
    // Nobody closes (and so nobody's file may vanish) before everyone has read.
    b.barrier().expect("barrier");
    say("DONE");
    0
}

fn rank_barrier() -> i32 {
    let mut b = join();
    if b.rank() == 1 {
        std::thread::sleep(Duration::from_millis(300));
    }
    let t0 = Instant::now();
    b.barrier().expect("barrier");
    say(format!("BARRIER_MS {}", t0.elapsed().as_millis()));
    0
}

/// Every rank tells two notices; every rank must hear each peer's two, in order, and none of
/// its own (rank 0 relays the others' between them). Odd ranks install their handler late, so
/// the even ranks' notices reach them first and must be held for it.
fn rank_notices() -> i32 {
    let b = join();
    let (r, n) = (b.rank(), b.world());
    let heard = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let h = heard.clone();
    let notices = b.notices();
    let note = |k: usize, i: usize| format!("notice {i} of rank {k}").into_bytes();
    if r % 2 == 1 {
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(notices.on_notice(Box::new(move |from, bytes| {
        h.lock().unwrap().push((from, bytes.to_vec()))
    })));
    notices.tell(note(r, 0));
    notices.tell(note(r, 1));
    let until = Instant::now() + Duration::from_secs(5);
    while heard.lock().unwrap().len() < 2 * (n - 1) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    let got = heard.lock().unwrap().clone();
    for k in (0..n).filter(|&k| k != r) {
        let of_k: Vec<Vec<u8>> = got
            .iter()
            .filter(|(f, _)| *f == k)
            .map(|(_, b)| b.clone())
            .collect();
        assert_eq!(
            of_k,
            vec![note(k, 0), note(k, 1)],
            "rank {r}: what rank {k} told"
        );
    }
    assert_eq!(got.len(), 2 * (n - 1), "rank {r} heard {got:?}");
    // Nobody leaves before everyone heard everything (a leaving rank 0 relays nothing).
    let mut b = b;
    b.barrier().expect("barrier");
    say(format!("HEARD {}", got.len()));
    0
}

fn unix_micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

fn rank_kill() -> i32 {
    let mut b = join();
    let victim: usize = std::env::var("IPCREDUCE_TEST_VICTIM")
        .ok()
        .and_then(|v| v.parse().ok())
        .expect("victim");
    b.all_gather(b"x").expect("all_gather");
    b.barrier().expect("barrier");
    say("READY");
    if b.rank() == victim {
        // Waits for the parent's SIGKILL.
        std::thread::sleep(Duration::from_secs(30));
        return 1;
    }
    let abort = b.abort_state();
    let until = Instant::now() + Duration::from_secs(10);
    while !abort.is_aborted() {
        if Instant::now() > until {
            say("NOT_ABORTED");
            return 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let seen = unix_micros();
    say(format!(
        "ABORTED {seen} {}",
        abort.reason().unwrap_or_default()
    ));
    // The communicator is now unusable, and says so at once.
    let t0 = Instant::now();
    match b.barrier() {
        Ok(()) => {
            say("BARRIER_AFTER_ABORT_SUCCEEDED");
            1
        }
        Err(e) => {
            say(format!("AFTER {} {e}", t0.elapsed().as_millis()));
            0
        }
    }
}

fn rank_expect_fail() -> i32 {
    let info = RankInfo::from_env().expect("rank info");
    let t0 = Instant::now();
    match Bootstrap::connect(info, rank_timeout()) {
        Ok(_) => {
            say("JOINED");
            1
        }
        Err(e) => {
            say(format!("FAILED {} {e}", t0.elapsed().as_millis()));
            0
        }
    }
}

// ---------------------------------------------------------------------------------------
// Parent side

/// Starts `rank` of `world` playing `role`, with `net`'s variables, then `extra` (which may
/// override them).
fn spawn(
    net: Net,
    test: &str,
    role: &str,
    job: &Job,
    rank: usize,
    world: usize,
    extra: &[(&str, &str)],
) -> Rank {
    let env = net.env(rank);
    let mut all: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    all.extend_from_slice(extra);
    let spec = Spawn {
        test,
        role_var: ROLE,
        role,
        world,
        extra: &all,
        hold: false,
    };
    Rank::spawn(&spec, job, rank)
}

fn spawn_world(
    test: &str,
    role: &str,
    job: &Job,
    world: usize,
    extra: &[(&str, &str)],
) -> Vec<Rank> {
    (0..world)
        .map(|r| spawn(Net::Unix, test, role, job, r, world, extra))
        .collect()
}

const T: Duration = Duration::from_secs(20);

/// How a test's ranks meet: the Unix socket of one host, or TCP on loopback with the ranks
/// spread over `per_node`-rank "hosts" (rank r on host `node-{r / per_node}`).
#[derive(Clone, Copy)]
enum Net {
    Unix,
    Tcp { port: u16, per_node: usize },
}

impl Net {
    fn tcp(per_node: usize) -> Net {
        Net::Tcp {
            port: free_port(),
            per_node,
        }
    }

    fn env(self, rank: usize) -> Vec<(String, String)> {
        match self {
            Net::Unix => vec![],
            Net::Tcp { port, per_node } => vec![
                ("IPCREDUCE_MASTER".into(), format!("127.0.0.1:{port}")),
                (
                    "IPCREDUCE_HOST_ID".into(),
                    format!("node-{}", rank / per_node),
                ),
            ],
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Net::Unix => "unix",
            Net::Tcp { .. } => "tcp",
        }
    }
}

/// A loopback port nobody listens on now (the kernel's pick; released at once for rank 0).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().unwrap().port()
}

// ---------------------------------------------------------------------------------------
// Tests

#[test]
fn all_gather_worlds_2_3_4_8() {
    play_rank_if_child();
    for world in [2, 3, 4, 8] {
        let job = Job::new("bt", &format!("gather{world}"));
        let mut ranks = spawn_world("all_gather_worlds_2_3_4_8", "gather", &job, world, &[]);
        for r in &mut ranks {
            r.expect("DONE", T);
            r.wait_ok(T);
        }
        assert!(!job.socket.exists(), "rank 0 removed its socket");
    }
}

#[test]
fn all_gather_fds_shares_memfds() {
    play_rank_if_child();
    let job = Job::new("bt", "fds");
    let mut ranks = spawn_world("all_gather_fds_shares_memfds", "fds", &job, 4, &[]);
    for r in &mut ranks {
        r.expect("DONE", T);
        r.wait_ok(T);
    }
}

#[test]
fn notices_reach_every_other_rank_in_order() {
    play_rank_if_child();
    let job = Job::new("bt", "notices");
    let mut ranks = spawn_world(
        "notices_reach_every_other_rank_in_order",
        "notices",
        &job,
        4,
        &[],
    );
    for r in &mut ranks {
        assert_eq!(r.expect("HEARD", T), "6");
        r.wait_ok(T);
    }
}

#[test]
fn barrier_waits_for_the_slowest_rank() {
    play_rank_if_child();
    let job = Job::new("bt", "barrier");
    let mut ranks = spawn_world(
        "barrier_waits_for_the_slowest_rank",
        "barrier",
        &job,
        3,
        &[],
    );
    for r in &mut ranks {
        let ms: u64 = r.expect("BARRIER_MS", T).parse().unwrap();
        // Rank 1 arrives 300 ms late; the others must have waited for it, and must have left
        // once it came: well inside the 10 s timeout, so a barrier that only gives up at its
        // deadline and then reports success cannot pass.
        if r.rank != 1 {
            assert!(
                (200..2000).contains(&ms),
                "rank {} left the barrier after {ms} ms (rank 1 came 300 ms late)",
                r.rank
            );
        } else {
            assert!(ms < 2000, "rank 1, the last to come, waited {ms} ms");
        }
        r.wait_ok(T);
    }
}

/// A same-user process with the right socket but wrong credentials of the job is refused and
/// logged by rank 0, and the real job still completes.
fn stranger_is_refused(test: &str, tag: &str, wrong: (&str, &str), logged: &str) {
    for net in [Net::Unix, Net::tcp(1)] {
        stranger_is_refused_on(net, test, tag, wrong, logged);
    }
}

fn stranger_is_refused_on(net: Net, test: &str, tag: &str, wrong: (&str, &str), logged: &str) {
    let job = Job::new("bt", &format!("{tag}-{}", net.tag()));
    let mut r0 = spawn(net, test, "gather", &job, 0, 2, &[]);
    let mut stranger = spawn(net, test, "expect_fail", &job, 1, 2, &[wrong]);
    let why = stranger.expect("FAILED", T);
    eprintln!("stranger: {why}");
    assert!(why.contains("refused"), "stranger saw: {why}");
    stranger.wait_ok(T);

    let mut r1 = spawn(net, test, "gather", &job, 1, 2, &[]);
    for r in [&mut r0, &mut r1] {
        r.expect("DONE", T);
        r.wait_ok(T);
    }
    let log = r0.stderr();
    assert!(
        log.contains("refused a connection") && log.contains(logged),
        "rank 0's log: {log}"
    );
}

#[test]
fn wrong_secret_is_refused_and_the_job_completes() {
    play_rank_if_child();
    stranger_is_refused(
        "wrong_secret_is_refused_and_the_job_completes",
        "secret",
        ("IPCREDUCE_SECRET", "00000000000000000000000000000000"),
        "wrong secret",
    );
}

#[test]
fn wrong_job_id_is_refused_and_the_job_completes() {
    play_rank_if_child();
    stranger_is_refused(
        "wrong_job_id_is_refused_and_the_job_completes",
        "jobid",
        ("IPCREDUCE_JOB_ID", "another-job"),
        "job id",
    );
}

#[test]
fn duplicate_rank_is_refused() {
    play_rank_if_child();
    let test = "duplicate_rank_is_refused";
    let job = Job::new("bt", "dup");
    let mut r0 = spawn(Net::Unix, test, "gather", &job, 0, 3, &[]);
    let mut a = spawn(Net::Unix, test, "gather", &job, 1, 3, &[]);
    let mut b = spawn(Net::Unix, test, "gather", &job, 1, 3, &[]);
    // Whichever claims rank 1 second is refused at once; rank 2 is held back until then, so
    // the rendezvous is still open when the duplicate arrives.
    let until = Instant::now() + T;
    let (mut winner, mut loser) = loop {
        if a.has_exited() {
            break (b, a);
        }
        if b.has_exited() {
            break (a, b);
        }
        assert!(
            Instant::now() < until,
            "neither rank-1 claimant was refused"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let why = loser.expect("CONNECT_FAILED", T);
    eprintln!("duplicate: {why}");
    assert!(why.contains("duplicate rank"), "{why}");
    loser.wait(T);
    let mut r2 = spawn(Net::Unix, test, "gather", &job, 2, 3, &[]);
    for r in [&mut r0, &mut winner, &mut r2] {
        r.expect("DONE", T);
        r.wait_ok(T);
    }
    assert!(r0.stderr().contains("duplicate rank"));
}

/// SIGKILLs `victim` of 4 ranks between operations; the other 3 must see their abort state
/// set, naming the victim, well within 2 s.
/// The rank's `ABORTED <unix us> <reason>` report: how long after `killed_at` it noticed (at
/// most 2 s, asserted) and why.
fn noticed_within_2s(r: &mut Rank, killed_at: u128) -> (Duration, String) {
    let msg = r.expect("ABORTED", Duration::from_secs(5));
    let (at, reason) = msg.split_once(' ').unwrap();
    let latency = Duration::from_micros((at.parse::<u128>().unwrap() - killed_at) as u64);
    assert!(
        latency < Duration::from_secs(2),
        "rank {} noticed after {latency:?}: {reason}",
        r.rank
    );
    (latency, reason.to_string())
}

fn kill_one_of_four(net: Net, test: &str, victim: usize) {
    let job = Job::new("bt", &format!("kill{victim}-{}", net.tag()));
    let v = victim.to_string();
    let mut ranks: Vec<Rank> = (0..4)
        .map(|r| {
            spawn(
                net,
                test,
                "kill",
                &job,
                r,
                4,
                &[("IPCREDUCE_TEST_VICTIM", &v)],
            )
        })
        .collect();
    for r in &mut ranks {
        r.expect("READY", T);
    }
    let killed_at = unix_micros();
    ranks[victim].kill();
    ranks[victim].wait(T);

    let mut latencies = HashMap::new();
    for r in ranks.iter_mut().filter(|r| r.rank != victim) {
        let (latency, reason) = noticed_within_2s(r, killed_at);
        assert!(
            reason.contains(&format!("rank {victim} died")),
            "rank {}'s abort reason: {reason}",
            r.rank
        );
        let after = r.expect("AFTER", T);
        eprintln!("rank {}: {reason}; then {after}", r.rank);
        let ms: u64 = after.split(' ').next().unwrap().parse().unwrap();
        assert!(ms < 100, "barrier after abort took {ms} ms: {after}");
        r.wait_ok(T);
        latencies.insert(r.rank, latency);
    }
    eprintln!("rank {victim} killed; survivors noticed after {latencies:?}");
}

#[test]
fn kill_9_of_rank_2_aborts_the_others_quickly() {
    play_rank_if_child();
    kill_one_of_four(Net::Unix, "kill_9_of_rank_2_aborts_the_others_quickly", 2);
}

#[test]
fn kill_9_of_rank_0_aborts_the_others_quickly() {
    play_rank_if_child();
    kill_one_of_four(Net::Unix, "kill_9_of_rank_0_aborts_the_others_quickly", 0);
}

#[test]
fn missing_rank_times_out_naming_it() {
    play_rank_if_child();
    let test = "missing_rank_times_out_naming_it";
    let timeout_ms = 1500u64;
    let t = timeout_ms.to_string();
    let job = Job::new("bt", "timeout");
    // World 3, rank 2 never starts.
    let mut ranks: Vec<Rank> = (0..2)
        .map(|r| {
            spawn(
                Net::Unix,
                test,
                "expect_fail",
                &job,
                r,
                3,
                &[(TIMEOUT_VAR, &t)],
            )
        })
        .collect();
    for r in &mut ranks {
        let msg = r.expect("FAILED", T);
        let (ms, err) = msg.split_once(' ').unwrap();
        let ms: u64 = ms.parse().unwrap();
        eprintln!("after {ms} ms: {err}");
        assert!(err.contains("rank 2"), "rank {}: {err}", r.rank);
        // Rank 0 waits the full timeout; rank 1 hears rank 0's verdict, so it gives up at
        // rank 0's deadline (earlier by however much later it started), at worst at its own
        // timeout plus the short grace it allows rank 0.
        let lowest = if r.rank == 0 { timeout_ms - 10 } else { 500 };
        assert!(
            (lowest..=timeout_ms + 700).contains(&ms),
            "rank {} gave up after {ms} ms (timeout {timeout_ms} ms): {err}",
            r.rank
        );
        r.wait_ok(T);
    }
}

#[test]
fn missing_rank_0_times_out_naming_it() {
    play_rank_if_child();
    let job = Job::new("bt", "noroot");
    let mut r1 = spawn(
        Net::Unix,
        "missing_rank_0_times_out_naming_it",
        "expect_fail",
        &job,
        1,
        2,
        &[(TIMEOUT_VAR, "800")],
    );
    let msg = r1.expect("FAILED", T);
    let (ms, err) = msg.split_once(' ').unwrap();
    let ms: u64 = ms.parse().unwrap();
    eprintln!("after {ms} ms: {err}");
    assert!(err.contains("rank 0"), "{err}");
    assert!((700..=1500).contains(&ms), "gave up after {ms} ms: {err}");
    r1.wait_ok(T);
}

#[test]
fn tcp_kill_9_of_a_rank_on_node_1_aborts_node_0_quickly() {
    play_rank_if_child();
    // Two "hosts" of two ranks: rank 3 is on node 1; ranks 0 and 1 on node 0 must notice.
    let test = "tcp_kill_9_of_a_rank_on_node_1_aborts_node_0_quickly";
    kill_one_of_four(Net::tcp(2), test, 3);
}

#[test]
fn tcp_kill_9_of_rank_0_aborts_node_1_quickly() {
    play_rank_if_child();
    kill_one_of_four(Net::tcp(2), "tcp_kill_9_of_rank_0_aborts_node_1_quickly", 0);
}

#[test]
fn tcp_ranks_are_grouped_by_host() {
    play_rank_if_child();
    let test = "tcp_ranks_are_grouped_by_host";
    // 3 "hosts" of 2 ranks.
    let net = Net::tcp(2);
    let job = Job::new("bt", "tcp-layout");
    let mut ranks: Vec<Rank> = (0..6)
        .map(|r| spawn(net, test, "layout", &job, r, 6, &[]))
        .collect();
    for r in &mut ranks {
        let layout = r.expect("LAYOUT", T);
        let want = format!(
            "{} {} 2 node-{} [0, 1]|[2, 3]|[4, 5]",
            r.rank / 2,
            r.rank % 2,
            r.rank / 2
        );
        assert_eq!(layout, want, "rank {}", r.rank);
        let fds = r.expect("FDS_REFUSED", T);
        assert!(
            fds.contains(&format!("rank {}", r.rank))
                && fds.contains("all_gather_fds")
                && fds.contains("TCP"),
            "rank {}: {fds}",
            r.rank
        );
        let host = r.expect("HOST_REFUSED", T);
        assert!(
            host.contains("host backend") && host.contains("spans 3 nodes"),
            "rank {}: {host}",
            r.rank
        );
        r.expect("DONE", T);
        r.wait_ok(T);
    }
}

#[test]
fn tcp_unequal_nodes_are_refused() {
    play_rank_if_child();
    let test = "tcp_unequal_nodes_are_refused";
    let port = free_port().to_string();
    let master = format!("127.0.0.1:{port}");
    let job = Job::new("bt", "tcp-uneven");
    // Ranks 0, 1, 2 on host a; rank 3 on host b.
    let mut ranks: Vec<Rank> = (0..4)
        .map(|r| {
            let host = if r < 3 { "a" } else { "b" };
            let env = [
                ("IPCREDUCE_MASTER", master.as_str()),
                ("IPCREDUCE_HOST_ID", host),
            ];
            spawn(Net::Unix, test, "expect_fail", &job, r, 4, &env)
        })
        .collect();
    for r in &mut ranks {
        let msg = r.expect("FAILED", T);
        assert!(
            msg.contains("different numbers of ranks")
                && msg.contains("node 0 (host a) has 3 rank(s): 0-2")
                && msg.contains("node 1 (host b) has 1 rank(s): 3"),
            "rank {}: {msg}",
            r.rank
        );
        r.wait_ok(T);
    }
}

#[test]
fn tcp_without_a_secret_is_refused_before_connecting() {
    play_rank_if_child();
    let test = "tcp_without_a_secret_is_refused_before_connecting";
    let job = Job::new("bt", "tcp-nosecret");
    let net = Net::tcp(1);
    let mut r = spawn(
        net,
        test,
        "expect_fail",
        &job,
        1,
        2,
        &[("IPCREDUCE_SECRET", "")],
    );
    // RankInfo::from_env refuses it: the rank panics naming the variable.
    let st = r.wait(T);
    assert!(!st.success());
    let log = r.stderr();
    assert!(
        log.contains("IPCREDUCE_SECRET") && log.contains("TCP"),
        "{log}"
    );
}

/// Ranks `started` of a 4-rank TCP job of two 2-rank nodes run; the other node never comes.
/// Every started rank must give up within its timeout (plus rank 0's verdict grace), naming
/// what is missing in `names`.
fn tcp_node_never_comes(test: &str, tag: &str, started: [usize; 2], names: &str) {
    let timeout_ms = 1500u64;
    let t = timeout_ms.to_string();
    let net = Net::tcp(2);
    let job = Job::new("bt", tag);
    let mut ranks: Vec<Rank> = started
        .iter()
        .map(|&r| spawn(net, test, "expect_fail", &job, r, 4, &[(TIMEOUT_VAR, &t)]))
        .collect();
    for r in &mut ranks {
        let msg = r.expect("FAILED", T);
        let (ms, err) = msg.split_once(' ').unwrap();
        let ms: u64 = ms.parse().unwrap();
        eprintln!("rank {} after {ms} ms: {err}", r.rank);
        assert!(err.contains(names), "rank {}: {err}", r.rank);
        assert!(
            (500..=timeout_ms + 1200).contains(&ms),
            "rank {} gave up after {ms} ms (timeout {timeout_ms} ms): {err}",
            r.rank
        );
        r.wait_ok(T);
    }
}

#[test]
fn tcp_node_1_never_comes_and_node_0_gives_up_in_time() {
    play_rank_if_child();
    tcp_node_never_comes(
        "tcp_node_1_never_comes_and_node_0_gives_up_in_time",
        "tcp-nonode1",
        [0, 1],
        "ranks 2, 3",
    );
}

#[test]
fn tcp_node_0_never_comes_and_node_1_gives_up_in_time() {
    play_rank_if_child();
    tcp_node_never_comes(
        "tcp_node_0_never_comes_and_node_1_gives_up_in_time",
        "tcp-nonode0",
        [2, 3],
        "127.0.0.1",
    );
}

#[test]
fn tcp_node_groups_meet_per_node_and_share_the_jobs_abort() {
    play_rank_if_child();
    let test = "tcp_node_groups_meet_per_node_and_share_the_jobs_abort";
    // 2 "hosts" of 2 ranks over TCP; each host's pair then meets over its own Unix socket.
    let net = Net::tcp(2);
    let job = Job::new("bt", "tcp-group");
    let mut ranks: Vec<Rank> = (0..4)
        .map(|r| spawn(net, test, "group", &job, r, 4, &[]))
        .collect();
    for r in &mut ranks {
        let g = r.expect("GROUP", T);
        let node = r.rank / 2;
        let want = format!("{} 2 [{}, {}] 1", r.rank % 2, 2 * node, 2 * node + 1);
        assert_eq!(g, want, "rank {}", r.rank);
        assert_eq!(r.expect("FDS", T), "2", "rank {}", r.rank);
        r.expect("READY", T);
    }
    // A rank of node 1 dies: node 0's ranks (which share no group with it) and its node
    // peer must all see the abort within 2 s, through either bootstrap.
    let victim = 3;
    let killed_at = unix_micros();
    ranks[victim].kill();
    ranks[victim].wait(T);
    for r in ranks.iter_mut().filter(|r| r.rank != victim) {
        let (_, reason) = noticed_within_2s(r, killed_at);
        assert!(
            reason.contains("rank 3 died") || reason.contains("node 1 (job ranks [2, 3]"),
            "rank {}: {reason}",
            r.rank
        );
        let after = r.expect("GROUP_BARRIER_", T);
        eprintln!("rank {}: {reason}; then {after}", r.rank);
        assert!(after.starts_with("FAILED"), "rank {}: {after}", r.rank);
        r.wait_ok(T);
    }
}
