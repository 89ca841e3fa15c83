//! Which NVIDIA device nodes exist on the host: the driver's control nodes under `<dev_root>/dev`
//! and the MIG capability minors the driver publishes in
//! `<proc_root>/driver/nvidia-caps/mig-minors`.
//!
//! The host facts of the edits model: the device nodes every renderer hands out come from here,
//! the way NVIDIA's plugin does it: control nodes that are absent are simply skipped, and MIG
//! devices additionally need the `/dev/nvidia-caps/nvidia-cap<N>` nodes of their GPU and compute
//! instances ([`super::device_nodes`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Control nodes the NVIDIA driver may create, in the order they are handed to containers.
pub const CONTROL_NODES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// Location of the MIG capability minor table, relative to the proc root.
pub const MIG_MINORS_PATH: &str = "driver/nvidia-caps/mig-minors";

/// Error from parsing the `mig-minors` table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DevNodesError {
    /// A non-blank line that is not `<name> <minor>` with a decimal `u32` minor.
    #[error("mig-minors line {line}: expected \"<name> <minor>\", got {text:?}")]
    MalformedLine {
        /// 1-based line number.
        line: usize,
        /// The offending line, as read.
        text: String,
    },
}

/// The device nodes present on this host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceNodes {
    /// Which of nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset exist under
    /// `dev_root/dev` (in that order), as container paths, e.g. `"/dev/nvidiactl"`.
    pub control: Vec<String>,
    /// From `/proc/driver/nvidia-caps/mig-minors`: `"gpu0/gi1/access" -> 21`,
    /// `"gpu0/gi1/ci0/access" -> 22`, `"config" -> 1`, `"monitor" -> 2`, ...
    /// The minor `N` is the one of `/dev/nvidia-caps/nvidia-cap<N>`.
    pub mig_minors: BTreeMap<String, u32>,
    /// The nodes of the opt-in injections (GDS, MOFED, GDRCopy, IMEX channels).
    pub extra: ExtraNodes,
}

/// Folder of the IMEX channel nodes (`channel<N>`).
pub const IMEX_CHANNELS_DIR: &str = "/dev/nvidia-caps-imex-channels";
/// The GDRCopy node.
pub const GDRCOPY_NODE: &str = "/dev/gdrdrv";

/// The container path of IMEX channel `id`.
pub fn imex_channel_path(id: u32) -> String {
    format!("{IMEX_CHANNELS_DIR}/channel{id}")
}

/// Device nodes of the opt-in injections found under `<dev_root>/dev`, as container paths,
/// sorted; the nodes the NVIDIA Container Toolkit's CDI modes `gds`, `mofed`, `gdrcopy` and
/// `imex` look for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraNodes {
    /// `/dev/nvidia-fs*` (GPUDirect Storage, the `nvidia-fs` module).
    pub gds: Vec<String>,
    /// `/dev/infiniband/uverbs*` and `/dev/infiniband/rdma_cm` (MOFED).
    pub mofed: Vec<String>,
    /// `/dev/gdrdrv` (GDRCopy, the `gdrdrv` module).
    pub gdrcopy: Vec<String>,
    /// `N` of every `/dev/nvidia-caps-imex-channels/channel<N>`.
    pub imex_channels: BTreeSet<u32>,
}

impl ExtraNodes {
    /// Reads `<dev_root>/dev`; an unreadable folder counts as empty.
    pub fn gather(dev_root: &Path) -> ExtraNodes {
        let names = |dir: &str| -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(dev_root.join(dir.trim_start_matches('/')))
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .filter_map(|e| e.file_name().into_string().ok())
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            names
        };
        let gds = names("/dev")
            .into_iter()
            .filter(|n| n.starts_with("nvidia-fs"))
            .map(|n| format!("/dev/{n}"))
            .collect();
        let mofed = names("/dev/infiniband")
            .into_iter()
            .filter(|n| n.starts_with("uverbs") || n == "rdma_cm")
            .map(|n| format!("/dev/infiniband/{n}"))
            .collect();
        let gdrcopy = [GDRCOPY_NODE]
            .into_iter()
            .filter(|node| dev_root.join(node.trim_start_matches('/')).exists())
            .map(str::to_string)
            .collect();
        let imex_channels = names(IMEX_CHANNELS_DIR)
            .iter()
            .filter_map(|n| n.strip_prefix("channel")?.parse().ok())
            .collect();
        ExtraNodes {
            gds,
            mofed,
            gdrcopy,
            imex_channels,
        }
    }
}

/// Parses the driver's `mig-minors` table: one `<name> <minor>` pair per line, separated by
/// whitespace (e.g. `config 1`, `gpu0/gi0/access 3`, `gpu0/gi0/ci0/access 4`). Blank lines are
/// ignored; any other line that is not exactly a name and a decimal minor is an error naming
/// its 1-based line number. A name that appears twice keeps its last minor.
pub fn parse_mig_minors(text: &str) -> Result<BTreeMap<String, u32>, DevNodesError> {
    let mut minors = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let malformed = || DevNodesError::MalformedLine {
            line: i + 1,
            text: raw.to_string(),
        };
        let mut fields = line.split_whitespace();
        let (Some(name), Some(minor), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(malformed());
        };
        let minor: u32 = minor.parse().map_err(|_| malformed())?;
        minors.insert(name.to_string(), minor);
    }
    Ok(minors)
}

