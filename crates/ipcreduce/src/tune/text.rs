//! The tuning table's file format: plain, versioned, one fact per line, read strictly.
//!
//! ```text
//! ipcreduce-tune 2
//! gpu NVIDIA H200
//! gpus 2
//! p2p yes
//! driver 580.159.04
//! # world elem_bytes min_bytes max_bytes algo ctas chunk time_us measured_bytes
//! row 2 2 0 65536 oneshot 1 - 3.1 4096
//! row 2 2 65537 - twoshot 16 - 55 16777216
//! ```
//!
//! The first line names the format and its version. Then, in any order: the four key lines
//! (all or none; the value is the rest of the line, so GPU names keep their spaces) and the
//! rows, nine fields separated by white space (`-`: no upper bound for `max_bytes`, not set for
//! `ctas` and `chunk`). Blank lines and lines starting with `#` are skipped. Anything else,
//! and any value that does not parse, is an error naming the line: a table is used exactly as
//! written or not at all. The same text carries rank 0's table to the other ranks.
//!
//! Written by hand rather than as JSON so that the library needs no serialization crate.

use super::{Entry, Table, TuneKey, FORMAT_VERSION};
use std::fmt::Write as _;

/// What the first line starts with.
const MAGIC: &str = "ipcreduce-tune";
/// Written for an unset field and for "no upper bound".
const NONE: &str = "-";

/// Why a table's text was refused: the line (1-based) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub msg: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.msg)
    }
}

impl std::error::Error for ParseError {}

/// The table as text; [`parse`] gives it back exactly (floats are written in Rust's
/// shortest round-trip form).
pub(super) fn write(t: &Table) -> String {
    // A line break inside a value would split its line; device names and driver versions
    // have none, and a space keeps the file readable if one ever did.
    let one_line = |s: &str| s.replace(['\n', '\r'], " ");
    let mut out = format!("{MAGIC} {}\n", t.version);
    if let Some(k) = &t.key {
        let p2p = if k.p2p { "yes" } else { "no" };
        let _ = writeln!(out, "gpu {}", one_line(&k.gpu));
        let _ = writeln!(out, "gpus {}", k.gpus);
        let _ = writeln!(out, "p2p {p2p}");
        let _ = writeln!(out, "driver {}", one_line(&k.driver));
    }
    out.push_str("# world elem_bytes min_bytes max_bytes algo ctas chunk time_us measured_bytes\n");
    let opt = |v: Option<String>| v.unwrap_or_else(|| NONE.into());
    for e in &t.entries {
        let max = Some(e.max_bytes)
            .filter(|m| *m != usize::MAX)
            .map(|m| m.to_string());
        let _ = writeln!(
            out,
            "row {} {} {} {} {} {} {} {} {}",
            e.world,
            e.elem_bytes,
            e.min_bytes,
            opt(max),
            e.algo,
            opt(e.ctas.map(|c| c.to_string())),
            opt(e.chunk.map(|c| c.to_string())),
            e.time_us,
            e.measured_bytes
        );
    }
    out
}

/// The key's four lines as they are read; all or none must be there.
#[derive(Default)]
struct KeyLines {
    gpu: Option<String>,
    gpus: Option<usize>,
    p2p: Option<bool>,
    driver: Option<String>,
}

/// Reads a table written by [`write`] (or by hand), refusing anything it does not expect.
pub(super) fn parse(text: &str) -> Result<Table, ParseError> {
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim()));
    let version = header(lines.next().map_or((1, ""), |l| l))?;
    let mut key = KeyLines::default();
    let mut entries = Vec::new();
    for (n, line) in lines {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |msg: String| ParseError { line: n, msg };
        let (word, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let rest = rest.trim();
        match word {
            "gpu" => set_once(
                &mut key.gpu,
                text_value("gpu", rest).map_err(err)?,
                n,
                "gpu",
            )?,
            "driver" => set_once(
                &mut key.driver,
                text_value("driver", rest).map_err(err)?,
                n,
                "driver",
            )?,
            "gpus" => set_once(&mut key.gpus, number("gpus", rest).map_err(err)?, n, "gpus")?,
            "p2p" => {
                let v = match rest {
                    "yes" => true,
                    "no" => false,
                    _ => return Err(err(format!("p2p is '{rest}', expected yes or no"))),
                };
                set_once(&mut key.p2p, v, n, "p2p")?
            }
            "row" => entries.push(row(rest).map_err(err)?),
            _ => {
                return Err(err(format!(
                    "unknown line '{word}' (expected gpu, gpus, p2p, driver or row)"
                )))
            }
        }
    }
    let key = match key {
        KeyLines {
            gpu: None,
            gpus: None,
            p2p: None,
            driver: None,
        } => None,
        KeyLines {
            gpu: Some(gpu),
            gpus: Some(gpus),
            p2p: Some(p2p),
            driver: Some(driver),
        } => Some(TuneKey {
            gpu,
            gpus,
            p2p,
            driver,
        }),
        k => {
            let missing: Vec<&str> = [
                ("gpu", k.gpu.is_none()),
                ("gpus", k.gpus.is_none()),
                ("p2p", k.p2p.is_none()),
                ("driver", k.driver.is_none()),
            ]
            .into_iter()
            .filter_map(|(name, gone)| gone.then_some(name))
            .collect();
            return Err(ParseError {
                line: text.lines().count(),
                msg: format!("the machine key lacks {}", missing.join(", ")),
            });
        }
    };
    Ok(Table {
        version,
        key,
        entries,
    })
}

