//! Which fused kernel a call runs, and how its chunks lie in the workspace slots.
//!
//! The algorithm comes chosen ([`crate::fused::choose`]: `OneShot` or `TwoShot`, by size for
//! `Auto`); `IPCREDUCE_FUSED_PATH` (read once at init, for the tests and the benchmark) forces a
//! path for every call instead. The path is part of the call's identity, so ranks that force
//! different ones fail with a mismatch instead of pairing two kernels.

use super::paths::CudaPath;
use crate::error::{Error, Result};
use crate::fused::{self, Shape};
use crate::types::Algorithm;

/// The environment variable that forces the fused path.
pub const FUSED_PATH_VAR: &str = "IPCREDUCE_FUSED_PATH";

/// `IPCREDUCE_FUSED_PATH`'s value: `oneshot`, `twoshot`, or `auto` (or unset, or empty: the
/// algorithm decides). Anything else is a configuration error naming the words.
pub fn parse_forced(value: Option<&str>) -> Result<Option<CudaPath>> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match v.to_ascii_lowercase().as_str() {
        "auto" => Ok(None),
        "oneshot" | "one-shot" => Ok(Some(CudaPath::FusedOneShot)),
        "twoshot" | "two-shot" => Ok(Some(CudaPath::FusedTwoShot)),
        _ => Err(Error::Config(format!(
            "{FUSED_PATH_VAR}={v}: expected oneshot, twoshot or auto"
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
/// input row (for its owner) or the owner's outputs of it (out, residual_out, fp8, for the
/// peers), on a 16-byte stride (kernels/fused.cu).
pub fn row_stride(path: CudaPath, s: &Shape, size: usize) -> usize {
    let row = s.hidden * size;
    match path {
        CudaPath::FusedTwoShot => (2 * row + if s.fp8 { s.hidden } else { 0 }).next_multiple_of(16),
        _ => row,
    }
}

/// The path and layout of a call: `forced` if set, else the algorithm's kernel. A two-shot
/// call whose row outputs do not fit a slot runs one-shot when its input row does (the slot
/// size is agreed, so every rank falls back alike); a row that fits neither is an error.
pub fn layout(
    rank: usize,
    forced: Option<CudaPath>,
    algo: Algorithm,
    slot_bytes: usize,
    s: &Shape,
    size: usize,
) -> Result<Layout> {
    let path = forced.unwrap_or(match algo {
        Algorithm::TwoShot => CudaPath::FusedTwoShot,
        _ => CudaPath::FusedOneShot,
    });
    let fit = |path| {
        let stride = row_stride(path, s, size);
        (slot_bytes / stride > 0).then(|| Layout {
            path,
            rows_per_chunk: (slot_bytes / stride).min(s.tokens),
            stride,
        })
    };
    let fallback = (forced.is_none() && path == CudaPath::FusedTwoShot)
        .then(|| fit(CudaPath::FusedOneShot))
        .flatten();
    fit(path).or(fallback).ok_or_else(|| {
        let need = row_stride(path, s, size);
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

/// CTAs of a call, from the identity (rows, slot, world) and the agreed cap: one per pair of
/// rows of a chunk (one-shot), one per pair a rank owns (two-shot: pairs dealt to ranks).
pub fn grid(l: &Layout, world: usize, cap: usize, max_blocks: usize) -> u32 {
    let pairs = l.rows_per_chunk.div_ceil(super::fused::ROWS_PER_PASS);
    let per_block = match l.path {
        CudaPath::FusedTwoShot => pairs.div_ceil(world.max(1)),
        _ => pairs,
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
        let e = parse_forced(Some("ll")).unwrap_err().to_string();
        assert!(
            e.contains(FUSED_PATH_VAR) && e.contains("oneshot, twoshot or auto"),
            "{e}"
        );
    }

    #[test]
    fn rows_lie_back_to_back_one_shot_and_with_their_outputs_two_shot() {
        let one = layout(
            0,
            None,
            Algorithm::OneShot,
            1 << 20,
            &s(512, 4096, false),
            2,
        )
        .unwrap();
        assert_eq!(
            (one.path, one.rows_per_chunk, one.stride),
            (CudaPath::FusedOneShot, 128, 8192)
        );
        let two = layout(0, None, Algorithm::TwoShot, 1 << 20, &s(512, 4096, true), 2).unwrap();
        assert_eq!(two.path, CudaPath::FusedTwoShot);
        assert_eq!((two.rows_per_chunk, two.stride), (51, 2 * 8192 + 4096));
        // Odd widths: a 16-byte stride.
        assert_eq!(
            row_stride(CudaPath::FusedTwoShot, &s(3, 4095, true), 2),
            20480
        );
        assert_eq!(
            row_stride(CudaPath::FusedTwoShot, &s(3, 4095, false), 2),
            16384
        );
        // The knob wins over the algorithm.
        let forced = Some(CudaPath::FusedTwoShot);
        let l = layout(
            0,
            forced,
            Algorithm::OneShot,
            1 << 20,
            &s(3, 4096, false),
            2,
        )
        .unwrap();
        assert_eq!((l.path, l.rows_per_chunk), (CudaPath::FusedTwoShot, 3));
    }

    #[test]
    fn a_two_shot_row_too_wide_for_the_slot_falls_back_unless_forced() {
        // 4096 bf16 = 8192 bytes: fits a 10000-byte slot alone, not with its outputs.
        let shape = s(4, 4096, false);
        let l = layout(0, None, Algorithm::TwoShot, 10_000, &shape, 2).unwrap();
        assert_eq!((l.path, l.rows_per_chunk), (CudaPath::FusedOneShot, 1));
        let e = layout(
            2,
            Some(CudaPath::FusedTwoShot),
            Algorithm::Auto,
            10_000,
            &shape,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("rank 2") && e.contains("16384 bytes") && e.contains("fused-twoshot"),
            "{e}"
        );
        let e = layout(0, None, Algorithm::OneShot, 8000, &shape, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("8192 bytes"), "{e}");
    }

    #[test]
    fn two_shot_grids_count_the_pairs_of_one_rank() {
        let one = Layout {
            path: CudaPath::FusedOneShot,
            rows_per_chunk: 128,
            stride: 0,
        };
        let two = Layout {
            path: CudaPath::FusedTwoShot,
            ..one
        };
        assert_eq!(grid(&one, 4, 128, 128), 64);
        assert_eq!(grid(&two, 4, 128, 128), 16);
        assert_eq!(grid(&two, 8, 4, 128), 4);
        let tiny = Layout {
            rows_per_chunk: 1,
            ..two
        };
        assert_eq!(grid(&tiny, 8, 128, 128), 1);
    }
}
