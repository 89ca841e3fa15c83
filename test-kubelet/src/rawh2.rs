//! A minimal HTTP/2 + gRPC client over a Unix socket that sends any `:authority`.
//!
//! Kubelets before 1.26 (grpc-go without `WithAuthority("localhost")`) sent the plugin
//! socket's full path as the HTTP/2 `:authority` pseudo-header. `http::Uri` cannot hold such
//! an authority, so neither tonic nor hyper can send it; this module speaks just enough
//! HTTP/2 to do so: one connection per call, one stream (id 1), header blocks encoded as
//! HPACK literals without indexing and without Huffman coding, response header blocks
//! decoded with a full HPACK decoder (the server side, h2, uses Huffman and the dynamic
//! table), connection and stream flow control in both directions, PING and SETTINGS
//! acknowledgements, RST_STREAM / GOAWAY detection and gRPC trailers.
//!
//! The frame codec and the HPACK literal encoder are public so tests can build HTTP/2
//! peers (e.g. a proxy that rewrites the authority) without another HTTP/2 stack.

use std::collections::VecDeque;
use std::io;
use std::path::Path;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tonic::{Code, Status};

/// The client connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Frame types (RFC 9113 §6).
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags.
pub mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// SETTINGS identifiers used here.
pub mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
}

/// Error code PROTOCOL_ERROR, what h2 answers to a malformed `:authority`.
pub const PROTOCOL_ERROR: u32 = 0x1;

/// Largest frame payload we accept (our SETTINGS_MAX_FRAME_SIZE is the default).
pub const DEFAULT_MAX_FRAME_SIZE: usize = 16_384;
const DEFAULT_WINDOW: i64 = 65_535;
const MAX_WINDOW: i64 = (1 << 31) - 1;

/// Name of an HTTP/2 error code.
pub fn reason_name(code: u32) -> &'static str {
    match code {
        0x0 => "NO_ERROR",
        0x1 => "PROTOCOL_ERROR",
        0x2 => "INTERNAL_ERROR",
        0x3 => "FLOW_CONTROL_ERROR",
        0x4 => "SETTINGS_TIMEOUT",
        0x5 => "STREAM_CLOSED",
        0x6 => "FRAME_SIZE_ERROR",
        0x7 => "REFUSED_STREAM",
        0x8 => "CANCEL",
        0x9 => "COMPRESSION_ERROR",
        0xa => "CONNECT_ERROR",
        0xb => "ENHANCE_YOUR_CALM",
        0xc => "INADEQUATE_SECURITY",
        0xd => "HTTP_1_1_REQUIRED",
        _ => "UNKNOWN_ERROR_CODE",
    }
}

/// One HTTP/2 frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream_id: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn new(kind: u8, flags: u8, stream_id: u32, payload: Vec<u8>) -> Frame {
        Frame {
            kind,
            flags,
            stream_id,
            payload,
        }
    }

    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// Wire encoding: 24-bit length, type, flags, 31-bit stream id, payload.
    pub fn encode(&self) -> Vec<u8> {
        let len = self.payload.len();
        assert!(len < 1 << 24, "frame payload too large");
        let mut out = Vec::with_capacity(9 + len);
        out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
        out.push(self.kind);
        out.push(self.flags);
        out.extend_from_slice(&(self.stream_id & 0x7fff_ffff).to_be_bytes());
        out.extend_from_slice(&self.payload);
        out
    }

    /// Parses one frame from the start of `buf`: `Ok(None)` if `buf` holds less than a frame,
    /// otherwise the frame and the number of bytes it took.
    pub fn decode(buf: &[u8], max_len: usize) -> Result<Option<(Frame, usize)>, String> {
        if buf.len() < 9 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
        if len > max_len {
            return Err(format!("FRAME_SIZE_ERROR: frame of {len} bytes exceeds {max_len}"));
        }
        if buf.len() < 9 + len {
            return Ok(None);
        }
        let stream_id = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
        let frame = Frame::new(buf[3], buf[4], stream_id, buf[9..9 + len].to_vec());
        Ok(Some((frame, 9 + len)))
    }

    /// The payload of a DATA or HEADERS frame without padding (and, for HEADERS, without
    /// the priority fields).
    pub fn body(&self) -> Result<&[u8], String> {
        let mut p: &[u8] = &self.payload;
        let mut pad = 0usize;
        if self.has(flag::PADDED) && (self.kind == kind::DATA || self.kind == kind::HEADERS) {
            let (&n, rest) = p
                .split_first()
                .ok_or("PROTOCOL_ERROR: padded frame without pad length")?;
            pad = n as usize;
            p = rest;
        }
        if self.kind == kind::HEADERS && self.has(flag::PRIORITY) {
            if p.len() < 5 {
                return Err("PROTOCOL_ERROR: HEADERS priority fields truncated".into());
            }
            p = &p[5..];
        }
        if pad > p.len() {
            return Err("PROTOCOL_ERROR: padding longer than the frame".into());
        }
        Ok(&p[..p.len() - pad])
    }
}

