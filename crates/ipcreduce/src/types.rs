//! The vocabulary of the library: element types, reduction operators, algorithms, backends.

use std::fmt;
use std::str::FromStr;

/// Element type of the buffers being reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DType {
    F32,
    F16,
    Bf16,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Name as printed in tables and accepted on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F16 => "half",
            DType::Bf16 => "bfloat16",
        }
    }

    /// Stable numeric code, used in call stamps and kernel names.
    pub fn code(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Bf16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => Ok(DType::F32),
            "f16" | "half" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            other => Err(format!(
                "unknown dtype '{other}' (expected f32, f16 or bf16)"
            )),
        }
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }

    pub fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        }
    }

    /// Applies the operator in f64 (the reference) or f32 (the accumulators).
    pub fn apply_f64(self, a: f64, b: f64) -> f64 {
        match self {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            other => Err(format!(
                "unknown reduction '{other}' (expected sum, max or min)"
            )),
        }
    }
}

/// All-reduce algorithm. `Auto` picks by message size (see [`crate::plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Algorithm {
    Auto,
    /// Every rank reads every peer's whole buffer and reduces all of it.
    OneShot,
    /// Reduce-scatter through peer memory, then all-gather.
    TwoShot,
    /// Hand the call to NCCL (cuda backend only).
    Nccl,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::OneShot => "oneshot",
            Algorithm::TwoShot => "twoshot",
            Algorithm::Nccl => "nccl",
        }
    }

    pub fn code(self) -> u32 {
        match self {
            Algorithm::Auto => 0,
            Algorithm::OneShot => 1,
            Algorithm::TwoShot => 2,
            Algorithm::Nccl => 3,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        // Case and '-' / '_' do not count. Compared without allocating: a tuning table's row
        // names its algorithm as text, read on every call (tune::Entry::algorithm).
        let name = || s.bytes().filter(|b| !matches!(b, b'-' | b'_'));
        let is = |a: &Algorithm| name().map(|b| b.to_ascii_lowercase()).eq(a.name().bytes());
        let found = [
            Algorithm::Auto,
            Algorithm::OneShot,
            Algorithm::TwoShot,
            Algorithm::Nccl,
        ]
        .into_iter()
        .find(is);
        found.ok_or_else(|| {
            let other = s.to_ascii_lowercase().replace(['-', '_'], "");
            format!("unknown algorithm '{other}' (expected auto, oneshot, twoshot or nccl)")
        })
    }
}

/// Which data plane a communicator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum BackendKind {
    /// GPUs of one machine, peer memory through CUDA IPC.
    Cuda,
    /// Processes of one machine, shared host memory.
    Host,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Host => "host",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Backend requested by the user: a concrete one or `Auto` (cuda when usable, else host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BackendChoice {
    #[default]
    Auto,
    Cuda,
    Host,
}

impl FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(BackendChoice::Auto),
            "cuda" | "gpu" => Ok(BackendChoice::Cuda),
            "host" | "cpu" => Ok(BackendChoice::Host),
            other => Err(format!(
                "unknown backend '{other}' (expected auto, cuda or host)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trips() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        for o in ReduceOp::ALL {
            assert_eq!(o.name().parse::<ReduceOp>().unwrap(), o);
        }
        for a in [
            Algorithm::Auto,
            Algorithm::OneShot,
            Algorithm::TwoShot,
            Algorithm::Nccl,
        ] {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
        }
        assert_eq!("one-shot".parse::<Algorithm>().unwrap(), Algorithm::OneShot);
        assert!("ring".parse::<Algorithm>().is_err());
        // Case and '-' / '_' anywhere do not count; anything more or less is another name.
        assert_eq!("Two_Shot".parse::<Algorithm>().unwrap(), Algorithm::TwoShot);
        assert_eq!("-N-C-C-L-".parse::<Algorithm>().unwrap(), Algorithm::Nccl);
        for bad in ["", "oneshots", "onesho", "auto ", "nccl2"] {
            assert!(bad.parse::<Algorithm>().is_err(), "{bad:?}");
        }
        assert_eq!(
            "One-Ring".parse::<Algorithm>().unwrap_err(),
            "unknown algorithm 'onering' (expected auto, oneshot, twoshot or nccl)"
        );
        assert!("f64".parse::<DType>().is_err());
    }
}
