//! `ipcreduce plot` of the fused benchmark (python/gpu/fused_bench.py, rank 0's JSON report):
//! per world and hidden size, the time per call of the fused all-reduce + add + RMSNorm and of
//! the unfused sequence (our all-reduce + torch add + rms_norm) against bytes per rank (left,
//! log), and the fused call's speedup over the sequence (right), with the 1.3x goal drawn.
//!
//! Reading and grouping ([`lines`]) is pure; drawing shares plot.rs's font and size labels.

use super::{register_font, size_label};
use plotters::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The speedup the fused call is to reach up to 2 MiB per rank (docs/fused.md).
pub const GOAL: f64 = 1.3;

/// One shape's times (us per call).
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub bytes: f64,
    pub fused_us: f64,
    pub unfused_us: f64,
}

/// The shapes of one world and hidden size, by bytes per rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub world: u64,
    pub hidden: u64,
    pub shapes: Vec<Shape>,
}

impl Line {
    fn label(&self) -> String {
        format!("world {}, hidden {}", self.world, self.hidden)
    }
}

/// Whether `doc` is a fused benchmark report (its rows carry a "fused" timing object).
pub fn is_fused(doc: &Value) -> bool {
    doc.get("rows")
        .and_then(Value::as_array)
        .and_then(|r| r.first())
        .is_some_and(|r| r.get("fused").is_some_and(Value::is_object))
}

/// Groups the rows of every report into one line per (world, hidden), sorted by size.
pub fn lines(docs: &[(String, Value)]) -> Result<Vec<Line>, String> {
    let mut by: BTreeMap<(u64, u64), Vec<Shape>> = BTreeMap::new();
    for (name, doc) in docs {
        let world = doc["world"]
            .as_u64()
            .ok_or_else(|| format!("{name}: no \"world\" (not a fused benchmark report?)"))?;
        let rows = doc["rows"]
            .as_array()
            .ok_or_else(|| format!("{name}: no \"rows\" array"))?;
        for (i, r) in rows.iter().enumerate() {
            let f = |v: &Value| v.as_f64();
            let shape = (|| {
                Some((
                    r["hidden"].as_u64()?,
                    Shape {
                        bytes: f(&r["bytes_per_rank"])?,
                        fused_us: f(&r["fused"]["us"])?,
                        unfused_us: f(&r["ipcreduce"]["us"])?,
                    },
                ))
            })()
            .ok_or_else(|| format!("{name}: row {i} lacks hidden, bytes_per_rank or a time"))?;
            by.entry((world, shape.0)).or_default().push(shape.1);
        }
    }
    if by.is_empty() {
        return Err("the reports hold no rows".into());
    }
    Ok(by
        .into_iter()
        .map(|((world, hidden), mut shapes)| {
            shapes.sort_by(|a, b| a.bytes.total_cmp(&b.bytes));
            Line {
                world,
                hidden,
                shapes,
            }
        })
        .collect())
}

/// The default title: the device, dtype, torch and date of the first report.
pub fn title_of(doc: &Value) -> String {
    format!(
        "fused all-reduce + add + RMSNorm, {}, {}, torch {}, {}",
        doc["dtype"].as_str().unwrap_or("?"),
        doc["device"].as_str().unwrap_or("?"),
        doc["torch"].as_str().unwrap_or("?"),
        doc["date"].as_str().unwrap_or("?")
    )
}

