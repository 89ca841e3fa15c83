//! The node's machine architecture, as a fact read from the host rather than the architecture
//! the agent was built for: a test on an x86_64 machine simulates an arm64 node (Grace Hopper,
//! Grace Blackwell) by writing `aarch64` to `<root>/proc/sys/kernel/arch`.
//!
//! What differs per architecture, and is derived here for the modules that need it:
//!
//! - Debian and Ubuntu keep libraries in a multiarch folder named by the GNU triplet:
//!   `/usr/lib/x86_64-linux-gnu` or `/usr/lib/aarch64-linux-gnu` ([`HostArch::library_dirs`]).
//!   The RHEL family uses `/usr/lib64` on both.
//! - NVIDIA names its `.run` installers and their download folders by `uname -m`:
//!   `NVIDIA-Linux-x86_64-<version>.run` under `Linux-x86_64/`, `NVIDIA-Linux-aarch64-<version>.run`
//!   under `Linux-aarch64/` ([`HostArch::machine`], the `{arch}` of the URL templates).

use std::path::PathBuf;

use serde::{Serialize, Serializer};

use super::HostRoot;

/// The host file that names the machine architecture (the `kernel.arch` sysctl, `uname -m`).
pub const ARCH_FILE: &str = "/proc/sys/kernel/arch";

/// The node's machine architecture, by its `uname -m` name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostArch {
    /// `x86_64` (Debian's `amd64`).
    X86_64,
    /// `aarch64` (Debian's `arm64`): Grace Hopper, Grace Blackwell, Jetson-class servers.
    Aarch64,
    /// Any other `uname -m` (`ppc64le`, ...): no multiarch folder is known for it.
    Other(String),
}

impl HostArch {
    /// The architecture a `uname -m` (or a Debian architecture name) means: `x86_64`/`amd64`,
    /// `aarch64`/`arm64`, else [`HostArch::Other`] with the name trimmed.
    pub fn parse(machine: &str) -> HostArch {
        match machine.trim() {
            "x86_64" | "amd64" => HostArch::X86_64,
            "aarch64" | "arm64" => HostArch::Aarch64,
            other => HostArch::Other(other.to_string()),
        }
    }

    /// The node's architecture. On the real root, uname(2). Under another root,
    /// `<root>/proc/sys/kernel/arch` (the host's when its `/proc` is there, a fixture in tests),
    /// and uname(2) when that file is missing or empty. Should uname fail, the architecture the
    /// agent was built for (a native binary runs on its own architecture).
    pub fn read(root: &HostRoot) -> HostArch {
        if !root.is_real()
            && let Ok(text) = std::fs::read_to_string(root.join(ARCH_FILE))
            && !text.trim().is_empty()
        {
            return HostArch::parse(&text);
        }
        match nix::sys::utsname::uname() {
            Ok(uts) => HostArch::parse(&uts.machine().to_string_lossy()),
            Err(_) => HostArch::parse(std::env::consts::ARCH),
        }
    }

    /// The `uname -m` name: `x86_64`, `aarch64`. NVIDIA uses it in its `.run` file names and
    /// download folders (`Linux-aarch64/<version>/NVIDIA-Linux-aarch64-<version>.run`) and in
    /// per-architecture Vulkan ICD files (`nvidia_icd.aarch64.json`).
    pub fn machine(&self) -> &str {
        match self {
            HostArch::X86_64 => "x86_64",
            HostArch::Aarch64 => "aarch64",
            HostArch::Other(name) => name,
        }
    }

    /// The Debian multiarch triplet (`dpkg-architecture -qDEB_HOST_MULTIARCH`):
    /// `x86_64-linux-gnu`, `aarch64-linux-gnu`; `None` for other architectures.
    pub fn multiarch_triplet(&self) -> Option<&'static str> {
        match self {
            HostArch::X86_64 => Some("x86_64-linux-gnu"),
            HostArch::Aarch64 => Some("aarch64-linux-gnu"),
            HostArch::Other(_) => None,
        }
    }

    /// The library folders the dynamic loader searches by default on this architecture, in the
    /// order the agent searches them (host paths): the Debian/Ubuntu multiarch folder, the RHEL
    /// family's `lib64` (both architectures), `/usr/lib`, and the multiarch folder under `/lib`
    /// (hosts without a merged `/usr`). The other architecture's multiarch folder is never
    /// searched: libraries there are for a foreign architecture and cannot be loaded.
    pub fn library_dirs(&self) -> Vec<PathBuf> {
        let triplet = self.multiarch_triplet();
        let mut dirs = Vec::new();
        dirs.extend(triplet.map(|t| PathBuf::from(format!("/usr/lib/{t}"))));
        dirs.extend(["/usr/lib64", "/lib64", "/usr/lib"].map(PathBuf::from));
        dirs.extend(triplet.map(|t| PathBuf::from(format!("/lib/{t}"))));
        dirs
    }
}

impl std::fmt::Display for HostArch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.machine())
    }
}

impl Serialize for HostArch {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.machine())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_the_architecture() {
        for (name, arch) in [
            ("x86_64", HostArch::X86_64),
            ("amd64", HostArch::X86_64),
            ("aarch64\n", HostArch::Aarch64),
            ("arm64", HostArch::Aarch64),
            ("ppc64le", HostArch::Other("ppc64le".into())),
        ] {
            assert_eq!(HostArch::parse(name), arch, "{name:?}");
        }
        assert_eq!(HostArch::Aarch64.machine(), "aarch64");
        assert_eq!(HostArch::Other("ppc64le".into()).to_string(), "ppc64le");
    }

    #[test]
    fn a_simulated_root_says_its_architecture() {
        let tmp = tempfile::tempdir().unwrap();
        let root = HostRoot::new(tmp.path());
        std::fs::create_dir_all(tmp.path().join("proc/sys/kernel")).unwrap();
        std::fs::write(tmp.path().join("proc/sys/kernel/arch"), "aarch64\n").unwrap();
        assert_eq!(HostArch::read(&root), HostArch::Aarch64);
        std::fs::write(tmp.path().join("proc/sys/kernel/arch"), "x86_64\n").unwrap();
        assert_eq!(HostArch::read(&root), HostArch::X86_64);
    }

    #[test]
    fn without_the_file_the_kernel_is_asked() {
        let tmp = tempfile::tempdir().unwrap();
        let own = nix::sys::utsname::uname().unwrap();
        assert_eq!(
            HostArch::read(&HostRoot::new(tmp.path())),
            HostArch::parse(&own.machine().to_string_lossy())
        );
    }

    #[test]
    fn library_folders_follow_the_architecture() {
        let strs = |arch: HostArch| {
            arch.library_dirs()
                .into_iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            strs(HostArch::X86_64),
            [
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib64",
                "/lib64",
                "/usr/lib",
                "/lib/x86_64-linux-gnu"
            ]
        );
        assert_eq!(
            strs(HostArch::Aarch64),
            [
                "/usr/lib/aarch64-linux-gnu",
                "/usr/lib64",
                "/lib64",
                "/usr/lib",
                "/lib/aarch64-linux-gnu"
            ]
        );
        assert_eq!(
            strs(HostArch::Other("ppc64le".into())),
            ["/usr/lib64", "/lib64", "/usr/lib"]
        );
    }
}
