//! Downloads of driver artifacts (NVIDIA `.run` files, prebuilt module tarballs), accepted only
//! with the sha256 the config names.
//!
//! [`fetch`] streams into `<dest>.part` beside the destination, resumes an interrupted part with a
//! `Range` request, retries transient failures with exponential backoff, and hashes the whole file
//! as it goes. Only a file whose sha256 matches is renamed onto `dest`; a mismatch deletes the
//! part. So `dest` only ever holds a verified artifact, and a file already there that verifies is
//! used without any request.
//!
//! One fetch per `dest` at a time: the part file is not locked, callers serialise.

use std::fmt::Write as _;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_RANGE, RANGE};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

use crate::kube::error_chain;

/// Default for [`FetchOptions::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default for [`FetchOptions::read_timeout`].
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`FetchOptions::max_bytes`]: driver runfiles are a few hundred MiB.
pub const DEFAULT_MAX_BYTES: u64 = 2 << 30;
/// Default for [`FetchOptions::retries`].
pub const DEFAULT_RETRIES: u32 = 3;
/// Default for [`FetchOptions::backoff`].
pub const DEFAULT_BACKOFF: Duration = Duration::from_secs(1);

/// The longest wait between two attempts, however many retries are configured.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A progress line at least this often while bytes arrive (and at every 10% when the size is known).
const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);
/// Read size when hashing a file on disk.
const HASH_BUFFER: usize = 64 * 1024;

/// Limits and retry policy of one [`fetch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchOptions {
    /// Together with `read_timeout`, how long the response headers may take after the request is
    /// sent. The TCP/TLS connect itself is bounded by the client's own connect timeout:
    /// [`FetchOptions::client_builder`] sets it to this value.
    pub connect_timeout: Duration,
    /// No body bytes for this long fails the attempt with [`FetchError::Timeout`].
    pub read_timeout: Duration,
    /// The largest artifact accepted, resumed bytes included.
    pub max_bytes: u64,
    /// How many times a transient failure is retried (so `retries + 1` attempts at most).
    pub retries: u32,
    /// Wait before the first retry; it doubles for each further one (capped at a minute).
    pub backoff: Duration,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            read_timeout: DEFAULT_READ_TIMEOUT,
            max_bytes: DEFAULT_MAX_BYTES,
            retries: DEFAULT_RETRIES,
            backoff: DEFAULT_BACKOFF,
        }
    }
}

impl FetchOptions {
    /// A client builder for `url` with this connect timeout: the environment's proxies
    /// apply unless the URL is on loopback ([`crate::net`]). The caller adds CAs and builds it.
    pub fn client_builder(&self, url: &str) -> reqwest::ClientBuilder {
        crate::net::direct_to_loopback(reqwest::Client::builder(), url)
            .connect_timeout(self.connect_timeout)
            .user_agent(concat!("gpu-node-agent/", env!("CARGO_PKG_VERSION")))
    }

    fn backoff_before_retry(&self, retry: u32) -> Duration {
        self.backoff.saturating_mul(2u32.saturating_pow(retry)).min(MAX_BACKOFF)
    }
}

/// A verified artifact at its destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    pub path: PathBuf,
    /// Size of the whole file.
    pub bytes: u64,
    /// Where the successful attempt picked up an earlier part (0: from the start).
    pub resumed_from: u64,
    /// The destination already held the right file; nothing was requested.
    pub cached: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("expected sha256 {given:?} for {url} is not 64 hex digits")]
    BadChecksumSpec { url: String, given: String },
    #[error("{url} answered HTTP {status}")]
    Http { url: String, status: StatusCode },
    #[error("cannot reach {} for {url}: {}", host(.url), error_chain(.source))]
    Network {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("download of {url} broke off after {received} bytes: {}", error_chain(.source))]
    Interrupted {
        url: String,
        received: u64,
        #[source]
        source: reqwest::Error,
    },
    #[error("no data from {url} for {after:?}")]
    Timeout { url: String, after: Duration },
    #[error("{url} is larger than the limit of {limit} bytes")]
    TooLarge { url: String, limit: u64 },
    #[error("{url} sent an unusable response: {reason}")]
    BadResponse { url: String, reason: String },
    #[error("sha256 of {url} is {actual}, but the config expects {expected}; the download was deleted")]
    ChecksumMismatch {
        url: String,
        expected: String,
        actual: String,
    },
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl FetchError {
    /// Worth another attempt: the network, the server's 5xx (and 408/429), a stall, a broken or
    /// garbled response. Not: 4xx, a size or checksum failure, local I/O.
    pub fn is_transient(&self) -> bool {
        match self {
            FetchError::Network { .. }
            | FetchError::Interrupted { .. }
            | FetchError::Timeout { .. }
            | FetchError::BadResponse { .. } => true,
            FetchError::Http { status, .. } => {
                status.is_server_error()
                    || *status == StatusCode::REQUEST_TIMEOUT
                    || *status == StatusCode::TOO_MANY_REQUESTS
            }
            FetchError::BadChecksumSpec { .. }
            | FetchError::TooLarge { .. }
            | FetchError::ChecksumMismatch { .. }
            | FetchError::Io { .. } => false,
        }
    }
}

