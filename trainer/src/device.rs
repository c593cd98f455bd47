//! Picks the device: CUDA when libtorch's CUDA backend loads and sees a GPU, else CPU.
//!
//! The linker drops `libtorch_cuda.so` from the binary (nothing references its symbols
//! directly, and it links `--as-needed`), so CUDA would never register with libtorch.
//! [`init`] therefore `dlopen`s it, from the directory of the `libtorch_cpu.so` this
//! process loaded, before any tensor is made. On a machine without the CUDA libraries the
//! `dlopen` fails; that is logged and the trainer runs on CPU.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tch::{Device, Kind};

/// What [`init`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub device: Device,
    /// How many CUDA devices libtorch sees (0 on CPU).
    pub cuda_devices: usize,
    /// Why CUDA is not used, when it is not.
    pub cpu_reason: Option<String>,
}

impl DeviceInfo {
    /// The dtype models compute in: bf16 on CUDA, f32 on CPU.
    pub fn compute_kind(&self) -> Kind {
        compute_kind(self.device)
    }
}

/// bf16 on CUDA, f32 on CPU.
pub fn compute_kind(device: Device) -> Kind {
    match device {
        Device::Cuda(_) => Kind::BFloat16,
        _ => Kind::Float,
    }
}

static INIT: OnceLock<DeviceInfo> = OnceLock::new();

/// Loads libtorch's CUDA backend when it can and returns the device to use. Call it at
/// start-up before any tch call; later calls return the first answer.
/// `GRAFT_DEVICE=cpu` forces the CPU.
pub fn init() -> DeviceInfo {
    INIT.get_or_init(|| {
        if std::env::var("GRAFT_DEVICE").is_ok_and(|v| v == "cpu") {
            return DeviceInfo {
                device: Device::Cpu,
                cuda_devices: 0,
                cpu_reason: Some("GRAFT_DEVICE=cpu".to_owned()),
            };
        }
        let loaded = load_cuda_backend();
        let n = tch::Cuda::device_count().max(0) as usize;
        let info = match (&loaded, n) {
            (Ok(_), n) if n > 0 => DeviceInfo {
                device: Device::Cuda(0),
                cuda_devices: n,
                cpu_reason: None,
            },
            (Ok(path), _) => DeviceInfo {
                device: Device::Cpu,
                cuda_devices: 0,
                cpu_reason: Some(format!(
                    "{} loaded but libtorch sees no CUDA device",
                    path.display()
                )),
            },
            (Err(e), _) => DeviceInfo {
                device: Device::Cpu,
                cuda_devices: 0,
                cpu_reason: Some(e.clone()),
            },
        };
        match &info.cpu_reason {
            None => tracing::info!(devices = n, "trainer: using CUDA"),
            Some(why) => tracing::info!(reason = %why, "trainer: using the CPU"),
        }
        info
    })
    .clone()
}

/// The directory of the `libtorch_cpu.so` mapped into this process.
fn libtorch_dir() -> Option<PathBuf> {
    // Force libtorch to be loaded (it is, as a DT_NEEDED of the binary), then find it.
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| Path::new(p).parent().map(Path::to_path_buf))
        .or_else(|| option_env!("GRAFT_LIBTORCH_LIB").map(PathBuf::from))
}

fn load_cuda_backend() -> Result<PathBuf, String> {
    let dir = libtorch_dir().ok_or("cannot find the loaded libtorch_cpu.so".to_owned())?;
    let path = dir.join("libtorch_cuda.so");
    if !path.exists() {
        return Err(format!(
            "{} does not exist (a CPU-only libtorch)",
            path.display()
        ));
    }
    dlopen_global(&path)
        .map(|()| path.clone())
        .map_err(|e| format!("cannot load {} ({e}); no CUDA here", path.display()))
}

#[allow(unsafe_code)]
fn dlopen_global(path: &Path) -> Result<(), String> {
    use std::ffi::{CStr, CString};
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: `c` is a valid NUL-terminated path. Loading libtorch_cuda runs its static
    // initialisers, which register the CUDA backend with the libtorch already loaded;
    // the handle is deliberately never closed (the backend must stay registered).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a valid C string owned by libc, read at once.
        let err = unsafe { libc::dlerror() };
        let msg = if err.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            // SAFETY: non-null, NUL-terminated, valid until the next dl* call.
            unsafe { CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(msg);
    }
    Ok(())
}
