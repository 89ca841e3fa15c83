//! The host files a node with the machine's GPUs and a loaded NVIDIA driver shows: its
//! architecture (`/proc/sys/kernel/arch`, the machine file's `arch`), the PCI
//! functions in sysfs, the driver's user-space libraries (in the architecture's Debian multiarch
//! folder, `usr/lib/x86_64-linux-gnu` or `usr/lib/aarch64-linux-gnu`), the loaded modules and their version, `/proc/driver/nvidia/version`, and
//! the MIG capability table, and (separately, [`install_mps_control`]) the MPS control program. Tests and `scripts/simulate` install them under the agent's root
//! (binary `fake-nvml-host MACHINE ROOT`), so the agent sees what a real node would show.

use std::path::Path;

use crate::machine::Machine;

/// `(path relative to the root, content)` for every file.
pub fn host_files(machine: &Machine) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, String)> = Vec::new();
    let mut binary: Vec<(String, Vec<u8>)> = Vec::new();
    for gpu in &machine.gpus {
        let b = &gpu.bus_id;
        let dir = format!(
            "sys/bus/pci/devices/{:04x}:{:02x}:{:02x}.{:x}",
            b.domain, b.bus, b.device, b.function
        );
        files.push((format!("{dir}/vendor"), "0x10de\n".to_string()));
        files.push((format!("{dir}/device"), format!("0x{:04x}\n", gpu.model.pci_device_id)));
        files.push((format!("{dir}/class"), format!("{:#08x}\n", gpu.pci_class)));
        binary.push((
            format!("{dir}/config"),
            config_space(gpu.model.pci_device_id, gpu.pci_class, gpu.vgpu),
        ));
        let numa = gpu.numa_node.map_or(-1, i64::from);
        files.push((format!("{dir}/numa_node"), format!("{numa}\n")));
    }
    let v = &machine.driver_version;
    let arch = &machine.arch;
    // The agent reads the architecture from here under a root other than `/`, so the simulated
    // node is the machine file's architecture whatever the test machine's.
    files.push(("proc/sys/kernel/arch".into(), format!("{arch}\n")));
    // The driver's user-space libraries as the driver's installer leaves them (empty stand-ins:
    // nothing loads them; the agent's CDI spec mounts them and refuses a tree without them).
    // The soname links are left out: the node's NVML library is the fake itself.
    for lib in ["libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler"] {
        files.push((format!("{}/{lib}.so.{v}", library_dir(machine)), String::new()));
    }
    files.push(("sys/module/nvidia/version".into(), format!("{v}\n")));
    files.push(("sys/module/nvidia/refcnt".into(), "2\n".into()));
    files.push(("sys/module/nvidia_uvm/refcnt".into(), "0\n".into()));
    files.push(("sys/module/nvidia_modeset/refcnt".into(), "0\n".into()));
    files.push((
        "proc/driver/nvidia/version".into(),
        format!(
            "NVRM version: NVIDIA UNIX Open Kernel Module for {arch}  {v}  Release Build  (dvs-builder@U16-I3-B03-4-3)  Thu Feb 22 01:44:30 UTC 2024\nGCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
        ),
    ));
    files.push((
        "proc/driver/nvidia-caps/mig-minors".into(),
        mig_minors_table(machine.gpus.iter().map(|g| g.minor + 1).max().unwrap_or(0).max(8)),
    ));
    files
        .into_iter()
        .map(|(p, c)| (p, c.into_bytes()))
        .chain(binary)
        .collect()
}

/// The folder, relative to the root, that holds the driver's libraries: the machine's Debian
/// multiarch folder (`usr/lib/x86_64-linux-gnu`, `usr/lib/aarch64-linux-gnu`). Tests install the
/// fake NVML library there as `libnvidia-ml.so.1`.
pub fn library_dir(machine: &Machine) -> String {
    format!("usr/lib/{}-linux-gnu", machine.arch)
}

