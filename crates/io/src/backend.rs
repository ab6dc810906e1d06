//! Which kernel interface does the I/O, and the variable that forces it.

/// The environment variable that forces the I/O backend: for local devices
/// (`cairn_device::open_local`) and for the event loop ([`crate::Reactor`]).
pub const IO_BACKEND_ENV: &str = "CAIRN_IO_BACKEND";

/// Which kernel interface does the I/O: io_uring, or plain system calls
/// (pread/pwrite for devices, poll(2) and non-blocking socket calls for the
/// event loop).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoBackend {
    /// io_uring if it works here, else plain system calls.
    #[default]
    Auto,
    /// Plain system calls: no io_uring at all.
    Pread,
    /// io_uring; an error if io_uring is unavailable.
    Uring,
}

impl IoBackend {
    /// Parse a value of [`IO_BACKEND_ENV`]: `auto`, `pread` or `uring`
    /// (case-insensitive; empty means `auto`).
    pub fn parse(value: &str) -> Option<IoBackend> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Some(IoBackend::Auto),
            "pread" => Some(IoBackend::Pread),
            "uring" | "io_uring" | "io-uring" => Some(IoBackend::Uring),
            _ => None,
        }
    }

    /// The backend [`IO_BACKEND_ENV`] asks for ([`IoBackend::Auto`] if unset),
    /// or a message saying what is wrong with its value.
    pub fn from_env() -> Result<IoBackend, String> {
        match std::env::var(IO_BACKEND_ENV) {
            Ok(value) => IoBackend::parse(&value).ok_or_else(|| {
                format!("{IO_BACKEND_ENV}={value:?} is not one of pread, uring, auto")
            }),
            Err(std::env::VarError::NotPresent) => Ok(IoBackend::Auto),
            Err(std::env::VarError::NotUnicode(value)) => Err(format!(
                "{IO_BACKEND_ENV}={value:?} is not one of pread, uring, auto"
            )),
        }
    }
}
