//! The wait-per-peer matrix of `ipcreduce trace summarize`: how long each rank waited for each
//! other rank, summed over the calls every rank recorded a start time for.
//!
//! A rank that starts call N at t_i cannot finish it before every peer j started it (at t_j):
//! it waited max(0, t_j - t_i) for j. Row i, column j is that sum over the calls compared, so
//! a row tells whom a rank waited for, and a column how long a rank kept the others waiting.
//! The start times are the host wall clock of each rank's call (the flight recorder's), so the
//! matrix is made only when every record comes from one host. It measures arrival skew, the
//! cause of most waiting; a kernel's own wait for a slow link is not in it.

use super::records::Dump;
use serde::Serialize;

#[derive(Debug, Serialize, PartialEq)]
pub(super) struct Waits {
    /// The ranks of the rows and columns, in order.
    pub ranks: Vec<usize>,
    /// Calls compared (those every rank recorded a start time for).
    pub calls: usize,
    /// `total_us[i][j]`: how long `ranks[i]` waited for `ranks[j]`, summed over the calls.
    pub total_us: Vec<Vec<f64>>,
}

/// The matrix over calls `first..=last` (None when fewer than two ranks or no call has every
/// rank's start time).
pub(super) fn waits(dumps: &[Dump], first: u64, last: u64) -> Option<Waits> {
    let ranks: Vec<usize> = dumps.iter().map(|d| d.header.rank).collect();
    let n = ranks.len();
    if n < 2 {
        return None;
    }
    let mut total = vec![vec![0u64; n]; n];
    let mut calls = 0;
    for seq in first..=last {
        let Some(starts) = dumps
            .iter()
            .map(|d| d.recs.get(&seq)?.start_ns)
            .collect::<Option<Vec<u64>>>()
        else {
            continue;
        };
        calls += 1;
        for (i, row) in total.iter_mut().enumerate() {
            for (j, cell) in row.iter_mut().enumerate() {
                *cell += starts[j].saturating_sub(starts[i]);
            }
        }
    }
    (calls > 0).then(|| Waits {
        ranks,
        calls,
        total_us: total
            .into_iter()
            .map(|row| row.into_iter().map(|ns| ns as f64 / 1e3).collect())
            .collect(),
    })
}

/// The matrix as text: a header line, then one row per rank, in ms.
pub(super) fn text(w: &Waits) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "waits over {} calls, ms (the row's rank waited for the column's; from start times):",
        w.calls
    );
    let head: Vec<String> = w
        .ranks
        .iter()
        .map(|r| format!("{:>9}", format!("r{r}")))
        .collect();
    let _ = writeln!(o, "{:>6}{}", "", head.join(""));
    for (i, row) in w.total_us.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(j, us)| {
                if i == j {
                    format!("{:>9}", "-")
                } else {
                    format!("{:>9.3}", us / 1e3)
                }
            })
            .collect();
        let _ = writeln!(o, "{:>6}{}", format!("r{}", w.ranks[i]), cells.join(""));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::super::records::made_up::{dump as made_up, rec};
    use super::*;

    /// Rank `rank`'s record (world 3, one host) of calls with these start times (ns), call 1
    /// first; None: a call recorded without a time.
    fn dump(rank: usize, starts: &[Option<u64>]) -> Dump {
        let recs = (1..)
            .zip(starts)
            .map(|(seq, &t)| rec(seq, t, None, None))
            .collect();
        made_up(rank, 3, "h", recs)
    }

    #[test]
    fn each_rank_waits_for_those_that_started_after_it() {
        // Call 1: rank 2 starts 5 us after rank 0 and 3 us after rank 1. Call 2: rank 0 is
        // 10 us late for both. Call 3 has no time on rank 1: left out.
        let d = [
            dump(0, &[Some(1_000), Some(20_000), Some(30_000)]),
            dump(1, &[Some(3_000), Some(10_000), None]),
            dump(2, &[Some(6_000), Some(10_000), Some(30_000)]),
        ];
        let w = waits(&d, 1, 3).unwrap();
        assert_eq!(w.ranks, [0, 1, 2]);
        assert_eq!(w.calls, 2);
        assert_eq!(
            w.total_us,
            [
                [0.0, 2.0, 5.0],  // rank 0 waited 2 us for rank 1, 5 for rank 2 (call 1)
                [10.0, 0.0, 3.0], // rank 1: 10 for rank 0 (call 2), 3 for rank 2 (call 1)
                [10.0, 0.0, 0.0], // rank 2: 10 for rank 0 (call 2)
            ]
        );
        let t = text(&w);
        assert!(t.starts_with("waits over 2 calls, ms"), "{t}");
        assert!(t.contains("    r1    0.010        -    0.003"), "{t}");
    }

    #[test]
    fn without_two_ranks_or_any_timed_call_there_is_no_matrix() {
        assert_eq!(waits(&[dump(0, &[Some(1)])], 1, 1), None);
        let d = [dump(0, &[None]), dump(1, &[Some(5)])];
        assert_eq!(waits(&d, 1, 1), None);
    }
}
