//! Watch streams: newline-delimited JSON events (`{"type": ..., "object": ...}`) read from a
//! chunked response, where a chunk may end in the middle of a line or hold several lines.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use serde::Deserialize;

use super::error::{ApiFailure, ApiStatus, KubeError, request_failure};
use super::limit::MAX_WATCH_EVENT;
use super::node::{Node, RawObject};

/// One watch event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// The Node appeared (or, without a resourceVersion, the synthetic initial state).
    Added(Node),
    /// The Node changed.
    Modified(Node),
    /// The Node was deleted.
    Deleted(Node),
    /// Progress marker: no change, but watching can resume from this resourceVersion.
    Bookmark {
        /// The resourceVersion to resume from.
        resource_version: String,
    },
    /// The resourceVersion is too old (an ERROR event with code 410): list again.
    Gone,
    /// Any other ERROR event.
    Error(ApiStatus),
}

/// The events of one watch request. It ends when the server closes the stream (at
/// `timeoutSeconds`); after an `Err` it ends too.
pub struct WatchStream {
    inner: Pin<Box<dyn Stream<Item = Result<WatchEvent, KubeError>> + Send>>,
}

impl WatchStream {
    /// Wraps any stream of events, e.g. a scripted one in tests.
    pub fn new(stream: impl Stream<Item = Result<WatchEvent, KubeError>> + Send + 'static) -> WatchStream {
        WatchStream {
            inner: Box::pin(stream),
        }
    }

    /// Events parsed from a watch response. `idle` bounds the wait for the next bytes: a
    /// connection that goes silent longer is presumed dead (the server closes a healthy watch
    /// at its `timeoutSeconds`, so `idle` should be a little more than that).
    pub(crate) fn from_response(
        response: reqwest::Response,
        idle: Duration,
        name: String,
        path: String,
    ) -> WatchStream {
        let state = ReadState {
            response,
            lines: LineBuffer::default(),
            idle,
            name,
            path,
            done: false,
        };
        WatchStream::new(futures_util::stream::unfold(state, |mut state| async move {
            let item = state.next().await?;
            Some((item, state))
        }))
    }
}

impl Stream for WatchStream {
    type Item = Result<WatchEvent, KubeError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl std::fmt::Debug for WatchStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WatchStream")
    }
}

struct ReadState {
    response: reqwest::Response,
    lines: LineBuffer,
    idle: Duration,
    name: String,
    path: String,
    done: bool,
}

impl ReadState {
    async fn next(&mut self) -> Option<Result<WatchEvent, KubeError>> {
        while !self.done {
            if let Some(line) = self.lines.next_line() {
                match parse_event(&line) {
                    Ok(Some(event)) => return Some(Ok(event)),
                    Ok(None) => continue,
                    Err(e) => return Some(Err(self.fail(ApiFailure::Decode(e)))),
                }
            }
            match tokio::time::timeout(self.idle, self.response.chunk()).await {
                Err(_) => {
                    let message = format!("no data for {}s: connection presumed dead", self.idle.as_secs());
                    return Some(Err(self.fail(ApiFailure::Transport(message))));
                }
                Ok(Err(e)) => return Some(Err(self.fail(request_failure(e)))),
                Ok(Ok(Some(chunk))) => {
                    if let Err(limit) = self.lines.push(&chunk) {
                        return Some(Err(self.fail(ApiFailure::TooLarge {
                            what: "a watch event line",
                            limit,
                            declared: None,
                        })));
                    }
                }
                Ok(Ok(None)) => {
                    self.done = true;
                    let rest = self.lines.finish()?;
                    return match parse_event(&rest) {
                        Ok(event) => event.map(Ok),
                        Err(e) => Some(Err(self.fail(ApiFailure::Decode(e)))),
                    };
                }
            }
        }
        None
    }

    fn fail(&mut self, failure: ApiFailure) -> KubeError {
        self.done = true;
        KubeError::WatchNode {
            name: self.name.clone(),
            path: self.path.clone(),
            failure,
        }
    }
}

/// Splits a byte stream into lines, across chunk boundaries, refusing lines longer than its
/// limit ([`MAX_WATCH_EVENT`] by default): it never holds more than the limit plus one chunk.
#[derive(Debug)]
pub(crate) struct LineBuffer {
    buf: Vec<u8>,
    /// Bytes before this are consumed.
    start: usize,
    /// Bytes before this (from `start`) hold no newline.
    scanned: usize,
    /// Bytes of the line not yet ended by a newline.
    partial: usize,
    /// Longest line accepted, without its newline.
    limit: usize,
}

impl Default for LineBuffer {
    fn default() -> Self {
        LineBuffer::with_limit(MAX_WATCH_EVENT)
    }
}

impl LineBuffer {
    /// A buffer accepting lines of up to `limit` bytes.
    pub fn with_limit(limit: usize) -> LineBuffer {
        LineBuffer {
            buf: Vec::new(),
            start: 0,
            scanned: 0,
            partial: 0,
            limit,
        }
    }

