//! Kubeconfig files (`kind: Config`): the current context's cluster and user, resolved into
//! [`Credentials`]. Field names follow client-go. Relative paths in the file (certificates,
//! keys, `tokenFile`, an exec `command` containing '/') are relative to the kubeconfig's
//! directory; absolute ones are host paths, mapped under the root.
//!
//! Unsupported authentication (`auth-provider`, basic auth, impersonation) is an error rather
//! than silently connecting as someone else.

use std::path::{Path, PathBuf};

use base64::Engine;
use serde::Deserialize;

use crate::host::HostRoot;

use super::credentials::{
    Auth, ClientCert, Credentials, ExecApiVersion, ExecConfig, FoundBy, Material, MaterialSource, Origin, Secret,
    TokenSource,
};
use super::error::KubeError;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    #[serde(rename = "current-context")]
    current_context: Option<String>,
    clusters: Option<Vec<NamedCluster>>,
    users: Option<Vec<NamedUser>>,
    contexts: Option<Vec<NamedContext>>,
}

#[derive(Debug, Deserialize)]
struct NamedCluster {
    name: String,
    #[serde(default)]
    cluster: Option<RawCluster>,
}

#[derive(Debug, Deserialize)]
struct NamedUser {
    name: String,
    #[serde(default)]
    user: Option<RawUser>,
}

#[derive(Debug, Deserialize)]
struct NamedContext {
    name: String,
    #[serde(default)]
    context: Option<RawContext>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawContext {
    cluster: Option<String>,
    user: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "kebab-case")]
