//! The bench's start-up figures (header and JSON) on the host backend, no GPU needed.

use std::process::Command;

#[test]
fn bench_reports_init_and_first_call_times() {
    let dir = std::env::temp_dir().join(format!("ipcreduce-startup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_ipcreduce"))
        .args([
            "bench",
            "--backend",
            "host",
            "--ranks",
            "2",
            "-b",
            "8",
            "-e",
            "8",
        ])
        .args(["-n", "2", "-w", "1", "-a", "auto", "--json"])
        .arg(&json)
        .env_remove("IPCREDUCE_RANK")
        .env_remove("RANK")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let all = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{all}");
    let header: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("# start-up (slowest rank): init "))
        .collect();
    assert_eq!(header.len(), 1, "one start-up line:\n{all}");
    assert!(
        header[0].contains("first call") && header[0].contains("(float sum of 8 B, auto, checked)"),
        "{}",
        header[0]
    );
    // Before the table's header.
    let at = |p: &str| {
        stdout
            .find(p)
            .unwrap_or_else(|| panic!("no {p}:\n{stdout}"))
    };
    assert!(at("# start-up") < at("#       size"), "{stdout}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let s = &doc["meta"]["startup"];
    let secs = |k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{k}: {s}"));
    assert!(secs("init_s") > 0.0 && secs("init_s") < 60.0, "{s}");
    assert!(
        secs("first_call_s") > 0.0 && secs("first_call_s") < 60.0,
        "{s}"
    );
    assert_eq!(s["wrong"], 0, "{s}");
    assert_eq!(s["first_call"], "float sum of 8 B, auto, checked", "{s}");
    // Host: no kernels, no kernel cache.
    assert!(s["kernel_cache_dir"].is_null(), "{s}");
    std::fs::remove_dir_all(&dir).ok();
}
