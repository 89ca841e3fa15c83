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
//! ([`state`]) and the injection-file readers and writers ([`inject`]). Its only effects are
//! reading the machine file and the injection files, writing `state.json`, and stderr notes.

pub mod error;
mod ffi;
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

/// The driver's `/proc/driver/nvidia-caps/mig-minors` table for `gpus` GPUs, numbered as the
/// real driver numbers it: `config 1`, `monitor 2`, then per GPU minor 15 GPU instances with 8
/// compute instances each, `gpu<g>/gi<i>/access` followed by its `gpu<g>/gi<i>/ci<c>/access`
/// lines. Test roots install it where the agent reads it.
pub fn mig_minors_table(gpus: u32) -> String {
    let mut out = String::from("config 1\nmonitor 2\n");
    let mut minor = 3;
    for g in 0..gpus {
        for i in 0..15 {
            out.push_str(&format!("gpu{g}/gi{i}/access {minor}\n"));
            minor += 1;
            for c in 0..8 {
                out.push_str(&format!("gpu{g}/gi{i}/ci{c}/access {minor}\n"));
                minor += 1;
            }
        }
    }
    out
}
