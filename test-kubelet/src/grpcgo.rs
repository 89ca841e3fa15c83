//! What a grpc-go client puts on the wire when it calls the kubelet over a Unix socket, and a
//! small client that sends exactly that: NVIDIA's device plugin, GPU Feature Discovery and
//! DCGM exporter are grpc-go programs, and the stand-in must accept them as the kubelet does.
//!
//! **`:authority`.** grpc-go derives it from the dial target (`clientconn.go`, `initAuthority`,
//! formerly `determineAuthority`):
//!
//! - a target with the `unix:` scheme (`unix:///var/lib/kubelet/device-plugins/kubelet.sock`,
//!   `unix:/path`, `unix:path`, `unix-abstract:`): `localhost`, in every version this crate
//!   knows of (since 1.54 through the unix resolver's `OverrideAuthority`);
//! - a bare path (`/var/lib/kubelet/device-plugins/kubelet.sock`) given to `grpc.Dial` /
//!   `grpc.DialContext` with a custom dialer, as NVIDIA's `k8s-device-plugin` does
//!   (`internal/plugin/server.go`, `dial`): the target becomes `passthrough:///<path>` and the
//!   authority is its endpoint, the path itself. grpc-go before 1.57 sends it as is
//!   (`/var/lib/kubelet/device-plugins/kubelet.sock`); 1.57 and later percent-encode it
//!   ("client: percent-encode the default authority for the channel", grpc-go #6428, release
//!   1.57.0): `%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fkubelet.sock` ([`encode_authority`]).
//!   grpc-go's own test `test/authority_test.go` (`UnixPassthrough`) expects
//!   `unix:%2F%2F%2Ftmp%2Fsock.sock` for `passthrough:///unix:///tmp/sock.sock`;
//! - `grpc.WithAuthority(a)`: `a` (what kubelets since 1.26 use towards plugins: `localhost`).
//!
//! Neither path form is a valid URI authority, and stock h2 (so tonic and hyper) resets such
//! a stream with `PROTOCOL_ERROR`; the kubelet's grpc-go server takes any value. NVIDIA's
//! plugin (grpc-go 1.63 and later) logs that as `stream terminated by RST_STREAM with error
//! code: PROTOCOL_ERROR`. The workspace's h2 (`vendor/h2`) treats such an authority as absent,
//! so the stand-in's and the agent's servers take it as grpc-go's do.
//!
//! **Headers** (`internal/transport/http2_client.go`, `createHeaderFields`), in this order:
//! `:method POST`, `:scheme http`, `:path /<service>/<method>`, `:authority`, `content-type
//! application/grpc`, `user-agent grpc-go/<version>`, `te trailers`, then only when they apply
//! `grpc-previous-rpc-attempts`, `grpc-encoding`, `grpc-accept-encoding`, `grpc-timeout` (a
//! deadline; NVIDIA's `Register` has none) and metadata. They are HPACK-coded by
//! `golang.org/x/net/http2/hpack` ([`GoHpackEncoder`]): a full match in the static or dynamic
//! table is indexed, anything else is a literal *with incremental indexing* (name indexed when
//! it is known, the static table's last entry of that name first), and strings are Huffman
//! coded whenever that is shorter.
//!
//! **Connection.** The preface, then a SETTINGS frame that is empty with grpc-go's defaults
//! (it names only an initial window or a header-list limit that differs from the default) and
//! no connection WINDOW_UPDATE; a unary call is one HEADERS frame (CONTINUATION past 16 KiB)
//! and one DATA frame with END_STREAM. Calls on one connection share the HPACK dynamic table.

use std::collections::VecDeque;
use std::io;
use std::path::Path;

use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tonic::{Code, Status};

use crate::rawh2::{
    DEFAULT_MAX_FRAME_SIZE, Frame, GrpcMessages, HeaderDecoder, PREFACE, encode_integer, flag, grpc_frame, kind,
    percent_decode, read_frame, reason_name,
};

