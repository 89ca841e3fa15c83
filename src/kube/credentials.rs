//! Where the API server is and how to authenticate to it: [`discover`] finds a kubeconfig or the
//! in-cluster service account, and [`Credentials`] holds the result as *sources* (inline data
//! or host files), so that rotated files are picked up by the client later.
//!
//! Secrets (tokens, private keys, exec plugin arguments and environment values) are kept in
//! types whose `Debug` prints a placeholder; no message of this module contains them.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::config::KubernetesConfig;
use crate::host::HostRoot;

use super::error::KubeError;
use super::kubeconfig;

/// Env var naming kubeconfig files, `:`-separated.
pub const ENV_KUBECONFIG: &str = "KUBECONFIG";
/// Env var set in pods: the API server's service IP.
pub const ENV_SERVICE_HOST: &str = "KUBERNETES_SERVICE_HOST";
/// Env var set in pods: the API server's service port.
pub const ENV_SERVICE_PORT: &str = "KUBERNETES_SERVICE_PORT";

/// A bearer token. `Debug` prints a placeholder; there is no `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a token.
    pub fn new(token: impl Into<String>) -> Secret {
        Secret(token.into())
    }

    /// The token itself, for the `Authorization` header.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Certificate, key or CA bytes: inline (from a `*-data` field or a plugin) or a host file,
/// re-read by the client when it changes.
#[derive(Clone, PartialEq, Eq)]
pub struct Material {
    /// Who names it, for messages: `kubeconfig /x, user "u": client-key`.
    pub field: String,
    /// Where the bytes are.
    pub source: MaterialSource,
}

/// Where certificate, key or CA bytes are.
#[derive(Clone, PartialEq, Eq)]
pub enum MaterialSource {
    /// Decoded bytes of a `*-data` field.
    Inline(Vec<u8>),
    /// A file, already mapped under the root.
    File(PathBuf),
}

impl fmt::Debug for Material {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            MaterialSource::Inline(data) => write!(f, "{}: <{} bytes inline>", self.field, data.len()),
            MaterialSource::File(path) => write!(f, "{}: {}", self.field, path.display()),
        }
    }
}

/// Where a bearer token comes from.
#[derive(Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// A `token` field.
    Inline(Secret),
    /// A `tokenFile` or the service account token, re-read when it changes.
    File {
        /// Who names it, for messages.
        field: String,
        /// The file, under the root.
        path: PathBuf,
    },
}

impl fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenSource::Inline(_) => f.write_str("token <redacted>"),
            TokenSource::File { path, .. } => write!(f, "token file {}", path.display()),
        }
    }
}

/// The ExecCredential API version a plugin speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecApiVersion {
    /// `client.authentication.k8s.io/v1`
    V1,
    /// `client.authentication.k8s.io/v1beta1`
    V1Beta1,
}

impl ExecApiVersion {
    /// The `apiVersion` string.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecApiVersion::V1 => "client.authentication.k8s.io/v1",
            ExecApiVersion::V1Beta1 => "client.authentication.k8s.io/v1beta1",
        }
    }

    /// Parses an `apiVersion` string.
    pub fn parse(text: &str) -> Option<ExecApiVersion> {
        match text {
            "client.authentication.k8s.io/v1" => Some(ExecApiVersion::V1),
            "client.authentication.k8s.io/v1beta1" => Some(ExecApiVersion::V1Beta1),
            _ => None,
        }
    }
}

/// A kubeconfig `exec` credential plugin.
#[derive(Clone, PartialEq, Eq)]
pub struct ExecConfig {
    /// The ExecCredential version to send and expect.
    pub api_version: ExecApiVersion,
    /// The command as written, for messages.
    pub command: String,
    /// What to run: a bare name (searched in `PATH`) or a path resolved against the
    /// kubeconfig's directory and the root.
    pub program: PathBuf,
    /// Arguments (may hold secrets: not printed).
    pub args: Vec<String>,
    /// Extra environment (values may hold secrets: not printed).
    pub env: Vec<(String, String)>,
    /// Pass the cluster's server and CA to the plugin in `KUBERNETES_EXEC_INFO`.
    pub provide_cluster_info: bool,
    /// The kubeconfig's `installHint`, added to "not found" errors.
    pub install_hint: Option<String>,
    /// The kubeconfig naming the plugin.
    pub kubeconfig: PathBuf,
}

impl fmt::Debug for ExecConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecConfig")
            .field("api_version", &self.api_version.as_str())
            .field("command", &self.command)
            .field("program", &self.program)
            .field("args", &format_args!("<{} redacted>", self.args.len()))
            .field("env", &self.env.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>())
            .field("provide_cluster_info", &self.provide_cluster_info)
            .field("kubeconfig", &self.kubeconfig)
            .finish()
    }
}

/// How the client authenticates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Auth {
    /// A bearer token.
    pub token: Option<TokenSource>,
    /// A client certificate and its key (possibly the same combined PEM file).
    pub client_cert: Option<ClientCert>,
    /// An exec plugin supplying a token or a client certificate.
    pub exec: Option<ExecConfig>,
}

/// A client certificate (chain) and its private key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientCert {
    /// The certificate PEM.
    pub cert: Material,
    /// The private key PEM.
    pub key: Material,
}