/// Reads one frame; `Ok(None)` on a clean end of stream before the frame's first byte.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max_len: usize) -> io::Result<Option<Frame>> {
    let mut head = [0u8; 9];
    if r.read(&mut head[..1]).await? == 0 {
        return Ok(None);
    }
    r.read_exact(&mut head[1..]).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    if len > max_len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("FRAME_SIZE_ERROR: frame of {len} bytes exceeds {max_len}"),
        ));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    let stream_id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    Ok(Some(Frame::new(head[3], head[4], stream_id, payload)))
}

/// SETTINGS payload from (identifier, value) pairs.
pub fn settings_payload(settings: &[(u16, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(settings.len() * 6);
    for (id, value) in settings {
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&value.to_be_bytes());
    }
    out
}

/// Parses a SETTINGS payload into (identifier, value) pairs.
pub fn parse_settings(payload: &[u8]) -> Result<Vec<(u16, u32)>, String> {
    if !payload.len().is_multiple_of(6) {
        return Err("FRAME_SIZE_ERROR: SETTINGS payload not a multiple of 6".into());
    }
    Ok(payload
        .chunks(6)
        .map(|c| {
            (
                u16::from_be_bytes([c[0], c[1]]),
                u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
            )
        })
        .collect())
}

/// HPACK integer with an N-bit prefix (RFC 7541 §5.1); `high` holds the bits above the prefix.
pub fn encode_integer(out: &mut Vec<u8>, high: u8, prefix_bits: u8, mut value: usize) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(high | value as u8);
        return;
    }
    out.push(high | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_integer(out, 0x00, 7, s.len()); // H = 0: no Huffman coding
    out.extend_from_slice(s);
}

/// Encodes a header block as "literal header field without indexing — new name" entries
/// (RFC 7541 §6.2.2) with plain (non-Huffman) strings, which is what grpc-go-era
/// kubelets' HPACK output reduces to for these headers and needs no encoder state.
pub fn encode_header_block<'a>(headers: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        out.push(0x00);
        encode_string(&mut out, name.as_bytes());
        encode_string(&mut out, value.as_bytes());
    }
    out
}

/// A stateful HPACK decoder (static table, dynamic table, Huffman), one per connection
/// direction.
pub struct HeaderDecoder {
    inner: fluke_hpack::Decoder<'static>,
}

impl Default for HeaderDecoder {
    fn default() -> Self {
        HeaderDecoder {
            inner: fluke_hpack::Decoder::new(),
        }
    }
}

impl HeaderDecoder {
    pub fn new() -> HeaderDecoder {
        HeaderDecoder::default()
    }

    /// Decodes one complete header block (HEADERS + CONTINUATION fragments concatenated).
    pub fn decode(&mut self, block: &[u8]) -> Result<Vec<(String, String)>, String> {
        let list = self
            .inner
            .decode(block)
            .map_err(|e| format!("COMPRESSION_ERROR: {e:?}"))?;
        Ok(list
            .into_iter()
            .map(|(n, v)| {
                (
                    String::from_utf8_lossy(&n).into_owned(),
                    String::from_utf8_lossy(&v).into_owned(),
                )
            })
            .collect())
    }
}

/// A gRPC length-prefixed message: compressed flag 0, 32-bit big-endian length, bytes.
pub fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// Splits a DATA byte stream into gRPC messages.
#[derive(Debug, Default)]
pub struct GrpcMessages {
    buf: Vec<u8>,
}

