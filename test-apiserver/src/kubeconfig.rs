//! Kubeconfig files and exec credential plugins for the client's configuration tests.

use std::fmt::Write as _;
use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;

/// How the kubeconfig's user authenticates.
#[derive(Clone, Debug)]
pub enum KubeconfigAuth {
    /// `token: T` inline.
    Token(String),
    /// `tokenFile: PATH`, written exactly as given (a relative path resolves against the
    /// kubeconfig's directory). The test owns the file, e.g. to rotate the token in it.
    TokenFile(PathBuf),
    /// A client certificate and key, inline (`client-certificate-data`/`client-key-data`, base64
    /// of the PEM) or as files `client.crt`/`client.key` written beside the kubeconfig and
    /// referenced by the relative paths `client.crt`/`client.key`.
    ClientCert {
        cert_pem: String,
        key_pem: String,
        inline: bool,
    },
    /// An exec credential plugin (`interactiveMode: Never`). See
    /// [`TestApiServer::write_exec_plugin`](crate::TestApiServer::write_exec_plugin).
    Exec {
        command: PathBuf,
        args: Vec<String>,
        api_version: String,
    },
}

/// Less common kubeconfig shapes; [`Default`] gives what `write_kubeconfig` writes.
#[derive(Clone, Debug)]
pub struct KubeconfigOptions {
    /// File name inside the directory (default `kubeconfig`).
    pub file_name: String,
    /// Write the CA to `ca.crt` beside the kubeconfig and reference it by that relative path
    /// (`certificate-authority: ca.crt`) instead of `certificate-authority-data` (default false).
    pub ca_file: bool,
    /// The cluster's `server` (default: the server's URL).
    pub server: Option<String>,
    /// The context's `namespace` (default: none).
    pub namespace: Option<String>,
}

impl Default for KubeconfigOptions {
    fn default() -> Self {
        KubeconfigOptions {
            file_name: "kubeconfig".to_owned(),
            ca_file: false,
            server: None,
            namespace: None,
        }
    }
}

/// A YAML double-quoted scalar (JSON string syntax is valid YAML).
fn q(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s.as_bytes())
}

