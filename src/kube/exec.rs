//! Exec credential plugins (`client.authentication.k8s.io/v1` and `v1beta1`): run the command
//! (argv, never a shell) with `KUBERNETES_EXEC_INFO` set, and parse the `ExecCredential` it
//! prints. Errors never contain the plugin's output (stdout or stderr), and both are read
//! within limits.

use std::process::Stdio;
use std::time::{Duration, SystemTime};

use base64::Engine;
use serde::Deserialize;

use super::credentials::{ExecApiVersion, ExecConfig, Secret};
use super::error::KubeError;
use super::limit::{MAX_EXEC_OUTPUT, MAX_EXEC_STDERR};
use super::time::parse_rfc3339;
use crate::host::size;

/// How long a plugin may run.
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(60);
/// A credential is renewed this long before its `expirationTimestamp`.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(30);

/// What a plugin returned.
#[derive(Clone)]
pub struct ExecOutput {
    /// A bearer token.
    pub token: Option<Secret>,
    /// A client identity: key and certificate PEM in one buffer.
    pub identity: Option<Vec<u8>>,
    /// When it expires; `None`: valid until the server rejects it.
    pub expires: Option<SystemTime>,
}

impl std::fmt::Debug for ExecOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecOutput")
            .field("token", &self.token)
            .field("identity", &self.identity.as_ref().map(|_| "<redacted>"))
            .field("expires", &self.expires)
            .finish()
    }
}

impl ExecOutput {
    /// Whether it can still be used at `now` (a margin before expiry).
    pub fn is_fresh(&self, now: SystemTime) -> bool {
        match self.expires {
            None => true,
            Some(expires) => now + EXPIRY_MARGIN < expires,
        }
    }
}

/// What the plugin is told about the cluster (`provideClusterInfo`).
#[derive(Debug, Clone, Default)]
pub struct ClusterInfo {
    /// The server URL.
    pub server: String,
    /// The CA bundle, when known.
    pub ca_pem: Option<Vec<u8>>,
    /// `insecure-skip-tls-verify`.
    pub insecure_skip_tls_verify: bool,
    /// `tls-server-name`.
    pub tls_server_name: Option<String>,
}

/// The `KUBERNETES_EXEC_INFO` value: the ExecCredential spec (never interactive).
pub fn exec_info(api_version: ExecApiVersion, cluster: Option<&ClusterInfo>) -> String {
    let mut spec = serde_json::json!({ "interactive": false });
    if let Some(c) = cluster {
        let mut info = serde_json::json!({ "server": c.server });
        if let Some(ca) = &c.ca_pem {
            info["certificate-authority-data"] = base64::engine::general_purpose::STANDARD.encode(ca).into();
        }
        if c.insecure_skip_tls_verify {
            info["insecure-skip-tls-verify"] = true.into();
        }
        if let Some(name) = &c.tls_server_name {
            info["tls-server-name"] = name.clone().into();
        }
        spec["cluster"] = info;
    }
    serde_json::json!({ "apiVersion": api_version.as_str(), "kind": "ExecCredential", "spec": spec }).to_string()
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawExecCredential {
    api_version: Option<String>,
    kind: Option<String>,
    status: Option<RawExecStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawExecStatus {
    expiration_timestamp: Option<String>,
    token: Option<String>,
    client_certificate_data: Option<String>,
    client_key_data: Option<String>,
}

/// Parses a plugin's stdout. Errors say what is wrong, never what was printed.
pub fn parse_exec_credential(stdout: &[u8], expected: ExecApiVersion) -> Result<ExecOutput, String> {
    let raw: RawExecCredential = serde_json::from_slice(stdout).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Io | serde_json::error::Category::Eof => "incomplete JSON",
            serde_json::error::Category::Syntax => "not JSON",
            serde_json::error::Category::Data => "JSON of the wrong shape",
        };
        format!(
            "printed {what} (line {} column {}) instead of an ExecCredential",
            e.line(),
            e.column()
        )
    })?;
    if raw.kind.as_deref() != Some("ExecCredential") {
        return Err(format!(
            "printed kind {:?}, expected ExecCredential",
            raw.kind.unwrap_or_default()
        ));
    }
    let version = raw.api_version.unwrap_or_default();
    if version != expected.as_str() {
        return Err(format!(
            "printed apiVersion {version:?}, expected {:?}",
            expected.as_str()
        ));
    }
    let status = raw.status.ok_or("printed an ExecCredential without status")?;
    let expires = match status.expiration_timestamp.as_deref().filter(|t| !t.is_empty()) {
        None => None,
        Some(text) => {
            Some(parse_rfc3339(text).ok_or_else(|| format!("status.expirationTimestamp {text:?} is not RFC 3339"))?)
        }
    };
    let token = status
        .token
        .filter(|t| !t.trim().is_empty())
        .map(|t| Secret::new(t.trim()));
    let cert = status.client_certificate_data.filter(|c| !c.trim().is_empty());
    let key = status.client_key_data.filter(|k| !k.trim().is_empty());
    let identity = match (cert, key) {
        (Some(cert), Some(key)) => Some(identity_pem(key.as_bytes(), cert.as_bytes())),
        (None, None) => None,
        _ => return Err("status has only one of clientCertificateData and clientKeyData".into()),
    };
    if token.is_none() && identity.is_none() {
        return Err("status has neither token nor clientCertificateData/clientKeyData".into());
    }
    Ok(ExecOutput {
        token,
        identity,
        expires,
    })
}

