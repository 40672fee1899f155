use cudarc::driver::DriverError;

/// Everything ember-cuda can fail with. No function of this crate panics on a missing driver,
/// a missing NVRTC or a full GPU: each is one of these.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no NVIDIA driver: {0}")]
    NoDriver(String),
    #[error("CUDA driver call {op} failed: {err}")]
    Driver { op: &'static str, err: DriverError },
    #[error(
        "no usable NVRTC library (tried: {tried}); install the CUDA toolkit or `pip install nvidia-cuda-nvrtc`, or set EMBER_NVRTC=/path/to/libnvrtc.so.13"
    )]
    NoNvrtc { tried: String },
    #[error("NVRTC {op}: {msg}")]
    Nvrtc { op: &'static str, msg: String },
    #[error("compiling kernel {kernel} for {arch} failed:\n{log}")]
    Compile { kernel: &'static str, arch: String, log: String },
    #[error(
        "out of GPU memory on device {device}: asked for {bytes_asked} bytes ({:.1} MiB), {bytes_free} bytes ({:.1} MiB) free",
        *bytes_asked as f64 / 1048576.0,
        *bytes_free as f64 / 1048576.0
    )]
    OutOfMemory { device: usize, bytes_asked: usize, bytes_free: usize },
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;

/// `map_err` helper: a driver error tagged with the call that returned it.
pub(crate) fn drv(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |err| Error::Driver { op, err }
}

/// A shape error for op `op`.
pub(crate) fn shape(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Shape { op, msg: msg.into() }
}
