//! [`discover`]: which credentials the agent uses, a kubeconfig (named in the config, in
//! `$KUBECONFIG`, or found on the search path) or the in-cluster service account. Above both
//! [`super::credentials`] (the types, the in-cluster reader) and [`super::kubeconfig`] (the
//! file parser), which import only the types.

use std::path::Path;

use crate::config::KubernetesConfig;
use crate::host::HostRoot;

use super::credentials::{
    Credentials, ENV_KUBECONFIG, ENV_SERVICE_HOST, ENV_SERVICE_PORT, FoundBy, exists, in_cluster,
};
use super::error::KubeError;
use super::kubeconfig;
use super::limit::MAX_KUBECONFIG;

/// Finds the credentials, reading the process environment. See [`discover_with`].
pub fn discover(cfg: &KubernetesConfig, root: &HostRoot) -> Result<Option<Credentials>, KubeError> {
    discover_with(cfg, root, &|name| std::env::var(name).ok())
}

/// Finds the credentials, first match wins:
///
/// 1. `kubernetes.kubeconfig` when set (a missing file is an error);
/// 2. `$KUBECONFIG`: the first existing file of the `:`-separated list (set, but none exists:
///    an error);
/// 3. the first existing file of `kubernetes.kubeconfig_search`;
/// 4. the in-cluster service account, when `KUBERNETES_SERVICE_HOST` and
///    `KUBERNETES_SERVICE_PORT` are set;
/// 5. none: `Ok(None)`.
///
/// With `kubernetes.enabled = false` nothing is looked at and the answer is `Ok(None)`.
///
/// Every path is mapped under `root`. `env` looks up environment variables, so tests need not
/// touch the process environment. Only the kubeconfig is read here; token, certificate and CA
/// files are read by the client (and re-read when they change).
pub fn discover_with(
    cfg: &KubernetesConfig,
    root: &HostRoot,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Credentials>, KubeError> {
    if !cfg.enabled {
        return Ok(None);
    }
    if !cfg.kubeconfig.as_os_str().is_empty() {
        let path = root.join(&cfg.kubeconfig);
        if !exists(&path, "kubeconfig")? {
            return Err(KubeError::KubeconfigNotFound {
                path,
                named_by: "kubernetes.kubeconfig",
            });
        }
        return load_kubeconfig(&path, FoundBy::Config, root).map(Some);
    }
    if let Some(list) = env(ENV_KUBECONFIG).filter(|v| !v.trim().is_empty()) {
        let mut looked_for = Vec::new();
        for entry in list.split(':').map(str::trim).filter(|e| !e.is_empty()) {
            let path = root.join(entry);
            if exists(&path, "kubeconfig")? {
                return load_kubeconfig(&path, FoundBy::Env, root).map(Some);
            }
            looked_for.push(path.display().to_string());
        }
        return Err(KubeError::KubeconfigEnvNotFound {
            looked_for: looked_for.join(", "),
        });
    }
    for candidate in &cfg.kubeconfig_search {
        let path = root.join(candidate);
        if exists(&path, "kubeconfig")? {
            return load_kubeconfig(&path, FoundBy::Search, root).map(Some);
        }
    }
    let host = env(ENV_SERVICE_HOST).filter(|v| !v.trim().is_empty());
    let port = env(ENV_SERVICE_PORT).filter(|v| !v.trim().is_empty());
    if let (Some(host), Some(port)) = (host, port) {
        return in_cluster(&root.join(&cfg.in_cluster_dir), host.trim(), port.trim()).map(Some);
    }
    Ok(None)
}

/// Reads and resolves one kubeconfig file (already under the root).
pub fn load_kubeconfig(path: &Path, found_by: FoundBy, root: &HostRoot) -> Result<Credentials, KubeError> {
    let read_err = |source| KubeError::ReadFile {
        what: "kubeconfig".into(),
        path: path.to_path_buf(),
        source,
    };
    let data = crate::host::read_file(path, MAX_KUBECONFIG).map_err(read_err)?;
    let text = String::from_utf8(data)
        .map_err(|_| read_err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text")))?;
    kubeconfig::resolve(&text, path, found_by, root)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::credentials::{Origin, TokenSource};
    use std::collections::HashMap;
    use std::fs;

    const TOKEN: &str = "sekrit-token-4f9a8c";

    fn kubeconfig(server: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts:\n- name: c\n  context: {{cluster: k, user: u}}\n\
             clusters:\n- name: k\n  cluster: {{server: '{server}'}}\nusers:\n- name: u\n  user: {{token: {TOKEN}}}\n"
        )
    }

    struct Fixture {
        dir: tempfile::TempDir,
        cfg: KubernetesConfig,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().expect("tempdir");
            let cfg = KubernetesConfig {
                kubeconfig_search: vec![
                    "/etc/kubernetes/kubelet.conf".into(),
                    "/var/lib/kubelet/kubeconfig".into(),
                ],
                in_cluster_dir: "/var/run/secrets/kubernetes.io/serviceaccount".into(),
                ..KubernetesConfig::default()
            };
            Fixture { dir, cfg }
        }

        fn root(&self) -> HostRoot {
            HostRoot::new(self.dir.path())
        }

        fn write(&self, host_path: &str, text: &str) {
            let path = self.root().join(host_path);
            fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            fs::write(path, text).expect("write");
        }

        fn discover(&self, env: &[(&str, &str)]) -> Result<Option<Credentials>, KubeError> {
            let env: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            discover_with(&self.cfg, &self.root(), &|name| env.get(name).cloned())
        }
    }

    const IN_CLUSTER: &[(&str, &str)] = &[(ENV_SERVICE_HOST, "10.96.0.1"), (ENV_SERVICE_PORT, "443")];

    #[test]
    fn nothing_found_is_none() {
        let f = Fixture::new();
        assert!(f.discover(&[]).expect("discover").is_none());
        // Service env without the service account files is an error naming the file.
        let err = f.discover(IN_CLUSTER).expect_err("no token file");
        assert!(err.to_string().contains("token does not exist"), "{err}");
    }

    #[test]
    fn discovery_order() {
        let mut f = Fixture::new();
        f.write("/var/run/secrets/kubernetes.io/serviceaccount/token", "sa-token\n");
        f.write("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt", "CA");
        let creds = f.discover(IN_CLUSTER).expect("discover").expect("some");
        assert_eq!(creds.server, "https://10.96.0.1:443");
        assert!(matches!(creds.origin, Origin::InCluster { .. }));

        f.write("/var/lib/kubelet/kubeconfig", &kubeconfig("https://second:6443"));
        let creds = f.discover(IN_CLUSTER).expect("discover").expect("some");
        assert_eq!(creds.server, "https://second:6443");
        assert!(matches!(
            creds.origin,
            Origin::Kubeconfig {
                found_by: FoundBy::Search,
                ..
            }
        ));

        f.write("/etc/kubernetes/kubelet.conf", &kubeconfig("https://first:6443"));
        let creds = f.discover(IN_CLUSTER).expect("discover").expect("some");
        assert_eq!(creds.server, "https://first:6443");

        f.write("/home/a/env.conf", &kubeconfig("https://env:6443"));
        let env = [
            (ENV_KUBECONFIG, "/nope/one:/home/a/env.conf"),
            IN_CLUSTER[0],
            IN_CLUSTER[1],
        ];
        let creds = f.discover(&env).expect("discover").expect("some");
        assert_eq!(creds.server, "https://env:6443");
        assert!(matches!(
            creds.origin,
            Origin::Kubeconfig {
                found_by: FoundBy::Env,
                ..
            }
        ));

        let err = f
            .discover(&[(ENV_KUBECONFIG, "/nope/one:/nope/two")])
            .expect_err("none exists");
        assert!(
            err.to_string().contains("nope/one") && err.to_string().contains("nope/two"),
            "{err}"
        );

        f.write("/etc/gpu-node-agent/kube.conf", &kubeconfig("https://explicit:6443"));
        f.cfg.kubeconfig = "/etc/gpu-node-agent/kube.conf".into();
        let creds = f.discover(&env).expect("discover").expect("some");
        assert_eq!(creds.server, "https://explicit:6443");
        assert!(matches!(
            creds.origin,
            Origin::Kubeconfig {
                found_by: FoundBy::Config,
                ..
            }
        ));

        f.cfg.kubeconfig = "/etc/gpu-node-agent/missing.conf".into();
        let err = f.discover(&env).expect_err("missing explicit");
        let text = err.to_string();
        assert!(
            text.contains("missing.conf") && text.contains("kubernetes.kubeconfig"),
            "{text}"
        );

        f.cfg.enabled = false;
        assert!(f.discover(&env).expect("disabled").is_none());
    }

    #[test]
    fn a_kubeconfig_over_the_limit_is_refused() {
        let f = Fixture::new();
        let mut text = kubeconfig("https://first:6443");
        f.write("/etc/kubernetes/kubelet.conf", &text);
        assert!(f.discover(&[]).expect("at a normal size").is_some());
        // A comment pads it to one byte over the limit.
        text.push('#');
        let pad = MAX_KUBECONFIG as usize + 1 - text.len() - 1;
        text.push_str(&" ".repeat(pad));
        text.push('\n');
        f.write("/etc/kubernetes/kubelet.conf", &text);
        let err = f.discover(&[]).expect_err("too large").to_string();
        let path = f.root().join("/etc/kubernetes/kubelet.conf");
        assert_eq!(
            err,
            format!(
                "kubeconfig: cannot read {}: the file is over the 1 MiB limit (1048577 bytes)",
                path.display()
            )
        );
    }

    #[test]
    fn debug_and_display_redact_secrets() {
        let f = Fixture::new();
        f.write("/etc/kubernetes/kubelet.conf", &kubeconfig("https://first:6443"));
        let creds = f.discover(&[]).expect("discover").expect("some");
        assert!(matches!(&creds.auth.token, Some(TokenSource::Inline(t)) if t.expose() == TOKEN));
        for text in [format!("{creds:?}"), format!("{creds:#?}"), creds.to_string()] {
            assert!(!text.contains(TOKEN), "{text}");
        }
        assert!(format!("{creds:?}").contains("<redacted>"));
    }
}