/// Downloads `url` to `dest` and checks it against `expected_sha256` (64 hex digits, any case).
///
/// A `dest` that already has that sha256 is returned as is, without a request; one that does not
/// is deleted first. The bytes go to `<dest>.part`, which a later call resumes; the part becomes
/// `dest` (fsynced, renamed) only once the whole file's sha256 matches.
pub async fn fetch(
    client: &reqwest::Client,
    url: &str,
    expected_sha256: &str,
    dest: &Path,
    opts: &FetchOptions,
) -> Result<Fetched, FetchError> {
    let expected = parse_sha256(expected_sha256).ok_or_else(|| FetchError::BadChecksumSpec {
        url: url.to_owned(),
        given: expected_sha256.to_owned(),
    })?;
    if let Some(fetched) = already_there(dest, &expected).await? {
        tracing::info!("{} is already the expected download of {url}", dest.display());
        return Ok(fetched);
    }
    if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
        tokio::fs::create_dir_all(dir).await.map_err(io_err(dir))?;
    }
    let part = part_path(dest);
    let mut failures = 0;
    let mut restarted_after_mismatch = false;
    loop {
        let failure = match attempt(client, url, &expected, &part, opts).await {
            Ok(Attempt::Restart) => continue,
            Ok(Attempt::Complete(done)) if done.sha256 == expected => {
                commit(&part, dest).await?;
                tracing::info!(
                    "downloaded {url} to {} ({} bytes, sha256 verified)",
                    dest.display(),
                    done.bytes
                );
                return Ok(Fetched {
                    path: dest.to_path_buf(),
                    bytes: done.bytes,
                    resumed_from: done.resumed_from,
                    cached: false,
                });
            }
            Ok(Attempt::Complete(done)) => {
                remove_if_exists(&part).await?;
                // A part left by an earlier download of something else makes the resumed file
                // wrong through no fault of the server: give it one clean try.
                if done.resumed_from > 0 && !restarted_after_mismatch {
                    tracing::warn!(
                        "{url} resumed at byte {} does not match its sha256; downloading it again from the start",
                        done.resumed_from
                    );
                    restarted_after_mismatch = true;
                    continue;
                }
                return Err(FetchError::ChecksumMismatch {
                    url: url.to_owned(),
                    expected,
                    actual: done.sha256,
                });
            }
            Err(e) => e,
        };
        if !failure.is_transient() || failures >= opts.retries {
            return Err(failure);
        }
        let wait = opts.backoff_before_retry(failures);
        failures += 1;
        tracing::warn!("{failure}; retry {failures} of {} in {wait:?}", opts.retries);
        tokio::time::sleep(wait).await;
    }
}

