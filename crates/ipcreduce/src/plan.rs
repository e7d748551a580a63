//! Pure decisions, kept apart from any backend so they can be unit-tested without a GPU:
//! which algorithm `Auto` picks, and how a message is cut into chunks and shards.
//!
//! All thresholds live here. They are first guesses until tuned on real hardware; the
//! benchmark's JSON is the evidence for changing them.

use crate::types::{Algorithm, BackendKind};

/// Size limits under which `Auto` picks one-shot, per backend and world size.
/// One-shot moves (world-1) x bytes per rank but needs one barrier; two-shot moves
/// 2 (world-1)/world x bytes and needs two, so one-shot wins while latency dominates.
pub fn oneshot_max_bytes(backend: BackendKind, world: usize) -> usize {
    match backend {
        BackendKind::Cuda => match world {
            0..=2 => 512 << 10,
            3..=4 => 256 << 10,
            _ => 128 << 10,
        },
        BackendKind::Host => match world {
            0..=2 => 64 << 10,
            3..=4 => 32 << 10,
            _ => 16 << 10,
        },
    }
}

/// Default largest message for the cuda backend's low-latency one-shot (data and flags pushed
/// together, no barrier): beyond it the doubled traffic costs more than the barrier saves.
/// `IPCREDUCE_LL_MAX` overrides (0 disables).
pub const LL_DEFAULT_MAX_BYTES: usize = 64 << 10;

/// The algorithm a call runs: an explicit choice wins over `IPCREDUCE_ALGO` (`env`), which
/// wins over `Auto`'s size rule.
pub fn choose(
    requested: Algorithm,
    env: Option<Algorithm>,
    backend: BackendKind,
    world: usize,
    bytes: usize,
) -> Algorithm {
    let algo = match (requested, env) {
        (Algorithm::Auto, Some(e)) => e,
        (r, _) => r,
    };
    match algo {
        Algorithm::Auto if world == 1 => Algorithm::OneShot,
        Algorithm::Auto if bytes <= oneshot_max_bytes(backend, world) => Algorithm::OneShot,
        Algorithm::Auto => Algorithm::TwoShot,
        other => other,
    }
}

/// A half-open element range `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Cuts `count` elements into chunks of at most `chunk_elems` elements.
pub fn chunks(count: usize, chunk_elems: usize) -> impl Iterator<Item = Span> {
    assert!(chunk_elems > 0, "chunk size must be positive");
    (0..count.div_ceil(chunk_elems)).map(move |i| Span {
        start: i * chunk_elems,
        end: ((i + 1) * chunk_elems).min(count),
    })
}

/// Splits `len` elements into `parts` contiguous shards whose starts are multiples of
/// `align` elements (so vector accesses stay aligned); the last shards may be shorter or empty.
pub fn shard(len: usize, parts: usize, index: usize, align: usize) -> Span {
    assert!(parts > 0 && index < parts && align > 0);
    let per = len.div_ceil(parts).div_ceil(align) * align;
    let start = (index * per).min(len);
    let end = ((index + 1) * per).min(len);
    Span { start, end }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn explicit_choice_beats_env_beats_auto() {
        let b = BackendKind::Cuda;
        assert_eq!(
            choose(Algorithm::TwoShot, Some(Algorithm::OneShot), b, 2, 8),
            Algorithm::TwoShot
        );
        assert_eq!(
            choose(Algorithm::Auto, Some(Algorithm::TwoShot), b, 2, 8),
            Algorithm::TwoShot
        );
        assert_eq!(choose(Algorithm::Auto, None, b, 2, 8), Algorithm::OneShot);
        assert_eq!(
            choose(Algorithm::Auto, None, b, 2, 1 << 30),
            Algorithm::TwoShot
        );
        assert_eq!(
            choose(Algorithm::Auto, None, b, 1, 1 << 30),
            Algorithm::OneShot
        );
    }

    proptest! {
        #[test]
        fn chunks_cover_exactly(count in 0usize..100_000, chunk in 1usize..5000) {
            let mut next = 0;
            for c in chunks(count, chunk) {
                prop_assert_eq!(c.start, next);
                prop_assert!(c.len() <= chunk && !c.is_empty());
                next = c.end;
            }
            prop_assert_eq!(next, count);
        }

        #[test]
        fn shards_partition_and_align(len in 0usize..100_000, parts in 1usize..9, align in 1usize..17) {
            let mut next = 0;
            for i in 0..parts {
                let s = shard(len, parts, i, align);
                prop_assert_eq!(s.start, next);
                prop_assert!(s.start.is_multiple_of(align) || s.start == len);
                next = s.end;
            }
            prop_assert_eq!(next, len);
        }
    }
}
