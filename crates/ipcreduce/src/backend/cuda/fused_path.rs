//! Which fused kernel a call runs, and how its chunks lie in the workspace slots.
//!
//! The algorithm comes chosen ([`crate::fused::choose`]: `OneShot` or `TwoShot`; `Auto` is
//! `OneShot`): `OneShot` runs the LL kernel where it was measured faster ([`ll_auto`]: short
//! rows, small calls, up to four ranks), the staged one-shot kernel elsewhere; `TwoShot` the
//! two-shot one. `IPCREDUCE_FUSED_PATH` (read once at init, for the tests and the benchmark)
//! forces any path for every call. The path is part of the call's identity, so ranks that force
//! different ones fail with a mismatch instead of pairing two kernels.

use super::kernels::LL_MAX_BYTES;
use super::paths::CudaPath;
use crate::error::{Error, Result};
use crate::fused::{self, Shape};
use crate::types::Algorithm;

/// The environment variable that forces the fused path.
pub const FUSED_PATH_VAR: &str = "IPCREDUCE_FUSED_PATH";

/// `IPCREDUCE_FUSED_PATH`'s value: `oneshot` (staged), `twoshot`, `ll`, or `auto` (or unset,
/// or empty: the algorithm decides). Anything else is a configuration error naming the words.
pub fn parse_forced(value: Option<&str>) -> Result<Option<CudaPath>> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match v.to_ascii_lowercase().as_str() {
        "auto" => Ok(None),
        "oneshot" | "one-shot" => Ok(Some(CudaPath::FusedOneShot)),
        "twoshot" | "two-shot" => Ok(Some(CudaPath::FusedTwoShot)),
        "ll" => Ok(Some(CudaPath::FusedLl)),
        _ => Err(Error::Config(format!(
            "{FUSED_PATH_VAR}={v}: expected oneshot, twoshot, ll or auto"
        ))),
    }
}

/// [`parse_forced`] of the process environment.
pub fn forced_from_env() -> Result<Option<CudaPath>> {
    parse_forced(std::env::var(FUSED_PATH_VAR).ok().as_deref())
}

/// Where a fused call's chunks lie: `rows_per_chunk` rows per chunk, row `lr` of a chunk at
/// `lr * stride` bytes of the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub path: CudaPath,
    pub rows_per_chunk: usize,
    pub stride: usize,
}

/// Bytes a row takes in a slot on `path`: the one-shot kernel stages the input rows back to back
/// (it copies pairs of rows at once); in the two-shot kernel a row's place holds either the
/// input row (for its owner) or the owner's sum of it (for every rank), one row of the dtype
/// either way, on a 16-byte stride so that rows copy 16 bytes at a time (kernels/fused.cu).
/// The slot is a multiple of 16 bytes, so a two-shot row fits wherever a one-shot row does.
pub fn row_stride(path: CudaPath, s: &Shape, size: usize) -> usize {
    let row = s.hidden * size;
    match path {
        CudaPath::FusedTwoShot => row.next_multiple_of(16),
        _ => row,
    }
}

/// Whether a call can run on the LL kernel: every row a whole number of 8-byte lines (so no
/// line holds two rows, which two blocks would clear), and the call within the LL area.
fn ll_fits(s: &Shape, size: usize) -> bool {
    let bytes = s.count() * size;
    (s.hidden * size).is_multiple_of(8) && bytes <= LL_MAX_BYTES
}

/// The widest row, in bytes, that `OneShot` gives the LL kernel. On one H100 under MPS
/// (2026-12-07, bf16, 1-32 tokens, graphs of 20 calls; bench/results/2026-12-07-h100-ll-fused)
/// fused-ll took 0.79-0.87 of the staged one-shot kernel's time with rows of 8 KiB (hidden
/// 4096) at worlds 2 and 4, but 0.94-1.25 with 16 KiB rows and 1.13-1.77 with 32 KiB rows.
pub const LL_AUTO_MAX_ROW_BYTES: usize = 8192;
/// The largest call (bytes per rank) `OneShot` gives the LL kernel: the largest measured.
pub const LL_AUTO_MAX_BYTES: usize = 256 * 1024;
/// The largest world `OneShot` gives the LL kernel: the largest measured.
pub const LL_AUTO_MAX_WORLD: usize = 4;

