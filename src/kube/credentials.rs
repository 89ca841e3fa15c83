//! Where the API server is and how to authenticate to it: [`Credentials`] holds it as *sources*
//! (inline data or host files), so that rotated files are picked up by the client later.
//! [`in_cluster`] builds them from the service account; `kubeconfig` from a kubeconfig file,
//! and `discover` chooses between the two.
//!
//! Secrets (tokens, private keys, exec plugin arguments and environment values) are kept in
//! types whose `Debug` prints a placeholder; no message of this module contains them.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use super::error::KubeError;

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

/// Whether a file exists; errors other than "not found" (permissions) are reported.
pub(super) fn exists(path: &Path, what: &str) -> Result<bool, KubeError> {
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
    use std::fs;

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
}