/// The `user-agent` of NVIDIA's device plugin as built from its `go.mod` (grpc 1.63.2).
pub const NVIDIA_PLUGIN_USER_AGENT: &str = "grpc-go/1.63.2";

/// grpc-go's `encodeAuthority` (1.57 and later): percent-encodes every byte that RFC 3986
/// §3.2 does not allow in an authority, keeping unreserved characters, sub-delims and
/// `:`, `[`, `]`, `@`.
pub fn encode_authority(authority: &str) -> String {
    const UPPERHEX: &[u8; 16] = b"0123456789ABCDEF";
    let keep = |c: u8| {
        c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'-' | b'_'
                    | b'.'
                    | b'~'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
                    | b':'
                    | b'['
                    | b']'
                    | b'@'
            )
    };
    let mut out = String::with_capacity(authority.len());
    for &c in authority.as_bytes() {
        if keep(c) {
            out.push(c as char);
        } else {
            out.push('%');
            out.push(UPPERHEX[(c >> 4) as usize] as char);
            out.push(UPPERHEX[(c & 15) as usize] as char);
        }
    }
    out
}

/// Which grpc-go a client is, for the `:authority` it sends to a Unix socket dialled by path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcGoVersion {
    /// Before 1.57: the path as is.
    Before1_57,
    /// 1.57 and later: the path percent-encoded.
    Since1_57,
}

/// The `:authority` grpc-go sends when `grpc.Dial`/`grpc.DialContext` is given the bare path
/// `socket` (default scheme `passthrough`) and a custom dialer, as NVIDIA's device plugin
/// dials `kubelet.sock`.
pub fn bare_path_authority(socket: &Path, version: GrpcGoVersion) -> String {
    // "passthrough:///" + "/a/b" parses to the path "//a/b"; Endpoint() strips one "/".
    let endpoint = socket.to_string_lossy();
    match version {
        GrpcGoVersion::Before1_57 => endpoint.into_owned(),
        GrpcGoVersion::Since1_57 => encode_authority(&endpoint),
    }
}

/// The header list grpc-go sends for a call without deadline, compression or metadata.
pub fn request_headers(path: &str, authority: &str, user_agent: &str) -> Vec<(String, String)> {
    [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("user-agent", user_agent),
        ("te", "trailers"),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), v.to_string()))
    .collect()
}

/// HPACK's static table (RFC 7541 Appendix A), 1-based in the protocol.
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// Bit length of each symbol's code in HPACK's Huffman code (RFC 7541 Appendix B; symbol 256
/// is EOS). The code is canonical: codes follow from the lengths, in (length, symbol) order.
const HUFFMAN_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, //
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28, //
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, //
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, //
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, //
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, //
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, //
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, //
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, //
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, //
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, //
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, //
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, //
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, //
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, //
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, //
    30,
];

/// The canonical Huffman codes for [`HUFFMAN_LENGTHS`].
fn huffman_codes() -> [u32; 257] {
    let mut order: Vec<usize> = (0..257).collect();
    order.sort_by_key(|&s| (HUFFMAN_LENGTHS[s], s));
    let mut codes = [0u32; 257];
    let mut code = 0u32;
    let mut prev_len = HUFFMAN_LENGTHS[order[0]];
    for (k, &s) in order.iter().enumerate() {
        let len = HUFFMAN_LENGTHS[s];
        if k > 0 {
            code = (code + 1) << (len - prev_len);
        }
        prev_len = len;
        codes[s] = code;
    }
    codes
}

/// `s` Huffman coded, padded with the EOS prefix (all ones).
pub fn huffman_encode(s: &[u8]) -> Vec<u8> {
    let codes = huffman_codes();
    let mut out = Vec::with_capacity(s.len());
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    for &c in s {
        let len = HUFFMAN_LENGTHS[c as usize] as u32;
        acc = (acc << len) | codes[c as usize] as u64;
        bits += len;
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
        acc &= (1u64 << bits) - 1;
    }
    if bits > 0 {
        let pad = 8 - bits;
        out.push(((acc << pad) | ((1u64 << pad) - 1)) as u8);
    }
    out
}