impl DeviceNodes {
    /// Looks at the host: control nodes under `<dev_root>/dev`, MIG minors from
    /// `<proc_root>/driver/nvidia-caps/mig-minors`. Never fails: a missing table (no MIG-capable
    /// driver, or caps not loaded) gives an empty map and is logged at debug; an unreadable or
    /// malformed one gives an empty map and is logged as a warning (MIG allocations with device
    /// specs then fail with a clear "missing MIG capability" error instead of silently producing
    /// a container without the capability nodes).
    pub fn gather(dev_root: &Path, proc_root: &Path) -> DeviceNodes {
        let control = CONTROL_NODES
            .iter()
            .filter(|node| dev_root.join(node.trim_start_matches('/')).exists())
            .map(ToString::to_string)
            .collect();

        let path = proc_root.join(MIG_MINORS_PATH);
        let mig_minors = match std::fs::read_to_string(&path) {
            Ok(text) => match parse_mig_minors(&text) {
                Ok(minors) => minors,
                Err(err) => {
                    tracing::warn!(path = %path.display(), %err, "ignoring malformed MIG minors table");
                    BTreeMap::new()
                }
            },
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                tracing::debug!(path = %path.display(), "no MIG minors table");
                BTreeMap::new()
            }
            Err(err) => {
                tracing::warn!(path = %path.display(), %err, "cannot read MIG minors table");
                BTreeMap::new()
            }
        };

        DeviceNodes {
            control,
            mig_minors,
            extra: ExtraNodes::gather(dev_root),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n\
gpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n\ngpu1/gi2/access 147\ngpu1/gi2/ci0/access 148\n";

    #[test]
    fn parses_sample_table() {
        let m = parse_mig_minors(SAMPLE).unwrap();
        assert_eq!(m.len(), 8);
        assert_eq!(m["config"], 1);
        assert_eq!(m["monitor"], 2);
        assert_eq!(m["gpu0/gi0/access"], 3);
        assert_eq!(m["gpu0/gi0/ci0/access"], 4);
        assert_eq!(m["gpu0/gi1/ci0/access"], 13);
        assert_eq!(m["gpu1/gi2/access"], 147);
    }

    #[test]
    fn tolerates_extra_whitespace_and_empty_input() {
        let m = parse_mig_minors("  config\t1  \r\n\n").unwrap();
        assert_eq!(m["config"], 1);
        assert!(parse_mig_minors("").unwrap().is_empty());
    }

    #[test]
    fn malformed_lines_name_their_number() {
        let err = parse_mig_minors("config 1\nmonitor two\n").unwrap_err();
        assert_eq!(
            err,
            DevNodesError::MalformedLine {
                line: 2,
                text: "monitor two".into()
            }
        );
        assert!(err.to_string().contains("line 2"), "{err}");

        let err = parse_mig_minors("config 1\n\ngpu0/gi0/access\n").unwrap_err();
        assert!(err.to_string().starts_with("mig-minors line 3:"), "{err}");

        let err = parse_mig_minors("a 1 2").unwrap_err();
        assert!(matches!(err, DevNodesError::MalformedLine { line: 1, .. }));

        let err = parse_mig_minors("a -1").unwrap_err();
        assert!(matches!(err, DevNodesError::MalformedLine { line: 1, .. }));
    }

    #[test]
    fn gather_reads_dev_and_proc() {
        let dev = tempfile::tempdir().unwrap();
        let proc = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dev.path().join("dev")).unwrap();
        std::fs::write(dev.path().join("dev/nvidiactl"), "").unwrap();
        std::fs::write(dev.path().join("dev/nvidia-modeset"), "").unwrap();

        // No MIG table: empty map, no failure.
        let nodes = DeviceNodes::gather(dev.path(), proc.path());
        assert_eq!(nodes.control, ["/dev/nvidiactl", "/dev/nvidia-modeset"]);
        assert!(nodes.mig_minors.is_empty());

        std::fs::create_dir_all(proc.path().join("driver/nvidia-caps")).unwrap();
        std::fs::write(proc.path().join(MIG_MINORS_PATH), SAMPLE).unwrap();
        std::fs::write(dev.path().join("dev/nvidia-uvm"), "").unwrap();
        let nodes = DeviceNodes::gather(dev.path(), proc.path());
        assert_eq!(
            nodes.control,
            ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-modeset"]
        );
        assert_eq!(nodes.mig_minors["gpu0/gi1/access"], 12);

        assert_eq!(nodes.extra, ExtraNodes::default());

        // Malformed table: still no failure, empty map.
        std::fs::write(proc.path().join(MIG_MINORS_PATH), "garbage\n").unwrap();
        let nodes = DeviceNodes::gather(dev.path(), proc.path());
        assert!(nodes.mig_minors.is_empty());
    }

    #[test]
    fn gather_finds_the_injection_nodes() {
        let dev = tempfile::tempdir().unwrap();
        for node in [
            "dev/nvidia-fs1",
            "dev/nvidia-fs0",
            "dev/nvidiactl",
            "dev/gdrdrv",
            "dev/infiniband/uverbs1",
            "dev/infiniband/uverbs0",
            "dev/infiniband/rdma_cm",
            "dev/infiniband/umad0",
            "dev/nvidia-caps-imex-channels/channel0",
            "dev/nvidia-caps-imex-channels/channel7",
            "dev/nvidia-caps-imex-channels/other",
        ] {
            let path = dev.path().join(node);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, "").unwrap();
        }
        let extra = ExtraNodes::gather(dev.path());
        assert_eq!(extra.gds, ["/dev/nvidia-fs0", "/dev/nvidia-fs1"]);
        assert_eq!(
            extra.mofed,
            [
                "/dev/infiniband/rdma_cm",
                "/dev/infiniband/uverbs0",
                "/dev/infiniband/uverbs1"
            ]
        );
        assert_eq!(extra.gdrcopy, ["/dev/gdrdrv"]);
        assert_eq!(extra.imex_channels, [0, 7].into());
        assert_eq!(imex_channel_path(7), "/dev/nvidia-caps-imex-channels/channel7");
    }
}
