//! Shard boundaries, defined once for every operation that cuts data among ranks: the public
//! reduce-scatter and all-gather (shards of the caller's count), the hierarchical all-reduce
//! (an arbitrary count cut into 16-byte aligned shards, one per rank of a node) and the
//! two-shot all-reduces ([`crate::plan::shard`] is this rule too).
//!
//! A cut is `total` elements in `parts` shards of `per` elements: shard `s` is
//! `[s * per, min((s + 1) * per, total))`, so the last shards may be shorter or empty. The
//! kernels receive `total` and `per` and compute the same ranges.

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

/// `total` elements cut into shards of `per` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    pub total: usize,
    pub per: usize,
    pub parts: usize,
}

impl Shards {
    /// `parts` shards of exactly `count` elements each (reduce-scatter's recvcount,
    /// all-gather's sendcount).
    pub fn even(count: usize, parts: usize) -> Shards {
        Shards {
            total: count * parts,
            per: count,
            parts,
        }
    }

    /// `total` elements in `parts` shards whose starts are multiples of `align` elements:
    /// every shard holds `ceil(ceil(total / parts) / align) * align` elements but the last
    /// non-empty one.
    pub fn aligned(total: usize, parts: usize, align: usize) -> Shards {
        assert!(parts > 0 && align > 0, "parts and align must be positive");
        Shards {
            total,
            per: total.div_ceil(parts).div_ceil(align) * align,
            parts,
        }
    }

    /// 16-byte aligned shards for elements of `elem_size` bytes: what vector loads need.
    pub fn aligned16(total: usize, parts: usize, elem_size: usize) -> Shards {
        Shards::aligned(total, parts, (16 / elem_size).max(1))
    }

    /// Shard `s`.
    pub fn span(&self, s: usize) -> Span {
        assert!(s < self.parts, "shard {s} of {}", self.parts);
        let start = (s * self.per).min(self.total);
        let end = (start + self.per).min(self.total);
        Span { start, end }
    }

    /// Chunks every rank runs when `chunk` elements of each shard move at a time: counted from
    /// `per`, not from a rank's own shard, so that every rank runs the same number.
    pub fn chunks(&self, chunk: usize) -> usize {
        self.per.div_ceil(chunk.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_shards_are_the_callers_counts() {
        let s = Shards::even(5, 3);
        assert_eq!(s.total, 15);
        let spans: Vec<_> = (0..3).map(|i| (s.span(i).start, s.span(i).end)).collect();
        assert_eq!(spans, [(0, 5), (5, 10), (10, 15)]);
        assert_eq!(Shards::even(0, 4).span(3).len(), 0);
    }

    #[test]
    fn aligned_shards_start_on_16_bytes_and_may_be_empty() {
        // 3 floats in 2 shards: 4 floats (16 bytes) per shard, the second one empty.
        let s = Shards::aligned16(3, 2, 4);
        assert_eq!((s.span(0).start, s.span(0).end), (0, 3));
        assert!(s.span(1).is_empty());
        // 100 bf16 in 4 shards: 25 -> 32 elements (64 bytes) per shard.
        let s = Shards::aligned16(100, 4, 2);
        assert_eq!(s.per, 32);
        assert_eq!(s.span(3).len(), 4);
        assert_eq!(s.chunks(10), 4);
    }
}
