//! `ipcreduce warmup`: fills the kernel cache (`IPCREDUCE_CACHE_DIR`, default
//! `~/.cache/ipcreduce/kernels`) with every kernel variant `auto` can pick on this machine, so
//! that no job compiles at start: for images, CI and fresh nodes.

use crate::cli::{refuse, usable_cores};
use ipcreduce::backend::cuda::driver::driver_present;
use ipcreduce::backend::cuda::kernels::cache::{default_dir, Outcome};
use ipcreduce::backend::cuda::kernels::variants::{self, Group, Target, Variant};
use ipcreduce::backend::cuda::kernels::MAX_RANKS;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct WarmupArgs {
    /// The largest job to prepare for: the kernels of every world size from 1 to N ranks.
    #[arg(long, default_value_t = MAX_RANKS)]
    pub world: usize,
    /// Compile for this real architecture (sm_XX, e.g. sm_90) instead of this machine's GPUs: for an
    /// image or a CI job built where there is no GPU.
    #[arg(long)]
    pub arch: Option<String>,
    /// The CUDA driver version the files are keyed to (cuDriverGetVersion, e.g. 13000; the
    /// key holds it). Default: this machine's driver; give the GPU machine's where there is
    /// no driver.
    #[arg(long)]
    pub driver_version: Option<i32>,
    /// Only these kernel groups, comma separated: ll, ll12, staged, zerocopy, zerocopy16, ce,
    /// scatter_gather, fused (default: all).
    #[arg(long, value_delimiter = ',')]
    pub only: Option<Vec<String>>,
    /// Compilations at once (default: the usable cores, at most 8).
    #[arg(short = 'j', long)]
    pub jobs: Option<usize>,
}

pub fn run(args: WarmupArgs) -> i32 {
    if args.world == 0 || args.world > MAX_RANKS {
        return refuse(&format!(
            "--world {}: 1 to {MAX_RANKS} ranks (the cuda backend's limit)",
            args.world
        ));
    }
    if args.jobs == Some(0) {
        return refuse("--jobs 0: at least one compilation at a time");
    }
    let groups = match &args.only {
        None => Group::ALL.to_vec(),
        Some(names) => {
            let mut g = Vec::new();
            for n in names {
                match Group::ALL.iter().find(|x| x.name() == n.trim()) {
                    Some(x) => g.push(*x),
                    None => {
                        let all: Vec<&str> = Group::ALL.iter().map(|g| g.name()).collect();
                        return refuse(&format!(
                            "--only {n}: not a kernel group ({})",
                            all.join(", ")
                        ));
                    }
                }
            }
            g
        }
    };
    let archs = match &args.arch {
        Some(a) => {
            let digits = a.strip_prefix("sm_").unwrap_or("");
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return refuse(&format!(
                    "--arch {a}: a real GPU architecture such as sm_90 (CUBINs are compiled \
                     for one)"
                ));
            }
            vec![a.clone()]
        }
        None => match local_archs() {
            Ok(a) if !a.is_empty() => a,
            Ok(_) => return refuse(NO_GPU),
            Err(why) => return refuse(&format!("{NO_GPU} ({why})")),
        },
    };
    if let Err(e) = ipcreduce::backend::cuda::kernels::require_nvrtc() {
        eprintln!("error: {e}");
        return 1;
    }
    let driver_here = variants::driver_version_number();
    let driver = args.driver_version.unwrap_or(driver_here);
    let nvrtc = match variants::nvrtc_version() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let mut work: Vec<(Target, Variant)> = Vec::new();
    for arch in &archs {
        let target = Target {
            arch: arch.clone(),
            nvrtc: nvrtc.clone(),
            driver,
        };
        // While tracing (IPCREDUCE_TRACE), the phase-stamped variants too: they are what the
        // traced jobs load.
        let traced = ipcreduce::flight::stamps::wanted();
        for w in Variant::classes(args.world) {
            for v in Variant::every(w) {
                if groups.contains(&v.group) {
                    work.push((target.clone(), v));
                    let stamped = v.group.paths().any(|p| p.phase_stamped());
                    if traced && stamped {
                        work.push((target.clone(), v.traced(true)));
                    }
                }
            }
        }
    }
    let jobs = args.jobs.unwrap_or_else(|| usable_cores().clamp(1, 8));
    let dir = default_dir();
    let classes: Vec<String> = Variant::classes(args.world)
        .iter()
        .map(|w| w.to_string())
        .collect();
    println!(
        "# warmup: {} kernel variants for {} (world-size classes {}; NVRTC {nvrtc}, driver {}) \
         into {}, {jobs} at a time",
        work.len(),
        archs.join(", "),
        classes.join(", "),
        if driver == 0 {
            "none".to_string()
        } else {
            driver.to_string()
        },
        dir.display()
    );
    if driver == 0 {
        println!(
            "# note: no CUDA driver here and no --driver-version: the files are keyed to no \
             driver, so a GPU machine compiles its own; give --driver-version (its \
             cuDriverGetVersion, e.g. 13000) to fill a cache for it"
        );
    }
    fill(&work, jobs)
}

