//! The recorder with a phase-stamp source: each call's stamps land in its trace line.

use super::stamps::{BlockStamps, CallStamps, Source};
use super::*;
use std::sync::{Arc, Mutex};

/// A source that says which call each kernel call belonged to, as the cuda ring does.
#[derive(Default)]
struct Fake {
    current: Mutex<Vec<u64>>,
}

impl Source for Fake {
    fn set_call(&self, seq: u64) {
        self.current.lock().unwrap().push(seq);
    }

    fn read(&self) -> (Vec<CallStamps>, u64) {
        let calls = self.current.lock().unwrap().clone();
        let stamps = calls
            .into_iter()
            .map(|seq| CallStamps {
                seq,
                kseq: seq + 100,
                blocks: vec![BlockStamps {
                    block: 0,
                    start: Some(1_000 * seq),
                    peers: vec![(1, 1_000 * seq + 7)],
                    reduce: None,
                    gather: None,
                    end: Some(1_000 * seq + 9),
                }],
            })
            .collect();
        (stamps, 32)
    }
}

#[test]
fn each_calls_stamps_are_written_into_its_trace_line() {
    let dir = std::env::temp_dir().join(format!("ipcreduce-stamps-unit-{}", std::process::id()));
    let mut r = Recorder::new(8, None);
    r.identify(Identity {
        job: "st".into(),
        rank: 1,
        world: 2,
        host: "h".into(),
    });
    let source = Arc::new(Fake::default());
    r.attach_stamps(Some(source.clone()));
    for count in [4, 8] {
        r.begin(&CallId {
            op: crate::backend::SgOp::AllReduce,
            count,
            dtype: DType::F32,
            reduce: ReduceOp::Sum,
            in_place: false,
            stream: std::ptr::null_mut(),
        });
        r.end(true);
    }
    assert_eq!(*source.current.lock().unwrap(), [1, 2]);
    let file = r.write_trace(&dir, 1).unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    // The header, then call 2 only (since 1), with its own stamps.
    assert_eq!(lines.len(), 2);
    let p = &lines[1]["phases"];
    assert_eq!(lines[1]["seq"], 2);
    assert_eq!(p["kseq"], 102);
    assert_eq!(p["tick_ns"], 32);
    assert_eq!(p["blocks"][0]["start_ns"], 2_000);
    assert_eq!(p["blocks"][0]["peers"][0], serde_json::json!([1, 2_007]));
    assert!(p["blocks"][0]["reduce_ns"].is_null());
}