/// The first line: the format's name and a version this build reads.
fn header((n, line): (usize, &str)) -> Result<u32, ParseError> {
    let err = |msg: String| ParseError { line: n, msg };
    let Some(v) = line.strip_prefix(MAGIC).and_then(|r| r.strip_prefix(' ')) else {
        let hint = if line.starts_with('{') {
            " (a JSON table from an older build: run `ipcreduce tune` again)"
        } else {
            ""
        };
        return Err(err(format!(
            "expected '{MAGIC} {FORMAT_VERSION}', found '{line}'{hint}"
        )));
    };
    let version: u32 = number("format version", v.trim()).map_err(err)?;
    if version != FORMAT_VERSION {
        return Err(err(format!(
            "format version {version} (this build reads {FORMAT_VERSION})"
        )));
    }
    Ok(version)
}

fn set_once<T>(slot: &mut Option<T>, v: T, line: usize, name: &str) -> Result<(), ParseError> {
    if slot.is_some() {
        return Err(ParseError {
            line,
            msg: format!("{name} given twice"),
        });
    }
    *slot = Some(v);
    Ok(())
}

fn text_value(name: &str, rest: &str) -> Result<String, String> {
    if rest.is_empty() {
        return Err(format!("{name} has no value"));
    }
    Ok(rest.to_string())
}

fn number<T: std::str::FromStr>(name: &str, s: &str) -> Result<T, String> {
    s.parse()
        .map_err(|_| format!("{name} '{s}' is not a whole number"))
}

fn optional<T: std::str::FromStr>(name: &str, s: &str) -> Result<Option<T>, String> {
    match s {
        NONE => Ok(None),
        _ => number(name, s).map(Some),
    }
}

/// One row's nine fields, checked as [`Table::lookup`] needs them.
fn row(rest: &str) -> Result<Entry, String> {
    let f: Vec<&str> = rest.split_whitespace().collect();
    let [world, elem, min, max, algo, ctas, chunk, time, at] = f[..] else {
        return Err(format!(
            "a row has 9 fields (world elem_bytes min_bytes max_bytes algo ctas chunk time_us \
             measured_bytes), this one {}",
            f.len()
        ));
    };
    let time_us: f64 = time
        .parse()
        .map_err(|_| format!("time_us '{time}' is not a number"))?;
    let e = Entry {
        world: number("world", world)?,
        elem_bytes: number("elem_bytes", elem)?,
        min_bytes: number("min_bytes", min)?,
        max_bytes: optional("max_bytes", max)?.unwrap_or(usize::MAX),
        algo: algo.to_string(),
        ctas: optional("ctas", ctas)?,
        chunk: optional("chunk", chunk)?,
        time_us,
        measured_bytes: number("measured_bytes", at)?,
    };
    if e.world == 0 || e.elem_bytes == 0 {
        return Err("world and elem_bytes must be at least 1".into());
    }
    if e.min_bytes > e.max_bytes {
        return Err(format!(
            "min_bytes {} is above max_bytes {}",
            e.min_bytes, e.max_bytes
        ));
    }
    if !(e.time_us.is_finite() && e.time_us >= 0.0) {
        return Err(format!("time_us {time} is not a finite time"));
    }
    if e.algorithm().is_none() {
        return Err(format!(
            "unknown algorithm '{}' (oneshot, twoshot or nccl)",
            e.algo
        ));
    }
    Ok(e)
}