impl GrpcMessages {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete message, if the buffer holds one.
    pub fn next_message(&mut self) -> Result<Option<Vec<u8>>, String> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        if self.buf[0] != 0 {
            return Err(format!(
                "compressed gRPC message (flag {}) although no grpc-accept-encoding was sent",
                self.buf[0]
            ));
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let msg = self.buf[5..5 + len].to_vec();
        self.buf.drain(..5 + len);
        Ok(Some(msg))
    }

    /// True if no partial message is buffered.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Decodes the percent-encoding of `grpc-message`.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            if let Some(v) = hex {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The message a caller sees for a RST_STREAM from the plugin.
pub fn reset_status(code: u32) -> Status {
    if code == PROTOCOL_ERROR {
        Status::new(
            Code::Internal,
            "plugin reset the stream: PROTOCOL_ERROR (the :authority kubelets before 1.26 send \
             was rejected)",
        )
    } else {
        Status::new(
            Code::Unavailable,
            format!("plugin reset the stream: {} (0x{code:x})", reason_name(code)),
        )
    }
}

const STREAM: u32 = 1;

/// One gRPC call on its own HTTP/2 connection over a Unix socket.
pub struct RawCall {
    io: BufReader<UnixStream>,
    hpack: HeaderDecoder,
    peer_max_frame: usize,
    peer_initial_window: i64,
    conn_send_window: i64,
    stream_send_window: i64,
    pending: Vec<u8>,
    end_sent: bool,
    header_block: Option<(Vec<u8>, bool)>,
    got_headers: bool,
    grpc: GrpcMessages,
    messages: VecDeque<Vec<u8>>,
    finished: Option<Result<(), Status>>,
    goaway: Option<String>,
}

impl RawCall {
    /// Connects to `socket`, sends the preface, SETTINGS, the request headers with the given
    /// `:authority` and `:path` (`/v1beta1.DevicePlugin/<Method>`) and the request message.
    pub async fn start(socket: &Path, authority: &str, path: &str, request: &[u8]) -> io::Result<RawCall> {
        let stream = UnixStream::connect(socket).await?;
        let mut call = RawCall {
            io: BufReader::new(stream),
            hpack: HeaderDecoder::new(),
            peer_max_frame: DEFAULT_MAX_FRAME_SIZE,
            peer_initial_window: DEFAULT_WINDOW,
            conn_send_window: DEFAULT_WINDOW,
            stream_send_window: DEFAULT_WINDOW,
            pending: grpc_frame(request),
            end_sent: false,
            header_block: None,
            got_headers: false,
            grpc: GrpcMessages::default(),
            messages: VecDeque::new(),
            finished: None,
            goaway: None,
        };
        let mut out = PREFACE.to_vec();
        out.extend(Frame::new(kind::SETTINGS, 0, 0, settings_payload(&[(setting::ENABLE_PUSH, 0)])).encode());
        let block = encode_header_block([
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("user-agent", "test-kubelet (grpc-go compatible)"),
            ("te", "trailers"),
        ]);
        let chunks: Vec<&[u8]> = block.chunks(DEFAULT_MAX_FRAME_SIZE).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let (k, f) = if i == 0 {
                (kind::HEADERS, if last { flag::END_HEADERS } else { 0 })
            } else {
                (kind::CONTINUATION, if last { flag::END_HEADERS } else { 0 })
            };
            out.extend(Frame::new(k, f, STREAM, chunk.to_vec()).encode());
        }
        call.io.get_mut().write_all(&out).await?;
        call.flush_pending().await?;
        Ok(call)
    }

    /// The next response message; `Ok(None)` once the call ended with grpc-status 0.
    /// Messages received before a failure are returned before the failure.
    pub async fn message(&mut self) -> Result<Option<Vec<u8>>, Status> {
        loop {
            if let Some(m) = self.messages.pop_front() {
                return Ok(Some(m));
            }
            if let Some(done) = &self.finished {
                return done.clone().map(|()| None);
            }
            self.step().await;
        }
    }

    fn finish(&mut self, result: Result<(), Status>) {
        if self.finished.is_none() {
            self.finished = Some(result);
        }
    }

