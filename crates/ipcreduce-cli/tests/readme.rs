//! README.md is tested: its commands that need no GPU run as written (the quick start, the
//! host commands of the commands table, the Python example and test command), every flag the
//! commands table names exists, and the Layout section names only what is in the tree.
//!
//! The Python half needs the package installed (`.ci/run` installs it after `cargo test`):
//! `IPCREDUCE_README_PYTHON=/path/to/python cargo test --release -p ipcreduce-cli --test
//! readme -- --ignored`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ipcreduce");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).expect("README.md")
}

/// The text of `## title` up to the next `## ` heading.
fn section(md: &str, title: &str) -> String {
    let start = md
        .find(&format!("\n## {title}"))
        .unwrap_or_else(|| panic!("README has no section '## {title}'"));
    let rest = &md[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |e| e + 3);
    rest[..end].to_string()
}

/// The fenced code blocks of `text`: (language, body).
fn code_blocks(text: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        match (line.strip_prefix("```"), open.take()) {
            (Some(_), Some(block)) => blocks.push(block),
            (Some(lang), None) => open = Some((lang.trim().to_string(), String::new())),
            (None, Some((lang, mut body))) => {
                body.push_str(line);
                body.push('\n');
                open = Some((lang, body));
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "unclosed code block");
    blocks
}

/// The binary with no rank variables from an outer launcher, in the repository root (where
/// the README's commands run).
fn ipcreduce(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .current_dir(root())
        .env_remove("IPCREDUCE_RANK")
        .env_remove("RANK");
    c
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn run_ok(c: &mut Command, what: &str) -> String {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let all = text(&out);
    assert!(
        out.status.success(),
        "README command `{what}` failed:\n{all}"
    );
    all
}

/// `cargo run --release -- ARGS`: the binary cargo builds, run with ARGS (cargo itself cannot
/// run inside `cargo test`: the build directory is locked).
fn cargo_run_args(cmd: &str) -> Option<Vec<&str>> {
    cmd.strip_prefix("cargo run --release --")
        .map(|rest| rest.split_whitespace().collect())
}

/// The Python test command's part after the build: `target/release/ipcreduce ARGS`.
fn python_test_command(md: &str) -> String {
    let quick = section(md, "Quick start");
    let cmd = code_blocks(&quick)
        .into_iter()
        .map(|(_, b)| b.trim().to_string())
        .find(|b| b.contains("pytest"))
        .expect("the Python test command in the quick start");
    let (build, run) = cmd
        .split_once(" && ")
        .unwrap_or_else(|| panic!("expected `cargo build --release && ...`: {cmd}"));
    assert_eq!(build, "cargo build --release", "{cmd}");
    run.to_string()
}

#[test]
fn quick_start_runs_as_written() {
    let md = readme();
    let quick = section(&md, "Quick start");
    let mut ran_bench = false;
    for (_, body) in code_blocks(&quick) {
        let cmd = body.trim();
        if cmd == "cargo test --release" || cmd.contains("pytest") {
            // This test is part of the first; the second is `python_tests_run_as_written`.
            continue;
        }
        let args = cargo_run_args(cmd)
            .unwrap_or_else(|| panic!("a quick-start command readme.rs cannot run: {cmd}"));
        let t0 = Instant::now();
        let all = run_ok(&mut ipcreduce(&args), cmd);
        let took = t0.elapsed();
        if args.first() == Some(&"bench") {
            ran_bench = true;
            assert!(all.contains("wrong elements: 0"), "{all}");
            // A fresh machine's first command must not keep a newcomer waiting: the host
            // default (cores, 8 MiB) keeps it to seconds on two cores.
            assert!(
                took < Duration::from_secs(60),
                "`{cmd}` took {took:?}:\n{all}"
            );
            if !Path::new("/dev/nvidiactl").exists() {
                assert!(all.contains("rank per core, at most 4"), "{all}");
            }
        }
    }
    assert!(ran_bench, "the quick start no longer runs bench:\n{quick}");
}

/// One row of the commands table: the synopsis inside the first backticks.
fn synopses(md: &str) -> Vec<String> {
    section(md, "Commands")
        .lines()
        .filter(|l| l.starts_with("| `ipcreduce "))
        .map(|l| {
            let s = &l[3..];
            s[..s.find('`').expect("closing backtick")].replace("\\|", "|")
        })
        .collect()
}

/// `ipcreduce CMD --help`'s block for one flag: its line and the description lines after it.
fn help_block(help: &str, flag: &str) -> Option<String> {
    let lines: Vec<&str> = help.lines().collect();
    let is_flag_line = |l: &str, f: &str| {
        let t = l.trim_start();
        t.starts_with('-')
            && t.split(|c: char| c == ',' || c.is_whitespace() || c == '=' || c == '<')
                .any(|w| w == f)
    };
    let at = lines.iter().position(|l| is_flag_line(l, flag))?;
    let mut block = lines[at].to_string();
    for l in &lines[at + 1..] {
        if l.trim_start().starts_with('-') || l.trim().is_empty() {
            break;
        }
        block.push(' ');
        block.push_str(l.trim());
    }
    Some(block)
}

#[test]
fn the_commands_table_names_flags_and_defaults_the_binary_has() {
    let md = readme();
    let rows = synopses(&md);
    assert!(rows.len() >= 10, "{rows:?}");
    for syn in rows {
        let words: Vec<&str> = syn.split_whitespace().collect();
        // The command and its subcommand words (`trace plot`): lowercase words up to the
        // first argument or flag.
        let cmd_words: Vec<&str> = words[1..]
            .iter()
            .copied()
            .take_while(|w| w.chars().all(|c| c.is_ascii_lowercase()))
            .collect();
        let cmd = cmd_words.join(" ");
        let mut args = cmd_words.clone();
        args.push("--help");
        let out = ipcreduce(&args).output().unwrap();
        let help = text(&out);
        assert!(out.status.success(), "`ipcreduce {cmd} --help`:\n{help}");
        for (i, w) in words.iter().enumerate() {
            let flag = w.trim_start_matches('[').trim_end_matches(']');
            if !flag.starts_with('-') || flag == "--" || flag.len() < 2 {
                continue;
            }
            let block = help_block(&help, flag).unwrap_or_else(|| {
                panic!("README's `{syn}` names {flag}; `{cmd} --help` has no such flag:\n{help}")
            });
            // `[-x VALUE]` with a literal value (not a placeholder or a choice): the value the
            // help gives, as its default or in its words.
            let Some(value) = words
                .get(i + 1)
                .filter(|_| w.starts_with('[') && !w.ends_with(']'))
            else {
                continue;
            };
            let value = value.trim_end_matches(']');
            let placeholder = value
                .chars()
                .all(|c| c.is_ascii_uppercase() || c == ':' || c == '_');
            let literal = !placeholder && !value.contains('|') && !value.contains("...");
            if literal
                && value
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphanumeric())
            {
                assert!(
                    block.contains(value),
                    "README's `{syn}` shows {flag} {value}; `{cmd} --help` says: {block}"
                );
            }
        }
    }
}

#[test]
fn host_commands_of_the_table_run() {
    let dir = std::env::temp_dir().join(format!("ipcreduce-readme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let json = json.to_str().unwrap();
    // bench with the table's options (small sizes and iterations) on the host backend.
    let all = run_ok(
        &mut ipcreduce(&[
            "bench",
            "-a",
            "all",
            "-b",
            "8",
            "-e",
            "4K",
            "-f",
            "8",
            "-d",
            "all",
            "-o",
            "sum",
            "-n",
            "3",
            "-w",
            "1",
            "--ranks",
            "2",
            "--backend",
            "host",
            "--json",
            json,
        ]),
        "bench",
    );
    assert!(all.contains("wrong elements: 0"), "{all}");
    // The table's check, with fewer cases.
    let all = run_ok(
        &mut ipcreduce(&[
            "check",
            "--cases",
            "40",
            "--seed",
            "1",
            "--max-bytes",
            "64K",
            "-a",
            "auto,oneshot,twoshot",
            "--ranks",
            "2",
            "--backend",
            "host",
        ]),
        "check",
    );
    assert!(all.contains("40 passed, 0 failed"), "{all}");
    let all = run_ok(
        &mut ipcreduce(&[
            "launch",
            "-n",
            "2",
            "--tag-output",
            "--grace",
            "5",
            "--",
            "sh",
            "-c",
            "echo $RANK",
        ]),
        "launch",
    );
    assert!(
        all.contains("[rank 0] 0") && all.contains("[rank 1] 1"),
        "{all}"
    );
    let all = run_ok(&mut ipcreduce(&["model"]), "model");
    assert!(!all.is_empty());
    let all = run_ok(&mut ipcreduce(&["report", json]), "report");
    assert!(all.contains("host backend `auto` against OpenMPI"), "{all}");
    let png = dir.join("bench.png");
    run_ok(
        &mut ipcreduce(&["plot", json, "-d", "f32", "-o", png.to_str().unwrap()]),
        "plot",
    );
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);
    std::fs::remove_dir_all(&dir).ok();
}

/// The path-like words of one Layout line: `a/b.rs, c.rs` -> [a/b.rs, c.rs].
fn layout_paths(entry: &str) -> Vec<String> {
    entry
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(String::from)
        .collect()
}

#[test]
fn the_layout_section_matches_the_tree() {
    let md = readme();
    let layout = section(&md, "Layout");
    let (_, block) = code_blocks(&layout)
        .into_iter()
        .next()
        .expect("Layout's tree");
    let root = root();
    let mut top: Option<PathBuf> = None;
    let mut named = Vec::new();
    for line in block.lines() {
        let indent = line.len() - line.trim_start().len();
        // The path column ends at the first run of two spaces; deeper lines continue a
        // description.
        let entry = line.trim_start().split("  ").next().unwrap_or("").trim();
        if entry.is_empty() || indent > 2 {
            continue;
        }
        let base = if indent == 0 {
            top = Some(PathBuf::from(entry.split(',').next().unwrap().trim()));
            PathBuf::new()
        } else {
            top.clone()
                .expect("an indented Layout line under a top-level one")
        };
        // `src/a.rs, b.rs`: the names after the first are in the first one's directory.
        let paths = layout_paths(entry);
        let first = base.join(&paths[0]);
        let dir = first.parent().map(Path::to_path_buf).unwrap_or_default();
        for (i, p) in paths.iter().enumerate() {
            let path = if i == 0 { first.clone() } else { dir.join(p) };
            assert!(
                root.join(&path).exists(),
                "README's Layout names {} (line `{}`), which is not in the tree",
                path.display(),
                line.trim()
            );
            named.push(path);
        }
    }
    // Every module of the binary is in the Layout.
    let cli_src = root.join("crates/ipcreduce-cli/src");
    for e in std::fs::read_dir(&cli_src).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        let p = PathBuf::from("crates/ipcreduce-cli/src").join(&name);
        assert!(
            named.contains(&p),
            "crates/ipcreduce-cli/src/{name} is missing from README's Layout"
        );
    }
}

/// The interpreter with the package installed (see the module doc).
fn python() -> String {
    std::env::var("IPCREDUCE_README_PYTHON")
        .expect("IPCREDUCE_README_PYTHON: a python with ipcreduce and numpy installed")
}

#[test]
#[ignore = "needs the Python package: IPCREDUCE_README_PYTHON=PY ... -- --ignored (.ci/run)"]
fn python_example_and_tests_run_as_written() {
    let py = python();
    let md = readme();
    let example = code_blocks(&section(&md, "Python"))
        .into_iter()
        .find(|(lang, body)| lang == "python" && body.contains("ipcreduce.init("))
        .map(|(_, b)| b)
        .expect("the Python example");
    let dir = std::env::temp_dir().join(format!("ipcreduce-readme-py-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("example.py");
    // As the README says to run it: under launch, and alone with the commented init.
    std::fs::write(&file, &example).unwrap();
    let f = file.to_str().unwrap();
    let all = run_ok(
        &mut ipcreduce(&["launch", "-n", "2", "--", &py, f]),
        "the Python example under launch",
    );
    assert!(all.contains("2 host"), "{all}");
    let alone_init = example
        .lines()
        .find_map(|l| l.trim().strip_prefix("# without a launcher: "))
        .expect("the example's init without a launcher");
    let alone = example.replace("comm = ipcreduce.init()", alone_init);
    std::fs::write(&file, alone).unwrap();
    let all = run_ok(
        Command::new(&py)
            .arg(f)
            .env_remove("IPCREDUCE_RANK")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE"),
        "the Python example alone",
    );
    assert!(all.contains("0 1 host"), "{all}");
    std::fs::remove_dir_all(&dir).ok();

    // The test command of the quick start, with this interpreter for python3.
    let cmd = python_test_command(&md);
    let args: Vec<String> = cmd
        .split_whitespace()
        .skip(1)
        .map(|w| {
            if w == "python3" {
                py.clone()
            } else {
                w.to_string()
            }
        })
        .collect();
    assert_eq!(
        cmd.split_whitespace().next(),
        Some("target/release/ipcreduce")
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let all = run_ok(&mut ipcreduce(&args), &cmd);
    // One summary: rank 0's pytest line, once.
    assert_eq!(all.matches(" passed").count(), 1, "{all}");
}