fn write_file(path: &Path, contents: &str, mode: u32) {
    fs::write(path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

pub(crate) fn write(
    dir: &Path,
    server: &str,
    ca_pem: &str,
    auth: &KubeconfigAuth,
    opts: &KubeconfigOptions,
) -> PathBuf {
    fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let mut y = String::new();
    let server = opts.server.as_deref().unwrap_or(server);
    let _ = writeln!(y, "apiVersion: v1\nkind: Config\npreferences: {{}}");
    let _ = writeln!(
        y,
        "clusters:\n- name: test-apiserver\n  cluster:\n    server: {}",
        q(server)
    );
    if server.starts_with("http://") {
        // No TLS, no CA to name.
    } else if opts.ca_file {
        write_file(&dir.join("ca.crt"), ca_pem, 0o644);
        let _ = writeln!(y, "    certificate-authority: ca.crt");
    } else {
        let _ = writeln!(y, "    certificate-authority-data: {}", b64(ca_pem));
    }
    let _ = writeln!(y, "users:\n- name: test-user\n  user:");
    match auth {
        KubeconfigAuth::Token(token) => {
            let _ = writeln!(y, "    token: {}", q(token));
        }
        KubeconfigAuth::TokenFile(path) => {
            let _ = writeln!(y, "    tokenFile: {}", q(&path.to_string_lossy()));
        }
        KubeconfigAuth::ClientCert {
            cert_pem,
            key_pem,
            inline: true,
        } => {
            let _ = writeln!(y, "    client-certificate-data: {}", b64(cert_pem));
            let _ = writeln!(y, "    client-key-data: {}", b64(key_pem));
        }
        KubeconfigAuth::ClientCert {
            cert_pem,
            key_pem,
            inline: false,
        } => {
            write_file(&dir.join("client.crt"), cert_pem, 0o644);
            write_file(&dir.join("client.key"), key_pem, 0o600);
            let _ = writeln!(y, "    client-certificate: client.crt\n    client-key: client.key");
        }
        KubeconfigAuth::Exec {
            command,
            args,
            api_version,
        } => {
            let args: Vec<String> = args.iter().map(|a| q(a)).collect();
            let _ = writeln!(y, "    exec:");
            let _ = writeln!(y, "      apiVersion: {}", q(api_version));
            let _ = writeln!(y, "      command: {}", q(&command.to_string_lossy()));
            let _ = writeln!(y, "      args: [{}]", args.join(", "));
            let _ = writeln!(y, "      interactiveMode: Never");
            let _ = writeln!(y, "      provideClusterInfo: false");
        }
    }
    let _ = writeln!(
        y,
        "contexts:\n- name: test\n  context:\n    cluster: test-apiserver\n    user: test-user"
    );
    if let Some(ns) = &opts.namespace {
        let _ = writeln!(y, "    namespace: {}", q(ns));
    }
    let _ = writeln!(y, "current-context: test");
    let path = dir.join(&opts.file_name);
    write_file(&path, &y, 0o600);
    path
}

pub(crate) const PLUGIN: &str = "exec-plugin.sh";
pub(crate) const PLUGIN_TOKEN: &str = "exec-plugin.token";
pub(crate) const PLUGIN_CALLS: &str = "exec-plugin.calls";
pub(crate) const PLUGIN_FAIL: &str = "exec-plugin.fail";

/// Single-quotes for `/bin/sh`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

pub(crate) fn check_token(token: &str) {
    assert!(
        !token.is_empty() && token.chars().all(|c| c.is_ascii_graphic() && c != '"' && c != '\\'),
        "exec plugin tokens must be non-empty printable ASCII without quotes or backslashes: {token:?}"
    );
}

pub(crate) fn write_exec_plugin(dir: &Path, token: &str, expires_in: Option<Duration>, api_version: &str) -> PathBuf {
    check_token(token);
    assert!(
        api_version
            .chars()
            .all(|c| c.is_ascii_graphic() && c != '"' && c != '\\'),
        "odd apiVersion"
    );
    fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let dir = fs::canonicalize(dir).unwrap_or_else(|e| panic!("canonicalize {}: {e}", dir.display()));
    write_file(&dir.join(PLUGIN_TOKEN), token, 0o600);
    let _ = fs::remove_file(dir.join(PLUGIN_FAIL));
    let d = sh_quote(&dir.to_string_lossy());
    let expiry = match expires_in {
        Some(e) => format!(
            "exp=$(date -u -d \"@$(( $(date +%s) + {} ))\" +%Y-%m-%dT%H:%M:%SZ)\n\
             printf '{{\"apiVersion\":\"%s\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"%s\",\
             \"expirationTimestamp\":\"%s\"}}}}\\n' \"$api\" \"$token\" \"$exp\"\n",
            e.as_secs()
        ),
        None => "printf '{\"apiVersion\":\"%s\",\"kind\":\"ExecCredential\",\"status\":{\"token\":\"%s\"}}\\n' \
                 \"$api\" \"$token\"\n"
            .to_owned(),
    };
    let script = format!(
        "#!/bin/sh\n\
         # Exec credential plugin written by test-apiserver.\n\
         dir={d}\n\
         api={api}\n\
         printf '%s\\n' \"$(printf '%s' \"${{KUBERNETES_EXEC_INFO:-}}\" | tr -d '\\n')\" >> \"$dir/{PLUGIN_CALLS}\"\n\
         if [ -e \"$dir/{PLUGIN_FAIL}\" ]; then\n  echo 'exec-plugin: failing on purpose' >&2\n  exit 1\nfi\n\
         token=$(cat \"$dir/{PLUGIN_TOKEN}\")\n\
         {expiry}",
        api = sh_quote(api_version),
    );
    // Write under a temporary name and rename, so a concurrent exec never sees a half-written file.
    let path = dir.join(PLUGIN);
    let tmp = dir.join(format!(".{PLUGIN}.tmp"));
    write_file(&tmp, &script, 0o755);
    fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("rename {}: {e}", path.display()));
    path
}

pub(crate) fn set_exec_token(dir: &Path, token: &str) {
    check_token(token);
    let tmp = dir.join(format!(".{PLUGIN_TOKEN}.tmp"));
    write_file(&tmp, token, 0o600);
    fs::rename(&tmp, dir.join(PLUGIN_TOKEN)).unwrap_or_else(|e| panic!("rename token: {e}"));
}

pub(crate) fn set_exec_failing(dir: &Path, failing: bool) {
    let flag = dir.join(PLUGIN_FAIL);
    if failing {
        write_file(&flag, "", 0o644);
    } else {
        let _ = fs::remove_file(flag);
    }
}

pub(crate) fn exec_calls(dir: &Path) -> Vec<String> {
    fs::read_to_string(dir.join(PLUGIN_CALLS))
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}
