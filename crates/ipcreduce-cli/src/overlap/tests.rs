//! Options, buckets, statistics and the compute kernel's source.

use super::plan::buckets;
use super::*;
use clap::Parser;

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    args: OverlapArgs,
}

fn parse(argv: &[&str]) -> OverlapArgs {
    let mut full = vec!["overlap"];
    full.extend_from_slice(argv);
    Cli::try_parse_from(full)
        .unwrap_or_else(|e| panic!("{e}"))
        .args
}

#[test]
fn defaults() {
    let a = parse(&[]);
    assert_eq!(a.steps, 1000);
    assert_eq!(a.warmup, 20);
    assert_eq!(a.grad_bytes, 1 << 30);
    assert_eq!(a.bucket_bytes, 25 << 20);
    assert_eq!(a.compute_us, 2000);
    assert_eq!(a.algos, vec![Algorithm::Auto, Algorithm::Nccl]);
    assert_eq!(a.seed, 1);
    assert!(a.json.is_none());
    assert_eq!(a.ranks.backend, BackendChoice::Auto);
    assert!(a.ranks.ranks.is_none());
    let plan = Plan::new(&a).unwrap();
    // 1 GiB in 25 MiB buckets: 40 full ones and 24 MiB left.
    assert_eq!(plan.buckets.len(), 41);
    assert_eq!(plan.buckets[40].bytes, 24 << 20);
}

#[test]
fn options_parse() {
    let a = parse(&[
        "--steps",
        "10",
        "--grad-bytes",
        "64M",
        "--bucket-bytes",
        "4m",
        "--compute-us",
        "0",
        "-a",
        "twoshot,nccl,twoshot",
        "--warmup",
        "0",
        "--json",
        "/tmp/x.json",
        "--backend",
        "cuda",
        "--ranks",
        "2",
    ]);
    assert_eq!((a.steps, a.warmup, a.compute_us), (10, 0, 0));
    assert_eq!((a.grad_bytes, a.bucket_bytes), (64 << 20, 4 << 20));
    assert_eq!(a.ranks.backend, BackendChoice::Cuda);
    assert_eq!(a.ranks.ranks, Some(2));
    assert_eq!(a.json.as_deref(), Some(std::path::Path::new("/tmp/x.json")));
    let plan = Plan::new(&a).unwrap();
    assert_eq!(plan.algos, vec![Algorithm::TwoShot, Algorithm::Nccl]);
    assert_eq!(plan.buckets.len(), 16);

    let bad = |argv: &[&str]| {
        let mut full = vec!["overlap"];
        full.extend_from_slice(argv);
        Cli::try_parse_from(full).is_err()
    };
    assert!(bad(&["-a", "ring"]));
    assert!(bad(&["--grad-bytes", "1T"]));
    assert!(bad(&["--steps", "-1"]));
    assert!(Plan::new(&parse(&["--steps", "0"])).is_err());
    assert!(Plan::new(&parse(&["--grad-bytes", "3"])).is_err());
    assert!(Plan::new(&parse(&["--bucket-bytes", "1"])).is_err());
}

#[test]
fn buckets_cover_the_gradients_exactly() {
    let b = buckets(10, 4, 2).unwrap();
    assert_eq!(
        b,
        vec![
            Bucket {
                offset: 0,
                bytes: 4
            },
            Bucket {
                offset: 4,
                bytes: 4
            },
            Bucket {
                offset: 8,
                bytes: 2
            },
        ]
    );
    // Bucket size rounded down to the element: 5 -> 4.
    assert_eq!(buckets(10, 5, 2).unwrap(), b);
    // One bucket when it is larger than everything.
    assert_eq!(
        buckets(8, 100, 2).unwrap(),
        vec![Bucket {
            offset: 0,
            bytes: 8
        }]
    );
    assert!(buckets(0, 4, 2).is_err());
    assert!(buckets(9, 4, 2).is_err());
    assert!(buckets(8, 1, 2).is_err());
    assert!(buckets(MAX_BUCKETS * 2 + 2, 2, 2).is_err());

    for (total, bucket) in [(1usize << 30, 25usize << 20), (1000, 998), (6, 6), (2, 2)] {
        let b = buckets(total, bucket, 2).unwrap();
        let mut next = 0;
        for (i, x) in b.iter().enumerate() {
            assert_eq!(x.offset, next, "contiguous");
            assert_eq!(x.offset % 2, 0, "aligned");
            assert!(x.bytes > 0 && x.bytes % 2 == 0);
            if i + 1 < b.len() {
                assert_eq!(x.bytes, bucket / 2 * 2, "only the last is partial");
            }
            next += x.bytes;
        }
        assert_eq!(next, total, "covers everything");
    }
}

#[test]
fn statistics_of_known_series() {
    let s = Stats::of(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]).unwrap();
    assert_eq!(s.mean, 5.0);
    assert_eq!(s.stddev, 2.0);
    assert_eq!(s.median, 4.5);
    assert_eq!((s.min, s.max), (2.0, 9.0));
    assert_eq!(s.p99, 9.0);

    let odd = Stats::of(&[3.0, 1.0, 2.0]).unwrap();
    assert_eq!(
        (odd.median, odd.mean, odd.min, odd.max),
        (2.0, 2.0, 1.0, 3.0)
    );

    // 1..=100: the 99th percentile is 99 (nearest rank), 1..=1000: 990.
    let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
    let s = Stats::of(&v).unwrap();
    assert_eq!((s.p99, s.median, s.mean), (99.0, 50.5, 50.5));
    let v: Vec<f64> = (1..=1000).map(f64::from).collect();
    assert_eq!(Stats::of(&v).unwrap().p99, 990.0);

    let one = Stats::of(&[1.5]).unwrap();
    assert_eq!(
        (one.mean, one.median, one.p99, one.stddev),
        (1.5, 1.5, 1.5, 0.0)
    );
    assert!(Stats::of(&[]).is_none());
}

