//! Size limits on everything the kube side reads from outside the agent: API answers, watch
//! event lines, exec credential plugin output, kubeconfig, token, certificate and CA files.
//!
//! A host file or an API server that hands over hundreds of megabytes (a Node with a runaway
//! annotation, a kubeconfig pointing at a log file, a plugin stuck printing) must not take the
//! agent's memory with it: every read stops one chunk past its limit, and refuses at once when
//! the size is known beforehand (`Content-Length`, a file's length). The limits are far above
//! what a working cluster produces, so they only ever stop something that is broken or hostile.

/// Longest API answer read (GET, PATCH, POST). A Node is normally under 100 KiB; one on a large
/// cluster with many cached images can reach about 1 MiB.
pub const MAX_API_BODY: usize = 16 << 20;
/// The part of an error answer read for its message (a `Status` object is a few hundred bytes).
pub const MAX_ERROR_BODY: usize = 64 << 10;
/// Longest watch event line (one Node, so as large as a GET answer can be).
pub const MAX_WATCH_EVENT: usize = 16 << 20;
/// Longest exec credential plugin output on stdout (an ExecCredential is a few KiB, with a
/// client certificate and key).
pub const MAX_EXEC_OUTPUT: usize = 1 << 20;
/// How much of an exec credential plugin's stderr is kept, for the debug log; the rest is read
/// and dropped.
pub const MAX_EXEC_STDERR: usize = 4 << 10;
/// Largest kubeconfig read.
pub const MAX_KUBECONFIG: u64 = 1 << 20;
/// Largest token, client certificate, client key or CA file read (a CA file can be a whole
/// system bundle, a few hundred KiB).
pub const MAX_CREDENTIAL_FILE: u64 = 1 << 20;

/// Why a body could not be read in full.
#[derive(Debug)]
pub enum BodyError {
    /// It is longer than the limit: `declared` is its `Content-Length` when that said so
    /// (nothing was read), else `None` (reading stopped one chunk past the limit).
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
        /// The `Content-Length` that was over it.
        declared: Option<u64>,
    },
    /// The connection failed while reading.
    Transport(reqwest::Error),
}

