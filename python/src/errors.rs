//! The library's errors as Python exceptions: one base class, one subclass per kind of failure
//! a caller may want to catch apart. The message is the library's own (rank, peer, operation).

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

/// The Python exception for a library error, carrying the library's message.
pub fn to_py(e: ipcreduce::Error) -> PyErr {
    use ipcreduce::Error as E;
    let msg = e.to_string();
    match e {
        E::Timeout { .. } => TimeoutError::new_err(msg),
        E::PeerLost { .. } => PeerLostError::new_err(msg),
        E::Aborted { .. } => AbortedError::new_err(msg),
        E::Mismatch { .. } => MismatchError::new_err(msg),
        E::InvalidArgument { .. } => InvalidArgumentError::new_err(msg),
        E::CudaUnavailable(_) | E::PeerAccess { .. } => UnavailableError::new_err(msg),
        E::Config(_) => ConfigError::new_err(msg),
        // Bootstrap, CUDA driver, I/O and whatever later versions add.
        _ => Error::new_err(msg),
    }
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