    /// Appends a chunk. `Err(limit)` when it holds, or continues, a line longer than the limit;
    /// the chunk is then not kept.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), usize> {
        let mut partial = self.partial;
        for (i, segment) in chunk.split(|&b| b == b'\n').enumerate() {
            partial = if i == 0 { partial + segment.len() } else { segment.len() };
            if partial > self.limit {
                return Err(self.limit);
            }
        }
        self.partial = partial;
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.scanned -= self.start;
            self.start = 0;
        }
        self.buf.extend_from_slice(chunk);
        Ok(())
    }

    /// The next complete, non-blank line, without its line ending.
    pub fn next_line(&mut self) -> Option<Vec<u8>> {
        loop {
            let from = self.scanned.max(self.start);
            match self.buf[from..].iter().position(|&b| b == b'\n') {
                None => {
                    self.scanned = self.buf.len();
                    return None;
                }
                Some(offset) => {
                    let end = from + offset;
                    let line = trim(&self.buf[self.start..end]).to_vec();
                    self.start = end + 1;
                    self.scanned = self.start;
                    if !line.is_empty() {
                        return Some(line);
                    }
                }
            }
        }
    }

    /// What is left after the stream ended (a last line without a newline), if not blank.
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        let rest = trim(&self.buf[self.start..]).to_vec();
        self.buf.clear();
        self.start = 0;
        self.scanned = 0;
        (!rest.is_empty()).then_some(rest)
    }
}

fn trim(line: &[u8]) -> &[u8] {
    line.trim_ascii()
}

#[derive(Deserialize)]
struct RawEvent {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    object: RawObject,
}

