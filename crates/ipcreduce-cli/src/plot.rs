//! `ipcreduce plot RESULTS.json [more.json] -o FILE.png`: latency (log-log) and bus bandwidth
//! against message size, one line per (algorithm, mode, registration), from the JSON that
//! `bench` writes (also the older files without the registration field); or, from the fused
//! benchmark's reports, its time and speedup per shape ([`fused`]).
//!
//! Reading and grouping ([`series`]) is pure; drawing uses plotters' bitmap backend with a
//! font compiled into the binary (no system font lookup, so a bare GPU machine renders too).

use plotters::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod fused;

#[derive(clap::Args, Debug, Clone)]
pub struct PlotArgs {
    /// Bench JSON files (`ipcreduce bench --json`). Files that split a sweep by size make one
    /// line per (algorithm, mode, registration); lines measured in two files carry the name.
    /// Or the fused benchmark's reports (python/gpu/fused_bench.py, rank 0's JSON), one line
    /// per world and hidden size.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The PNG to write.
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// Data type to draw (bf16, f16, f32); default: bf16 if the files have it, else the first.
    #[arg(short = 'd', long = "datatype")]
    pub dtype: Option<String>,
    /// Reduction to draw; default: sum if the files have it, else the first.
    #[arg(long = "op")]
    pub op: Option<String>,
    /// Title above the plots (default: the devices and commit of the first file).
    #[arg(long)]
    pub title: Option<String>,
}

/// One point of a bench row, as much as the plot needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub bytes: f64,
    pub time_us: f64,
    pub busbw_gbps: f64,
}

/// One line: a label and its points by size.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub nccl: bool,
    pub graph: bool,
    pub points: Vec<Point>,
}

/// A bench row's fields the plot reads; None when the row lacks one.
struct RowView {
    algo: String,
    mode: String,
    registered: bool,
    dtype: String,
    op: String,
    point: Point,
}

fn view(row: &Value) -> Option<RowView> {
    let s = |k: &str| row.get(k).and_then(Value::as_str).map(str::to_string);
    let f = |k: &str| row.get(k).and_then(Value::as_f64);
    Some(RowView {
        algo: s("algo")?,
        mode: s("mode").unwrap_or_else(|| "eager".into()),
        registered: row
            .get("registered")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        dtype: s("dtype")?,
        op: s("op").unwrap_or_else(|| "sum".into()),
        point: Point {
            bytes: f("bytes")?,
            time_us: f("time_us")?,
            busbw_gbps: f("busbw_gbps")?,
        },
    })
}

/// Picks `want` if given, else `preferred` if some row has it, else the first row's value.
fn pick(values: &[String], want: Option<&str>, preferred: &str) -> Option<String> {
    if let Some(w) = want {
        return Some(w.to_string());
    }
    if values.iter().any(|v| v == preferred) {
        return Some(preferred.to_string());
    }
    values.first().cloned()
}

/// Groups the rows of every document (named) into lines for one dtype and op.
pub fn series(
    docs: &[(String, Value)],
    dtype: Option<&str>,
    op: Option<&str>,
) -> Result<(String, String, Vec<Series>), String> {
    let mut rows = Vec::new();
    for (name, doc) in docs {
        let list = doc
            .get("rows")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("{name}: no \"rows\" array (not a bench JSON?)"))?;
        rows.extend(list.iter().filter_map(view).map(|r| (name.clone(), r)));
    }
    let dtypes: Vec<String> = rows.iter().map(|(_, r)| r.dtype.clone()).collect();
    let dtype = pick(&dtypes, dtype, "bf16").ok_or("the files hold no rows")?;
    let ops: Vec<String> = rows.iter().map(|(_, r)| r.op.clone()).collect();
    let op = pick(&ops, op, "sum").ok_or("the files hold no rows")?;
    let rows: Vec<(String, RowView)> = rows
        .into_iter()
        .filter(|(_, r)| r.dtype == dtype && r.op == op)
        .collect();
    let base = |r: &RowView| {
        let reg = if r.registered { " reg" } else { "" };
        format!("{} {}{reg}", r.algo, r.mode)
    };
    // Files that split one sweep by size merge into one line; files that measured the same
    // line at the same size (two runs) are told apart by name.
    let mut seen: BTreeMap<(String, u64), &str> = BTreeMap::new();
    let several = rows.iter().any(|(name, r)| {
        let key = (base(r), r.point.bytes.to_bits());
        seen.insert(key, name).is_some_and(|prev| prev != name)
    });
    let mut lines: BTreeMap<String, Series> = BTreeMap::new();
    for (name, r) in &rows {
        let mut label = base(r);
        if several {
            label = format!("{label} ({name})");
        }
        let line = lines.entry(label.clone()).or_insert_with(|| Series {
            label,
            nccl: r.algo == "nccl",
            graph: r.mode == "graph",
            points: Vec::new(),
        });
        line.points.push(r.point.clone());
    }
    if lines.is_empty() {
        return Err(format!("no rows of {dtype} {op} in the files"));
    }
    let mut out: Vec<Series> = lines.into_values().collect();
    for s in &mut out {
        s.points.sort_by(|a, b| a.bytes.total_cmp(&b.bytes));
    }
    Ok((dtype, op, out))
}