/// Fills in `{name}` placeholders from `vars` (say `version`, `arch`, `kernel`, `flavour`). An
/// unknown placeholder, a lone brace, or a result that is not an http(s) URL is an error.
pub fn url_from_template(template: &str, vars: &[(&str, &str)]) -> Result<String, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find(['{', '}']) {
        out.push_str(&rest[..at]);
        if rest[at..].starts_with('}') {
            return Err(format!("URL template {template:?} has a '}}' without a '{{'"));
        }
        let after = &rest[at + 1..];
        let Some(end) = after.find('}') else {
            return Err(format!(
                "URL template {template:?} has an unclosed '{{' at {:?}",
                &rest[at..]
            ));
        };
        let name = &after[..end];
        let Some((_, value)) = vars.iter().find(|(key, _)| *key == name) else {
            let known: Vec<String> = vars.iter().map(|(key, _)| format!("{{{key}}}")).collect();
            return Err(format!(
                "URL template {template:?} has an unknown placeholder {{{name}}} (known: {})",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ));
        };
        out.push_str(value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    let parsed = reqwest::Url::parse(&out).map_err(|e| format!("URL template {template:?} gives {out:?}: {e}"))?;
    if !matches!(parsed.scheme(), "https" | "http") || parsed.host_str().is_none_or(str::is_empty) {
        return Err(format!(
            "URL template {template:?} gives {out:?}, which is not an https:// or http:// URL"
        ));
    }
    Ok(out)
}

/// The sha256 of a file as lowercase hex, read in chunks.
pub fn sha256_file(path: &Path) -> Result<String, io::Error> {
    let (hasher, _) = hash_file(path)?;
    Ok(hex(&hasher.finalize()))
}

// === one attempt ===

enum Attempt {
    /// The part was dropped for a reason that is not a failure; go again at once.
    Restart,
    Complete(Complete),
}

struct Complete {
    bytes: u64,
    resumed_from: u64,
    sha256: String,
}

/// One request: resume or start the part, stream the body into it, hash the whole part.
async fn attempt(
    client: &reqwest::Client,
    url: &str,
    expected: &str,
    part: &Path,
    opts: &FetchOptions,
) -> Result<Attempt, FetchError> {
    let mut offset = file_len(part).await?;
    if offset > opts.max_bytes {
        remove_if_exists(part).await?;
        offset = 0;
    }
    let mut request = client.get(url);
    if offset > 0 {
        request = request.header(RANGE, format!("bytes={offset}-"));
    }
    let headers_within = opts.connect_timeout.saturating_add(opts.read_timeout);
    let response = match tokio::time::timeout(headers_within, request.send()).await {
        Err(_) => return Err(timeout(url, headers_within)),
        Ok(Err(e)) => {
            return Err(FetchError::Network {
                url: url.to_owned(),
                source: e.without_url(),
            });
        }
        Ok(Ok(response)) => response,
    };

    let status = response.status();
    let resumed_from = match status {
        StatusCode::OK => {
            if offset > 0 {
                tracing::info!("{url} ignored the request to resume at byte {offset}; downloading from the start");
            }
            0
        }
        StatusCode::PARTIAL_CONTENT if offset > 0 => {
            let start = response
                .headers()
                .get(CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(content_range_start);
            if start != Some(offset) {
                // Cannot append whatever range this is; the next attempt starts clean.
                remove_if_exists(part).await?;
                return Err(FetchError::BadResponse {
                    url: url.to_owned(),
                    reason: format!("asked for bytes from {offset}, got Content-Range {start:?}"),
                });
            }
            tracing::info!("resuming {url} at byte {offset}");
            offset
        }
        StatusCode::RANGE_NOT_SATISFIABLE if offset > 0 => {
            // Nothing past the part: it is either the whole file or not this file at all.
            drop(response);
            let (hasher, bytes) = hash_file_async(part).await?;
            let sha256 = hex(&hasher.finalize());
            if sha256 == expected {
                return Ok(Attempt::Complete(Complete {
                    bytes,
                    resumed_from: bytes,
                    sha256,
                }));
            }
            tracing::warn!("{url} has nothing past byte {offset} and the part does not match; starting over");
            remove_if_exists(part).await?;
            return Ok(Attempt::Restart);
        }
        _ => {
            return Err(FetchError::Http {
                url: url.to_owned(),
                status,
            });
        }
    };

    let total = response.content_length().map(|len| resumed_from.saturating_add(len));
    if total.is_some_and(|total| total > opts.max_bytes) {
        remove_if_exists(part).await?;
        return Err(too_large(url, opts));
    }
    let (hasher, mut file) = if resumed_from > 0 {
        let (hasher, hashed) = hash_file_async(part).await?;
        if hashed != resumed_from {
            return Err(io_err(part)(io::Error::other(format!(
                "part changed while resuming ({hashed} bytes, expected {resumed_from})"
            ))));
        }
        let file = tokio::fs::OpenOptions::new()
            .append(true)
            .open(part)
            .await
            .map_err(io_err(part))?;
        (hasher, file)
    } else {
        (
            Sha256::new(),
            tokio::fs::File::create(part).await.map_err(io_err(part))?,
        )
    };

    let mut body = Body {
        url,
        part,
        opts,
        hasher,
        received: resumed_from,
        progress: Progress::new(url, resumed_from, total),
    };
    let streamed = body.stream(response, &mut file).await;
    // Whatever happened, what was written must be on disk before the next attempt measures it.
    let flushed = file.flush().await.and(file.sync_all().await).map_err(io_err(part));
    drop(file);
    match streamed {
        Err(e @ FetchError::TooLarge { .. }) => {
            remove_if_exists(part).await?;
            return Err(e);
        }
        Err(e) => return Err(e),
        Ok(()) => flushed?,
    }
    Ok(Attempt::Complete(Complete {
        bytes: body.received,
        resumed_from,
        sha256: hex(&body.hasher.finalize()),
    }))
}

/// The state of one response body being streamed into the part.
struct Body<'a> {
    url: &'a str,
    part: &'a Path,
    opts: &'a FetchOptions,
    hasher: Sha256,
    received: u64,
    progress: Progress<'a>,
}

impl Body<'_> {
    async fn stream(&mut self, response: reqwest::Response, file: &mut tokio::fs::File) -> Result<(), FetchError> {
        let mut chunks = response.bytes_stream();
        loop {
            let chunk = match tokio::time::timeout(self.opts.read_timeout, chunks.next()).await {
                Err(_) => return Err(timeout(self.url, self.opts.read_timeout)),
                Ok(None) => return Ok(()),
                Ok(Some(Err(e))) => {
                    return Err(FetchError::Interrupted {
                        url: self.url.to_owned(),
                        received: self.received,
                        source: e.without_url(),
                    });
                }
                Ok(Some(Ok(chunk))) => chunk,
            };
            let received = self.received.saturating_add(chunk.len() as u64);
            if received > self.opts.max_bytes {
                return Err(too_large(self.url, self.opts));
            }
            file.write_all(&chunk).await.map_err(io_err(self.part))?;
            self.hasher.update(&chunk);
            self.received = received;
            self.progress.update(received);
        }
    }
}