/// Draws both panels into `out` (PNG, 1800 x 760).
pub fn draw(lines: &[Line], title: &str, out: &Path) -> Result<(), String> {
    register_font()?;
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", out.display());
    let all = || lines.iter().flat_map(|l| l.shapes.iter());
    let (xmin, xmax) = all().fold((f64::INFINITY, 0.0f64), |(a, b), s| {
        (a.min(s.bytes), b.max(s.bytes))
    });
    let (tmin, tmax) = all().fold((f64::INFINITY, 0.0f64), |(a, b), s| {
        (
            a.min(s.fused_us.min(s.unfused_us)),
            b.max(s.fused_us.max(s.unfused_us)),
        )
    });
    let smax = all().fold(GOAL, |m, s| m.max(s.unfused_us / s.fused_us));
    if !(xmin.is_finite() && xmin > 0.0 && tmin.is_finite() && tmin > 0.0) {
        return Err("no positive sizes and times to draw".into());
    }
    let root = BitMapBackend::new(out, (1800, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 24))
        .map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(900);
    let xr = xmin.log2().floor() - 0.3..xmax.log2().ceil() + 0.3;

    let mut time = ChartBuilder::on(&left)
        .caption(
            "us per call (log): fused (thick), all-reduce + add + rms_norm (thin)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(xr.clone(), (tmin * 0.8..tmax * 1.25).log_scale())
        .map_err(|e| err(&e))?;
    time.configure_mesh()
        .x_desc("bytes per rank")
        .y_desc("us")
        .x_label_formatter(&|k| size_label(k.exp2()))
        .draw()
        .map_err(|e| err(&e))?;
    let mut speed = ChartBuilder::on(&right)
        .caption(
            format!("speedup of the fused call (goal {GOAL}x dashed)"),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(xr.clone(), 0.0..smax * 1.1)
        .map_err(|e| err(&e))?;
    speed
        .configure_mesh()
        .x_desc("bytes per rank")
        .y_desc("unfused / fused")
        .x_label_formatter(&|k| size_label(k.exp2()))
        .draw()
        .map_err(|e| err(&e))?;
    speed
        .draw_series(DashedLineSeries::new(
            vec![(xr.start, GOAL), (xr.end, GOAL)],
            8,
            6,
            BLACK.stroke_width(1),
        ))
        .map_err(|e| err(&e))?;
    speed
        .draw_series(LineSeries::new(
            vec![(xr.start, 1.0), (xr.end, 1.0)],
            BLACK.mix(0.4).stroke_width(1),
        ))
        .map_err(|e| err(&e))?;

    for (i, l) in lines.iter().enumerate() {
        let c = Palette99::pick(i).to_rgba();
        let c = RGBColor(c.0, c.1, c.2);
        let x = |s: &Shape| s.bytes.log2();
        let fused: Vec<(f64, f64)> = l.shapes.iter().map(|s| (x(s), s.fused_us)).collect();
        let unfused: Vec<(f64, f64)> = l.shapes.iter().map(|s| (x(s), s.unfused_us)).collect();
        let ratio: Vec<(f64, f64)> = l
            .shapes
            .iter()
            .map(|s| (x(s), s.unfused_us / s.fused_us))
            .collect();
        let thick = c.stroke_width(3);
        time.draw_series(LineSeries::new(fused.clone(), thick))
            .map_err(|e| err(&e))?
            .label(l.label())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], thick));
        time.draw_series(LineSeries::new(unfused, c.stroke_width(1)))
            .map_err(|e| err(&e))?;
        time.draw_series(fused.iter().map(|p| Circle::new(*p, 3, c.filled())))
            .map_err(|e| err(&e))?;
        speed
            .draw_series(LineSeries::new(ratio.clone(), thick))
            .map_err(|e| err(&e))?;
        speed
            .draw_series(ratio.iter().map(|p| Circle::new(*p, 3, c.filled())))
            .map_err(|e| err(&e))?;
    }
    time.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(world: u64) -> Value {
        let row = |hidden: u64, tokens: u64, fused: f64, ours: f64| {
            serde_json::json!({
                "hidden": hidden, "tokens": tokens, "bytes_per_rank": hidden * tokens * 2,
                "fused": {"us": fused}, "ipcreduce": {"us": ours}, "nccl": {"us": 100.0},
            })
        };
        serde_json::json!({
            "world": world, "dtype": "bfloat16", "device": "NVIDIA H100 80GB HBM3",
            "torch": "2.11.0", "date": "2026-12-06",
            "rows": [row(8192, 8, 12.0, 14.0), row(4096, 8, 9.0, 10.0), row(4096, 1, 7.0, 9.0)],
        })
    }

    #[test]
    fn rows_group_into_lines_per_world_and_hidden_sorted_by_size() {
        let docs = vec![("w2".to_string(), report(2)), ("w4".to_string(), report(4))];
        assert!(is_fused(&docs[0].1));
        assert!(!is_fused(&serde_json::json!({"rows": [{"bytes": 8}]})));
        let l = lines(&docs).unwrap();
        let keys: Vec<(u64, u64)> = l.iter().map(|l| (l.world, l.hidden)).collect();
        assert_eq!(keys, vec![(2, 4096), (2, 8192), (4, 4096), (4, 8192)]);
        let sizes: Vec<f64> = l[0].shapes.iter().map(|s| s.bytes).collect();
        assert_eq!(sizes, vec![8192.0, 65536.0]);
        assert_eq!(
            (l[0].shapes[0].fused_us, l[0].shapes[0].unfused_us),
            (7.0, 9.0)
        );
        // A row without its times is an error naming the file and the row.
        let mut bad = report(2);
        bad["rows"][1]["fused"] = serde_json::json!({});
        let e = lines(&[("bad".to_string(), bad)]).unwrap_err();
        assert!(e.contains("bad") && e.contains("row 1"), "{e}");
    }

    #[test]
    fn draws_a_png() {
        let docs = vec![("w2".to_string(), report(2))];
        let dir = std::env::temp_dir().join(format!("ipcreduce-fused-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("f.png");
        draw(&lines(&docs).unwrap(), &title_of(&docs[0].1), &out).unwrap();
        let png = std::fs::read(&out).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        std::fs::remove_dir_all(&dir).ok();
    }
}
