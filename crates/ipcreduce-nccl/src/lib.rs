//! # libipcreduce_nccl.so: NCCL's C API, with ipcreduce inside one node
//!
//! Loaded in place of NCCL (`LD_PRELOAD=libipcreduce_nccl.so`), it exports every entry point
//! of NCCL 2.28 and hands each to the real NCCL ([`real`] finds it), except the all-reduce,
//! reduce-scatter and all-gather of communicators whose ranks share one machine, which
//! ipcreduce's cuda backend runs on the caller's stream ([`coll`]). That communicator is
//! made beside NCCL's at `ncclCommInitRank*`/`ncclCommSplit`/`ncclCommShrink`, its
//! rendezvous data all-gathered through NCCL's own communicator ([`comm`]), so a program
//! needs no setting of ours. `IPCREDUCE_NCCL=off|on|log` ([`log`]).
//!
//! | module | what is there |
//! |---|---|
//! | [`types`] | nccl.h's types and numbers |
//! | [`real`] | finding and loading the real NCCL |
//! | [`forward`] | the entry points handed on unchanged |
//! | [`comm`] | the ipcreduce communicator beside NCCL's, and the registry of them |
//! | [`comm_entries`] | the entry points of communicator life: init, split, destroy, abort, errors |
//! | [`coll`] | the accelerated collectives: which calls are ours, running and forwarding them |
//! | [`coll_entries`] | the collectives' entry points |
//! | [`avg`] | `ncclAvg`'s division by the world size |
//! | [`group`] | `ncclGroupStart`/`ncclGroupEnd` |
//! | [`log`] | `IPCREDUCE_NCCL`, call lines and counts |
//! | [`profile`] | `IPCREDUCE_NCCL_PROFILE=1`: host time per phase |
//! | [`errors`] | texts for `ncclGetLastError` |
//! | [`window`] | symmetric windows registered with ipcreduce too: zero-copy collectives |

// The entry points' safety contract is nccl.h's, the same for all of them; they are called
// from C only.
#![allow(clippy::missing_safety_doc, non_snake_case)]

/// What this library was built from, one contiguous string in the binary (device scripts read
/// it with `grep -a`; the ready line of `IPCREDUCE_NCCL=log` prints it).
pub const BUILD: &str = concat!("ipcreduce-nccl build ", env!("IPCREDUCE_GIT_COMMIT"));

#[macro_use]
mod macros;
pub mod avg;
pub mod coll;
pub mod coll_entries;
pub mod comm;
pub mod comm_entries;
pub mod errors;
pub mod forward;
pub mod group;
pub mod log;
pub mod profile;
pub mod real;
pub mod types;
pub mod window;