/// Key and certificate PEM in one buffer, as `reqwest::Identity::from_pem` wants it. The same
/// bytes for both (a combined PEM such as `kubelet-client-current.pem`) are used once.
pub fn identity_pem(key: &[u8], cert: &[u8]) -> Vec<u8> {
    if key == cert {
        return key.to_vec();
    }
    let mut pem = Vec::with_capacity(key.len() + cert.len() + 1);
    pem.extend_from_slice(key);
    if !key.ends_with(b"\n") {
        pem.push(b'\n');
    }
    pem.extend_from_slice(cert);
    pem
}

/// Runs the plugin and parses its credential. Its stdout is read up to [`MAX_EXEC_OUTPUT`]
/// (more is an error, and the plugin is killed); its stderr, which may hold anything (a
/// token, a URL with a key in it), never goes into the error, which reaches `status.json` and
/// Events: the first [`MAX_EXEC_STDERR`] of it are logged at debug level, the rest is dropped.
pub async fn run_plugin(exec: &ExecConfig, cluster: Option<&ClusterInfo>) -> Result<ExecOutput, KubeError> {
    let fail = |reason: String| KubeError::ExecPlugin {
        kubeconfig: exec.kubeconfig.clone(),
        command: exec.command.clone(),
        reason,
    };
    let info = exec_info(exec.api_version, if exec.provide_cluster_info { cluster } else { None });
    let mut command = tokio::process::Command::new(&exec.program);
    command
        .args(&exec.args)
        .envs(exec.env.iter().map(|(k, v)| (k, v)))
        .env("KUBERNETES_EXEC_INFO", info)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // Dropped (and so killed, if still running) on every way out of this function.
    let mut child = command.spawn().map_err(|e| {
        let hint = match (&exec.install_hint, e.kind()) {
            (Some(hint), std::io::ErrorKind::NotFound) => format!(" ({})", hint.trim()),
            _ => String::new(),
        };
        fail(format!("cannot run {}: {e}{hint}", exec.program.display()))
    })?;
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let run = async {
        let (stdout, stderr) = tokio::try_join!(
            read_output(stdout, MAX_EXEC_OUTPUT, true),
            read_output(stderr, MAX_EXEC_STDERR, false),
        )?;
        let status = child.wait().await.map_err(ReadFailure::Io)?;
        Ok::<_, ReadFailure>((status, stdout, stderr))
    };
    let (status, stdout, stderr) = match tokio::time::timeout(EXEC_TIMEOUT, run).await {
        Err(_) => return Err(fail(format!("did not finish within {}s", EXEC_TIMEOUT.as_secs()))),
        Ok(Err(ReadFailure::TooLong)) => {
            return Err(fail(format!(
                "printed more than the {} limit on stdout (an ExecCredential is a few KiB)",
                size(MAX_EXEC_OUTPUT as u64)
            )));
        }
        Ok(Err(ReadFailure::Io(e))) => return Err(fail(format!("cannot read its output: {e}"))),
        Ok(Ok(output)) => output,
    };
    let stderr_note = log_stderr(exec, &stderr);
    if !status.success() {
        return Err(fail(format!("{}{stderr_note}", exit_text(status))));
    }
    parse_exec_credential(&stdout.kept, exec.api_version).map_err(fail)
}