#[test]
fn each_step_takes_its_slowest_rank() {
    let per_rank = vec![vec![1.0, 5.0, 2.0], vec![3.0, 1.0, 2.5, 9.0]];
    assert_eq!(slowest_per_step(&per_rank), vec![3.0, 5.0, 2.5]);
    assert!(slowest_per_step(&[]).is_empty());
}

#[test]
fn json_report_has_meta_args_and_rows() {
    let args = parse(&["--grad-bytes", "10", "--bucket-bytes", "5"]);
    let plan = Plan::new(&args).unwrap();
    let meta = Meta {
        run: crate::harness::RunMeta {
            backend: BackendKind::Cuda,
            world: 2,
            devices: vec!["GPU 0".into(), "GPU 1".into()],
            driver: None,
            nccl_version: Some("2.28.3".into()),
            commit: env!("IPCREDUCE_GIT_COMMIT"),
            date: crate::harness::utc_now(),
            host_cores: 1,
        },
        args: args_json(&args, &plan),
    };
    let row = Row {
        algo: Algorithm::Auto,
        ran: Algorithm::TwoShot,
        path: Some("twoshot-reg".into()),
        ctas: Some(16),
        zero_copy: Some(true),
        steps: 2,
        step_ms: Stats::of(&[1.0, 3.0]).unwrap(),
        exposed_ms: 0.5,
        wrong: 0,
    };
    let compute = Stats::of(&[1.5]).unwrap();
    let doc = report_json(&meta, &Calibration::default(), &compute, &[row], Some(1.25));
    assert_eq!(doc["meta"]["world"], 2);
    assert_eq!(doc["meta"]["args"]["bucket_bytes"], 4);
    assert_eq!(doc["meta"]["args"]["last_bucket_bytes"], 2);
    assert_eq!(doc["meta"]["args"]["buckets"], 3);
    assert_eq!(doc["meta"]["args"]["dtype"], "bf16");
    assert_eq!(doc["meta"]["args"]["algos"][1], "nccl");
    assert_eq!(doc["rows"][0]["ran"], "twoshot");
    assert_eq!(doc["rows"][0]["step_ms"]["mean"], 2.0);
    assert_eq!(doc["nccl_over_ipcreduce_mean"], 1.25);
    assert_eq!(doc["compute_only_ms"]["mean"], 1.5);
    assert_eq!(doc["rows"][0]["exposed_ms"], 0.5);
    assert_eq!(doc["rows"][0]["path"], "twoshot-reg");
    assert_eq!(doc["meta"]["args"]["buffers"], "registered");
}

#[test]
fn ratio_is_nccl_over_auto() {
    let row = |algo, mean| Row {
        algo,
        ran: algo,
        path: None,
        ctas: None,
        zero_copy: None,
        steps: 1,
        step_ms: Stats::of(&[mean]).unwrap(),
        exposed_ms: 0.0,
        wrong: 0,
    };
    let rows = vec![row(Algorithm::Auto, 2.0), row(Algorithm::Nccl, 3.0)];
    assert_eq!(nccl_ratio(&rows), Some(1.5));
    assert_eq!(nccl_ratio(&rows[..1]), None);
    let rows = vec![row(Algorithm::Nccl, 3.0), row(Algorithm::TwoShot, 1.5)];
    assert_eq!(nccl_ratio(&rows), Some(2.0));
}

/// Compiles compute.cu with NVRTC. Needs libnvrtc but no GPU; like
/// `kernels_compile_with_nvrtc`, `IPCREDUCE_REQUIRE_NVRTC=1` turns a skip into a failure.
#[test]
fn compute_kernel_compiles_with_nvrtc() {
    if !kernels::nvrtc_for_tests() {
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        let ptx = kernels::compile_compute(arch).unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        assert!(
            text.contains(&format!(".entry {COMPUTE_KERNEL}")),
            "{arch}: {COMPUTE_KERNEL} missing"
        );
        // The FMA loop must survive optimisation, and the result must be stored.
        assert!(text.contains("fma.rn.f32"), "{arch}: no FMA in the PTX");
        assert!(text.contains("st.global"), "{arch}: result not stored");
        // Two parameters: the output pointer (8 bytes) and the round count (4 bytes).
        assert!(text.contains(".param .u64"), "{arch}: pointer parameter");
        assert!(text.contains(".param .u32"), "{arch}: count parameter");
    }
}

#[test]
fn kernel_constants_match_the_source() {
    assert!(kernels::COMPUTE_SOURCE.contains(&format!("#define COMPUTE_THREADS {COMPUTE_THREADS}")));
    assert!(kernels::COMPUTE_SOURCE.contains(&format!(
        "{COMPUTE_KERNEL}(float* __restrict__ out, unsigned int iters)"
    )));
}