struct RawCluster {
    server: Option<String>,
    certificate_authority: Option<String>,
    certificate_authority_data: Option<String>,
    insecure_skip_tls_verify: Option<bool>,
    tls_server_name: Option<String>,
    proxy_url: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct RawUser {
    token: Option<String>,
    #[serde(rename = "tokenFile")]
    token_file: Option<String>,
    #[serde(rename = "client-certificate")]
    client_certificate: Option<String>,
    #[serde(rename = "client-certificate-data")]
    client_certificate_data: Option<String>,
    #[serde(rename = "client-key")]
    client_key: Option<String>,
    #[serde(rename = "client-key-data")]
    client_key_data: Option<String>,
    exec: Option<RawExec>,
    #[serde(rename = "auth-provider")]
    auth_provider: Option<RawAuthProvider>,
    username: Option<String>,
    password: Option<String>,
    #[serde(rename = "as")]
    impersonate: Option<String>,
}

// Hand-written so that a token or password never reaches a log through `{:?}`.
impl std::fmt::Debug for RawUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawUser").finish_non_exhaustive()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawAuthProvider {
    name: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct RawExec {
    api_version: Option<String>,
    command: Option<String>,
    args: Option<Vec<String>>,
    env: Option<Vec<RawEnv>>,
    provide_cluster_info: Option<bool>,
    interactive_mode: Option<String>,
    install_hint: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct RawEnv {
    name: String,
    value: String,
}

/// Parses a kubeconfig's text and resolves its current context into [`Credentials`]. `path` is
/// the file as read (under the root); its directory anchors relative paths.
pub fn resolve(text: &str, path: &Path, found_by: FoundBy, root: &HostRoot) -> Result<Credentials, KubeError> {
    let err = |field: &str, reason: String| KubeError::Kubeconfig {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason,
    };
    let raw = parse(text).map_err(|reason| err("YAML", reason))?;
    let dir = path.parent().unwrap_or(Path::new("/"));

    let context_name = raw.current_context.as_deref().map(str::trim).unwrap_or_default();
    if context_name.is_empty() {
        return Err(err("current-context", "not set".into()));
    }
    let context = raw
        .contexts
        .iter()
        .flatten()
        .find(|c| c.name == context_name)
        .ok_or_else(|| {
            err(
                "current-context",
                format!("no context named {context_name:?} in contexts"),
            )
        })?;
    let context = context
        .context
        .as_ref()
        .map(|c| (c.cluster.as_deref(), c.user.as_deref()));
    let (cluster_name, user_name) = context.unwrap_or((None, None));
    let context_field = format!("context {context_name:?}");
    let cluster_name = cluster_name
        .filter(|c| !c.is_empty())
        .ok_or_else(|| err(&format!("{context_field}: cluster"), "not set".into()))?;
    let cluster = raw
        .clusters
        .iter()
        .flatten()
        .find(|c| c.name == cluster_name)
        .ok_or_else(|| {
            err(
                &format!("{context_field}: cluster"),
                format!("no cluster named {cluster_name:?} in clusters"),
            )
        })?;
    let default_cluster = RawCluster::default();
    let cluster = cluster.cluster.as_ref().unwrap_or(&default_cluster);

    let user = match user_name.filter(|u| !u.is_empty()) {
        None => None,
        Some(user_name) => {
            let user = raw
                .users
                .iter()
                .flatten()
                .find(|u| u.name == user_name)
                .ok_or_else(|| {
                    err(
                        &format!("{context_field}: user"),
                        format!("no user named {user_name:?} in users"),
                    )
                })?;
            Some((user_name, user.user.as_ref()))
        }
    };

    let origin = Origin::Kubeconfig {
        path: path.to_path_buf(),
        found_by,
    };
    let cluster_field = |name: &str| format!("cluster {cluster_name:?}: {name}");
    let server = cluster.server.as_deref().map(str::trim).unwrap_or_default();
    if server.is_empty() {
        return Err(err(&cluster_field("server"), "not set".into()));
    }
    let url = reqwest::Url::parse(server).map_err(|e| err(&cluster_field("server"), format!("not a URL: {e}")))?;
    if !matches!(url.scheme(), "https" | "http") || url.host_str().is_none() {
        return Err(err(&cluster_field("server"), format!("{server} is not an http(s) URL")));
    }
    let insecure = cluster.insecure_skip_tls_verify.unwrap_or(false);
    let ca = material(
        &origin,
        &cluster_field("certificate-authority"),
        cluster.certificate_authority.as_deref(),
        cluster.certificate_authority_data.as_deref(),
        dir,
        root,
    )
    .map_err(|(field, reason)| err(&field, reason))?;
    if insecure && ca.is_some() {
        return Err(err(
            &cluster_field("insecure-skip-tls-verify"),
            "cannot be combined with a certificate authority (client-go refuses this too)".into(),
        ));
    }

    let auth = match user {
        None => Auth::default(),
        Some((user_name, user)) => {
            let default_user = RawUser::default();
            resolve_user(user.unwrap_or(&default_user), user_name, &origin, dir, root, path)?
        }
    };

    Ok(Credentials {
        server: server.trim_end_matches('/').to_string(),
        origin,
        ca,
        insecure_skip_tls_verify: insecure,
        tls_server_name: cluster.tls_server_name.clone().filter(|s| !s.is_empty()),
        proxy_url: cluster.proxy_url.clone().filter(|s| !s.is_empty()),
        auth,
    })
}

fn resolve_user(
    user: &RawUser,
    user_name: &str,
    origin: &Origin,
    dir: &Path,
    root: &HostRoot,
    path: &Path,
) -> Result<Auth, KubeError> {
    let field = |name: &str| format!("user {user_name:?}: {name}");
    let err = |field: String, reason: String| KubeError::Kubeconfig {
        path: path.to_path_buf(),
        field,
        reason,
    };
    if let Some(provider) = &user.auth_provider {
        let name = provider.name.as_deref().unwrap_or("?");
        return Err(err(
            field("auth-provider"),
            format!("auth provider {name:?} is not supported (removed from Kubernetes 1.26); use an exec plugin"),
        ));
    }
    if user.username.is_some() || user.password.is_some() {
        return Err(err(
            field("username"),
            "basic authentication is not supported (removed from Kubernetes 1.19)".into(),
        ));
    }
    if user.impersonate.is_some() {
        return Err(err(field("as"), "impersonation is not supported".into()));
    }

    let token = match (
        user.token_file.as_deref().filter(|t| !t.is_empty()),
        user.token.as_deref(),
    ) {
        // client-go prefers the file (it is the one that rotates).
        (Some(file), _) => Some(TokenSource::File {
            field: format!("{origin}, {}", field("tokenFile")),
            path: resolve_path(file, dir, root),
        }),
        (None, Some(token)) if !token.trim().is_empty() => Some(TokenSource::Inline(Secret::new(token.trim()))),
        _ => None,
    };

    let cert = material(
        origin,
        &field("client-certificate"),
        user.client_certificate.as_deref(),
        user.client_certificate_data.as_deref(),
        dir,
        root,
    )
    .map_err(|(f, r)| err(f, r))?;
    let key = material(
        origin,
        &field("client-key"),
        user.client_key.as_deref(),
        user.client_key_data.as_deref(),
        dir,
        root,
    )
    .map_err(|(f, r)| err(f, r))?;
    let client_cert = match (cert, key) {
        (Some(cert), Some(key)) => Some(ClientCert { cert, key }),
        (None, None) => None,
        (Some(_), None) => {
            return Err(err(
                field("client-key"),
                "client-certificate is set but no client key".into(),
            ));
        }
        (None, Some(_)) => {
            return Err(err(
                field("client-certificate"),
                "client-key is set but no client certificate".into(),
            ));
        }
    };

    let exec = match &user.exec {
        None => None,
        Some(exec) => Some(resolve_exec(exec, &field("exec"), dir, root, path)?),
    };
    if exec.is_some() && token.is_some() {
        return Err(err(field("exec"), "cannot be combined with token or tokenFile".into()));
    }
    Ok(Auth {
        token,
        client_cert,
        exec,
    })
}

fn resolve_exec(
    exec: &RawExec,
    field: &str,
    dir: &Path,
    root: &HostRoot,
    path: &Path,
) -> Result<ExecConfig, KubeError> {
    let err = |name: &str, reason: String| KubeError::Kubeconfig {
        path: path.to_path_buf(),
        field: format!("{field}.{name}"),
        reason,
    };
    let version = exec.api_version.as_deref().unwrap_or_default();
    let api_version = ExecApiVersion::parse(version).ok_or_else(|| {
        err(
            "apiVersion",
            format!(
                "{version:?} is not supported; expected {} or {}",
                ExecApiVersion::V1.as_str(),
                ExecApiVersion::V1Beta1.as_str()
            ),
        )
    })?;
    let command = exec.command.as_deref().map(str::trim).unwrap_or_default();
    if command.is_empty() {
        return Err(err("command", "not set".into()));
    }
    if exec.interactive_mode.as_deref() == Some("Always") {
        return Err(err(
            "interactiveMode",
            "Always needs a terminal, which a daemon does not have; use Never or IfAvailable".into(),
        ));
    }
    let program = if command.contains('/') {
        resolve_path(command, dir, root)
    } else {
        PathBuf::from(command)
    };
    Ok(ExecConfig {
        api_version,
        command: command.to_string(),
        program,
        args: exec.args.clone().unwrap_or_default(),
        env: exec
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect(),
        provide_cluster_info: exec.provide_cluster_info.unwrap_or(false),
        install_hint: exec.install_hint.clone().filter(|h| !h.trim().is_empty()),
        kubeconfig: path.to_path_buf(),
    })
}

/// A path field and its `-data` twin: `-data` wins (as in client-go); `None` when neither is set.
/// Errors are `(field, reason)`.
fn material(
    origin: &Origin,
    field: &str,
    file: Option<&str>,
    data: Option<&str>,
    dir: &Path,
    root: &HostRoot,
) -> Result<Option<Material>, (String, String)> {
    if let Some(data) = data.filter(|d| !d.trim().is_empty()) {
        let field = format!("{field}-data");
        let compact: String = data.chars().filter(|c| !c.is_whitespace()).collect();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(compact)
            .map_err(|_| (field.clone(), "not valid base64".to_string()))?;
        return Ok(Some(Material {
            field: format!("{origin}, {field}"),
            source: MaterialSource::Inline(bytes),
        }));
    }
    Ok(file.filter(|f| !f.trim().is_empty()).map(|file| Material {
        field: format!("{origin}, {field}"),
        source: MaterialSource::File(resolve_path(file.trim(), dir, root)),
    }))
}

/// A path from a kubeconfig: absolute = a host path (under the root), relative = against the
/// kubeconfig's directory (which is already under the root).
fn resolve_path(value: &str, dir: &Path, root: &HostRoot) -> PathBuf {
    let p = Path::new(value);
    if p.is_absolute() { root.join(p) } else { dir.join(p) }
}

/// Parses the YAML. Messages carry the position and serde's complaint, never a snippet of the
/// file (which may hold a token).
fn parse(text: &str) -> Result<RawConfig, String> {
    let options = serde_saphyr::options! { with_snippet: false };
    let raw: Option<RawConfig> = serde_saphyr::from_str_with_options(text, options)
        .map_err(|e| redact_quoted(&e.without_snippet().to_string()))?;
    Ok(raw.unwrap_or_default())
}

/// Replaces quoted or backticked text in a parser message, which may echo a value from the
/// file, with `…`.
fn redact_quoted(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut open: Option<char> = None;
    for c in message.chars() {
        match open {
            Some(q) if c == q => {
                out.push('…');
                out.push(c);
                open = None;
            }
            Some(_) => {}
            None => {
                out.push(c);
                if matches!(c, '"' | '`') {
                    open = Some(c);
                }
            }
        }
    }
    if open.is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "sekrit-token-4f9a8c";

    fn resolve_at(text: &str) -> Result<Credentials, KubeError> {
        let root = HostRoot::new("/tmp/root");
        resolve(
            text,
            Path::new("/tmp/root/etc/kubernetes/kubelet.conf"),
            FoundBy::Search,
            &root,
        )
    }

    fn config(cluster: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: ctx\ncontexts:\n- name: ctx\n  context:\n    cluster: k\n    user: u\n\
             clusters:\n- name: other\n  cluster:\n    server: https://wrong\n- name: k\n  cluster:\n{cluster}\
             users:\n- name: u\n  user:\n{user}"
        )
    }

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    fn file(m: &Material) -> &Path {
        match &m.source {
            MaterialSource::File(p) => p,
            MaterialSource::Inline(_) => panic!("expected a file: {m:?}"),
        }
    }

    fn inline(m: &Material) -> &[u8] {
        match &m.source {
            MaterialSource::Inline(d) => d,
            MaterialSource::File(_) => panic!("expected inline data: {m:?}"),
        }
    }

    #[test]
    fn token_and_ca_data() {
        let text = config(
            &format!(
                "    server: https://10.0.0.1:6443/\n    certificate-authority-data: {}\n",
                b64("CA PEM")
            ),
            &format!("    token: {TOKEN}\n"),
        );
        let creds = resolve_at(&text).expect("resolve");
        assert_eq!(creds.server, "https://10.0.0.1:6443");
        assert_eq!(inline(creds.ca.as_ref().expect("ca")), b"CA PEM");
        assert!(!creds.insecure_skip_tls_verify);
        assert!(matches!(&creds.auth.token, Some(TokenSource::Inline(t)) if t.expose() == TOKEN));
        assert!(creds.auth.client_cert.is_none() && creds.auth.exec.is_none());
    }

    #[test]
    fn kubelet_conf_with_combined_pem_and_relative_paths() {
        let text = config(
            "    server: https://api.example:6443\n    certificate-authority: pki/ca.crt\n",
            "    client-certificate: /var/lib/kubelet/pki/kubelet-client-current.pem\n    \
             client-key: /var/lib/kubelet/pki/kubelet-client-current.pem\n",
        );
        let creds = resolve_at(&text).expect("resolve");
        assert_eq!(
            file(creds.ca.as_ref().expect("ca")),
            Path::new("/tmp/root/etc/kubernetes/pki/ca.crt")
        );
        let cc = creds.auth.client_cert.as_ref().expect("client cert");
        let pem = Path::new("/tmp/root/var/lib/kubelet/pki/kubelet-client-current.pem");
        assert_eq!(file(&cc.cert), pem);
        assert_eq!(file(&cc.key), pem);
        assert!(
            cc.key.field.contains("kubelet.conf") && cc.key.field.contains("client-key"),
            "{:?}",
            cc.key
        );
    }

    #[test]
    fn client_cert_data_and_token_file() {
        let text = config(
            "    server: https://10.0.0.1:6443\n",
            &format!(
                "    client-certificate-data: {}\n    client-key-data: {}\n    tokenFile: ../tok\n    token: ignored\n",
                b64("CERT"),
                b64("KEY")
            ),
        );
        let creds = resolve_at(&text).expect("resolve");
        let cc = creds.auth.client_cert.as_ref().expect("client cert");
        assert_eq!(inline(&cc.cert), b"CERT");
        assert_eq!(inline(&cc.key), b"KEY");
        assert!(
            matches!(&creds.auth.token, Some(TokenSource::File { path, .. }) if path == Path::new("/tmp/root/etc/kubernetes/../tok"))
        );
    }

    #[test]
    fn exec_v1_and_v1beta1() {
        for (version, expected) in [
            ("client.authentication.k8s.io/v1", ExecApiVersion::V1),
            ("client.authentication.k8s.io/v1beta1", ExecApiVersion::V1Beta1),
        ] {
            let text = config(
                "    server: https://10.0.0.1:6443\n",
                &format!(
                    "    exec:\n      apiVersion: {version}\n      command: ./bin/get-token\n      args: [--cluster, c1]\n      \
                     env:\n      - name: AWS_PROFILE\n        value: prod\n      interactiveMode: Never\n      \
                     provideClusterInfo: true\n"
                ),
            );
            let creds = resolve_at(&text).expect("resolve");
            let exec = creds.auth.exec.as_ref().expect("exec");
            assert_eq!(exec.api_version, expected);
            assert_eq!(exec.command, "./bin/get-token");
            assert_eq!(exec.program, Path::new("/tmp/root/etc/kubernetes/./bin/get-token"));
            assert_eq!(exec.args, ["--cluster", "c1"]);
            assert_eq!(exec.env, [("AWS_PROFILE".to_string(), "prod".to_string())]);
            assert!(exec.provide_cluster_info);
            let debug = format!("{creds:?}");
            assert!(!debug.contains("prod") && !debug.contains("c1"), "{debug}");
        }
        // A bare command is looked up in PATH; an absolute one is a host path.
        let bare = config(
            "    server: https://h\n",
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n",
        );
        let creds = resolve_at(&bare).expect("resolve");
        assert_eq!(creds.auth.exec.expect("exec").program, Path::new("aws"));
        let absolute = bare.replace("command: aws", "command: /usr/bin/aws");
        let creds = resolve_at(&absolute).expect("resolve");
        assert_eq!(
            creds.auth.exec.expect("exec").program,
            Path::new("/tmp/root/usr/bin/aws")
        );

        let bad = bare.replace("/v1\n", "/v1alpha1\n");
        let text = resolve_at(&bad).expect_err("v1alpha1").to_string();
        assert!(
            text.contains("kubelet.conf") && text.contains("exec.apiVersion"),
            "{text}"
        );
        let always = bare.replace("command: aws", "command: aws\n      interactiveMode: Always");
        assert!(resolve_at(&always).is_err());
    }

    #[test]
    fn insecure_skip_tls_verify() {
        let text = config(
            "    server: https://10.0.0.1:6443\n    insecure-skip-tls-verify: true\n",
            "    {}\n",
        );
        let creds = resolve_at(&text).expect("resolve");
        assert!(creds.insecure_skip_tls_verify);
        assert!(creds.ca.is_none());
        assert!(creds.to_string().contains("TLS NOT VERIFIED"));
        let both = text.replace(
            "insecure-skip-tls-verify: true",
            "insecure-skip-tls-verify: true\n    certificate-authority: ca.crt",
        );
        assert!(resolve_at(&both).is_err());
    }

    #[test]
    fn errors_name_the_file_and_field() {
        let cases = [
            ("apiVersion: v1\nkind: Config\n".to_string(), "current-context: not set"),
            (
                config("    server: https://h\n", "    {}\n").replace("current-context: ctx", "current-context: nope"),
                "current-context: no context named \"nope\"",
            ),
            (
                config("    server: https://h\n", "    {}\n").replace("cluster: k\n", "cluster: gone\n"),
                "context \"ctx\": cluster: no cluster named \"gone\"",
            ),
            (
                config("    server: https://h\n", "    {}\n").replace("user: u\n", "user: gone\n"),
                "context \"ctx\": user: no user named \"gone\"",
            ),
            (
                config("    insecure-skip-tls-verify: true\n", "    {}\n"),
                "cluster \"k\": server: not set",
            ),
            (
                config("    server: https://h\n", "    client-key-data: '!!!'\n"),
                "user \"u\": client-key-data: not valid base64",
            ),
            (
                config("    server: https://h\n", "    client-certificate: c.pem\n"),
                "user \"u\": client-key: client-certificate is set but no client key",
            ),
            (
                config("    server: https://h\n", "    auth-provider: {name: gcp}\n"),
                "auth-provider: auth provider \"gcp\" is not supported",
            ),
        ];
        for (text, expected) in cases {
            let err = resolve_at(&text).expect_err(expected).to_string();
            assert!(
                err.starts_with("kubeconfig /tmp/root/etc/kubernetes/kubelet.conf: "),
                "{err}"
            );
            assert!(err.contains(expected), "{err}\nexpected: {expected}");
        }
    }

    #[test]
    fn parse_errors_do_not_echo_the_file() {
        for text in [
            format!("current-context: [\nusers:\n- name: u\n  user: {{token: {TOKEN}\n"),
            format!("users:\n- name: u\n  user:\n    token: {{a: {TOKEN}}}\n"),
            format!("users:\n- name: u\n  user:\n    token: [{TOKEN}]\n"),
            format!("clusters: {TOKEN}\n"),
            format!("users:\n- name: u\n  user:\n    exec: {{args: {TOKEN}}}\n"),
        ] {
            let err = resolve_at(&text).expect_err("invalid");
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains(TOKEN), "{shown}");
            assert!(shown.contains("kubelet.conf"), "{shown}");
        }
    }

    #[test]
    fn empty_user_is_anonymous() {
        let text = config("    server: http://127.0.0.1:8080\n", "    {}\n");
        let creds = resolve_at(&text).expect("resolve");
        assert_eq!(creds.auth, Auth::default());
    }
}
