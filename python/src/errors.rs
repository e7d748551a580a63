//! The library's errors as Python exceptions: one base class, one subclass per kind of failure
//! a caller may want to catch apart. The message is the library's own (rank, peer, operation);
//! the exception also carries, as attributes, `rank` (the rank that raised it, None where the
//! error is not a rank's, e.g. configuration), `kind` (the error's kind in one word:
//! `timeout`, `mismatch`, `aborted`, ...) and `flight_record` (the path of the file where this
//! rank wrote its last calls, as in the message, or None: see docs/tracing.md).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    ipcreduce,
    Error,
    PyException,
    "Base class of every ipcreduce error."
);
create_exception!(
    ipcreduce,
    TimeoutError,
    Error,
    "A bounded wait expired: a peer never arrived. The communicator is unusable."
);
create_exception!(
    ipcreduce,
    PeerLostError,
    Error,
    "A peer process died or left. The communicator is unusable."
);
create_exception!(
    ipcreduce,
    AbortedError,
    Error,
    "The communicator was aborted (peer death, timeout, abort(), or a mismatch another rank \
     found first: the message names the cause); create a new one."
);
create_exception!(
    ipcreduce,
    MismatchError,
    Error,
    "Ranks called the same collective with different arguments. The communicator is unusable."
);
create_exception!(
    ipcreduce,
    InvalidArgumentError,
    Error,
    "An unusable argument (dtype, layout, device, size); the communicator stays usable."
);
create_exception!(
    ipcreduce,
    UnavailableError,
    Error,
    "The requested backend cannot run here (no GPU, no driver, no peer access)."
);
create_exception!(
    ipcreduce,
    ConfigError,
    Error,
    "Missing or contradictory configuration (rank variables, IPCREDUCE_* variables)."
);

/// The error's kind in one word (the `kind` attribute), and the rank that raised it.
fn kind_and_rank(e: &ipcreduce::Error) -> (&'static str, Option<usize>) {
    use ipcreduce::Error as E;
    match e {
        E::Config(_) => ("config", None),
        E::InvalidArgument { rank, .. } => ("invalid_argument", Some(*rank)),
        E::Bootstrap { rank, .. } => ("bootstrap", Some(*rank)),
        E::PeerLost { rank, .. } => ("peer_lost", Some(*rank)),
        E::Timeout { rank, .. } => ("timeout", Some(*rank)),
        E::Mismatch { rank, .. } => ("mismatch", Some(*rank)),
        E::Aborted { rank, .. } => ("aborted", Some(*rank)),
        E::CudaUnavailable(_) => ("cuda_unavailable", None),
        E::Cuda { rank, .. } => ("cuda", Some(*rank)),
        E::CudaDriver { rank, .. } => ("cuda_driver", Some(*rank)),
        E::PeerAccess { rank, .. } => ("peer_access", Some(*rank)),
        E::Io { .. } => ("io", None),
        // Whatever later versions add: the message still says it all.
        #[allow(unreachable_patterns)]
        _ => ("error", None),
    }
}

/// The Python exception for a library error, carrying the library's message and, as
/// attributes, the rank, the kind and the flight record's path.
pub fn to_py(e: ipcreduce::Error) -> PyErr {
    use ipcreduce::Error as E;
    let msg = e.to_string();
    let (kind, rank) = kind_and_rank(&e);
    let record = e.flight_record();
    let err = match e {
        E::Timeout { .. } => TimeoutError::new_err(msg),
        E::PeerLost { .. } => PeerLostError::new_err(msg),
        E::Aborted { .. } => AbortedError::new_err(msg),
        E::Mismatch { .. } => MismatchError::new_err(msg),
        E::InvalidArgument { .. } => InvalidArgumentError::new_err(msg),
        E::CudaUnavailable(_) | E::PeerAccess { .. } => UnavailableError::new_err(msg),
        E::Config(_) => ConfigError::new_err(msg),
        // Bootstrap, CUDA driver, I/O and whatever later versions add.
        _ => Error::new_err(msg),
    };
    Python::attach(|py| {
        let v = err.value(py);
        // Setting attributes on a fresh exception instance cannot fail short of memory; the
        // message alone is still right if it does.
        let _ = v.setattr("rank", rank);
        let _ = v.setattr("kind", kind);
        let _ = v.setattr(
            "flight_record",
            record.map(|p| p.to_string_lossy().into_owned()),
        );
    });
    err
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("PeerLostError", py.get_type::<PeerLostError>())?;
    m.add("AbortedError", py.get_type::<AbortedError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    Ok(())
}
