//! The sizes the GPU suite's LL wrap test relies on (pure: runs without a GPU).

mod common;

use common::ll_sizes::ll_count;

/// A 16-bit sequence check would accept call k's lines in call k + 65,536: the test can only
/// catch that if the large call's lines (64 KiB, at every multiple of 65,536) are left in
/// place by the smaller calls between them and the sizes repeat with the same period.
#[test]
fn ll_wrap_sizes_are_built_to_catch_a_16_bit_sequence() {
    assert_eq!(ll_count(0) * 4, 64 << 10);
    for i in 1..65_536 {
        assert!(ll_count(i) * 4 <= 16 << 10, "call {i}");
        assert_eq!(ll_count(i), ll_count(i + 65_536));
    }
    assert_eq!(ll_count(65_536), ll_count(0));
    let distinct: std::collections::HashSet<_> = (1..65_536).map(ll_count).collect();
    assert!(distinct.len() > 1000, "sizes vary: {}", distinct.len());
}