    async fn send(&mut self, frame: Frame) -> io::Result<()> {
        self.io.get_mut().write_all(&frame.encode()).await
    }

    /// Sends as much of the request body as the flow-control windows allow.
    async fn flush_pending(&mut self) -> io::Result<()> {
        while !self.end_sent {
            let window = self.conn_send_window.min(self.stream_send_window).max(0) as usize;
            let n = self.pending.len().min(self.peer_max_frame).min(window);
            if n == 0 && !self.pending.is_empty() {
                return Ok(()); // wait for WINDOW_UPDATE
            }
            let chunk: Vec<u8> = self.pending.drain(..n).collect();
            let last = self.pending.is_empty();
            self.conn_send_window -= n as i64;
            self.stream_send_window -= n as i64;
            let flags = if last { flag::END_STREAM } else { 0 };
            self.send(Frame::new(kind::DATA, flags, STREAM, chunk)).await?;
            self.end_sent = last;
        }
        Ok(())
    }

    async fn step(&mut self) {
        if let Err(e) = self.flush_pending().await {
            self.finish(Err(Status::unavailable(format!("writing to plugin: {e}"))));
            return;
        }
        let frame = match read_frame(&mut self.io, DEFAULT_MAX_FRAME_SIZE).await {
            Ok(Some(f)) => f,
            Ok(None) => {
                let why = match &self.goaway {
                    Some(g) => format!(" (after {g})"),
                    None => String::new(),
                };
                self.finish(Err(Status::unavailable(format!(
                    "plugin closed the connection before the call completed{why}"
                ))));
                return;
            }
            Err(e) => {
                self.finish(Err(Status::unavailable(format!("reading from plugin: {e}"))));
                return;
            }
        };
        if let Err(e) = self.handle(frame).await {
            self.finish(Err(e));
        }
    }

