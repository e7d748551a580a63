//! The ranks of one node as a group of their own: a second rendezvous, over a Unix socket,
//! among the ranks that share this rank's host. Jobs across hosts run their peer-memory
//! data plane (and its descriptor exchange, which cannot cross hosts) over this group.
//!
//! The group's socket is named from the job id and the node's index, beside the job's own
//! socket; the node's first rank listens. Its abort state is linked both ways with the job's:
//! a rank that dies anywhere, seen by either liveness watcher, aborts the job's communicator
//! and the group's alike (the group's reasons, which number ranks within the node, reach the
//! job's state prefixed with the node and its ranks in the job).

use super::env::{default_socket_dir, ensure_private_dir, RankInfo};
use super::Bootstrap;
use crate::abort::AbortState;
use crate::error::Result;
use std::sync::{Arc, Weak};

/// The group's job id: the job's (cut to leave room), then the node.
fn group_job_id(job_id: &str, node: usize) -> String {
    let keep = job_id.len().min(52);
    // Job ids are ASCII (checked at start), so any byte index is a character boundary.
    format!("{}-node{node}", &job_id[..keep])
}

impl Bootstrap {
    /// Collective among the ranks of this rank's node (each node meets separately): the
    /// node's ranks as a [`Bootstrap`] of their own, numbered by their rank in the job.
    /// Bounded by the job's timeout; shares the job's abort state.
    pub fn node_group(&self) -> Result<Bootstrap> {
        let layout = self.layout();
        let node = layout.node();
        let job = group_job_id(&self.info.job_id, node);
        let dir = match self.info.socket.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => default_socket_dir(),
        };
        // Over TCP the job's socket directory was never made (nothing listened there).
        if dir == default_socket_dir() {
            ensure_private_dir(&dir)?;
        }
        let mut info = RankInfo::new(
            layout.local_rank(),
            layout.local_size(),
            dir.join(format!("{job}.sock")),
            job,
            self.info.secret.clone(),
        )?
        .with_host_id(self.info.host_id.clone())?;
        // The GPU follows the rank's place on its host, as in the job.
        info.local_rank = self.info.local_rank;
        let abort = AbortState::new();
        let ranks = layout.node_ranks(node);
        link(
            &self.abort_state(),
            &abort,
            format!("node {node} (job ranks {ranks:?} by local rank)"),
        );
        Bootstrap::connect_sharing(info, self.timeout, abort)
    }
}

/// Aborting either state aborts the other (the first reason wins in each); `group_name`
/// prefixes the group's reasons in the job's state.
fn link(job: &Arc<AbortState>, group: &Arc<AbortState>, group_name: String) {
    // Weak: each state's hooks are kept by the other, which must not keep it alive.
    let pair = || (Arc::downgrade(job), Arc::downgrade(group));
    let up = |w: &Weak<AbortState>| w.upgrade();
    let (j, g) = pair();
    job.on_abort(Box::new(move || {
        if let (Some(j), Some(g)) = (up(&j), up(&g)) {
            // The origin travels along: a local abort is news for the group's ranks too.
            if let Some((why, origin)) = j.first() {
                g.abort_from(why, origin);
            }
        }
    }));
    let (j, g) = pair();
    group.on_abort(Box::new(move || {
        if let (Some(j), Some(g)) = (up(&j), up(&g)) {
            if let Some((why, origin)) = g.first() {
                j.abort_from(format!("{group_name}: {why}"), origin);
            }
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ids_are_valid_job_ids_naming_the_node() {
        let long = "j".repeat(64);
        let id = group_job_id(&long, 12);
        assert!(id.len() <= 64 && id.ends_with("-node12"), "{id}");
        assert_eq!(group_job_id("job", 1), "job-node1");
        RankInfo::new(0, 2, "/tmp/x.sock", id, None).unwrap();
    }

    #[test]
    fn linked_states_abort_each_other_with_the_first_reason() {
        let (job, group) = (AbortState::new(), AbortState::new());
        link(&job, &group, "node 1".into());
        group.abort("rank 1 died");
        assert!(job.is_aborted());
        assert_eq!(job.reason().unwrap(), "node 1: rank 1 died");
        assert_eq!(group.reason().unwrap(), "rank 1 died");
        let (job, group) = (AbortState::new(), AbortState::new());
        link(&job, &group, "node 0".into());
        job.abort("rank 7 died");
        assert_eq!(group.reason().unwrap(), "rank 7 died");
        assert_eq!(job.reason().unwrap(), "rank 7 died");
    }
}