/// Log lines while a body streams: every [`PROGRESS_INTERVAL`] or every tenth of the total.
struct Progress<'a> {
    url: &'a str,
    total: Option<u64>,
    started: Instant,
    start_bytes: u64,
    last_at: Instant,
    last_tenth: u64,
}

impl<'a> Progress<'a> {
    fn new(url: &'a str, start_bytes: u64, total: Option<u64>) -> Self {
        let now = Instant::now();
        Progress {
            url,
            total,
            started: now,
            start_bytes,
            last_at: now,
            last_tenth: total.map_or(0, |total| tenths(start_bytes, total)),
        }
    }

    fn update(&mut self, received: u64) {
        let now = Instant::now();
        let tenth = self.total.map_or(0, |total| tenths(received, total));
        if now.duration_since(self.last_at) < PROGRESS_INTERVAL && tenth <= self.last_tenth {
            return;
        }
        self.last_at = now;
        self.last_tenth = tenth;
        let secs = now.duration_since(self.started).as_secs_f64().max(0.001);
        let rate = (received - self.start_bytes) as f64 / secs;
        let of = match self.total {
            Some(total) => format!(" of {} ({}%)", mib(total as f64), tenth * 10),
            None => String::new(),
        };
        tracing::info!(
            bytes = received,
            total = self.total,
            "downloading {}: {}{of} at {}/s",
            self.url,
            mib(received as f64),
            mib(rate)
        );
    }
}

fn tenths(bytes: u64, total: u64) -> u64 {
    if total == 0 {
        10
    } else {
        (u128::from(bytes) * 10 / u128::from(total)) as u64
    }
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / f64::from(1u32 << 20))
}

// === files ===

/// `<dest>.part`, in the same directory so the final rename is atomic.
fn part_path(dest: &Path) -> PathBuf {
    let mut name = dest.as_os_str().to_owned();
    name.push(".part");
    PathBuf::from(name)
}

/// `dest` as a [`Fetched`] when it has the expected sha256; otherwise it is deleted.
async fn already_there(dest: &Path, expected: &str) -> Result<Option<Fetched>, FetchError> {
    match tokio::fs::metadata(dest).await {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(dest)(e)),
        Ok(meta) if !meta.is_file() => return Err(io_err(dest)(io::Error::other("exists but is not a regular file"))),
        Ok(_) => {}
    }
    let (hasher, bytes) = hash_file_async(dest).await?;
    let actual = hex(&hasher.finalize());
    if actual == expected {
        return Ok(Some(Fetched {
            path: dest.to_path_buf(),
            bytes,
            resumed_from: 0,
            cached: true,
        }));
    }
    tracing::warn!(
        "{} has sha256 {actual}, not the expected {expected}; deleting it and downloading again",
        dest.display()
    );
    remove_if_exists(dest).await?;
    Ok(None)
}

/// fsyncs the part, renames it onto `dest`, and fsyncs the directory so the rename survives a crash.
async fn commit(part: &Path, dest: &Path) -> Result<(), FetchError> {
    let file = tokio::fs::File::open(part).await.map_err(io_err(part))?;
    file.sync_all().await.map_err(io_err(part))?;
    drop(file);
    tokio::fs::rename(part, dest).await.map_err(io_err(dest))?;
    if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
        let dir_file = tokio::fs::File::open(dir).await.map_err(io_err(dir))?;
        dir_file.sync_all().await.map_err(io_err(dir))?;
    }
    Ok(())
}

async fn file_len(path: &Path) -> Result<u64, FetchError> {
    match tokio::fs::metadata(path).await {
        Ok(meta) => Ok(meta.len()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(io_err(path)(e)),
    }
}

async fn remove_if_exists(path: &Path) -> Result<(), FetchError> {
    match tokio::fs::remove_file(path).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(path)(e)),
        _ => Ok(()),
    }
}

fn hash_file(path: &Path) -> io::Result<(Sha256, u64)> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; HASH_BUFFER];
    let mut total = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => return Ok((hasher, total)),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        total += n as u64;
    }
}

/// [`hash_file`] off the async workers: a runfile is hundreds of MiB.
async fn hash_file_async(path: &Path) -> Result<(Sha256, u64), FetchError> {
    let owned = path.to_path_buf();
    tokio::task::spawn_blocking(move || hash_file(&owned))
        .await
        .map_err(io::Error::other)
        .and_then(|hashed| hashed)
        .map_err(io_err(path))
}