const NO_GPU: &str = "warmup: no CUDA GPU on this machine: give --arch sm_XX (e.g. --arch sm_90) \
                      to compile for that architecture, and --driver-version for the machine \
                      that will run them";

/// The distinct architectures (sm_XX) of this machine's GPUs, or why they cannot be read.
fn local_archs() -> Result<Vec<String>, String> {
    use cudarc::driver::sys;
    if !driver_present() {
        return Err("libcuda not found".into());
    }
    let ck = |r: sys::CUresult, what: &str| match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        r => Err(format!("{what}: {r:?}")),
    };
    // SAFETY: plain driver queries into local ints.
    unsafe {
        ck(sys::cuInit(0), "cuInit")?;
        let mut n = 0;
        ck(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount")?;
        let mut archs = Vec::new();
        for i in 0..n {
            let mut dev = 0;
            ck(sys::cuDeviceGet(&mut dev, i), "cuDeviceGet")?;
            let (mut major, mut minor) = (0, 0);
            use sys::CUdevice_attribute::*;
            ck(
                sys::cuDeviceGetAttribute(
                    &mut major,
                    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    dev,
                ),
                "compute capability",
            )?;
            ck(
                sys::cuDeviceGetAttribute(
                    &mut minor,
                    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    dev,
                ),
                "compute capability",
            )?;
            let a = format!("sm_{major}{minor}");
            if !archs.contains(&a) {
                archs.push(a);
            }
        }
        Ok(archs)
    }
}

/// Compiles (or finds) every variant, `jobs` at a time, one progress line per variant.
fn fill(work: &[(Target, Variant)], jobs: usize) -> i32 {
    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut compiled = 0;
    let mut cached = 0;
    let mut unstored: Option<String> = None;
    let mut failed = 0;
    std::thread::scope(|s| {
        for _ in 0..jobs.min(work.len().max(1)) {
            let tx = tx.clone();
            let next = &next;
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((target, v)) = work.get(i) else {
                    break;
                };
                let t0 = Instant::now();
                let r = variants::cubin(*v, target);
                let _ = tx.send((target.arch.clone(), *v, r, t0.elapsed()));
            });
        }
        drop(tx);
        for (done, (arch, v, r, took)) in rx.iter().enumerate() {
            let what = match r {
                Ok((_, Outcome::Uncached { why })) => {
                    compiled += 1;
                    unstored = Some(why);
                    format!("compiled in {}, NOT stored", secs(took))
                }
                Ok((_, o)) if o.compiled() => {
                    compiled += 1;
                    format!("compiled in {}", secs(took))
                }
                Ok(_) => {
                    cached += 1;
                    "already cached".to_string()
                }
                Err(e) => {
                    failed += 1;
                    format!("FAILED: {e}")
                }
            };
            println!(
                "[{:>3}/{}] {arch} {}: {what}",
                done + 1,
                work.len(),
                v.label()
            );
            let _ = std::io::stdout().flush();
        }
    });
    println!(
        "# done in {}: {compiled} compiled, {cached} already cached{}",
        secs(start.elapsed()),
        if failed > 0 {
            format!(", {failed} FAILED")
        } else {
            String::new()
        }
    );
    if let Some(why) = unstored {
        eprintln!("error: nothing could be stored: {why}");
        return 1;
    }
    if failed > 0 {
        return 1;
    }
    0
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Args;

    /// `--only`'s help names every group the option accepts.
    #[test]
    fn only_help_names_every_group() {
        let cmd = WarmupArgs::augment_args(clap::Command::new("warmup"));
        let only = cmd
            .get_arguments()
            .find(|a| a.get_id() == "only")
            .expect("--only");
        let help = only.get_help().expect("help").to_string();
        for g in Group::ALL {
            assert!(help.contains(g.name()), "{} missing from: {help}", g.name());
        }
    }
}