    async fn handle(&mut self, frame: Frame) -> Result<(), Status> {
        let io_err = |e: io::Error| Status::unavailable(format!("writing to plugin: {e}"));
        let proto = |e: String| Status::internal(format!("HTTP/2 error from plugin: {e}"));
        if self.header_block.is_some() && frame.kind != kind::CONTINUATION {
            return Err(proto("expected CONTINUATION".into()));
        }
        match frame.kind {
            kind::SETTINGS => {
                if frame.has(flag::ACK) {
                    return Ok(());
                }
                for (id, value) in parse_settings(&frame.payload).map_err(proto)? {
                    match id {
                        setting::INITIAL_WINDOW_SIZE => {
                            let new = value as i64;
                            if new > MAX_WINDOW {
                                return Err(proto("FLOW_CONTROL_ERROR: initial window".into()));
                            }
                            self.stream_send_window += new - self.peer_initial_window;
                            self.peer_initial_window = new;
                        }
                        setting::MAX_FRAME_SIZE => self.peer_max_frame = (value as usize).clamp(16_384, (1 << 24) - 1),
                        // We never index headers, so the peer's table size does not matter.
                        _ => {}
                    }
                }
                self.send(Frame::new(kind::SETTINGS, flag::ACK, 0, Vec::new()))
                    .await
                    .map_err(io_err)?;
            }
            kind::PING if !frame.has(flag::ACK) => {
                self.send(Frame::new(kind::PING, flag::ACK, 0, frame.payload))
                    .await
                    .map_err(io_err)?;
            }
            kind::WINDOW_UPDATE => {
                if frame.payload.len() != 4 {
                    return Err(proto("FRAME_SIZE_ERROR: WINDOW_UPDATE".into()));
                }
                let inc = (u32::from_be_bytes(frame.payload[..4].try_into().unwrap()) & 0x7fff_ffff) as i64;
                match frame.stream_id {
                    0 => self.conn_send_window += inc,
                    STREAM => self.stream_send_window += inc,
                    _ => {}
                }
            }
            kind::GOAWAY => {
                if frame.payload.len() < 8 {
                    return Err(proto("FRAME_SIZE_ERROR: GOAWAY".into()));
                }
                let last = u32::from_be_bytes(frame.payload[..4].try_into().unwrap()) & 0x7fff_ffff;
                let code = u32::from_be_bytes(frame.payload[4..8].try_into().unwrap());
                let debug = String::from_utf8_lossy(&frame.payload[8..]).into_owned();
                let text = format!("GOAWAY {} {:?}", reason_name(code), debug);
                if last < STREAM {
                    return Err(Status::unavailable(format!(
                        "plugin sent {text} before handling the call"
                    )));
                }
                self.goaway = Some(text);
            }
            kind::RST_STREAM if frame.stream_id == STREAM => {
                if frame.payload.len() != 4 {
                    return Err(proto("FRAME_SIZE_ERROR: RST_STREAM".into()));
                }
                let code = u32::from_be_bytes(frame.payload[..4].try_into().unwrap());
                return Err(reset_status(code));
            }
            kind::HEADERS if frame.stream_id == STREAM => {
                let body = frame.body().map_err(proto)?.to_vec();
                let end_stream = frame.has(flag::END_STREAM);
                if frame.has(flag::END_HEADERS) {
                    self.headers(&body, end_stream)?;
                } else {
                    self.header_block = Some((body, end_stream));
                }
            }
            kind::CONTINUATION => {
                let Some((mut block, end_stream)) = self.header_block.take() else {
                    return Err(proto("unexpected CONTINUATION".into()));
                };
                block.extend_from_slice(&frame.payload);
                if frame.has(flag::END_HEADERS) {
                    self.headers(&block, end_stream)?;
                } else {
                    self.header_block = Some((block, end_stream));
                }
            }
            kind::DATA if frame.stream_id == STREAM => {
                let end_stream = frame.has(flag::END_STREAM);
                if !self.got_headers {
                    return Err(proto("DATA before response headers".into()));
                }
                self.grpc.push(frame.body().map_err(proto)?);
                while let Some(m) = self.grpc.next_message().map_err(Status::internal)? {
                    self.messages.push_back(m);
                }
                let n = frame.payload.len() as u32;
                if n > 0 {
                    let inc = n.to_be_bytes().to_vec();
                    self.send(Frame::new(kind::WINDOW_UPDATE, 0, 0, inc.clone()))
                        .await
                        .map_err(io_err)?;
                    if !end_stream {
                        self.send(Frame::new(kind::WINDOW_UPDATE, 0, STREAM, inc))
                            .await
                            .map_err(io_err)?;
                    }
                }
                if end_stream {
                    return Err(Status::internal("plugin ended the stream without grpc-status trailers"));
                }
            }
            kind::PUSH_PROMISE => return Err(proto("PUSH_PROMISE although push is disabled".into())),
            _ => {} // PRIORITY, unknown types, frames for other streams
        }
        Ok(())
    }

    fn headers(&mut self, block: &[u8], end_stream: bool) -> Result<(), Status> {
        let headers = self
            .hpack
            .decode(block)
            .map_err(|e| Status::internal(format!("HTTP/2 error from plugin: {e}")))?;
        let get = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        if !self.got_headers {
            self.got_headers = true;
            match get(":status") {
                Some("200") => {}
                Some(other) => {
                    return Err(Status::unknown(format!("plugin answered HTTP status {other}")));
                }
                None => return Err(Status::internal("plugin response lacks :status")),
            }
            if let Some(ct) = get("content-type")
                && !ct.starts_with("application/grpc")
            {
                return Err(Status::unknown(format!("plugin answered content-type {ct}")));
            }
            if !end_stream {
                return Ok(());
            }
            // Trailers-only response: the status is in this block.
        } else if !end_stream {
            return Err(Status::internal("plugin sent a second header block without END_STREAM"));
        }
        let message = get("grpc-message").map(percent_decode).unwrap_or_default();
        match get("grpc-status").map(|s| s.trim().parse::<i32>()) {
            Some(Ok(0)) => {
                if !self.grpc.is_empty() {
                    return Err(Status::internal(
                        "plugin ended the call in the middle of a gRPC message",
                    ));
                }
                self.finish(Ok(()));
                Ok(())
            }
            Some(Ok(code)) => Err(Status::new(Code::from_i32(code), message)),
            Some(Err(_)) => Err(Status::internal("plugin sent an unparsable grpc-status")),
            None => Err(Status::unknown("plugin's trailers lack grpc-status")),
        }
    }
}

