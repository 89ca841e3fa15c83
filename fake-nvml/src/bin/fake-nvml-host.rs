//! `fake-nvml-host MACHINE ROOT`: installs under ROOT the host files (sysfs PCI functions,
//! loaded-module entries, `/proc/driver/nvidia`) a node with MACHINE's GPUs shows, and the fake
//! MPS control program (built beside this binary) as `/usr/bin/nvidia-cuda-mps-control`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [machine, root] = args.as_slice() else {
        eprintln!("usage: fake-nvml-host MACHINE.toml ROOT");
        return ExitCode::from(2);
    };
    let text = match std::fs::read_to_string(machine) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("fake-nvml-host: {machine}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let parsed = match fake_nvml::machine::Machine::parse(&text) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("fake-nvml-host: {machine}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let root = std::path::Path::new(root);
    let installed = fake_nvml::host::install(&parsed, root).and_then(|()| fake_nvml::host::install_mps_control(root));
    match installed {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fake-nvml-host: {}: {e}", root.display());
            ExitCode::FAILURE
        }
    }
}