fn huffman_len(s: &[u8]) -> usize {
    let bits: usize = s.iter().map(|&c| HUFFMAN_LENGTHS[c as usize] as usize).sum();
    bits.div_ceil(8)
}

/// `appendHpackString`: Huffman when strictly shorter.
fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    let hl = huffman_len(s);
    if hl < s.len() {
        encode_integer(out, 0x80, 7, hl);
        out.extend(huffman_encode(s));
    } else {
        encode_integer(out, 0x00, 7, s.len());
        out.extend_from_slice(s);
    }
}

/// An HPACK encoder that makes the choices of `golang.org/x/net/http2/hpack.Encoder` (which
/// grpc-go uses), with its default 4096-byte dynamic table.
pub struct GoHpackEncoder {
    /// Newest first: index 62 is `dynamic[0]`.
    dynamic: VecDeque<(String, String)>,
    size: usize,
    max_size: usize,
}

impl Default for GoHpackEncoder {
    fn default() -> Self {
        GoHpackEncoder {
            dynamic: VecDeque::new(),
            size: 0,
            max_size: 4096,
        }
    }
}

impl GoHpackEncoder {
    pub fn new() -> GoHpackEncoder {
        GoHpackEncoder::default()
    }

    /// `searchTable`: (index, whether name and value matched); index 0 if nothing matched.
    fn search(&self, name: &str, value: &str) -> (usize, bool) {
        let mut static_name = 0;
        for (i, (n, v)) in STATIC_TABLE.iter().enumerate() {
            if *n == name {
                if *v == value {
                    return (i + 1, true);
                }
                static_name = i + 1; // the table's byName keeps the last entry of a name
            }
        }
        let mut dynamic_name = 0;
        for (i, (n, v)) in self.dynamic.iter().enumerate() {
            if n == name {
                if v == value {
                    return (STATIC_TABLE.len() + i + 1, true);
                }
                if dynamic_name == 0 {
                    dynamic_name = STATIC_TABLE.len() + i + 1;
                }
            }
        }
        if static_name == 0 && dynamic_name != 0 {
            return (dynamic_name, false);
        }
        (static_name, false)
    }

    fn add(&mut self, name: &str, value: &str) {
        self.size += name.len() + value.len() + 32;
        self.dynamic.push_front((name.to_string(), value.to_string()));
        while self.size > self.max_size {
            match self.dynamic.pop_back() {
                Some((n, v)) => self.size -= n.len() + v.len() + 32,
                None => break,
            }
        }
    }

    /// One header block for `headers`, in order (`WriteField` for each).
    pub fn encode<N: AsRef<str>, V: AsRef<str>>(&mut self, headers: &[(N, V)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (n, v) in headers {
            let (name, value) = (n.as_ref(), v.as_ref());
            let (index, full) = self.search(name, value);
            if full {
                encode_integer(&mut out, 0x80, 7, index);
                continue;
            }
            let indexing = name.len() + value.len() + 32 <= self.max_size;
            if indexing {
                self.add(name, value);
            }
            let high = if indexing { 0x40 } else { 0x00 };
            if index == 0 {
                out.push(high);
                put_string(&mut out, name.as_bytes());
            } else {
                encode_integer(&mut out, high, if indexing { 6 } else { 4 }, index);
            }
            put_string(&mut out, value.as_bytes());
        }
        out
    }
}

/// grpc-go's status code for a stream reset with `code` (`http2ErrConvTab`).
fn reset_code(code: u32) -> Code {
    match code {
        0x3 | 0xb => Code::ResourceExhausted,
        0x7 => Code::Unavailable,
        0x8 => Code::Cancelled,
        0xc => Code::PermissionDenied,
        _ => Code::Internal,
    }
}

/// One client connection that frames and encodes its calls like grpc-go: several calls in
/// turn on one connection (stream 1, 3, …), one shared HPACK dynamic table.
pub struct GrpcGoConn {
    io: UnixStream,
    authority: String,
    user_agent: String,
    encoder: GoHpackEncoder,
    decoder: HeaderDecoder,
    next_stream: u32,
}

impl GrpcGoConn {
    /// Connects to `socket` and sends the preface and grpc-go's (empty) SETTINGS. Every call
    /// carries `authority` and `user_agent`.
    pub async fn connect(socket: &Path, authority: &str, user_agent: &str) -> io::Result<GrpcGoConn> {
        let mut io = UnixStream::connect(socket).await?;
        let mut out = PREFACE.to_vec();
        out.extend(Frame::new(kind::SETTINGS, 0, 0, Vec::new()).encode());
        io.write_all(&out).await?;
        Ok(GrpcGoConn {
            io,
            authority: authority.to_string(),
            user_agent: user_agent.to_string(),
            encoder: GoHpackEncoder::new(),
            decoder: HeaderDecoder::new(),
            next_stream: 1,
        })
    }

