//! Which container engine the kubelet uses: its CRI endpoint, found where a node keeps it.
//!
//! The runtime stage makes the `nvidia` runtime the default of that engine only (so an unmodified
//! GPU pod gets its GPU, as under the GPU Operator), and holds the device plugin back only when
//! that engine's configuration failed. The endpoint is looked for, in order:
//!
//! 1. `[runtime] kubelet_runtime_endpoint` in the agent's config;
//! 2. a running kubelet's command line (`--container-runtime-endpoint`), and the
//!    `containerRuntimeEndpoint` of the config file its `--config` names;
//! 3. kubeadm's `/var/lib/kubelet/kubeadm-flags.env`, then `/etc/default/kubelet` and
//!    `/etc/sysconfig/kubelet` (`KUBELET_EXTRA_ARGS`);
//! 4. `/var/lib/kubelet/config.yaml`'s `containerRuntimeEndpoint`;
//! 5. the kubelet's own default since 1.27, `unix:///run/containerd/containerd.sock`.
//!
//! The readers take text; [`detect`] reads the files under the root.

use std::path::Path;

use crate::config::Engine;
use crate::host::HostRoot;

/// The kubelet's default CRI endpoint (KubeletConfiguration, Kubernetes 1.27 and later).
pub const DEFAULT_ENDPOINT: &str = "unix:///run/containerd/containerd.sock";

/// Files that hold kubelet flags, in the order they are read.
const FLAG_FILES: [&str; 3] = [
    "/var/lib/kubelet/kubeadm-flags.env",
    "/etc/default/kubelet",
    "/etc/sysconfig/kubelet",
];

/// The kubelet config file kubeadm and most installers write.
const CONFIG_FILE: &str = "/var/lib/kubelet/config.yaml";

/// The kubelet's CRI endpoint and where it was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletEndpoint {
    /// `unix:///run/containerd/containerd.sock`.
    pub endpoint: String,
    /// Where it was found, in words (`/var/lib/kubelet/kubeadm-flags.env`, `the kubelet's
    /// default`).
    pub source: String,
}

impl KubeletEndpoint {
    /// The engine behind the endpoint, by its socket's name.
    pub fn engine(&self) -> Option<Engine> {
        engine_of(&self.endpoint)
    }
}

/// The engine an endpoint belongs to, from its path: `crio` (CRI-O), `cri-dockerd` / `docker`
/// (docker through cri-dockerd), `containerd` (containerd, k3s's and RKE2's included).
pub fn engine_of(endpoint: &str) -> Option<Engine> {
    let path = endpoint.trim().trim_start_matches("unix://").to_ascii_lowercase();
    if path.contains("crio") || path.contains("cri-o") {
        Some(Engine::Crio)
    } else if path.contains("docker") {
        Some(Engine::Docker)
    } else if path.contains("containerd") {
        Some(Engine::Containerd)
    } else {
        None
    }
}

/// The endpoint, looked for as the module says; `configured` is `[runtime]
/// kubelet_runtime_endpoint` (empty: look).
pub fn detect(root: &HostRoot, configured: &str) -> KubeletEndpoint {
    let found = |endpoint: String, source: String| KubeletEndpoint { endpoint, source };
    if !configured.is_empty() {
        return found(configured.to_owned(), "[runtime] kubelet_runtime_endpoint".into());
    }
    if let Some(args) = running_kubelet(root) {
        if let Some(endpoint) = flag(&args, "--container-runtime-endpoint") {
            return found(endpoint, "the running kubelet's --container-runtime-endpoint".into());
        }
        if let Some(file) = flag(&args, "--config")
            && let Some(endpoint) = read(root, &file).and_then(|text| config_endpoint(&text))
        {
            return found(endpoint, file);
        }
    }
    for file in FLAG_FILES {
        if let Some(endpoint) = read(root, file).and_then(|text| flag(&env_args(&text), "--container-runtime-endpoint"))
        {
            return found(endpoint, file.into());
        }
    }
    if let Some(endpoint) = read(root, CONFIG_FILE).and_then(|text| config_endpoint(&text)) {
        return found(endpoint, CONFIG_FILE.into());
    }
    found(DEFAULT_ENDPOINT.into(), "the kubelet's default".into())
}

fn read(root: &HostRoot, file: &str) -> Option<String> {
    crate::host::read_text(&root.join(file)).ok()
}

/// The argv of a running kubelet: the first `/proc/<pid>` whose `comm` is `kubelet`.
fn running_kubelet(root: &HostRoot) -> Option<Vec<String>> {
    let proc = root.join("/proc");
    for entry in std::fs::read_dir(&proc).ok()?.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let dir = entry.path();
        let is_kubelet = std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim() == "kubelet");
        if !is_kubelet {
            continue;
        }
        if let Ok(raw) = std::fs::read(dir.join("cmdline")) {
            return Some(
                raw.split(|b| *b == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect(),
            );
        }
    }
    None
}