/// What a plugin printed on one stream: the first bytes kept, and how many there were.
struct Output {
    kept: Vec<u8>,
    total: u64,
}

enum ReadFailure {
    /// More than the limit on a stream that must not exceed it.
    TooLong,
    Io(std::io::Error),
}

/// Reads a stream to its end, keeping the first `keep` bytes. `refuse_more`: more than `keep`
/// is [`ReadFailure::TooLong`] (stdout); else the rest is read and dropped, so that the plugin
/// is never blocked on a full pipe (stderr).
async fn read_output(
    stream: Option<impl tokio::io::AsyncRead + Unpin>,
    keep: usize,
    refuse_more: bool,
) -> Result<Output, ReadFailure> {
    use tokio::io::AsyncReadExt;
    let mut output = Output {
        kept: Vec::new(),
        total: 0,
    };
    let Some(mut stream) = stream else {
        return Ok(output);
    };
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let n = stream.read(&mut buf).await.map_err(ReadFailure::Io)?;
        if n == 0 {
            return Ok(output);
        }
        output.total += n as u64;
        if output.total > keep as u64 && refuse_more {
            return Err(ReadFailure::TooLong);
        }
        let room = keep.saturating_sub(output.kept.len()).min(n);
        output.kept.extend_from_slice(&buf[..room]);
    }
}

/// `exited with status 1`, `was killed by signal 9`.
fn exit_text(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => format!("ended with {status}"),
    }
}

