//! `libfake_nvml.so`: a fake `libnvidia-ml.so` that simulates NVIDIA GPUs for CI.
//!
//! Load it like the real library, e.g. with nvml-wrapper:
//! `Nvml::builder().lib_path(fake_nvml::library_path().unwrap().as_os_str()).init()`.
//! The machine comes from the TOML file named by `FAKE_NVML_MACHINE`; mutable state (MIG
//! mode, GPU and compute instances) is kept in `$FAKE_NVML_STATE_DIR/state.json`, and tests
//! inject Xid errors, running processes and lost GPUs through files in that directory.
//! See `README.md` for the machine format, models, MIG tables and modelled behaviour.
//!
//! The crate owns: the exported NVML C symbols (module `ffi`), the model tables
//! ([`models`]), the machine-file parser ([`machine`]), the MIG placement engine
//! ([`state`]), the GPM counters ([`gpm`]) and the injection-file readers and writers ([`inject`]). Its only effects are
//! reading the machine file and the injection files, writing `state.json`, and stderr notes.

pub mod error;
pub mod fabric;
mod ffi;
pub mod gpm;
pub mod host;
pub mod ids;
pub mod inject;
pub mod machine;
pub mod models;
mod runtime;
pub mod state;

use std::path::PathBuf;

pub use inject::{append_xid, write_lost, write_processes};
pub use runtime::{ENV_MACHINE, ENV_STATE_DIR, STATE_FILE};

/// File name of the built library.
pub const LIBRARY_FILE: &str = "libfake_nvml.so";

/// Finds the built `libfake_nvml.so` for a test executable: next to it (`target/<profile>/deps`)
/// or one directory up (`target/<profile>`). Returns `None` if it was not built.
pub fn library_path() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [Some(dir), dir.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join(LIBRARY_FILE))
        .find(|p| p.is_file())
}