/// The value of `--name=value` or `--name value` in `args`; the last one wins, as with Go's flag
/// package.
pub fn flag(args: &[String], name: &str) -> Option<String> {
    let mut value = None;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        if let Some(v) = arg.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')) {
            value = Some(v.to_owned());
        } else if arg == name {
            value = iter.next().cloned();
        }
    }
    value
        .map(|v| v.trim_matches(['"', '\'']).to_owned())
        .filter(|v| !v.is_empty())
}

/// The words of every `KEY="..."` line of an environment file (kubeadm-flags.env,
/// /etc/default/kubelet), quotes removed.
pub fn env_args(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .flat_map(|(_, value)| {
            value
                .trim()
                .trim_matches(['"', '\''])
                .split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `containerRuntimeEndpoint` of a KubeletConfiguration (YAML).
pub fn config_endpoint(text: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Subset {
        #[serde(rename = "containerRuntimeEndpoint")]
        endpoint: Option<String>,
    }
    serde_saphyr::from_str::<Subset>(text)
        .ok()?
        .endpoint
        .filter(|e| !e.is_empty())
}

/// The socket path of a `unix://` endpoint (or a bare path) under the root.
pub fn socket_path(root: &HostRoot, endpoint: &str) -> std::path::PathBuf {
    root.join(Path::new(endpoint.trim_start_matches("unix://")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn engines_by_socket_name() {
        for (endpoint, engine) in [
            ("unix:///run/containerd/containerd.sock", Some(Engine::Containerd)),
            ("unix:///run/k3s/containerd/containerd.sock", Some(Engine::Containerd)),
            ("unix:///var/run/crio/crio.sock", Some(Engine::Crio)),
            ("unix:///var/run/cri-dockerd.sock", Some(Engine::Docker)),
            ("/run/containerd/containerd.sock", Some(Engine::Containerd)),
            ("unix:///run/other.sock", None),
        ] {
            assert_eq!(engine_of(endpoint), engine, "{endpoint}");
        }
    }

    #[test]
    fn flags_in_both_forms_last_wins() {
        let args = strings(&["kubelet", "--container-runtime-endpoint=unix:///a.sock", "--v=2"]);
        assert_eq!(
            flag(&args, "--container-runtime-endpoint").as_deref(),
            Some("unix:///a.sock")
        );
        let args = strings(&["--container-runtime-endpoint", "unix:///b.sock", "--config", "/c.yaml"]);
        assert_eq!(
            flag(&args, "--container-runtime-endpoint").as_deref(),
            Some("unix:///b.sock")
        );
        assert_eq!(flag(&args, "--config").as_deref(), Some("/c.yaml"));
        assert_eq!(
            flag(
                &strings(&["--container-runtime-endpoint-x=1"]),
                "--container-runtime-endpoint"
            ),
            None
        );
    }

    #[test]
    fn kubeadm_flags_env_and_kubelet_config() {
        let env = "KUBELET_KUBEADM_ARGS=\"--container-runtime-endpoint=unix:///var/run/crio/crio.sock \
                   --pod-infra-container-image=registry.k8s.io/pause:3.9\"\n";
        assert_eq!(
            flag(&env_args(env), "--container-runtime-endpoint").as_deref(),
            Some("unix:///var/run/crio/crio.sock")
        );
        let yaml = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n\
                    containerRuntimeEndpoint: unix:///run/containerd/containerd.sock\ncgroupDriver: systemd\n";
        assert_eq!(
            config_endpoint(yaml).as_deref(),
            Some("unix:///run/containerd/containerd.sock")
        );
        assert_eq!(config_endpoint("kind: KubeletConfiguration\n"), None);
    }

    #[test]
    fn detection_order_under_a_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = HostRoot::new(tmp.path());
        let write = |path: &str, text: &str| {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        let got = detect(&root, "");
        assert_eq!(got.endpoint, DEFAULT_ENDPOINT);
        assert_eq!(got.source, "the kubelet's default");
        write(
            CONFIG_FILE,
            "containerRuntimeEndpoint: unix:///var/run/crio/crio.sock\n",
        );
        assert_eq!(detect(&root, "").engine(), Some(Engine::Crio));
        write(
            "/var/lib/kubelet/kubeadm-flags.env",
            "KUBELET_KUBEADM_ARGS=\"--container-runtime-endpoint=unix:///var/run/cri-dockerd.sock\"\n",
        );
        let got = detect(&root, "");
        assert_eq!(
            (got.engine(), got.source.as_str()),
            (Some(Engine::Docker), "/var/lib/kubelet/kubeadm-flags.env")
        );
        // A running kubelet's own flags come first.
        write("/proc/4242/comm", "kubelet\n");
        write(
            "/proc/4242/cmdline",
            "/usr/bin/kubelet\0--container-runtime-endpoint=unix:///run/containerd/containerd.sock\0",
        );
        assert_eq!(detect(&root, "").engine(), Some(Engine::Containerd));
        let got = detect(&root, "unix:///var/run/crio/crio.sock");
        assert_eq!(
            (got.engine(), got.source.as_str()),
            (Some(Engine::Crio), "[runtime] kubelet_runtime_endpoint")
        );
    }
}