/// Logs the plugin's stderr at debug level (its first [`MAX_EXEC_STDERR`], as one escaped
/// line) and returns what the error may say about it: only that it exists.
fn log_stderr(exec: &ExecConfig, stderr: &Output) -> String {
    let text = String::from_utf8_lossy(&stderr.kept);
    let text = text.trim();
    if text.is_empty() {
        return String::new();
    }
    let cut = if stderr.total > stderr.kept.len() as u64 {
        format!(" (first {} of {} bytes)", size(MAX_EXEC_STDERR as u64), stderr.total)
    } else {
        String::new()
    };
    tracing::debug!(
        "exec credential plugin {:?} (kubeconfig {}) wrote on stderr{cut}: {text:?}",
        exec.command,
        exec.kubeconfig.display()
    );
    "; its stderr is in the agent's log at debug level (not shown here: it may hold secrets)".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::time::format_rfc3339;

    const TOKEN: &str = "sekrit-token-4f9a8c";
    const V1: ExecApiVersion = ExecApiVersion::V1;

    #[test]
    fn parses_token_with_expiry() {
        let out = parse_exec_credential(
            br#"{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential",
                "status":{"token":"sekrit-token-4f9a8c","expirationTimestamp":"2030-01-01T00:00:00Z"}}"#,
            V1,
        )
        .expect("parse");
        assert_eq!(out.token.as_ref().map(Secret::expose), Some(TOKEN));
        assert_eq!(format_rfc3339(out.expires.expect("expiry")), "2030-01-01T00:00:00Z");
        assert!(!format!("{out:?}").contains(TOKEN));
    }

    #[test]
    fn parses_client_certificate_v1beta1() {
        let out = parse_exec_credential(
            br#"{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential",
                "status":{"clientCertificateData":"-----BEGIN CERTIFICATE-----\nC\n-----END CERTIFICATE-----\n",
                          "clientKeyData":"-----BEGIN EC PRIVATE KEY-----\nK\n-----END EC PRIVATE KEY-----"}}"#,
            ExecApiVersion::V1Beta1,
        )
        .expect("parse");
        assert!(out.token.is_none() && out.expires.is_none());
        let pem = String::from_utf8(out.identity.expect("identity")).expect("utf8");
        assert!(pem.starts_with("-----BEGIN EC PRIVATE KEY-----"));
        assert!(pem.contains("-----END EC PRIVATE KEY-----\n-----BEGIN CERTIFICATE-----"));
    }

    #[test]
    fn rejects_bad_credentials_without_echoing_them() {
        let cases: [(&[u8], &str); 6] = [
            (b"sekrit-token-4f9a8c", "not JSON"),
            (br#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","status":{"token":["sekrit-token-4f9a8c"]}}"#, "wrong shape"),
            (br#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1beta1","status":{"token":"sekrit-token-4f9a8c"}}"#, "apiVersion"),
            (br#"{"kind":"Other","apiVersion":"client.authentication.k8s.io/v1","status":{"token":"sekrit-token-4f9a8c"}}"#, "kind"),
            (br#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","status":{}}"#, "neither"),
            (br#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","status":{"token":"sekrit-token-4f9a8c","expirationTimestamp":"soon"}}"#, "RFC 3339"),
        ];
        for (stdout, expected) in cases {
            let err = parse_exec_credential(stdout, V1).expect_err(expected);
            assert!(err.contains(expected), "{err}");
            assert!(!err.contains(TOKEN), "{err}");
        }
    }

    fn shell(script: &str) -> ExecConfig {
        ExecConfig {
            api_version: V1,
            command: "sh".into(),
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![],
            provide_cluster_info: false,
            install_hint: None,
            kubeconfig: "/k".into(),
        }
    }

    #[tokio::test]
    async fn output_over_the_limit_is_refused_without_waiting() {
        // Endless stdout: refused once past the limit, long before EXEC_TIMEOUT.
        let started = std::time::Instant::now();
        let err = run_plugin(&shell("yes"), None).await.expect_err("endless").to_string();
        assert!(err.contains("more than the 1 MiB limit on stdout"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());

        // A credential after a flood of stderr: the stderr is drained (the plugin never blocks
        // on a full pipe) and dropped, the credential is used.
        let ok = shell(&format!(
            "head -c 5000000 /dev/zero | tr '\\0' x >&2; \
             printf '{{\"apiVersion\":\"client.authentication.k8s.io/v1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"{TOKEN}\"}}}}'"
        ));
        let out = run_plugin(&ok, None).await.expect("credential after stderr");
        assert_eq!(out.token.as_ref().map(Secret::expose), Some(TOKEN));
    }

    #[test]
    fn freshness_uses_a_margin() {
        let now = SystemTime::now();
        let out = |expires| ExecOutput {
            token: Some(Secret::new("t")),
            identity: None,
            expires,
        };
        assert!(out(None).is_fresh(now));
        assert!(out(Some(now + Duration::from_secs(3600))).is_fresh(now));
        assert!(!out(Some(now + EXPIRY_MARGIN / 2)).is_fresh(now));
        assert!(!out(Some(now - Duration::from_secs(1))).is_fresh(now));
    }

    #[test]
    fn exec_info_json() {
        let info = exec_info(ExecApiVersion::V1Beta1, None);
        let v: serde_json::Value = serde_json::from_str(&info).expect("json");
        assert_eq!(v["apiVersion"], "client.authentication.k8s.io/v1beta1");
        assert_eq!(v["kind"], "ExecCredential");
        assert_eq!(v["spec"]["interactive"], false);
        assert!(v["spec"].get("cluster").is_none());
        let cluster = ClusterInfo {
            server: "https://h:6443".into(),
            ca_pem: Some(b"CA".to_vec()),
            ..ClusterInfo::default()
        };
        let v: serde_json::Value = serde_json::from_str(&exec_info(V1, Some(&cluster))).expect("json");
        assert_eq!(v["spec"]["cluster"]["server"], "https://h:6443");
        assert_eq!(v["spec"]["cluster"]["certificate-authority-data"], "Q0E=");
    }

    #[test]
    fn identity_pem_dedups_a_combined_file() {
        assert_eq!(identity_pem(b"BOTH", b"BOTH"), b"BOTH");
        assert_eq!(identity_pem(b"K", b"C"), b"K\nC");
        assert_eq!(identity_pem(b"K\n", b"C"), b"K\nC");
    }

    #[tokio::test]
    async fn runs_a_plugin_with_env_and_args() {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("plugin.sh");
        std::fs::write(
            &script,
            "#!/bin/sh\n[ \"$1\" = --flag ] || { echo bad args >&2; exit 3; }\n\
             case \"$KUBERNETES_EXEC_INFO\" in *'\"interactive\":false'*) ;; *) echo no info >&2; exit 4;; esac\n\
             printf '{\"apiVersion\":\"client.authentication.k8s.io/v1\",\"kind\":\"ExecCredential\",\"status\":{\"token\":\"%s\"}}' \"$TOK\"\n",
        )
        .expect("write");
        let exec = ExecConfig {
            api_version: V1,
            command: "sh".into(),
            program: "sh".into(),
            args: vec![script.display().to_string(), "--flag".into()],
            env: vec![("TOK".into(), TOKEN.into())],
            provide_cluster_info: false,
            install_hint: None,
            kubeconfig: "/k".into(),
        };
        let out = run_plugin(&exec, None).await.expect("run");
        assert_eq!(out.token.as_ref().map(Secret::expose), Some(TOKEN));

        let failing = ExecConfig {
            args: vec![script.display().to_string(), "--other".into()],
            ..exec.clone()
        };
        let err = run_plugin(&failing, None).await.expect_err("exit 3").to_string();
        assert!(
            err.contains("exited with status 3") && err.contains("/k") && err.contains("debug level"),
            "{err}"
        );
        // What it printed on stderr is for the debug log only: errors reach status.json.
        assert!(!err.contains("bad args"), "{err}");

        // A secret on stderr and a failure: the error names the plugin and the exit status only.
        let leaky = ExecConfig {
            args: vec!["-c".into(), format!("echo 'Authorization: Bearer {TOKEN}' >&2; exit 1")],
            ..exec.clone()
        };
        let err = run_plugin(&leaky, None).await.expect_err("exit 1");
        let shown = format!("{err} {err:?}");
        assert!(!shown.contains(TOKEN), "{shown}");
        assert!(
            shown.contains("\"sh\"") && shown.contains("exited with status 1"),
            "{shown}"
        );

        let missing = ExecConfig {
            program: dir.path().join("nope"),
            install_hint: Some("install nope".into()),
            ..exec
        };
        let err = run_plugin(&missing, None).await.expect_err("missing").to_string();
        assert!(err.contains("install nope"), "{err}");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn credential(token: &str, expires: Option<u64>) -> String {
            let expiry = expires
                .map(|secs| {
                    format!(
                        r#","expirationTimestamp":"{}""#,
                        format_rfc3339(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
                    )
                })
                .unwrap_or_default();
            format!(
                r#"{{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{{"token":{}{expiry}}}}}"#,
                serde_json::Value::from(token)
            )
        }

        proptest! {
            /// Whatever a plugin prints, the parser answers without panicking, and an error never
            /// repeats what was printed (it may be a token).
            #[test]
            fn never_panics_and_errors_never_quote_the_output(stdout in proptest::collection::vec(any::<u8>(), 0..512)) {
                if let Err(e) = parse_exec_credential(&stdout, V1) {
                    prop_assert!(!e.is_empty());
                    let printed = String::from_utf8_lossy(&stdout);
                    if printed.trim().len() >= 8 {
                        prop_assert!(!e.contains(printed.trim()), "{e}");
                    }
                }
            }

            /// A well-formed credential gives back its token (trimmed) and expiry; cut short or
            /// edited anywhere, it is either still read or refused without the token in the error.
            #[test]
            fn a_credential_round_trips_and_mangled_ones_do_not_leak(
                token in "[A-Za-z0-9._~+/-]{8,64}",
                expires in proptest::option::of(0u64..4_000_000_000),
                cut in any::<prop::sample::Index>(),
                insert in prop::sample::select(vec!["", "}", "\"", ",", "\\", "\\u0000", "{"]),
            ) {
                let text = credential(&token, expires);
                let out = parse_exec_credential(text.as_bytes(), V1).expect("well-formed");
                prop_assert_eq!(out.token.as_ref().map(Secret::expose), Some(token.as_str()));
                prop_assert_eq!(
                    out.expires,
                    expires.map(|s| std::time::UNIX_EPOCH + std::time::Duration::from_secs(s))
                );
                let at = cut.index(text.len() + 1);
                if text.is_char_boundary(at) {
                    let mangled = format!("{}{insert}{}", &text[..at], &text[at..]);
                    let truncated = &text[..at];
                    for variant in [mangled.as_str(), truncated] {
                        if let Err(e) = parse_exec_credential(variant.as_bytes(), V1) {
                            prop_assert!(!e.contains(&token), "{e}");
                        }
                    }
                }
            }
        }
    }
}