/// The body's length as the `Content-Length` header (or the body itself) declares it.
fn declared_length(response: &reqwest::Response) -> Option<u64> {
    response
        .headers()
        .get(reqwest::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .or_else(|| response.content_length())
}

/// Reads a body of at most `limit` bytes, chunk by chunk: memory never holds more than the
/// limit plus one chunk. A `Content-Length` over the limit is refused before reading anything.
pub async fn read_body(response: &mut reqwest::Response, limit: usize) -> Result<Vec<u8>, BodyError> {
    let declared = declared_length(response);
    if let Some(n) = declared
        && n > limit as u64
    {
        return Err(BodyError::TooLarge {
            limit,
            declared: Some(n),
        });
    }
    let capacity = declared.map_or(0, |n| usize::try_from(n).unwrap_or(limit)).min(limit);
    let mut body = Vec::with_capacity(capacity);
    while let Some(chunk) = response.chunk().await.map_err(BodyError::Transport)? {
        if body.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge { limit, declared: None });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Reads at most the first `limit` bytes of a body and drops the rest unread (the connection
/// is then closed rather than reused): for error answers, whose start is all a message needs.
pub async fn read_body_prefix(response: &mut reqwest::Response, limit: usize) -> Result<Vec<u8>, reqwest::Error> {
    let mut body = Vec::new();
    while body.len() < limit {
        match response.chunk().await? {
            None => break,
            Some(chunk) => {
                let take = chunk.len().min(limit - body.len());
                body.extend_from_slice(&chunk[..take]);
            }
        }
    }
    Ok(body)
}

/// Reads and drops a body of at most `limit` bytes so that the connection can be reused,
/// holding one chunk at a time; a longer one is left unread (the connection is closed).
pub async fn drain_body(mut response: reqwest::Response, limit: usize) {
    if declared_length(&response).is_some_and(|n| n > limit as u64) {
        return;
    }
    let mut read = 0usize;
    while let Ok(Some(chunk)) = response.chunk().await {
        read += chunk.len();
        if read > limit {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{read_file, size};
    use bytes::Bytes;
    use std::io;
    use std::path::Path;
    use std::time::Duration;

    /// A response whose body arrives in `chunks`, with `Content-Length` when given.
    fn response(chunks: Vec<Vec<u8>>, content_length: Option<u64>) -> reqwest::Response {
        let stream = futures_util::stream::iter(chunks.into_iter().map(|c| Ok::<_, io::Error>(Bytes::from(c))));
        let mut builder = hyper::http::Response::builder().status(200);
        if let Some(n) = content_length {
            builder = builder.header("Content-Length", n.to_string());
        }
        reqwest::Response::from(builder.body(reqwest::Body::wrap_stream(stream)).expect("response"))
    }

    #[tokio::test]
    async fn a_body_of_exactly_the_limit_is_read() {
        let mut r = response(vec![vec![b'a'; 60], vec![b'b'; 40]], None);
        let body = read_body(&mut r, 100).await.expect("at the limit");
        assert_eq!(body.len(), 100);
        let mut r = response(vec![vec![b'a'; 100]], Some(100));
        assert_eq!(read_body(&mut r, 100).await.expect("declared at the limit").len(), 100);
        let mut r = response(vec![], None);
        assert!(read_body(&mut r, 100).await.expect("empty").is_empty());
    }

    #[tokio::test]
    async fn one_byte_over_the_limit_is_refused() {
        let mut r = response(vec![vec![b'a'; 60], vec![b'b'; 41]], None);
        match read_body(&mut r, 100).await {
            Err(BodyError::TooLarge {
                limit: 100,
                declared: None,
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn reading_stops_one_chunk_past_the_limit() {
        // An endless body: the read must stop on its own, having held about the limit.
        let endless = futures_util::stream::repeat_with(|| Ok::<_, io::Error>(Bytes::from(vec![b'x'; 1000])));
        let http = hyper::http::Response::builder()
            .body(reqwest::Body::wrap_stream(endless))
            .expect("response");
        let mut r = reqwest::Response::from(http);
        let read = tokio::time::timeout(Duration::from_secs(10), read_body(&mut r, 10_000))
            .await
            .expect("stops by itself");
        assert!(
            matches!(read, Err(BodyError::TooLarge { limit: 10_000, .. })),
            "{read:?}"
        );
    }

    #[tokio::test]
    async fn a_content_length_over_the_limit_is_refused_before_reading() {
        // The body never comes: only the header can have refused it.
        let pending = futures_util::stream::pending::<Result<Bytes, io::Error>>();
        let http = hyper::http::Response::builder()
            .header("Content-Length", "101")
            .body(reqwest::Body::wrap_stream(pending))
            .expect("response");
        let mut r = reqwest::Response::from(http);
        let read = tokio::time::timeout(Duration::from_secs(5), read_body(&mut r, 100))
            .await
            .expect("refused without waiting for the body");
        match read {
            Err(BodyError::TooLarge {
                limit: 100,
                declared: Some(101),
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn prefix_and_drain_are_bounded() {
        let mut r = response(vec![vec![b'a'; 60], vec![b'b'; 60]], None);
        let prefix = read_body_prefix(&mut r, 100).await.expect("prefix");
        assert_eq!(prefix.len(), 100);
        let endless = futures_util::stream::repeat_with(|| Ok::<_, io::Error>(Bytes::from(vec![b'x'; 1000])));
        let http = hyper::http::Response::builder()
            .body(reqwest::Body::wrap_stream(endless))
            .expect("response");
        tokio::time::timeout(
            Duration::from_secs(10),
            drain_body(reqwest::Response::from(http), 10_000),
        )
        .await
        .expect("drain stops by itself");
    }

    #[test]
    fn files_over_the_limit_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        std::fs::write(&path, vec![b'a'; 100]).expect("write");
        assert_eq!(read_file(&path, 100).expect("at the limit").len(), 100);
        std::fs::write(&path, vec![b'a'; 101]).expect("write");
        let err = read_file(&path, 100).expect_err("over");
        assert_eq!(err.kind(), io::ErrorKind::FileTooLarge);
        assert_eq!(err.to_string(), "the file is over the 100 bytes limit (101 bytes)");
        // No length to go by: stopped after limit + 1 bytes.
        let err = read_file(Path::new("/dev/zero"), 1 << 10).expect_err("endless");
        assert_eq!(err.to_string(), "the file is over the 1 KiB limit");
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(size(16 << 20), "16 MiB");
        assert_eq!(size(4 << 10), "4 KiB");
        assert_eq!(size(1000), "1000 bytes");
        assert_eq!(size((1 << 20) + 1), "1048577 bytes");
    }
}