// === small helpers ===

/// 64 hex digits, lowercased; `None` for anything else.
fn parse_sha256(text: &str) -> Option<String> {
    (text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())).then(|| text.to_ascii_lowercase())
}

/// The first byte of a `Content-Range: bytes <first>-<last>/<size>` header.
fn content_range_start(value: &str) -> Option<u64> {
    let range = value.trim().strip_prefix("bytes ")?;
    let (first, _) = range.split_once('-')?;
    first.trim().parse().ok()
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The host (and port, when the URL names one) of `url`, for "cannot reach" messages.
fn host(url: &str) -> String {
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return url.to_owned();
    };
    match (parsed.host_str(), parsed.port()) {
        (Some(host), Some(port)) => format!("{host}:{port}"),
        (Some(host), None) => host.to_owned(),
        (None, _) => url.to_owned(),
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn timeout(url: &str, after: Duration) -> FetchError {
    FetchError::Timeout {
        url: url.to_owned(),
        after,
    }
}

fn too_large(url: &str, opts: &FetchOptions) -> FetchError {
    FetchError::TooLarge {
        url: url.to_owned(),
        limit: opts.max_bytes,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    /// What the test server does with one request.
    #[derive(Debug, Clone, Copy)]
    enum Reply {
        /// 200 with the whole body, or 206 from the `Range` start (416 past the end).
        Serve,
        /// 200 with the whole body, whatever the `Range` says.
        IgnoreRange,
        /// Like `Serve`, but the connection closes after this many body bytes.
        CutAfter(usize),
        /// Headers and this many body bytes, then silence.
        StallAfter(usize),
        /// 200 with the whole body and no `Content-Length`, ended by closing the connection.
        NoLength,
        /// This status and an empty body.
        Status(u16),
    }

    /// An HTTP/1.1 server on 127.0.0.1 that answers request `i` with `script[i]` (the last entry
    /// repeats) and records each request's `Range` header.
    struct Server {
        url: String,
        ranges: Arc<Mutex<Vec<Option<String>>>>,
    }

    impl Server {
        async fn start(body: &[u8], script: &[Reply]) -> Server {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/driver.run", listener.local_addr().unwrap());
            let ranges = Arc::new(Mutex::new(Vec::new()));
            let (body, script, seen) = (Arc::new(body.to_vec()), script.to_vec(), ranges.clone());
            tokio::spawn(async move {
                loop {
                    let (stream, _) = listener.accept().await.unwrap();
                    let (body, seen) = (body.clone(), seen.clone());
                    let script = script.clone();
                    tokio::spawn(async move {
                        let Some(range) = read_request(&stream).await else {
                            return;
                        };
                        let reply = {
                            let mut seen = seen.lock().unwrap();
                            seen.push(range.clone());
                            script[(seen.len() - 1).min(script.len() - 1)]
                        };
                        answer(stream, reply, &body, range.as_deref()).await;
                    });
                }
            });
            Server { url, ranges }
        }

        fn ranges(&self) -> Vec<Option<String>> {
            self.ranges.lock().unwrap().clone()
        }
    }

    /// Reads the request head; returns its `Range` header (outer `None`: the client went away).
    async fn read_request(stream: &TcpStream) -> Option<Option<String>> {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            stream.readable().await.ok()?;
            match stream.try_read(&mut buf) {
                Ok(0) => return None,
                Ok(n) => head.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => return None,
            }
        }
        let head = String::from_utf8(head).ok()?;
        Some(head.lines().find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("range").then(|| value.trim().to_owned())
        }))
    }

    async fn answer(mut stream: TcpStream, reply: Reply, body: &[u8], range: Option<&str>) {
        let start = range
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.strip_suffix('-'))
            .map(|r| r.parse::<usize>().unwrap());
        let len = body.len();
        let (head, bytes): (String, &[u8]) = match (reply, start) {
            (Reply::Status(code), _) => (format!("HTTP/1.1 {code} Test\r\nContent-Length: 0\r\n"), &[]),
            (Reply::NoLength, _) => ("HTTP/1.1 200 OK\r\n".to_owned(), body),
            (Reply::Serve | Reply::CutAfter(_) | Reply::StallAfter(_), Some(s)) if s >= len => (
                format!("HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{len}\r\nContent-Length: 0\r\n"),
                &[],
            ),
            (Reply::Serve | Reply::CutAfter(_) | Reply::StallAfter(_), Some(s)) => (
                format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {s}-{}/{len}\r\nContent-Length: {}\r\n",
                    len - 1,
                    len - s
                ),
                &body[s..],
            ),
            _ => (format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n"), body),
        };
        let head = format!("{head}Connection: close\r\n\r\n");
        if stream.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let bytes = match reply {
            Reply::CutAfter(n) | Reply::StallAfter(n) => &bytes[..n.min(bytes.len())],
            _ => bytes,
        };
        let _ = stream.write_all(bytes).await;
        if let Reply::StallAfter(_) = reply {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        let _ = stream.shutdown().await;
        // Let the client read to the end before the socket is dropped.
        let mut rest = [0u8; 64];
        let _ = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut rest)).await;
    }

    fn body(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 % 251) as u8).collect()
    }

    fn sha(bytes: &[u8]) -> String {
        hex(&Sha256::digest(bytes))
    }

    fn opts() -> FetchOptions {
        FetchOptions {
            connect_timeout: Duration::from_secs(1),
            read_timeout: Duration::from_secs(1),
            max_bytes: 1 << 20,
            retries: 3,
            backoff: Duration::from_millis(2),
        }
    }

    struct Dir {
        _tmp: tempfile::TempDir,
        dest: PathBuf,
        part: PathBuf,
    }

    fn dir() -> Dir {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("cache/NVIDIA-Linux-x86_64-580.65.06.run");
        let part = part_path(&dest);
        Dir { _tmp: tmp, dest, part }
    }

    async fn run(server: &Server, sha256: &str, d: &Dir, opts: &FetchOptions) -> Result<Fetched, FetchError> {
        let client = opts.client_builder(&server.url).build().expect("client");
        fetch(&client, &server.url, sha256, &d.dest, opts).await
    }

    #[tokio::test]
    async fn right_checksum_puts_the_file_in_place() {
        let data = body(100_000);
        let server = Server::start(&data, &[Reply::Serve]).await;
        let d = dir();
        let fetched = run(&server, &sha(&data).to_uppercase(), &d, &opts()).await.unwrap();
        assert_eq!(
            fetched,
            Fetched {
                path: d.dest.clone(),
                bytes: 100_000,
                resumed_from: 0,
                cached: false
            }
        );
        assert_eq!(std::fs::read(&d.dest).unwrap(), data);
        assert!(!d.part.exists());
        assert_eq!(server.ranges(), [None]);
    }

    #[tokio::test]
    async fn wrong_checksum_leaves_nothing_behind() {
        let data = body(10_000);
        let server = Server::start(&data, &[Reply::Serve]).await;
        let d = dir();
        let err = run(&server, &sha(b"something else"), &d, &opts()).await.unwrap_err();
        let FetchError::ChecksumMismatch { url, expected, actual } = &err else {
            panic!("{err}")
        };
        assert_eq!(
            (url, expected, actual),
            (&server.url, &sha(b"something else"), &sha(&data))
        );
        assert!(err.to_string().contains(&server.url), "{err}");
        assert!(!d.dest.exists());
        assert!(!d.part.exists());
        assert_eq!(server.ranges().len(), 1);
    }

    #[tokio::test]
    async fn valid_destination_is_used_without_a_request() {
        let data = body(5_000);
        let server = Server::start(&data, &[Reply::Status(500)]).await;
        let d = dir();
        std::fs::create_dir_all(d.dest.parent().unwrap()).unwrap();
        std::fs::write(&d.dest, &data).unwrap();
        let fetched = run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert!(fetched.cached);
        assert_eq!(fetched.bytes, 5_000);
        assert!(server.ranges().is_empty());
    }

    #[tokio::test]
    async fn invalid_destination_is_replaced() {
        let data = body(5_000);
        let server = Server::start(&data, &[Reply::Serve]).await;
        let d = dir();
        std::fs::create_dir_all(d.dest.parent().unwrap()).unwrap();
        std::fs::write(&d.dest, b"stale").unwrap();
        let fetched = run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert!(!fetched.cached);
        assert_eq!(std::fs::read(&d.dest).unwrap(), data);
    }

    #[tokio::test]
    async fn dropped_connection_resumes_from_the_part() {
        let data = body(200_000);
        let server = Server::start(&data, &[Reply::CutAfter(70_000), Reply::Serve]).await;
        let d = dir();
        let fetched = run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert!(fetched.resumed_from > 0, "{fetched:?}");
        assert_eq!(fetched.bytes, 200_000);
        assert_eq!(std::fs::read(&d.dest).unwrap(), data);
        assert_eq!(
            server.ranges(),
            [None, Some(format!("bytes={}-", fetched.resumed_from))]
        );
    }

    #[tokio::test]
    async fn server_ignoring_range_restarts_from_zero() {
        let data = body(50_000);
        let server = Server::start(&data, &[Reply::IgnoreRange]).await;
        let d = dir();
        std::fs::create_dir_all(d.dest.parent().unwrap()).unwrap();
        std::fs::write(&d.part, vec![0xAA; 1_000]).unwrap();
        let fetched = run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert_eq!(fetched.resumed_from, 0);
        assert_eq!(std::fs::read(&d.dest).unwrap(), data);
        assert_eq!(server.ranges(), [Some("bytes=1000-".to_owned())]);
    }

    #[tokio::test]
    async fn stale_part_that_does_not_match_is_downloaded_again_once() {
        let data = body(50_000);
        let server = Server::start(&data, &[Reply::Serve]).await;
        let d = dir();
        std::fs::create_dir_all(d.dest.parent().unwrap()).unwrap();
        std::fs::write(&d.part, vec![0xAA; 1_000]).unwrap();
        let fetched = run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert_eq!(fetched.resumed_from, 0);
        assert_eq!(std::fs::read(&d.dest).unwrap(), data);
        assert_eq!(server.ranges(), [Some("bytes=1000-".to_owned()), None]);
    }

    #[tokio::test]
    async fn complete_part_with_416_is_verified_and_kept() {
        let data = body(20_000);
        let server = Server::start(&data, &[Reply::Serve]).await;
        let d = dir();
        std::fs::create_dir_all(d.dest.parent().unwrap()).unwrap();
        std::fs::write(&d.part, &data).unwrap();
        let fetched = run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert_eq!((fetched.bytes, fetched.resumed_from), (20_000, 20_000));
        assert_eq!(std::fs::read(&d.dest).unwrap(), data);
        assert_eq!(server.ranges(), [Some("bytes=20000-".to_owned())]);
    }

    #[tokio::test]
    async fn bogus_part_with_416_starts_over() {
        let data = body(20_000);
        let server = Server::start(&data, &[Reply::Serve]).await;
        let d = dir();
        std::fs::create_dir_all(d.dest.parent().unwrap()).unwrap();
        std::fs::write(&d.part, vec![0xAA; 30_000]).unwrap();
        let fetched = run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert_eq!(fetched.resumed_from, 0);
        assert_eq!(std::fs::read(&d.dest).unwrap(), data);
        assert_eq!(server.ranges(), [Some("bytes=30000-".to_owned()), None]);
    }

    #[tokio::test]
    async fn not_found_fails_at_once() {
        let server = Server::start(b"", &[Reply::Status(404)]).await;
        let d = dir();
        let err = run(&server, &sha(b""), &d, &opts()).await.unwrap_err();
        assert!(
            matches!(
                err,
                FetchError::Http {
                    status: StatusCode::NOT_FOUND,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains(&server.url), "{err}");
        assert!(err.to_string().contains("404"), "{err}");
        assert_eq!(server.ranges().len(), 1);
    }

    #[tokio::test]
    async fn server_errors_are_retried() {
        let data = body(10_000);
        let server = Server::start(&data, &[Reply::Status(500), Reply::Status(503), Reply::Serve]).await;
        let d = dir();
        let fetched = run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert_eq!(std::fs::read(&fetched.path).unwrap(), data);
        assert_eq!(server.ranges().len(), 3);
    }

    #[tokio::test]
    async fn retries_run_out() {
        let server = Server::start(b"", &[Reply::Status(502)]).await;
        let d = dir();
        let opts = FetchOptions { retries: 2, ..opts() };
        let err = run(&server, &sha(b""), &d, &opts).await.unwrap_err();
        assert!(
            matches!(
                err,
                FetchError::Http {
                    status: StatusCode::BAD_GATEWAY,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(server.ranges().len(), 3);
    }

    #[tokio::test]
    async fn stalled_body_times_out() {
        let data = body(10_000);
        let server = Server::start(&data, &[Reply::StallAfter(1_000)]).await;
        let d = dir();
        let opts = FetchOptions {
            read_timeout: Duration::from_millis(150),
            retries: 0,
            ..opts()
        };
        let err = run(&server, &sha(&data), &d, &opts).await.unwrap_err();
        let FetchError::Timeout { url, after } = &err else {
            panic!("{err}")
        };
        assert_eq!((url, *after), (&server.url, Duration::from_millis(150)));
        // What arrived stays for the next attempt to resume.
        assert_eq!(std::fs::metadata(&d.part).unwrap().len(), 1_000);
        assert!(!d.dest.exists());
    }

    #[tokio::test]
    async fn content_length_over_the_limit_fails_before_reading() {
        let data = body(10_000);
        let server = Server::start(&data, &[Reply::Serve]).await;
        let d = dir();
        let opts = FetchOptions {
            max_bytes: 9_999,
            ..opts()
        };
        let err = run(&server, &sha(&data), &d, &opts).await.unwrap_err();
        assert!(matches!(err, FetchError::TooLarge { limit: 9_999, .. }), "{err}");
        assert!(!d.part.exists() && !d.dest.exists());
        assert_eq!(server.ranges().len(), 1);
    }

    #[tokio::test]
    async fn stream_over_the_limit_without_length_fails() {
        let data = body(10_000);
        let server = Server::start(&data, &[Reply::NoLength]).await;
        let d = dir();
        let opts = FetchOptions {
            max_bytes: 4_000,
            ..opts()
        };
        let err = run(&server, &sha(&data), &d, &opts).await.unwrap_err();
        assert!(matches!(err, FetchError::TooLarge { limit: 4_000, .. }), "{err}");
        assert!(!d.part.exists() && !d.dest.exists());
        assert_eq!(server.ranges().len(), 1);
    }

    #[tokio::test]
    async fn no_length_within_the_limit_is_fine() {
        let data = body(10_000);
        let server = Server::start(&data, &[Reply::NoLength]).await;
        let d = dir();
        run(&server, &sha(&data), &d, &opts()).await.unwrap();
        assert_eq!(std::fs::read(&d.dest).unwrap(), data);
    }

    #[tokio::test]
    async fn refused_connection_is_a_network_error_naming_the_host() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let url = format!("http://127.0.0.1:{port}/driver.run");
        let d = dir();
        let opts = FetchOptions { retries: 1, ..opts() };
        let client = opts.client_builder(&url).build().expect("client");
        let err = fetch(&client, &url, &sha(b""), &d.dest, &opts).await.unwrap_err();
        assert!(matches!(err, FetchError::Network { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("cannot reach 127.0.0.1:{port} for {url}: ")),
            "{text}"
        );
        assert!(text.to_lowercase().contains("refused"), "{text}");
    }

    #[tokio::test]
    async fn bad_checksum_spec_is_refused_before_any_request() {
        let server = Server::start(b"", &[Reply::Serve]).await;
        let d = dir();
        for bad in [
            "",
            "abc",
            &"g".repeat(64),
            &"a".repeat(65),
            &format!(" {}", "a".repeat(63)),
        ] {
            let err = run(&server, bad, &d, &opts()).await.unwrap_err();
            assert!(matches!(err, FetchError::BadChecksumSpec { .. }), "{bad:?}: {err}");
        }
        assert!(server.ranges().is_empty());
    }

    #[test]
    fn sha256_of_a_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("abc");
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(
            sha256_file(&path).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            sha256_file(&tmp.path().join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn templates_fill_placeholders() {
        let vars = [
            ("version", "580.65.06"),
            ("arch", "x86_64"),
            ("kernel", "6.8.0-45-generic"),
            ("flavour", "open"),
        ];
        assert_eq!(
            url_from_template(
                "https://download.nvidia.com/XFree86/Linux-{arch}/{version}/NVIDIA-Linux-{arch}-{version}.run",
                &vars
            )
            .unwrap(),
            "https://download.nvidia.com/XFree86/Linux-x86_64/580.65.06/NVIDIA-Linux-x86_64-580.65.06.run"
        );
        assert_eq!(
            url_from_template("http://mirror.local:8080/{kernel}/{flavour}.tar.zst", &vars).unwrap(),
            "http://mirror.local:8080/6.8.0-45-generic/open.tar.zst"
        );
        assert_eq!(
            url_from_template("https://example.com/fixed.run", &[]).unwrap(),
            "https://example.com/fixed.run"
        );
    }

    #[test]
    fn template_errors_name_the_problem() {
        let vars = [("version", "580.65.06")];
        let err = url_from_template("https://x/{verison}.run", &vars).unwrap_err();
        assert!(err.contains("{verison}") && err.contains("{version}"), "{err}");
        let err = url_from_template("https://x/{version.run", &vars).unwrap_err();
        assert!(err.contains("unclosed") && err.contains("{version.run"), "{err}");
        let err = url_from_template("https://x/version}.run", &vars).unwrap_err();
        assert!(err.contains("'}'"), "{err}");
        let err = url_from_template("https://x/{}.run", &vars).unwrap_err();
        assert!(err.contains("unknown placeholder {}"), "{err}");
        for not_http in [
            "ftp://x/{version}",
            "file:///tmp/{version}",
            "{version}",
            "https:///{version}",
        ] {
            let err = url_from_template(not_http, &vars).unwrap_err();
            assert!(err.contains(not_http), "{err}");
        }
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let opts = FetchOptions::default();
        assert_eq!(opts.backoff_before_retry(0), Duration::from_secs(1));
        assert_eq!(opts.backoff_before_retry(2), Duration::from_secs(4));
        assert_eq!(opts.backoff_before_retry(40), MAX_BACKOFF);
    }

    #[test]
    fn content_range_start_parses() {
        assert_eq!(content_range_start("bytes 100-199/200"), Some(100));
        assert_eq!(content_range_start("bytes 0-9/*"), Some(0));
        assert_eq!(content_range_start("bytes */200"), None);
        assert_eq!(content_range_start("items 1-2/3"), None);
    }
}
