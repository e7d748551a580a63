//! `ipcreduce check`: randomized correctness sweep against the float64 reference.
