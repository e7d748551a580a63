//! The call sizes of the GPU suite's LL wrap test (tests/gpu.rs, `low_latency_sequence_wrap`),
//! apart from it so that the test of the sizes themselves (tests/ll_wrap_sizes.rs) runs
//! without a GPU.

/// Elements of call `i` of the LL wrap test: a 64 KiB call at every multiple of 65,536, calls
/// of at most 16 KiB between them (so the large call's tail lines are not overwritten), the
/// same sizes every 65,536 calls.
pub fn ll_count(i: usize) -> usize {
    let j = i % 65_536;
    if j == 0 {
        16_384
    } else {
        1 + (j.wrapping_mul(2_654_435_761) >> 7) % 4096
    }
}
