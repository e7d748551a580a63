//! `ipcreduce trace plot FILES_OR_DIR... -o FILE.png`: a window of a job's calls as a PNG
//! timeline, for a report or an issue where a Perfetto trace cannot be opened. One lane per
//! rank: each call a bar from the host's start to its end (the call's host time; on cuda a
//! call returns once enqueued), and beneath it, where recorded (cuda, `IPCREDUCE_TIMELINE=1`),
//! when it ran on its stream. Times are the ranks' host wall clock, so the lanes line up only
//! for records of one host (others are drawn each from its own first call, and the title says
//! so).
//!
//! The window: `--calls A-B`, default the last 16 calls every rank recorded. Laying out
//! ([`lanes`]) is pure; drawing uses plotters' bitmap backend with the font of `ipcreduce plot`.

use super::records::{Dump, Rec};
use plotters::prelude::*;
use std::path::Path;

/// Calls drawn when no window is asked for.
pub const DEFAULT_CALLS: u64 = 16;

/// One bar: call `seq` from `t0_us` to `t1_us` after the window's start.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub seq: u64,
    pub t0_us: f64,
    pub t1_us: f64,
    pub ok: bool,
}

/// One rank's bars: the host's and, where recorded, the device's.
#[derive(Debug, Clone, PartialEq)]
pub struct Lane {
    pub rank: usize,
    pub host: Vec<Bar>,
    pub device: Vec<Bar>,
}

/// `A-B` as (A, B).
pub fn parse_calls(s: &str) -> Result<(u64, u64), String> {
    let bad = || format!("--calls {s:?}: expected FIRST-LAST, e.g. 100-120");
    let (a, b) = s.split_once('-').ok_or_else(bad)?;
    let (a, b): (u64, u64) = (
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    );
    if a == 0 || b < a {
        return Err(bad());
    }
    Ok((a, b))
}

/// The calls of the window: `calls`, else the last [`DEFAULT_CALLS`] every rank recorded.
pub fn window(dumps: &[Dump], calls: Option<(u64, u64)>) -> Result<(u64, u64), String> {
    if let Some(w) = calls {
        return Ok(w);
    }
    let last = dumps
        .iter()
        .map(|d| d.recs.keys().next_back().copied().unwrap_or(0))
        .min()
        .unwrap_or(0);
    let first_kept = dumps
        .iter()
        .map(|d| d.recs.keys().next().copied().unwrap_or(u64::MAX))
        .max()
        .unwrap_or(u64::MAX);
    if last == 0 || first_kept > last {
        return Err("no call that every rank recorded".into());
    }
    Ok((last.saturating_sub(DEFAULT_CALLS - 1).max(first_kept), last))
}

/// The lanes of calls `first..=last`, times in us after the earliest start among them (per
/// host when `same_clock` is false: each dump from its own earliest start). Calls without a
/// start time are left out; a call still running ends where the window's latest time is.
pub fn lanes(dumps: &[Dump], first: u64, last: u64, same_clock: bool) -> Result<Vec<Lane>, String> {
    fn in_window(d: &Dump, first: u64, last: u64) -> impl Iterator<Item = &Rec> {
        d.recs.range(first..=last).map(|(_, r)| r)
    }
    let earliest = |d: &Dump| in_window(d, first, last).filter_map(|r| r.start_ns).min();
    let global0 = dumps.iter().filter_map(earliest).min();
    let Some(global0) = global0 else {
        let kept: Vec<String> = dumps
            .iter()
            .filter_map(|d| {
                let (a, b) = (d.recs.keys().next()?, d.recs.keys().next_back()?);
                Some(format!("rank {}: #{a}-#{b}", d.header.rank))
            })
            .collect();
        return Err(format!(
            "no call #{first}-#{last} with a start time in the records ({}; \
             IPCREDUCE_FLIGHT_TIMES=0 records none)",
            kept.join(", ")
        ));
    };
    let latest = dumps
        .iter()
        .flat_map(|d| in_window(d, first, last).flat_map(|r| [r.start_ns, r.end_ns, r.dev_end_ns]))
        .flatten()
        .max()
        .unwrap_or(global0);
    let mut out = Vec::new();
    for d in dumps {
        let t0 = if same_clock {
            global0
        } else {
            earliest(d).unwrap_or(global0)
        };
        let us = |t: u64| t.saturating_sub(t0) as f64 / 1e3;
        let mut lane = Lane {
            rank: d.header.rank,
            host: Vec::new(),
            device: Vec::new(),
        };
        for r in in_window(d, first, last) {
            let Some(s) = r.start_ns else { continue };
            lane.host.push(Bar {
                seq: r.seq,
                t0_us: us(s),
                t1_us: us(r.end_ns.unwrap_or(latest)),
                ok: r.state == "ok",
            });
            if let (Some(b), Some(e)) = (r.dev_start_ns, r.dev_end_ns) {
                lane.device.push(Bar {
                    seq: r.seq,
                    t0_us: us(b),
                    t1_us: us(e),
                    ok: r.state == "ok",
                });
            }
        }
        out.push(lane);
    }
    Ok(out)
}

/// Pixels per lane, and the image's width.
const LANE_PX: u32 = 90;
const WIDTH: u32 = 1800;

