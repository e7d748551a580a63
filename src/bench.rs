//! `ipcreduce bench`: nccl-tests-style timing table, every timed size checked.