/// Whether `OneShot` runs the call on the LL kernel (see [`LL_AUTO_MAX_ROW_BYTES`]): from the
/// identity alone (shape, element size, world), so every rank decides alike.
pub fn ll_auto(s: &Shape, size: usize, world: usize) -> bool {
    ll_fits(s, size)
        && s.hidden * size <= LL_AUTO_MAX_ROW_BYTES
        && s.count() * size <= LL_AUTO_MAX_BYTES
        && world <= LL_AUTO_MAX_WORLD
}

/// The path and layout of a call: `forced` if set, else the algorithm's kernel. A row that does
/// not fit a slot of `slot_bytes` (the agreed workspace's) is an error (on either staged path
/// the same: see [`row_stride`]).
pub fn layout(
    rank: usize,
    world: usize,
    forced: Option<CudaPath>,
    algo: Algorithm,
    slot_bytes: usize,
    s: &Shape,
    size: usize,
) -> Result<Layout> {
    let path = forced.unwrap_or(match algo {
        Algorithm::TwoShot => CudaPath::FusedTwoShot,
        _ if ll_auto(s, size, world) => CudaPath::FusedLl,
        _ => CudaPath::FusedOneShot,
    });
    if path == CudaPath::FusedLl {
        if !ll_fits(s, size) {
            return Err(Error::invalid(
                rank,
                fused::NAME,
                format!(
                    "fused-ll takes rows of a multiple of 8 bytes and at most {LL_MAX_BYTES} \
                     bytes per rank, not {} x {} of {size} bytes",
                    s.tokens, s.hidden
                ),
            ));
        }
        // No slot: the whole call at once, rows back to back in the LL area.
        return Ok(Layout {
            path,
            rows_per_chunk: s.tokens,
            stride: s.hidden * size,
        });
    }
    let stride = row_stride(path, s, size);
    (slot_bytes / stride > 0)
        .then(|| Layout {
            path,
            rows_per_chunk: (slot_bytes / stride).min(s.tokens),
            stride,
        })
        .ok_or_else(|| {
            let need = stride;
            Error::invalid(
                rank,
                fused::NAME,
                format!(
                    "a row takes {need} bytes of the workspace slot on {} but the slot has \
                 {slot_bytes}: raise IPCREDUCE_WORKSPACE_BYTES",
                    path.name()
                ),
            )
        })
}

/// Rows dealt to a block at a time (kernels/fused.cu `FusedArgs::pass_rows`): one row per
/// block (taken by the whole block) while a chunk's rows, or on two-shot a rank's share of
/// them, fit within the agreed cap; beyond, pairs (taken by the block's two halves at once).
/// The LL kernel's call is one chunk. From the identity and the cap alone, so the same on every
/// rank.
pub fn pass_rows(l: &Layout, world: usize, cap: usize) -> usize {
    let rows = match l.path {
        CudaPath::FusedTwoShot => l.rows_per_chunk.div_ceil(world.max(1)),
        _ => l.rows_per_chunk,
    };
    if rows <= cap.max(1) {
        1
    } else {
        2
    }
}

