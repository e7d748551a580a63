//! `tune` on the host backend writes a table that `auto` then follows: real ranks started by
//! the command itself, small sizes only (a few seconds).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ipcreduce(args: &[&str], tune_file: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ipcreduce"))
        .args(args)
        .env_remove("IPCREDUCE_RANK")
        .env_remove("RANK")
        .env_remove("IPCREDUCE_ALGO")
        .env("IPCREDUCE_TUNE_FILE", tune_file)
        .output()
        .expect("run ipcreduce")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ipcreduce-tune-host-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What `auto` ran at each size of a `bench --backend host --ranks 2 -a auto` run.
fn auto_choices(tune_file: &Path, json: &Path) -> Vec<(u64, String)> {
    let out = ipcreduce(
        &[
            "bench",
            "--backend",
            "host",
            "--ranks",
            "2",
            "-a",
            "auto",
            "-d",
            "f32",
            "-b",
            "1K",
            "-e",
            "64K",
            "-f",
            "4",
            "-n",
            "2",
            "-w",
            "1",
            "--json",
            json.to_str().unwrap(),
        ],
        tune_file,
    );
    assert!(out.status.success(), "{}", text(&out));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    doc["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert_eq!(r["wrong"], 0, "{r}");
            (
                r["bytes"].as_u64().unwrap(),
                r["ran"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn tune_on_host_writes_a_table_that_auto_follows() {
    let dir = scratch("table");
    let table = dir.join("tune-host.txt");
    let json = dir.join("samples.json");
    let out = ipcreduce(
        &[
            "tune",
            "--backend",
            "host",
            "--ranks",
            "2",
            "-b",
            "1K",
            "-e",
            "16K",
            "-f",
            "4",
            "-d",
            "f32",
            "--json",
            json.to_str().unwrap(),
        ],
        &table,
    );
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains(&format!("# wrote {}", table.display())),
        "{all}"
    );

    // The file: the format's header, a host key (no GPU), rows for world 2, 4-byte elements,
    // covering every size with one of the two host algorithms.
    let written = std::fs::read_to_string(&table).unwrap();
    let mut lines = written.lines();
    assert_eq!(lines.next(), Some("ipcreduce-tune 2"), "{written}");
    assert!(
        written.lines().any(|l| l.starts_with("gpu host: ")),
        "{written}"
    );
    assert!(written.lines().any(|l| l == "gpus 0"), "{written}");
    assert!(written.lines().any(|l| l == "p2p no"), "{written}");
    let rows: Vec<Vec<&str>> = written
        .lines()
        .filter(|l| l.starts_with("row "))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(!rows.is_empty(), "{written}");
    assert_eq!(rows[0][3], "0", "the first row starts at 0: {written}");
    assert_eq!(
        rows[rows.len() - 1][4],
        "-",
        "the last row is open: {written}"
    );
    for r in &rows {
        assert_eq!((r[1], r[2]), ("2", "4"), "{written}");
        assert!(matches!(r[5], "oneshot" | "twoshot"), "{written}");
        assert_eq!(r[6], "-", "no CTAs on host: {written}");
    }
    // Every size measured with both algorithms, each a positive time.
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let samples = doc["samples"].as_array().unwrap();
    let mut seen: Vec<(u64, String)> = samples
        .iter()
        .map(|s| {
            assert!(s["time_us"].as_f64().unwrap() > 0.0, "{s}");
            (
                s["bytes"].as_u64().unwrap(),
                s["algo"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    seen.sort();
    let want: Vec<(u64, String)> = [1024u64, 4096, 16384]
        .iter()
        .flat_map(|&b| [(b, "oneshot".to_string()), (b, "twoshot".to_string())])
        .collect();
    assert_eq!(seen, want);

    // Auto follows the table on both sides of its crossover. The rows are replaced by a
    // choice no built-in rule makes (two-shot for small messages, one-shot above 8 KiB), the
    // key kept as tune wrote it.
    let header: String = written
        .lines()
        .filter(|l| !l.starts_with("row "))
        .map(|l| format!("{l}\n"))
        .collect();
    let flipped =
        format!("{header}row 2 4 0 8192 twoshot - - 1 4096\nrow 2 4 8193 - oneshot - - 1 65536\n");
    std::fs::write(&table, &flipped).unwrap();
    let got = auto_choices(&table, &dir.join("auto.json"));
    let expect = |v: &[(u64, &str)]| -> Vec<(u64, String)> {
        v.iter().map(|(b, a)| (*b, a.to_string())).collect()
    };
    assert_eq!(
        got,
        expect(&[
            (1024, "twoshot"),
            (4096, "twoshot"),
            (16384, "oneshot"),
            (65536, "oneshot"),
        ]),
        "{flipped}"
    );

    // The same rows under another machine's key are not used: the built-in rule (one-shot for
    // the smallest messages) decides instead.
    let foreign = flipped.replace("gpu host: ", "gpu host: another CPU ");
    std::fs::write(&table, &foreign).unwrap();
    let got = auto_choices(&table, &dir.join("auto-foreign.json"));
    assert_eq!(got[0], (1024, "oneshot".to_string()), "{foreign}");
    std::fs::remove_dir_all(&dir).ok();
}