    /// A unary call of `path` (`/<service>/<method>`) with `request`; the response message.
    /// Errors read as grpc-go's: a reset is `stream terminated by RST_STREAM with error code:
    /// <NAME>`.
    pub async fn unary<Req, Resp>(&mut self, path: &str, request: &Req) -> Result<Resp, Status>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        let bytes = self.call(path, &request.encode_to_vec()).await?;
        Resp::decode(bytes.as_slice()).map_err(|e| Status::internal(format!("decoding the response: {e}")))
    }

    /// [`unary`](Self::unary) on encoded messages.
    pub async fn call(&mut self, path: &str, request: &[u8]) -> Result<Vec<u8>, Status> {
        let stream = self.next_stream;
        self.next_stream += 2;
        let headers = request_headers(path, &self.authority, &self.user_agent);
        let block = self.encoder.encode(&headers);
        let mut out = Vec::new();
        let chunks: Vec<&[u8]> = block.chunks(DEFAULT_MAX_FRAME_SIZE).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let k = if i == 0 { kind::HEADERS } else { kind::CONTINUATION };
            let f = if last { flag::END_HEADERS } else { 0 };
            out.extend(Frame::new(k, f, stream, chunk.to_vec()).encode());
        }
        let body = grpc_frame(request);
        if body.len() > DEFAULT_MAX_FRAME_SIZE {
            return Err(Status::invalid_argument("GrpcGoConn sends messages of at most 16 KiB"));
        }
        out.extend(Frame::new(kind::DATA, flag::END_STREAM, stream, body).encode());
        self.io
            .write_all(&out)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        self.response(stream).await
    }

    async fn send(&mut self, frame: Frame) -> Result<(), Status> {
        self.io
            .write_all(&frame.encode())
            .await
            .map_err(|e| Status::unavailable(format!("writing: {e}")))
    }

    async fn response(&mut self, stream: u32) -> Result<Vec<u8>, Status> {
        let proto = |e: String| Status::internal(format!("HTTP/2 error from the server: {e}"));
        let mut block: Option<(u32, Vec<u8>, bool)> = None;
        let mut got_headers = false;
        let mut grpc = GrpcMessages::default();
        let mut messages = Vec::new();
        loop {
            let frame = match read_frame(&mut self.io, DEFAULT_MAX_FRAME_SIZE).await {
                Ok(Some(f)) => f,
                Ok(None) => return Err(Status::unavailable("the server closed the connection")),
                Err(e) => return Err(Status::unavailable(format!("reading: {e}"))),
            };
            if block.is_some() && frame.kind != kind::CONTINUATION {
                return Err(proto("expected CONTINUATION".into()));
            }
            let headers = match frame.kind {
                kind::SETTINGS if !frame.has(flag::ACK) => {
                    self.send(Frame::new(kind::SETTINGS, flag::ACK, 0, Vec::new())).await?;
                    None
                }
                kind::PING if !frame.has(flag::ACK) => {
                    self.send(Frame::new(kind::PING, flag::ACK, 0, frame.payload)).await?;
                    None
                }
                kind::GOAWAY if frame.payload.len() >= 8 => {
                    let code =
                        u32::from_be_bytes([frame.payload[4], frame.payload[5], frame.payload[6], frame.payload[7]]);
                    return Err(Status::unavailable(format!(
                        "the server sent GOAWAY {}: {}",
                        reason_name(code),
                        String::from_utf8_lossy(&frame.payload[8..])
                    )));
                }
                kind::RST_STREAM if frame.stream_id == stream && frame.payload.len() == 4 => {
                    let code =
                        u32::from_be_bytes([frame.payload[0], frame.payload[1], frame.payload[2], frame.payload[3]]);
                    return Err(Status::new(
                        reset_code(code),
                        format!("stream terminated by RST_STREAM with error code: {}", reason_name(code)),
                    ));
                }
                kind::HEADERS => {
                    let body = frame.body().map_err(proto)?.to_vec();
                    let end_stream = frame.has(flag::END_STREAM);
                    if frame.has(flag::END_HEADERS) {
                        Some((frame.stream_id, body, end_stream))
                    } else {
                        block = Some((frame.stream_id, body, end_stream));
                        None
                    }
                }
                kind::CONTINUATION => {
                    let Some((id, mut b, end_stream)) = block.take() else {
                        return Err(proto("unexpected CONTINUATION".into()));
                    };
                    b.extend_from_slice(&frame.payload);
                    if frame.has(flag::END_HEADERS) {
                        Some((id, b, end_stream))
                    } else {
                        block = Some((id, b, end_stream));
                        None
                    }
                }
                kind::DATA if frame.stream_id == stream => {
                    if !got_headers {
                        return Err(proto("DATA before the response headers".into()));
                    }
                    grpc.push(frame.body().map_err(proto)?);
                    while let Some(m) = grpc.next_message().map_err(Status::internal)? {
                        messages.push(m);
                    }
                    let n = frame.payload.len() as u32;
                    if n > 0 {
                        self.send(Frame::new(kind::WINDOW_UPDATE, 0, 0, n.to_be_bytes().to_vec()))
                            .await?;
                    }
                    if frame.has(flag::END_STREAM) {
                        return Err(Status::internal("the server ended the stream without trailers"));
                    }
                    None
                }
                _ => None,
            };
            let Some((id, b, end_stream)) = headers else {
                continue;
            };
            // Every block goes through the decoder, whatever its stream: the table is shared.
            let fields = self.decoder.decode(&b).map_err(proto)?;
            if id != stream {
                continue;
            }
            let get = |name: &str| fields.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
            if !got_headers {
                got_headers = true;
                if let Some(status) = get(":status")
                    && status != "200"
                {
                    return Err(Status::unknown(format!(
                        "unexpected HTTP status code received from server: {status}"
                    )));
                }
                if !end_stream {
                    continue;
                }
            }
            if !end_stream {
                return Err(proto("a second header block without END_STREAM".into()));
            }
            let code = get("grpc-status")
                .and_then(|s| s.trim().parse::<i32>().ok())
                .ok_or_else(|| Status::internal("the server's trailers lack grpc-status"))?;
            if code != 0 {
                let message = get("grpc-message").map(|m| percent_decode(&m)).unwrap_or_default();
                return Err(Status::new(Code::from_i32(code), message));
            }
            if messages.len() != 1 || !grpc.is_empty() {
                return Err(Status::internal(format!(
                    "a unary call answered with {} messages",
                    messages.len()
                )));
            }
            return Ok(messages.remove(0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authority_like_grpc_go() {
        // grpc-go test/authority_test.go, UnixPassthrough.
        assert_eq!(
            encode_authority("unix:///tmp/sock.sock"),
            "unix:%2F%2F%2Ftmp%2Fsock.sock"
        );
        assert_eq!(encode_authority("localhost:50051"), "localhost:50051");
        assert_eq!(encode_authority("a b%c"), "a%20b%25c");
        let kubelet = Path::new("/var/lib/kubelet/device-plugins/kubelet.sock");
        assert_eq!(
            bare_path_authority(kubelet, GrpcGoVersion::Since1_57),
            "%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fkubelet.sock"
        );
        assert_eq!(
            bare_path_authority(kubelet, GrpcGoVersion::Before1_57),
            "/var/lib/kubelet/device-plugins/kubelet.sock"
        );
    }

    #[test]
    fn huffman_matches_rfc_7541() {
        // C.4.1: "www.example.com"; C.4.2: "no-cache"; C.6.1: "302".
        assert_eq!(
            huffman_encode(b"www.example.com"),
            [0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff]
        );
        assert_eq!(huffman_encode(b"no-cache"), [0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf]);
        assert_eq!(huffman_encode(b"302"), [0x64, 0x02]);
        // Every byte value survives a round trip through an independent decoder.
        let all: Vec<u8> = (0..=255u8).collect();
        let mut block = vec![0x00];
        encode_integer(&mut block, 0x80, 7, huffman_len(b"x"));
        block.extend(huffman_encode(b"x"));
        encode_integer(&mut block, 0x80, 7, huffman_len(&all));
        block.extend(huffman_encode(&all));
        let decoded = fluke_hpack::Decoder::new().decode(&block).unwrap();
        assert_eq!(decoded, vec![(b"x".to_vec(), all)]);
    }

    #[test]
    fn encoder_matches_rfc_7541_c4_and_go_choices() {
        // RFC 7541 C.4: requests with Huffman coding and a shared dynamic table. Go's encoder
        // produces these bytes, except that it names ":path" by index 5 (the static table's
        // last ":path"); the RFC's third request has no ":path" of that kind.
        let mut e = GoHpackEncoder::new();
        let first = e.encode(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
        ]);
        assert_eq!(
            first,
            [
                0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff
            ]
        );
        let second = e.encode(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
            ("cache-control", "no-cache"),
        ]);
        assert_eq!(
            second,
            [0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf]
        );
        let third = e.encode(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ]);
        assert_eq!(
            third,
            [
                0x82, 0x87, 0x85, 0xbf, 0x40, 0x88, 0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xa9, 0x7d, 0x7f, 0x89, 0x25, 0xa8,
                0x49, 0xe9, 0x5b, 0xb8, 0xe8, 0xb4, 0xbf
            ]
        );
        // A grpc-go request: ":path" named by index 5, "te" a new name; the second call on
        // the connection is all dynamic-table references.
        let mut e = GoHpackEncoder::new();
        let h = request_headers(
            "/v1beta1.Registration/Register",
            "%2Fx%2Fkubelet.sock",
            NVIDIA_PLUGIN_USER_AGENT,
        );
        let one = e.encode(&h);
        assert_eq!(&one[..3], &[0x83, 0x86, 0x45]);
        let two = e.encode(&h);
        assert!(two.iter().all(|b| b & 0x80 != 0), "{two:x?}");
        let mut d = fluke_hpack::Decoder::new();
        for block in [one, two] {
            let got: Vec<(String, String)> = d
                .decode(&block)
                .unwrap()
                .into_iter()
                .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                .collect();
            assert_eq!(got, h);
        }
    }

    #[test]
    fn dynamic_table_evicts_the_oldest() {
        let mut e = GoHpackEncoder::new();
        let big = "v".repeat(3000);
        e.encode(&[("a", big.as_str())]);
        e.encode(&[("b", big.as_str())]); // evicts "a"
        assert_eq!(e.dynamic.len(), 1);
        assert_eq!(e.search("a", &big), (0, false));
        assert_eq!(e.search("b", &big), (62, true));
        // Too big for the table: a literal without indexing.
        let huge = "v".repeat(5000);
        let block = e.encode(&[("c", huge.as_str())]);
        assert_eq!(block[0], 0x00);
        assert_eq!(e.dynamic.len(), 1);
    }
}