/// CTAs of a call, from the identity (rows, slot, world) and the agreed cap: one per pass of
/// rows of a chunk (one-shot), one per pass a rank owns (two-shot: passes dealt to ranks).
pub fn grid(l: &Layout, world: usize, cap: usize, max_blocks: usize) -> u32 {
    let passes = l.rows_per_chunk.div_ceil(pass_rows(l, world, cap));
    let per_block = match l.path {
        CudaPath::FusedTwoShot => passes.div_ceil(world.max(1)),
        _ => passes,
    };
    per_block.min(cap).clamp(1, max_blocks) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(tokens: usize, hidden: usize, fp8: bool) -> Shape {
        Shape {
            tokens,
            hidden,
            eps_bits: 0,
            fp8,
            out_in_place: false,
            residual_in_place: false,
        }
    }

    #[test]
    fn a_row_per_block_while_the_rows_fit_the_cap_then_pairs() {
        let l = |path, rows_per_chunk| Layout {
            path,
            rows_per_chunk,
            stride: 8192,
        };
        let one = CudaPath::FusedOneShot;
        let two = CudaPath::FusedTwoShot;
        // One-shot, cap 64: 8 and 64 rows one per block; 65 and 128 rows in pairs.
        assert_eq!(pass_rows(&l(one, 8), 2, 64), 1);
        assert_eq!(grid(&l(one, 8), 2, 64, 1024), 8);
        assert_eq!(pass_rows(&l(one, 64), 2, 64), 1);
        assert_eq!(grid(&l(one, 64), 2, 64, 1024), 64);
        assert_eq!(pass_rows(&l(one, 65), 2, 64), 2);
        assert_eq!(grid(&l(one, 65), 2, 64, 1024), 33);
        assert_eq!(grid(&l(one, 128), 2, 64, 1024), 64);
        assert_eq!(grid(&l(one, 1), 2, 64, 1024), 1);
        // Two-shot, world 4: a rank's share of 256 rows is 64 (one per block); of 260, 65.
        assert_eq!(pass_rows(&l(two, 256), 4, 64), 1);
        assert_eq!(grid(&l(two, 256), 4, 64, 1024), 64);
        assert_eq!(pass_rows(&l(two, 260), 4, 64), 2);
        assert_eq!(grid(&l(two, 260), 4, 64, 1024), 33);
        // LL (the whole call one chunk): as one-shot.
        let ll = CudaPath::FusedLl;
        assert_eq!(pass_rows(&l(ll, 4), 2, 64), 1);
        assert_eq!(grid(&l(ll, 4), 2, 64, 1024), 4);
        assert_eq!(pass_rows(&l(ll, 100), 2, 64), 2);
        assert_eq!(grid(&l(ll, 100), 2, 64, 1024), 50);
    }

    #[test]
    fn the_knob_takes_its_words_and_refuses_others() {
        assert_eq!(parse_forced(None).unwrap(), None);
        assert_eq!(parse_forced(Some(" ")).unwrap(), None);
        assert_eq!(parse_forced(Some("auto")).unwrap(), None);
        assert_eq!(
            parse_forced(Some("oneshot")).unwrap(),
            Some(CudaPath::FusedOneShot)
        );
        assert_eq!(
            parse_forced(Some("TwoShot")).unwrap(),
            Some(CudaPath::FusedTwoShot)
        );
        assert_eq!(parse_forced(Some("ll")).unwrap(), Some(CudaPath::FusedLl));
        let e = parse_forced(Some("nccl")).unwrap_err().to_string();
        assert!(
            e.contains(FUSED_PATH_VAR) && e.contains("oneshot, twoshot, ll or auto"),
            "{e}"
        );
    }

    #[test]
    fn rows_lie_back_to_back_one_shot_and_on_a_16_byte_stride_two_shot() {
        let bf16 = |algo, tokens, fp8| layout(0, 2, None, algo, 1 << 20, &s(tokens, 4096, fp8), 2);
        let one = bf16(Algorithm::OneShot, 512, false).unwrap();
        assert_eq!(
            (one.path, one.rows_per_chunk, one.stride),
            (CudaPath::FusedOneShot, 128, 8192)
        );
        let two = bf16(Algorithm::TwoShot, 512, true).unwrap();
        assert_eq!(two.path, CudaPath::FusedTwoShot);
        // The sums, not the outputs: one row of the dtype, with or without fp8.
        assert_eq!((two.rows_per_chunk, two.stride), (128, 8192));
        // Odd widths: a 16-byte stride.
        let stride = |fp8| row_stride(CudaPath::FusedTwoShot, &s(3, 4095, fp8), 2);
        assert_eq!((stride(true), stride(false)), (8192, 8192));
        // The knob wins over the algorithm.
        let forced = Some(CudaPath::FusedTwoShot);
        let l = layout(
            0,
            2,
            forced,
            Algorithm::OneShot,
            1 << 20,
            &s(3, 4096, false),
            2,
        );
        assert_eq!(
            l.map(|l| (l.path, l.rows_per_chunk)).unwrap(),
            (CudaPath::FusedTwoShot, 3)
        );
    }

    #[test]
    fn one_shot_takes_ll_for_short_rows_and_small_calls_up_to_four_ranks() {
        let path = |world, algo, tokens, hidden, size| {
            layout(
                0,
                world,
                None,
                algo,
                1 << 20,
                &s(tokens, hidden, false),
                size,
            )
            .unwrap()
            .path
        };
        let (one, auto, two) = (Algorithm::OneShot, Algorithm::Auto, Algorithm::TwoShot);
        // bf16 rows of 8 KiB (hidden 4096): LL from 1 to 32 tokens (256 KiB), worlds 2-4.
        assert_eq!(path(2, one, 1, 4096, 2), CudaPath::FusedLl);
        assert_eq!(path(2, auto, 32, 4096, 2), CudaPath::FusedLl);
        assert_eq!(path(4, one, 8, 4096, 2), CudaPath::FusedLl);
        // f32 rows of 8 KiB too; a row that is no whole line (7 bf16 = 14 bytes) is not.
        assert_eq!(path(3, one, 2, 2048, 4), CudaPath::FusedLl);
        assert_eq!(path(2, one, 1, 7, 2), CudaPath::FusedOneShot);
        // Past a bound: 33 tokens (264 KiB), rows of 16 KiB, world 5 and 8.
        assert_eq!(path(2, one, 33, 4096, 2), CudaPath::FusedOneShot);
        assert_eq!(path(2, one, 1, 8192, 2), CudaPath::FusedOneShot);
        assert_eq!(path(5, one, 1, 4096, 2), CudaPath::FusedOneShot);
        assert_eq!(path(8, one, 1, 4096, 2), CudaPath::FusedOneShot);
        // Two-shot stays two-shot.
        assert_eq!(path(2, two, 1, 4096, 2), CudaPath::FusedTwoShot);
        // The LL layout: the whole call one chunk, rows back to back.
        let l = layout(0, 2, None, one, 1 << 20, &s(32, 4096, false), 2).unwrap();
        assert_eq!((l.rows_per_chunk, l.stride), (32, 8192));
        // Forced, the LL area is the only bound; a row that is no whole line is refused.
        let forced = |tokens, hidden| {
            layout(
                3,
                2,
                Some(CudaPath::FusedLl),
                Algorithm::TwoShot,
                1 << 20,
                &s(tokens, hidden, false),
                2,
            )
        };
        assert_eq!(forced(128, 4096).unwrap().path, CudaPath::FusedLl);
        for (tokens, hidden) in [(129, 4096), (1, 7)] {
            let e = forced(tokens, hidden).unwrap_err().to_string();
            assert!(e.contains("rank 3") && e.contains("fused-ll"), "{e}");
        }
    }

    #[test]
    fn a_row_too_wide_for_the_slot_is_an_error_naming_the_path() {
        // 4096 bf16 = 8192 bytes: two-shot no longer needs room for the outputs.
        let shape = s(4, 4096, true);
        let l = layout(0, 2, None, Algorithm::TwoShot, 8192, &shape, 2).unwrap();
        assert_eq!((l.path, l.rows_per_chunk), (CudaPath::FusedTwoShot, 1));
        let forced = Some(CudaPath::FusedTwoShot);
        let e = layout(2, 2, forced, Algorithm::Auto, 8176, &shape, 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 2") && e.contains("8192 bytes") && e.contains("fused-twoshot"),
            "{e}"
        );
        // (World 8: at 2-4 ranks one-shot would take these rows on the LL kernel, slot-free.)
        let e = layout(0, 8, None, Algorithm::OneShot, 8000, &shape, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("8192 bytes"), "{e}");
    }

    #[test]
    fn two_shot_grids_count_the_passes_of_one_rank() {
        let one = Layout {
            path: CudaPath::FusedOneShot,
            rows_per_chunk: 128,
            stride: 0,
        };
        let two = Layout {
            path: CudaPath::FusedTwoShot,
            ..one
        };
        // 128 rows within the cap: a row per block; a rank's 32 of them on two-shot.
        assert_eq!(grid(&one, 4, 128, 128), 128);
        assert_eq!(grid(&two, 4, 128, 128), 32);
        // Over the cap: pairs, 8 per rank, cut at the cap.
        assert_eq!(grid(&two, 8, 4, 128), 4);
        assert_eq!(grid(&one, 4, 64, 128), 64);
        let tiny = Layout {
            rows_per_chunk: 1,
            ..two
        };
        assert_eq!(grid(&tiny, 8, 128, 128), 1);
    }
}