/// Where the credentials were found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A kubeconfig file.
    Kubeconfig {
        /// The file, under the root.
        path: PathBuf,
        /// How it was chosen.
        found_by: FoundBy,
    },
    /// The in-cluster service account.
    InCluster {
        /// The service account directory, under the root.
        dir: PathBuf,
    },
}

/// How a kubeconfig was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FoundBy {
    /// `kubernetes.kubeconfig` in the config.
    Config,
    /// `$KUBECONFIG`.
    Env,
    /// `kubernetes.kubeconfig_search`.
    Search,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Kubeconfig { path, .. } => write!(f, "kubeconfig {}", path.display()),
            Origin::InCluster { dir } => write!(f, "in-cluster service account {}", dir.display()),
        }
    }
}

/// The API server and how to reach and authenticate to it.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// Base URL, e.g. `https://10.0.0.1:6443` (no trailing slash; may carry a path prefix).
    pub server: String,
    /// Where these came from.
    pub origin: Origin,
    /// CA bundle that signs the server's certificate; `None`: the system's roots.
    pub ca: Option<Material>,
    /// Skip server certificate verification (kubeconfig `insecure-skip-tls-verify`).
    pub insecure_skip_tls_verify: bool,
    /// Name to verify the server's certificate against instead of the URL's host.
    pub tls_server_name: Option<String>,
    /// HTTP(S) proxy to reach the server through.
    pub proxy_url: Option<String>,
    /// Authentication.
    pub auth: Auth,
}

impl Credentials {
    /// A short description for logs: origin, server and kind of authentication.
    pub fn summary(&self) -> String {
        let mut kinds = Vec::new();
        match &self.auth.token {
            Some(TokenSource::Inline(_)) => kinds.push("token".to_string()),
            Some(TokenSource::File { path, .. }) => kinds.push(format!("token file {}", path.display())),
            None => {}
        }
        if self.auth.client_cert.is_some() {
            kinds.push("client certificate".into());
        }
        if let Some(exec) = &self.auth.exec {
            kinds.push(format!("exec plugin {:?}", exec.command));
        }
        if kinds.is_empty() {
            kinds.push("anonymous".into());
        }
        let insecure = if self.insecure_skip_tls_verify {
            ", TLS NOT VERIFIED"
        } else {
            ""
        };
        format!(
            "{} (server {}, {}{insecure})",
            self.origin,
            self.server,
            kinds.join(" + ")
        )
    }
}

impl fmt::Display for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary())
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("server", &self.server)
            .field("origin", &self.origin)
            .field("ca", &self.ca)
            .field("insecure_skip_tls_verify", &self.insecure_skip_tls_verify)
            .field("tls_server_name", &self.tls_server_name)
            .field("proxy_url", &self.proxy_url)
            .field("auth", &self.auth)
            .finish()
    }
}

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

/// Whether a file exists; errors other than "not found" (permissions) are reported.
fn exists(path: &Path, what: &str) -> Result<bool, KubeError> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(KubeError::ReadFile {
            what: what.to_string(),
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Reads and resolves one kubeconfig file (already under the root).
pub fn load_kubeconfig(path: &Path, found_by: FoundBy, root: &HostRoot) -> Result<Credentials, KubeError> {
    let text = std::fs::read_to_string(path).map_err(|source| KubeError::ReadFile {
        what: "kubeconfig".into(),
        path: path.to_path_buf(),
        source,
    })?;
    kubeconfig::resolve(&text, path, found_by, root)
}

/// The in-cluster credentials: `https://HOST:PORT` with the service account's token and CA.
/// The token and CA files must exist (they are read, and re-read, by the client).
pub fn in_cluster(dir: &Path, host: &str, port: &str) -> Result<Credentials, KubeError> {
    let invalid = |reason: String| KubeError::InCluster {
        dir: dir.to_path_buf(),
        reason,
    };
    if port.parse::<u16>().is_err() {
        return Err(invalid(format!("{ENV_SERVICE_PORT}={port} is not a port number")));
    }
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    let token = dir.join("token");
    let ca = dir.join("ca.crt");
    for file in [&token, &ca] {
        if !exists(file, "in-cluster service account file")? {
            return Err(invalid(format!("{} does not exist", file.display())));
        }
    }
    let origin = Origin::InCluster { dir: dir.to_path_buf() };
    Ok(Credentials {
        server: format!("https://{host}:{port}"),
        ca: Some(Material {
            field: format!("{origin}: ca.crt"),
            source: MaterialSource::File(ca),
        }),
        insecure_skip_tls_verify: false,
        tls_server_name: None,
        proxy_url: None,
        auth: Auth {
            token: Some(TokenSource::File {
                field: format!("{origin}: token"),
                path: token,
            }),
            client_cert: None,
            exec: None,
        },
        origin,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn in_cluster_brackets_ipv6_and_checks_port() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join("token"), "t").expect("write");
        fs::write(dir.path().join("ca.crt"), "c").expect("write");
        let creds = in_cluster(dir.path(), "fd00::1", "6443").expect("in-cluster");
        assert_eq!(creds.server, "https://[fd00::1]:6443");
        let creds = in_cluster(dir.path(), "[fd00::1]", "6443").expect("in-cluster");
        assert_eq!(creds.server, "https://[fd00::1]:6443");
        assert!(in_cluster(dir.path(), "10.0.0.1", "https").is_err());
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