/// The first 256 bytes of the GPU's PCI configuration space, as `config` in sysfs shows them to
/// root: vendor and device id, and a capability list that holds NVIDIA's vendor-specific
/// capability with the vGPU signature (`"VF"` at bytes 3 and 4, then the host driver version and
/// branch records) when the GPU is a vGPU guest, and a plain PCI Express capability otherwise.
fn config_space(device_id: u16, class: u32, vgpu: bool) -> Vec<u8> {
    let mut c = [0u8; 256];
    c[0..2].copy_from_slice(&0x10deu16.to_le_bytes());
    c[2..4].copy_from_slice(&device_id.to_le_bytes());
    c[0x06] = 0x10; // status: capability list present
    c[0x09..0x0c].copy_from_slice(&class.to_le_bytes()[0..3]); // prog-if, subclass, base class
    c[0x34] = 0x60; // first capability
    c[0x60] = 0x10; // PCI Express
    if vgpu {
        c[0x61] = 0xd4; // next
        let cap = [0x09u8, 0x00, 0x1b, b'V', b'F', 0x00, 0x16];
        c[0xd4..0xd4 + cap.len()].copy_from_slice(&cap);
        c[0xdb..0xe1].copy_from_slice(b"550.54");
        c[0xe5..0xeb].copy_from_slice(b"r550_0");
    }
    c.to_vec()
}

/// Writes [`host_files`] under `root` (not the MPS control program: [`install_mps_control`]).
pub fn install(machine: &Machine, root: &Path) -> std::io::Result<()> {
    for (path, content) in host_files(machine) {
        let path = root.join(path);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, content)?;
    }
    Ok(())
}

/// Where the driver installs its MPS control program, relative to the root.
pub const MPS_CONTROL_PATH: &str = "usr/bin/nvidia-cuda-mps-control";
/// The fake's binary (`src/bin/fake-mps-control.rs`).
pub const FAKE_MPS_CONTROL: &str = "fake-mps-control";

/// The fake MPS control program built beside the running executable (in its folder or the one
/// above, as cargo lays out `target/<profile>/` and `target/<profile>/deps/`); `None` when it was
/// not built (`cargo build --workspace` builds it).
pub fn fake_mps_control() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [Some(dir), dir.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join(FAKE_MPS_CONTROL))
        .find(|p| p.is_file())
}

/// Installs [`fake_mps_control`] at `<root>/usr/bin/nvidia-cuda-mps-control` as the driver's
/// installer would: a copy (not a link to the build folder, which the agent's contained daemon
/// does not see) with the dynamic loader and the libraries it links (as `ldd` lists them) at
/// their own paths under `root`, so it runs in a mount namespace that has only the driver
/// root's `usr`, `lib` and `lib64`. `Ok(false)` when the fake was not built (nothing is
/// installed then).
pub fn install_mps_control(root: &Path) -> std::io::Result<bool> {
    let Some(program) = fake_mps_control() else {
        return Ok(false);
    };
    let path = root.join(MPS_CONTROL_PATH);
    copy_file(&program, &path)?;
    for lib in linked_libraries(&program)? {
        let under = root.join(lib.strip_prefix("/").unwrap_or(&lib));
        if !under.exists() {
            copy_file(&lib, &under)?;
        }
    }
    Ok(true)
}

/// Copies `from` (following links) to `to`, replacing what is there, with its mode.
fn copy_file(from: &Path, to: &Path) -> std::io::Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(to);
    std::fs::copy(from, to)?;
    Ok(())
}

/// The absolute paths `ldd` lists for `program`: the libraries it links and the loader.
fn linked_libraries(program: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let out = std::process::Command::new("ldd").arg(program).output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "ldd {}: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    // Lines are `name => /path (0x...)`, `/loader (0x...)` or `linux-vdso.so.1 (0x...)`.
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let rest = line.split("=>").last()?.trim();
            let path = rest.split_whitespace().next()?;
            path.starts_with('/').then(|| std::path::PathBuf::from(path))
        })
        .collect())
}

/// The driver's `/proc/driver/nvidia-caps/mig-minors` table for GPU minors `0..gpus`, numbered
/// as the real driver numbers it: `config 1`, `monitor 2`, then per GPU 15 GPU instances with 8
/// compute instances each, `gpu<g>/gi<i>/access` followed by its `gpu<g>/gi<i>/ci<c>/access`.
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