/// A unary gRPC call over [`RawCall`].
pub async fn unary<Req, Resp>(socket: &Path, authority: &str, path: &str, request: &Req) -> Result<Resp, Status>
where
    Req: prost::Message,
    Resp: prost::Message + Default,
{
    let mut call = RawCall::start(socket, authority, path, &request.encode_to_vec())
        .await
        .map_err(|e| Status::unavailable(format!("dialing {}: {e}", socket.display())))?;
    let first = call
        .message()
        .await?
        .ok_or_else(|| Status::internal("plugin returned no message for a unary call"))?;
    if call.message().await?.is_some() {
        return Err(Status::internal(
            "plugin returned more than one message for a unary call",
        ));
    }
    Resp::decode(first.as_slice()).map_err(|e| Status::internal(format!("decoding the plugin's response: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip() {
        let f = Frame::new(kind::HEADERS, flag::END_HEADERS, 7, b"abc".to_vec());
        let bytes = f.encode();
        assert_eq!(&bytes[..9], &[0, 0, 3, 1, 4, 0, 0, 0, 7]);
        assert_eq!(Frame::decode(&bytes[..8], 100).unwrap(), None);
        assert_eq!(Frame::decode(&bytes[..10], 100).unwrap(), None);
        let (g, used) = Frame::decode(&bytes, 100).unwrap().unwrap();
        assert_eq!((g, used), (f, 12));
        assert!(Frame::decode(&bytes, 2).is_err());
    }

    #[tokio::test]
    async fn read_frame_from_stream() {
        let mut data = Frame::new(kind::PING, 0, 0, vec![1; 8]).encode();
        data.extend(Frame::new(kind::DATA, flag::END_STREAM, 1, vec![]).encode());
        let mut r: &[u8] = &data;
        let a = read_frame(&mut r, 16384).await.unwrap().unwrap();
        assert_eq!((a.kind, a.payload.len()), (kind::PING, 8));
        let b = read_frame(&mut r, 16384).await.unwrap().unwrap();
        assert!(b.has(flag::END_STREAM));
        assert_eq!(read_frame(&mut r, 16384).await.unwrap(), None);
    }

    #[test]
    fn padded_and_priority_bodies() {
        // pad length 2, priority (5 bytes), "hi", 2 pad bytes
        let payload = vec![2, 0, 0, 0, 0, 9, b'h', b'i', 0, 0];
        let f = Frame::new(kind::HEADERS, flag::PADDED | flag::PRIORITY, 1, payload);
        assert_eq!(f.body().unwrap(), b"hi");
        let d = Frame::new(kind::DATA, flag::PADDED, 1, vec![1, b'x', 0]);
        assert_eq!(d.body().unwrap(), b"x");
        let bad = Frame::new(kind::DATA, flag::PADDED, 1, vec![5, b'x']);
        assert!(bad.body().is_err());
    }

    #[test]
    fn hpack_integers() {
        // RFC 7541 C.1.1 / C.1.2 / C.1.3
        let mut out = Vec::new();
        encode_integer(&mut out, 0, 5, 10);
        assert_eq!(out, [0b01010]);
        out.clear();
        encode_integer(&mut out, 0, 5, 1337);
        assert_eq!(out, [31, 154, 10]);
        out.clear();
        encode_integer(&mut out, 0, 8, 42);
        assert_eq!(out, [42]);
        out.clear();
        encode_integer(&mut out, 0, 7, 127);
        assert_eq!(out, [127, 0]);
    }

    #[test]
    fn literal_header_block_decodes() {
        let long = "x".repeat(300);
        let block = encode_header_block([
            (":authority", "/var/lib/kubelet/device-plugins/nvidia-gpu.sock"),
            (":path", "/v1beta1.DevicePlugin/Allocate"),
            ("long", long.as_str()),
        ]);
        // literal without indexing, new name, no Huffman
        assert_eq!(block[0], 0x00);
        assert_eq!(block[1], 10);
        assert_eq!(&block[2..12], b":authority");
        let mut d = HeaderDecoder::new();
        let h = d.decode(&block).unwrap();
        assert_eq!(
            h[0],
            (
                ":authority".to_string(),
                "/var/lib/kubelet/device-plugins/nvidia-gpu.sock".to_string()
            )
        );
        assert_eq!(h[2].1, long);
        // Nothing was indexed: decoding the same block again gives the same result.
        assert_eq!(d.decode(&block).unwrap(), h);
    }

    #[test]
    fn decoder_handles_huffman_and_dynamic_table() {
        // RFC 7541 C.4.1 and C.4.2 (requests with Huffman coding, sharing a dynamic table).
        let first = [
            0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        let second = [0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf];
        let mut d = HeaderDecoder::new();
        let a = d.decode(&first).unwrap();
        assert_eq!(a[3], (":authority".into(), "www.example.com".into()));
        let b = d.decode(&second).unwrap();
        assert_eq!(b[3], (":authority".into(), "www.example.com".into()));
        assert_eq!(b[4], ("cache-control".into(), "no-cache".into()));
    }

    #[test]
    fn grpc_messages_split_across_pushes() {
        let mut m = GrpcMessages::default();
        let mut bytes = grpc_frame(b"hello");
        bytes.extend(grpc_frame(b""));
        m.push(&bytes[..3]);
        assert_eq!(m.next_message().unwrap(), None);
        m.push(&bytes[3..]);
        assert_eq!(m.next_message().unwrap().unwrap(), b"hello");
        assert_eq!(m.next_message().unwrap().unwrap(), b"");
        assert!(m.is_empty());
        m.push(&[1, 0, 0, 0, 0]);
        assert!(m.next_message().is_err());
    }

    #[test]
    fn settings_and_percent_decoding() {
        let p = settings_payload(&[
            (setting::INITIAL_WINDOW_SIZE, 1 << 20),
            (setting::MAX_FRAME_SIZE, 16384),
        ]);
        assert_eq!(
            parse_settings(&p).unwrap(),
            vec![
                (setting::INITIAL_WINDOW_SIZE, 1 << 20),
                (setting::MAX_FRAME_SIZE, 16384)
            ]
        );
        assert!(parse_settings(&p[..5]).is_err());
        assert_eq!(percent_decode("no%20such%20device%3A%20x"), "no such device: x");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    #[test]
    fn reset_messages() {
        let s = reset_status(PROTOCOL_ERROR);
        assert!(s.message().contains("PROTOCOL_ERROR"));
        assert!(s.message().contains("before 1.26"));
        assert!(reset_status(8).message().contains("CANCEL"));
    }

    /// A scripted HTTP/2 server: reads the client's request, checks it, then sends `reply`
    /// and returns the frames the client sent back afterwards.
    async fn scripted(reply: Vec<Frame>) -> (Result<Vec<Vec<u8>>, Status>, Vec<Frame>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut preface = [0u8; 24];
            conn.read_exact(&mut preface).await.unwrap();
            assert_eq!(&preface, PREFACE);
            let mut dec = HeaderDecoder::new();
            loop {
                let f = read_frame(&mut conn, 1 << 20).await.unwrap().unwrap();
                if f.kind == kind::HEADERS {
                    let h = dec.decode(f.body().unwrap()).unwrap();
                    assert!(h.contains(&(":authority".into(), "/some/plugin.sock".into())));
                    assert!(h.contains(&(":path".into(), "/v1beta1.DevicePlugin/X".into())));
                    assert!(h.contains(&("te".into(), "trailers".into())));
                }
                if f.kind == kind::DATA && f.has(flag::END_STREAM) {
                    assert_eq!(f.payload, grpc_frame(b"req"));
                    break;
                }
            }
            for f in reply {
                conn.write_all(&f.encode()).await.unwrap();
            }
            conn.shutdown().await.unwrap();
            let mut back = Vec::new();
            while let Ok(Some(f)) = read_frame(&mut conn, 1 << 20).await {
                back.push(f);
            }
            back
        });
        let result = async {
            let mut call = RawCall::start(&path, "/some/plugin.sock", "/v1beta1.DevicePlugin/X", b"req")
                .await
                .unwrap();
            let mut msgs = Vec::new();
            while let Some(m) = call.message().await? {
                msgs.push(m);
            }
            Ok(msgs)
        }
        .await;
        let back = server.await.unwrap();
        (result, back)
    }

    fn headers(list: &[(&str, &str)], flags: u8) -> Frame {
        Frame::new(
            kind::HEADERS,
            flags | flag::END_HEADERS,
            1,
            encode_header_block(list.iter().copied()),
        )
    }

    #[tokio::test]
    async fn raw_call_full_exchange() {
        let mut two = grpc_frame(b"one");
        two.extend(grpc_frame(b"two"));
        let mut padded = vec![3u8];
        padded.extend_from_slice(&two[..4]);
        padded.extend_from_slice(&[0, 0, 0]);
        let reply = vec![
            Frame::new(
                kind::SETTINGS,
                0,
                0,
                settings_payload(&[(setting::MAX_FRAME_SIZE, 32768)]),
            ),
            Frame::new(kind::PING, 0, 0, b"pingpong".to_vec()),
            headers(&[(":status", "200"), ("content-type", "application/grpc")], 0),
            Frame::new(kind::DATA, flag::PADDED, 1, padded),
            Frame::new(kind::DATA, 0, 1, two[4..].to_vec()),
            Frame::new(kind::PRIORITY, 0, 1, vec![0; 5]),
            headers(&[("grpc-status", "0")], flag::END_STREAM),
        ];
        let (result, back) = scripted(reply).await;
        assert_eq!(result.unwrap(), vec![b"one".to_vec(), b"two".to_vec()]);
        let kinds: Vec<(u8, u8)> = back.iter().map(|f| (f.kind, f.flags)).collect();
        assert!(kinds.contains(&(kind::SETTINGS, flag::ACK)), "{kinds:?}");
        let pong = back.iter().find(|f| f.kind == kind::PING).unwrap();
        assert!(pong.has(flag::ACK));
        assert_eq!(pong.payload, b"pingpong");
        // Both DATA frames were credited back on the connection.
        let credited: u32 = back
            .iter()
            .filter(|f| f.kind == kind::WINDOW_UPDATE && f.stream_id == 0)
            .map(|f| u32::from_be_bytes(f.payload[..4].try_into().unwrap()))
            .sum();
        assert_eq!(credited as usize, 8 + (two.len() - 4));
    }

    #[tokio::test]
    async fn raw_call_error_status_in_trailers_only_response() {
        let reply = vec![headers(
            &[
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("grpc-status", "5"),
                ("grpc-message", "no%20such%20device"),
            ],
            flag::END_STREAM,
        )];
        let err = scripted(reply).await.0.unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        assert_eq!(err.message(), "no such device");
    }

    #[tokio::test]
    async fn raw_call_goaway_and_missing_status() {
        let mut goaway = 0u32.to_be_bytes().to_vec();
        goaway.extend(0xbu32.to_be_bytes());
        goaway.extend(b"calm down");
        let err = scripted(vec![Frame::new(kind::GOAWAY, 0, 0, goaway)])
            .await
            .0
            .unwrap_err();
        assert!(err.message().contains("GOAWAY ENHANCE_YOUR_CALM"), "{}", err.message());

        let reply = vec![
            headers(&[(":status", "200"), ("content-type", "application/grpc")], 0),
            headers(&[("x", "y")], flag::END_STREAM),
        ];
        let err = scripted(reply).await.0.unwrap_err();
        assert!(err.message().contains("lack grpc-status"), "{}", err.message());

        let reply = vec![headers(&[(":status", "404")], flag::END_STREAM)];
        let err = scripted(reply).await.0.unwrap_err();
        assert!(err.message().contains("HTTP status 404"), "{}", err.message());

        // Connection closed mid-call.
        let reply = vec![headers(&[(":status", "200"), ("content-type", "application/grpc")], 0)];
        let err = scripted(reply).await.0.unwrap_err();
        assert!(err.message().contains("closed the connection"), "{}", err.message());
    }

    #[tokio::test]
    async fn raw_call_reset_stream() {
        let reply = vec![Frame::new(
            kind::RST_STREAM,
            0,
            1,
            PROTOCOL_ERROR.to_be_bytes().to_vec(),
        )];
        let err = scripted(reply).await.0.unwrap_err();
        assert_eq!(
            err.message(),
            "plugin reset the stream: PROTOCOL_ERROR (the :authority kubelets before 1.26 send was rejected)"
        );
    }
}
