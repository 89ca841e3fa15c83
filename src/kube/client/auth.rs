//! Keeping the credentials current: token, certificate and CA files re-read when they change, the
//! exec plugin's credential cached until it expires, a forced refresh after a 401, and the HTTP
//! client rebuilt when the TLS material changes.

use std::fs;
use std::io;
use std::path::Path;
use std::time::SystemTime;

use super::{AuthState, Built, FileCache, FileStamp, Inner, KubeClient, Loaded, Prepared};
use crate::kube::credentials::{Material, MaterialSource, Secret, TokenSource};
use crate::kube::error::KubeError;
use crate::kube::exec::{ClusterInfo, identity_pem, run_plugin};
use crate::kube::limit::MAX_CREDENTIAL_FILE;
use crate::kube::time::format_rfc3339;

impl KubeClient {
    /// The HTTP client and token for the next request. `refresh`: the generation a request got
    /// a 401 with; if nobody refreshed since, re-read every file and re-run the exec plugin.
    pub(super) async fn prepare(&self, refresh: Option<u64>) -> Result<Prepared, KubeError> {
        let inner = &self.inner;
        let mut state = inner.state.lock().await;
        let force = refresh.is_some_and(|g| g == state.generation);
        if force {
            state.generation += 1;
            state.exec = None;
        }
        let mut loaded = inner.load_files(&mut state, force)?;
        if let Some(exec) = &inner.creds.auth.exec {
            let now = SystemTime::now();
            let output = match state.exec.take() {
                Some(output) if output.is_fresh(now) => output,
                _ => {
                    let cluster = ClusterInfo {
                        server: inner.creds.server.clone(),
                        ca_pem: loaded.ca.clone(),
                        insecure_skip_tls_verify: inner.creds.insecure_skip_tls_verify,
                        tls_server_name: inner.creds.tls_server_name.clone(),
                    };
                    let output = run_plugin(exec, Some(&cluster)).await?;
                    match output.expires {
                        Some(at) => tracing::debug!(
                            "exec plugin {:?} gave a credential valid until {}",
                            exec.command,
                            format_rfc3339(at)
                        ),
                        None => tracing::debug!("exec plugin {:?} gave a credential without expiry", exec.command),
                    }
                    output
                }
            };
            if let Some(token) = &output.token {
                loaded.token = Some(token.clone());
            }
            if let Some(identity) = &output.identity {
                loaded.identity = Some(identity.clone());
            }
            state.exec = Some(output);
        }
        let http = inner.ensure_http(&mut state, loaded.ca, loaded.identity)?;
        Ok(Prepared {
            http,
            token: loaded.token,
            generation: state.generation,
        })
    }
}

impl Inner {
    /// Reads (or takes from the cache) the CA, the client certificate and key, and the token.
    pub(super) fn load_files(&self, state: &mut AuthState, force: bool) -> Result<Loaded, KubeError> {
        let creds = &self.creds;
        let ca = match &creds.ca {
            Some(m) => Some(load_material(m, &mut state.ca, force)?),
            None => None,
        };
        let identity = match &creds.auth.client_cert {
            None => None,
            Some(cc) => {
                let cert = load_material(&cc.cert, &mut state.cert, force)?;
                let key = if cc.key.source == cc.cert.source {
                    cert.clone()
                } else {
                    load_material(&cc.key, &mut state.key, force)?
                };
                Some(identity_pem(&key, &cert))
            }
        };
        let token = match &creds.auth.token {
            None => None,
            Some(TokenSource::Inline(token)) => Some(token.clone()),
            Some(TokenSource::File { field, path }) => {
                let data = load_file(&mut state.token, path, field, force)?;
                let text = String::from_utf8_lossy(&data);
                let token = text.trim();
                if token.is_empty() {
                    return Err(KubeError::ReadFile {
                        what: field.clone(),
                        path: path.clone(),
                        source: io::Error::new(io::ErrorKind::InvalidData, "the token file is empty"),
                    });
                }
                Some(Secret::new(token))
            }
        };
        Ok(Loaded { ca, identity, token })
    }

    /// The HTTP client for this TLS material, built anew when the material changed.
    pub(super) fn ensure_http(
        &self,
        state: &mut AuthState,
        ca: Option<Vec<u8>>,
        identity: Option<Vec<u8>>,
    ) -> Result<reqwest::Client, KubeError> {
        if let Some(built) = &state.http
            && built.ca == ca
            && built.identity == identity
        {
            return Ok(built.client.clone());
        }
        if state.http.is_some() {
            tracing::info!(
                "{}: TLS material changed; reconnecting with the new one",
                self.creds.origin
            );
        }
        let client = self.build_http(ca.as_deref(), identity.as_deref())?;
        state.http = Some(Built {
            client: client.clone(),
            ca,
            identity,
        });
        Ok(client)
    }
}

fn load_material(material: &Material, cache: &mut FileCache, force: bool) -> Result<Vec<u8>, KubeError> {
    match &material.source {
        MaterialSource::Inline(data) => Ok(data.clone()),
        MaterialSource::File(path) => load_file(cache, path, &material.field, force),
    }
}

/// A file's bytes, re-read only when its stamp changed (or `force`). When it cannot be read
/// but was read before, the old bytes are used (a rotation in progress) with a warning.
fn load_file(cache: &mut FileCache, path: &Path, what: &str, force: bool) -> Result<Vec<u8>, KubeError> {
    let read = fs::metadata(path).map(|m| FileStamp::of(&m)).and_then(|stamp| {
        if !force
            && cache.stamp == Some(stamp)
            && let Some(data) = &cache.data
        {
            return Ok(data.clone());
        }
        let data = crate::host::read_file(path, MAX_CREDENTIAL_FILE)?;
        if cache.data.is_some() && cache.stamp != Some(stamp) {
            tracing::info!("{what}: {} changed; using the new contents", path.display());
        }
        cache.stamp = Some(stamp);
        cache.data = Some(data.clone());
        Ok(data)
    });
    match read {
        Ok(data) => Ok(data),
        Err(source) => match &cache.data {
            Some(data) => {
                tracing::warn!(
                    "{what}: cannot read {}: {source}; using the copy read before",
                    path.display()
                );
                Ok(data.clone())
            }
            None => Err(KubeError::ReadFile {
                what: what.to_string(),
                path: path.to_path_buf(),
                source,
            }),
        },
    }
}