/// Registers the compiled-in font once under the family plotters asks for.
pub(crate) fn register_font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            epaint_default_fonts::UBUNTU_LIGHT,
        )
        .map_err(|_| "the compiled-in font does not load".to_string())
    })
    .clone()
}

/// "8", "32K", "1G": the size at a power of two, nothing between them.
pub(crate) fn size_label(b: f64) -> String {
    if (b.log2() - b.log2().round()).abs() > 1e-6 {
        return String::new();
    }
    let b = b.round() as u64;
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// A colour per line: NCCL in greys, ours from the palette.
fn colour(i: usize, s: &Series) -> RGBColor {
    if s.nccl {
        return if s.graph {
            RGBColor(60, 60, 60)
        } else {
            RGBColor(150, 150, 150)
        };
    }
    let c = Palette99::pick(i).to_rgba();
    RGBColor(c.0, c.1, c.2)
}

/// Draws both panels into `out` (PNG, 1800 x 760).
pub fn draw(lines: &[Series], title: &str, out: &Path) -> Result<(), String> {
    register_font()?;
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", out.display());
    let all = || lines.iter().flat_map(|s| s.points.iter());
    let (xmin, xmax) = all().fold((f64::INFINITY, 0.0f64), |(a, b), p| {
        (a.min(p.bytes), b.max(p.bytes))
    });
    let (tmin, tmax) = all()
        .filter(|p| p.time_us > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(a, b), p| {
            (a.min(p.time_us), b.max(p.time_us))
        });
    let bmax = all().fold(0.0f64, |m, p| m.max(p.busbw_gbps));
    if !(xmin.is_finite() && tmin.is_finite() && xmin > 0.0) {
        return Err("no positive sizes and times to draw".into());
    }
    let root = BitMapBackend::new(out, (1800, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 24))
        .map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(900);
    // x is log2 of the size on a linear axis, labelled at sizes (8, 32, 128... or 1K, 1M),
    // which plotters' log axis (powers of ten) would not do.
    let (lo, hi) = (xmin.log2().floor() - 0.3, xmax.log2().ceil() + 0.3);
    // About one label per power of two, or per two: plotters picks round steps (1, 2).
    let xlabels = ((hi - lo) / if hi - lo > 16.0 { 2.0 } else { 1.0 }) as usize + 1;
    let xr = lo..hi;

    let mut lat = ChartBuilder::on(&left)
        .caption("latency per call (us, log)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(xr.clone(), (tmin * 0.8..tmax * 1.25).log_scale())
        .map_err(|e| err(&e))?;
    lat.configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc("us")
        .x_labels(xlabels)
        .x_label_formatter(&|k| size_label(k.exp2()))
        .draw()
        .map_err(|e| err(&e))?;

    let mut bw = ChartBuilder::on(&right)
        .caption("bus bandwidth (GB/s)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(xr, 0.0..(bmax * 1.08).max(1e-3))
        .map_err(|e| err(&e))?;
    bw.configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc("GB/s")
        .x_labels(xlabels)
        .x_label_formatter(&|k| size_label(k.exp2()))
        .draw()
        .map_err(|e| err(&e))?;

    for (i, s) in lines.iter().enumerate() {
        let c = colour(i, s);
        let style = c.stroke_width(if s.graph { 3 } else { 1 });
        let pts_t: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|p| p.time_us > 0.0)
            .map(|p| (p.bytes.log2(), p.time_us))
            .collect();
        let pts_b: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|p| (p.bytes.log2(), p.busbw_gbps))
            .collect();
        lat.draw_series(LineSeries::new(pts_t.clone(), style))
            .map_err(|e| err(&e))?
            .label(&s.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        lat.draw_series(pts_t.iter().map(|p| Circle::new(*p, 2, c.filled())))
            .map_err(|e| err(&e))?;
        bw.draw_series(LineSeries::new(pts_b.clone(), style))
            .map_err(|e| err(&e))?;
        bw.draw_series(pts_b.iter().map(|p| Circle::new(*p, 2, c.filled())))
            .map_err(|e| err(&e))?;
    }
    lat.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

fn load(path: &Path) -> Result<(String, Value), String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let doc: Value =
        serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", path.display()))?;
    let name = path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    Ok((name, doc))
}

/// The default title: devices, world, commit and date of the first file.
fn title_of(doc: &Value, dtype: &str, op: &str) -> String {
    let meta = &doc["meta"];
    let devices = meta["devices"]
        .as_array()
        .and_then(|d| d.first())
        .and_then(Value::as_str)
        .unwrap_or("?");
    format!(
        "all-reduce {dtype} {op}, world {}, {devices}, commit {}, {}",
        meta["world"],
        meta["commit"].as_str().unwrap_or("?"),
        meta["date"].as_str().unwrap_or("?")
    )
}

pub fn run(args: PlotArgs) -> i32 {
    let go = || -> Result<usize, String> {
        let docs = args
            .inputs
            .iter()
            .map(|p| load(p))
            .collect::<Result<Vec<_>, _>>()?;
        if docs.iter().any(|(_, d)| fused::is_fused(d)) {
            if let Some((name, _)) = docs.iter().find(|(_, d)| !fused::is_fused(d)) {
                return Err(format!(
                    "{name}: not a fused benchmark report, unlike the others: plot them apart"
                ));
            }
            let lines = fused::lines(&docs)?;
            let title = args
                .title
                .clone()
                .unwrap_or_else(|| fused::title_of(&docs[0].1));
            fused::draw(&lines, &title, &args.output)?;
            return Ok(lines.len());
        }
        let (dtype, op, lines) = series(&docs, args.dtype.as_deref(), args.op.as_deref())?;
        let title = args
            .title
            .clone()
            .unwrap_or_else(|| title_of(&docs[0].1, &dtype, &op));
        draw(&lines, &title, &args.output)?;
        Ok(lines.len())
    };
    match go() {
        Ok(n) => {
            println!("# wrote {} ({n} lines)", args.output.display());
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> Value {
        let row = |algo: &str, mode: &str, reg: Option<bool>, dtype: &str, bytes: f64, t: f64| {
            let mut r = serde_json::json!({
                "algo": algo, "mode": mode, "dtype": dtype, "op": "sum",
                "bytes": bytes, "time_us": t, "busbw_gbps": bytes / t / 1e3,
            });
            if let Some(reg) = reg {
                r["registered"] = Value::Bool(reg);
            }
            r
        };
        serde_json::json!({
            "meta": {"world": 2, "devices": ["NVIDIA H200 (GPU 0)"], "commit": "abc", "date": "d"},
            "rows": [
                row("auto", "eager", None, "bf16", 1024.0, 5.0),
                row("auto", "eager", None, "bf16", 8.0, 4.0),
                row("auto", "graph", Some(false), "bf16", 8.0, 3.0),
                row("auto", "eager", Some(true), "bf16", 8.0, 3.5),
                row("nccl", "eager", None, "bf16", 8.0, 10.0),
                row("auto", "eager", None, "f32", 8.0, 4.0),
            ]
        })
    }

    #[test]
    fn rows_group_into_sorted_lines_per_algo_mode_and_registration() {
        let docs = vec![("a".to_string(), doc())];
        let (dtype, op, lines) = series(&docs, None, None).unwrap();
        assert_eq!((dtype.as_str(), op.as_str()), ("bf16", "sum"));
        let labels: Vec<&str> = lines.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            vec!["auto eager", "auto eager reg", "auto graph", "nccl eager"]
        );
        // Sorted by size, the f32 row left out.
        let sizes: Vec<f64> = lines[0].points.iter().map(|p| p.bytes).collect();
        assert_eq!(sizes, vec![8.0, 1024.0]);
        assert!(lines[3].nccl && !lines[3].graph && lines[2].graph);
        // Another dtype on request; several files are told apart.
        let (_, _, f32_lines) = series(&docs, Some("f32"), None).unwrap();
        assert_eq!(f32_lines.len(), 1);
        let two = vec![("a".to_string(), doc()), ("b".to_string(), doc())];
        let (_, _, lines) = series(&two, None, None).unwrap();
        assert_eq!(lines.len(), 8);
        assert!(lines.iter().any(|s| s.label == "nccl eager (b)"));
        // A sweep split by size over two files is one line per (algo, mode, registration).
        let mut big = doc();
        for r in big["rows"].as_array_mut().unwrap() {
            r["bytes"] = serde_json::json!(r["bytes"].as_f64().unwrap() * 1e6);
        }
        let split = vec![("small".to_string(), doc()), ("big".to_string(), big)];
        let (_, _, lines) = series(&split, None, None).unwrap();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0].points.len(), 4);
        // Nothing to draw, or not a bench file: errors.
        assert!(series(&docs, Some("f16"), None).is_err());
        assert!(series(&[("x".into(), serde_json::json!({}))], None, None).is_err());
    }

    #[test]
    fn draws_a_png() {
        let docs = vec![("a".to_string(), doc())];
        let (_, _, lines) = series(&docs, None, None).unwrap();
        let dir = std::env::temp_dir().join(format!("ipcreduce-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("p.png");
        draw(&lines, &title_of(&docs[0].1, "bf16", "sum"), &out).unwrap();
        let png = std::fs::read(&out).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // IHDR: width and height, big-endian, at bytes 16..24.
        let w = u32::from_be_bytes(png[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(png[20..24].try_into().unwrap());
        assert_eq!((w, h), (1800, 760));
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(size_label(8.0), "8");
        assert_eq!(size_label(32768.0), "32K");
        assert_eq!(size_label((1u64 << 30) as f64), "1G");
    }
}
