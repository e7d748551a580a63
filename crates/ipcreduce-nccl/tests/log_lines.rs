//! Log lines of several processes sharing one stderr (a launcher's pipe) stay whole: four
//! children of this test write thousands of long lines each into the same pipe at once, and
//! every line read back is one of theirs, complete, with its rank.

use ipcreduce_nccl::log::{self, Coll};
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILDREN: usize = 4;
const LINES: usize = 3000;
/// A long body: a line written in several pieces would very likely be cut by another's.
const PAD: usize = 300;

#[test]
fn lines_of_several_processes_never_interleave() {
    let mut fds = [0; 2];
    // SAFETY: a two-int array for pipe(2).
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
    // SAFETY: the two fresh descriptors, owned from here on.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let mut kids = Vec::new();
    for rank in 0..CHILDREN {
        let err = write.try_clone().expect("dup of the pipe's write end");
        let kid = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("IPCREDUCE_NCCL", "log")
            .env("LOG_LINES_RANK", rank.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::from(err))
            .spawn()
            .expect("spawn a child");
        kids.push(kid);
    }
    drop(write);
    // Read everything (the children end; the pipe closes) on a thread, bounded by a deadline.
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let mut f = std::fs::File::from(read);
        f.read_to_string(&mut text).map(|_| text)
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    for (rank, mut kid) in kids.into_iter().enumerate() {
        loop {
            if let Some(st) = kid.try_wait().expect("wait for a child") {
                assert!(st.success(), "child {rank} failed: {st}");
                break;
            }
            if Instant::now() > deadline {
                let _ = kid.kill();
                panic!("child {rank} still runs after 60 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let text = reader
        .join()
        .expect("reader thread")
        .expect("read the pipe");
    let mut per_rank = [0usize; CHILDREN];
    for line in text.lines() {
        // The harness's own lines ("running 1 test", results) come on stdout, sent to null.
        if line.contains("counts:") {
            continue;
        }
        let rest = line
            .strip_prefix("ipcreduce-nccl: rank ")
            .unwrap_or_else(|| panic!("a line not starting with the prefix: {line:?}"));
        let (rank, rest) = rest.split_once(' ').expect("rank then pid");
        let rank: usize = rank.parse().unwrap_or_else(|_| panic!("rank in {line:?}"));
        let want_tail = format!("ncclAllReduce {} rank={rank} -> ipcreduce", "x".repeat(PAD));
        assert!(
            rest.starts_with("pid ") && rest.ends_with(&want_tail),
            "a cut or mixed line: {line:?}"
        );
        assert_eq!(line.matches("ipcreduce-nccl:").count(), 1, "{line:?}");
        per_rank[rank] += 1;
    }
    assert_eq!(per_rank, [LINES; CHILDREN], "lines per child");
}

#[test]
#[ignore = "run by the other test in a child process"]
fn child() {
    let rank: usize = std::env::var("LOG_LINES_RANK").unwrap().parse().unwrap();
    assert!(log::logging(), "IPCREDUCE_NCCL=log");
    let pad = "x".repeat(PAD);
    for _ in 0..LINES {
        log::collective(
            Coll::AllReduce,
            Some(rank),
            true,
            format_args!("{pad} rank={rank}"),
        );
    }
    // stderr is the shared pipe itself, not a copy of it.
    assert!(std::io::stderr().as_raw_fd() == 2);
}