/// Draws `lanes` with `title` into the PNG `out`.
pub fn draw(lanes: &[Lane], title: &str, out: &Path) -> Result<(), String> {
    crate::plot::register_font()?;
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", out.display());
    let tmax = lanes
        .iter()
        .flat_map(|l| l.host.iter().chain(l.device.iter()))
        .map(|b| b.t1_us)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let height = 120 + LANE_PX * lanes.len() as u32;
    let image = BitMapBackend::new(out, (WIDTH, height)).into_drawing_area();
    image.fill(&WHITE).map_err(|e| err(&e))?;
    let root = image
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let n = lanes.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..tmax * 1.02, 0.0..n)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc("us from the window's first call")
        .draw()
        .map_err(|e| err(&e))?;
    let colour = |b: &Bar, device: bool| match (b.ok, device) {
        (false, _) => RGBColor(200, 40, 40),
        (true, false) => RGBColor(60, 110, 190),
        (true, true) => RGBColor(240, 150, 40),
    };
    // Two pixels at least, so that a host call of a few us shows beside a long device span.
    let min_bar = tmax * 2.0 / f64::from(WIDTH);
    for (k, lane) in lanes.iter().enumerate() {
        // Lane k spans [n - k - 1, n - k), rank 0 at the top; its name in the margin.
        let top = n - k as f64;
        // (backend_coord is in the image's pixels, as `image` draws.)
        let label_at = chart.backend_coord(&(0.0, top - 0.35));
        image
            .draw(&Text::new(
                format!("rank {}", lane.rank),
                (12, label_at.1),
                ("sans-serif", 16),
            ))
            .map_err(|e| err(&e))?;
        // Host bars in the upper half of the lane, device bars beneath.
        for (bars, device, (y0, y1)) in [
            (&lane.host, false, (top - 0.45, top - 0.1)),
            (&lane.device, true, (top - 0.9, top - 0.55)),
        ] {
            chart
                .draw_series(bars.iter().flat_map(|b| {
                    let corners = [(b.t0_us, y0), (b.t1_us.max(b.t0_us + min_bar), y1)];
                    // A white edge, so that back-to-back calls stay apart.
                    [
                        Rectangle::new(corners, colour(b, device).filled()),
                        Rectangle::new(corners, WHITE.stroke_width(1)),
                    ]
                }))
                .map_err(|e| err(&e))?;
            // Call numbers where the bar is wide enough to hold one.
            let min_width = tmax / 40.0;
            chart
                .draw_series(
                    bars.iter()
                        .filter(|b| b.t1_us - b.t0_us >= min_width)
                        .map(|b| {
                            Text::new(format!("#{}", b.seq), (b.t0_us, y1), ("sans-serif", 13))
                        }),
                )
                .map_err(|e| err(&e))?;
        }
    }
    image.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::super::records::made_up::dump as made_up;
    use super::*;

    fn rec(seq: u64, start: u64, end: u64, dev: Option<(u64, u64)>) -> Rec {
        super::super::records::made_up::rec(seq, Some(start), Some(end), dev)
    }

    fn dump(rank: usize, host: &str, recs: Vec<Rec>) -> Dump {
        made_up(rank, 2, host, recs)
    }

    fn two_ranks() -> Vec<Dump> {
        vec![
            dump(
                0,
                "h",
                vec![
                    rec(1, 10_000, 12_000, None),
                    rec(2, 20_000, 21_000, Some((20_500, 23_000))),
                    rec(3, 30_000, 31_000, None),
                ],
            ),
            dump(
                1,
                "h",
                vec![rec(2, 25_000, 26_000, None), rec(3, 31_000, 32_000, None)],
            ),
        ]
    }

    #[test]
    fn the_window_defaults_to_the_last_calls_every_rank_recorded() {
        let d = two_ranks();
        assert_eq!(window(&d, None), Ok((2, 3)));
        assert_eq!(window(&d, Some((1, 2))), Ok((1, 2)));
        assert_eq!(parse_calls("100-120"), Ok((100, 120)));
        for bad in ["5", "0-3", "9-2", "a-b"] {
            assert!(parse_calls(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lanes_put_every_rank_on_one_clock_from_the_first_start() {
        let d = two_ranks();
        let l = lanes(&d, 2, 3, true).unwrap();
        let bar = |seq, t0_us, t1_us| Bar {
            seq,
            t0_us,
            t1_us,
            ok: true,
        };
        assert_eq!(l[0].host, [bar(2, 0.0, 1.0), bar(3, 10.0, 11.0)]);
        assert_eq!(l[0].device, [bar(2, 0.5, 3.0)]);
        assert_eq!(l[1].host, [bar(2, 5.0, 6.0), bar(3, 11.0, 12.0)]);
        assert!(l[1].device.is_empty());
        // Each on its own clock: rank 1 from its own first start.
        let own = lanes(&d, 2, 3, false).unwrap();
        assert_eq!(own[1].host[0], bar(2, 0.0, 1.0));
    }

    #[test]
    fn draws_a_png_with_a_lane_per_rank() {
        let d = two_ranks();
        let l = lanes(&d, 1, 3, true).unwrap();
        let dir = std::env::temp_dir().join(format!("ipcreduce-tplot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("t.png");
        draw(&l, "test", &out).unwrap();
        let png = std::fs::read(&out).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let w = u32::from_be_bytes(png[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(png[20..24].try_into().unwrap());
        assert_eq!((w, h), (WIDTH, 120 + 2 * LANE_PX));
        std::fs::remove_dir_all(&dir).ok();
    }
}
