//! `ipcreduce launch -n N -- CMD...`: starts N ranks of a command with the job's variables set.