/// Parses one event line; `Ok(None)` for an event type this client does not know (skipped).
pub(crate) fn parse_event(line: &[u8]) -> Result<Option<WatchEvent>, String> {
    let raw: RawEvent = serde_json::from_slice(line).map_err(|e| format!("a watch event that is not JSON: {e}"))?;
    let node = |object: RawObject| object.into_node().map_err(|e| format!("{} event: {e}", raw.kind));
    Ok(Some(match raw.kind.as_str() {
        "ADDED" => WatchEvent::Added(node(raw.object)?),
        "MODIFIED" => WatchEvent::Modified(node(raw.object)?),
        "DELETED" => WatchEvent::Deleted(node(raw.object)?),
        "BOOKMARK" => WatchEvent::Bookmark {
            resource_version: raw
                .object
                .resource_version()
                .ok_or("BOOKMARK event without metadata.resourceVersion")?
                .to_string(),
        },
        "ERROR" => {
            let status = raw.object.into_status().into_status();
            if status.code == 410 || matches!(status.reason.as_str(), "Expired" | "Gone") {
                WatchEvent::Gone
            } else {
                WatchEvent::Error(status)
            }
        }
        other => {
            tracing::debug!("skipping watch event of unknown type {other:?}");
            return Ok(None);
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(chunks: &[&[u8]]) -> Vec<String> {
        let mut buf = LineBuffer::default();
        let mut out = Vec::new();
        for chunk in chunks {
            buf.push(chunk).expect("push");
            while let Some(line) = buf.next_line() {
                out.push(String::from_utf8(line).expect("utf8"));
            }
        }
        out.extend(buf.finish().map(|l| String::from_utf8(l).expect("utf8")));
        out
    }

    #[test]
    fn splits_lines_across_chunks() {
        assert_eq!(
            lines_of(&[b"{\"a\":1}\n{\"b\"", b":2}\n", b"\n\r\n{\"c\":3}\r\n{\"d\"", b":4}"]),
            ["{\"a\":1}", "{\"b\":2}", "{\"c\":3}", "{\"d\":4}"]
        );
        // One byte at a time.
        let text = b"{\"x\":1}\n\n{\"y\":2}\n";
        let chunks: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(lines_of(&chunks), ["{\"x\":1}", "{\"y\":2}"]);
        // Many lines in one chunk.
        assert_eq!(lines_of(&[b"1\n2\n3\n"]), ["1", "2", "3"]);
        assert!(lines_of(&[b"\n\n  \n"]).is_empty());
    }

    #[test]
    fn refuses_endless_lines() {
        let mut buf = LineBuffer::default();
        let chunk = vec![b'x'; 1 << 20];
        let mut result = Ok(());
        for _ in 0..20 {
            result = buf.push(&chunk);
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(MAX_WATCH_EVENT));
        assert!(buf.buf.len() <= MAX_WATCH_EVENT, "held {} bytes", buf.buf.len());
    }

    #[test]
    fn a_line_of_exactly_the_limit_is_accepted_one_more_byte_is_not() {
        // Whatever the chunking, a 10-byte line passes and an 11-byte one does not.
        for split in 0..=11 {
            let mut buf = LineBuffer::with_limit(10);
            let text = b"0123456789\nabc\n";
            let (a, b) = text.split_at(split.min(text.len()));
            buf.push(a).expect("first part");
            buf.push(b).expect("second part");
            assert_eq!(buf.next_line().as_deref(), Some(&b"0123456789"[..]));
            assert_eq!(buf.next_line().as_deref(), Some(&b"abc"[..]));

            let mut buf = LineBuffer::with_limit(10);
            let text = b"abc\n0123456789X\n";
            let (a, b) = text.split_at(split.min(text.len()));
            let refused = buf.push(a).and_then(|()| buf.push(b));
            assert_eq!(refused, Err(10), "split at {split}");
        }
        // The last line, without a newline, is limited too.
        let mut buf = LineBuffer::with_limit(10);
        buf.push(b"0123456789").expect("at the limit");
        assert_eq!(buf.push(b"X"), Err(10));
    }

    #[test]
    fn parses_each_event_type() {
        let node = r#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"gpu-1","uid":"u","resourceVersion":"7","labels":{"a":"b"}}}"#;
        for (kind, expect) in [("ADDED", 0), ("MODIFIED", 1), ("DELETED", 2)] {
            let line = format!(r#"{{"type":"{kind}","object":{node}}}"#);
            let event = parse_event(line.as_bytes()).expect("parse").expect("event");
            let n = match (expect, event) {
                (0, WatchEvent::Added(n)) | (1, WatchEvent::Modified(n)) | (2, WatchEvent::Deleted(n)) => n,
                (_, other) => panic!("{kind}: {other:?}"),
            };
            assert_eq!((n.name.as_str(), n.resource_version.as_str()), ("gpu-1", "7"));
        }
        let bookmark = br#"{"type":"BOOKMARK","object":{"kind":"Node","apiVersion":"v1","metadata":{"resourceVersion":"99","annotations":{"k8s.io/initial-events-end":"true"}}}}"#;
        assert_eq!(
            parse_event(bookmark).expect("parse"),
            Some(WatchEvent::Bookmark {
                resource_version: "99".into()
            })
        );
        let expired = br#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 1 (5)","reason":"Expired","code":410}}"#;
        assert_eq!(parse_event(expired).expect("parse"), Some(WatchEvent::Gone));
        let internal = br#"{"type":"ERROR","object":{"kind":"Status","status":"Failure","message":"boom","reason":"InternalError","code":500}}"#;
        match parse_event(internal).expect("parse") {
            Some(WatchEvent::Error(s)) => assert_eq!((s.code, s.reason.as_str()), (500, "InternalError")),
            other => panic!("{other:?}"),
        }
        assert_eq!(parse_event(br#"{"type":"FUTURE","object":{}}"#).expect("parse"), None);
        assert!(parse_event(b"{not json").is_err());
        assert!(parse_event(br#"{"type":"BOOKMARK","object":{}}"#).is_err());
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// However the stream is cut into chunks, the same non-blank lines come out, in order.
            #[test]
            fn lines_do_not_depend_on_the_chunking(
                lines in proptest::collection::vec("[ -~]{0,40}", 0..20),
                cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..10),
                crlf in any::<bool>(),
            ) {
                let end = if crlf { "\r\n" } else { "\n" };
                let text: String = lines.iter().map(|l| format!("{l}{end}")).collect();
                let mut at: Vec<usize> = cuts.iter().map(|c| c.index(text.len() + 1)).collect();
                at.push(0);
                at.push(text.len());
                at.sort_unstable();
                at.dedup();
                let chunks: Vec<&[u8]> = at.windows(2).map(|w| &text.as_bytes()[w[0]..w[1]]).collect();
                let expected: Vec<String> =
                    lines.iter().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect();
                prop_assert_eq!(lines_of(&chunks), expected);
            }

            /// Any line: parsed, skipped or refused with a message, never a panic.
            #[test]
            fn any_event_line_is_parsed_or_refused(line in proptest::collection::vec(any::<u8>(), 0..512)) {
                if let Err(e) = parse_event(&line) {
                    prop_assert!(!e.is_empty());
                }
            }

            /// A Node event carries the node's name, labels and resource version through.
            #[test]
            fn node_events_carry_the_node(
                kind in prop::sample::select(vec!["ADDED", "MODIFIED", "DELETED"]),
                name in "[a-z0-9]([a-z0-9.-]{0,40}[a-z0-9])?",
                version in "[0-9]{1,12}",
                labels in proptest::collection::btree_map("[a-z]{1,10}(/[a-z]{1,10})?", "[A-Za-z0-9._-]{0,20}", 0..5),
            ) {
                let line = serde_json::json!({
                    "type": kind,
                    "object": {"kind": "Node", "apiVersion": "v1",
                               "metadata": {"name": name, "uid": "u", "resourceVersion": version, "labels": labels}},
                })
                .to_string();
                let node = match parse_event(line.as_bytes()) {
                    Ok(Some(WatchEvent::Added(n) | WatchEvent::Modified(n) | WatchEvent::Deleted(n))) => n,
                    other => return Err(TestCaseError::fail(format!("{other:?}"))),
                };
                prop_assert_eq!(&node.name, &name);
                prop_assert_eq!(&node.resource_version, &version);
                prop_assert_eq!(&node.labels, &labels);
            }
        }
    }
}
