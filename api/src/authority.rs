//! Rewriting the HTTP/2 `:authority` of requests on a connection, so the kubelet's plugin watcher
//! can talk to a tonic server.
//!
//! The plugin watcher dials `plugins_registry` sockets with grpc-go and no `WithAuthority`, so
//! every request it sends carries the socket *path* as `:authority`
//! (`/var/lib/kubelet/plugins_registry/x.sock`). The `h2` server under tonic parses `:authority`
//! as a URI authority, finds a `/` in it and resets the stream (`PROTOCOL_ERROR`, "malformed
//! authority") before any service sees the request, so a plain tonic server never answers the
//! real kubelet. [`Rewritten::server`] sits between the accepted socket and tonic and replaces
//! the value before `h2` parses it; [`connect`] does the opposite on the client side, so the
//! kubelet simulator sends what the kubelet sends.
//!
//! Header blocks are HPACK-compressed against a dynamic table that spans the whole connection
//! (the watcher's `GetInfo` and `NotifyRegistrationStatus` share one), so the rewriter keeps a
//! decoder per connection and rewrites every header block; all other frames pass through
//! byte for byte, as does everything the server sends.

use std::collections::VecDeque;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use fluke_hpack::Decoder;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Uri};

/// An authority `h2` accepts, and what [`crate::uds::connect`] sends.
pub const LOCALHOST: &str = "localhost";

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEAD_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// SETTINGS_MAX_FRAME_SIZE before the server says otherwise, and the least it may say: frames of
/// this size are always accepted.
const MAX_FRAME: usize = 16 * 1024;
/// The most an encoded header block (HEADERS and CONTINUATION payloads together) may take, so
/// the bytes held while a block is assembled stay bounded. gRPC requests carry a few hundred
/// bytes of headers.
const MAX_BLOCK: usize = 64 * 1024;
/// The most a decoded header list may take, counted as HTTP/2 does (RFC 9113 §6.5.2: name +
/// value + 32 per field), on the list as rewritten, i.e. as the server will count it.
///
/// A block's output is bounded by this, not by its encoded size: an indexed field is one octet
/// that expands to a whole dynamic-table entry. hyper's server advertises a 16 KiB
/// SETTINGS_MAX_HEADER_LIST_SIZE; h2 0.4 answers a list over it with a 431 on that stream and
/// closes the connection only over 4 times that (its `MAX_HEADER_LIST_ABUSE_MULTIPLIER`), so
/// refusing above 64 KiB refuses only what the server itself would drop the connection for.
const MAX_LIST: usize = 4 * 16 * 1024;
/// The most field representations (size updates included) a header block may hold. A gRPC
/// request has about ten; the bound caps the decoding work per block, which `fluke-hpack` does
/// not (it rebuilds its Huffman table, hundreds of allocations, for every Huffman-coded string
/// and decodes the whole block even once the list is over [`MAX_LIST`]).
///
/// It is also the decoding budget between yields: once header blocks with this many fields in
/// all have been decoded, [`Rewriter::feed`] stops and the server side's next read yields to
/// the scheduler before it goes on, so a stream of small blocks cannot hold the thread for a
/// whole read buffer's worth of decoding (thousands of Huffman strings).
const MAX_FIELDS: usize = 100;
/// SETTINGS_HEADER_TABLE_SIZE before the server says otherwise, and the most we let a peer grow
/// the HPACK dynamic table we mirror to: neither the h2 server behind [`Rewritten::server`] nor
/// the tonic server [`Rewritten::client`] talks to advertises more, so a size update above it
/// is a compression error anyway. It bounds what one indexed field can expand to.
const DEFAULT_TABLE: usize = 4096;
/// Once this much rewritten output is pending, [`Rewriter::feed`] stops taking input until it
/// has been handed on: one read (or write) cannot expand into an unbounded amount of output.
const MAX_PENDING: usize = 64 * 1024;
/// The most rewritten output held at once, whatever the input: [`MAX_PENDING`], less one byte,
/// plus what the step that crosses it may add, at most one header block as rewritten (its
/// encoding is smaller than its [`MAX_LIST`]-bounded list size, and it takes at most four frame
/// heads of [`MAX_FRAME`]-sized frames).
const MAX_OUT: usize = MAX_PENDING + MAX_LIST + MAX_LIST.div_ceil(MAX_FRAME) * HEAD_LEN;
const READ_BUFFER: usize = 16 * 1024;

/// A connection whose requests, in one direction, get their `:authority` replaced.
///
/// Built with [`Rewritten::server`] around an accepted stream (requests are read from it) or
/// with [`Rewritten::client`] around a dialed one (requests are written to it). Bytes in the
/// other direction pass untouched. A malformed or oversized request header block fails the
/// read or write with [`io::ErrorKind::InvalidData`], which makes hyper close the connection.
pub struct Rewritten<S> {
    inner: S,
    side: Side,
    rewriter: Rewriter,
    /// Rewritten bytes not yet handed on (to the reader, or written to `inner`).
    out: Vec<u8>,
    sent: usize,
    /// Bytes read from `inner` before rewriting (server side only).
    raw: Vec<u8>,
    /// The part of `raw` not yet fed to `rewriter`: it is fed once `out` has been handed on.
    raw_at: usize,
    raw_len: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Server,
    Client,
}

impl<S> Rewritten<S> {
    /// Wraps a stream accepted by an HTTP/2 server: requests read from it reach the server with
    /// `:authority` = `authority` (a request without one stays without one).
    ///
    /// The replacement goes in as a literal that the server does not index, so the server's
    /// HPACK table stays empty and cannot disagree with the client's.
    ///
    /// ```no_run
    /// # async fn serve(listener: tokio::net::UnixListener, routes: tonic::service::Routes) {
    /// use devicelet_api::authority::{LOCALHOST, Rewritten};
    /// use tokio_stream::{StreamExt, wrappers::UnixListenerStream};
    ///
    /// let incoming = UnixListenerStream::new(listener)
    ///     .map(|accepted| accepted.map(|stream| Rewritten::server(stream, LOCALHOST)));
    /// tonic::transport::Server::builder()
    ///     .add_routes(routes)
    ///     .serve_with_incoming(incoming)
    ///     .await
    ///     .unwrap();
    /// # }
    /// ```
    ///
    /// What a connection needs is decided on its first request: when that request's
    /// `:authority` is one the server takes (absent, or a valid URI authority such as
    /// `localhost`, what the kubelet's device manager sends), the connection is passed through
    /// untouched from then on, costing nothing more; otherwise (the plugin watcher's socket path)
    /// every request's header block is rewritten. A client has no reason to change authorities
    /// between requests on one connection, and one that does only has its own request refused.
    pub fn server(stream: S, authority: &str) -> Self {
        let mut rewritten = Self::new(stream, Side::Server, authority, Encoding::Literal);
        rewritten.rewriter.mode = Mode::Deciding;
        rewritten
    }

    /// Wraps a stream dialed by an HTTP/2 client: requests written to it reach the server with
    /// `:authority` = `authority`.
    ///
    /// Headers are re-encoded with incremental indexing, as grpc-go does, so a second request on
    /// the connection refers to the first one's headers (its `:authority` included) through the
    /// server's dynamic table. That table is assumed to keep its default size (4096), which
    /// tonic and grpc-go servers do; a server that shrinks it would fail the connection.
    pub fn client(stream: S, authority: &str) -> Self {
        Self::new(
            stream,
            Side::Client,
            authority,
            Encoding::Indexed(Table::default()),
        )
    }

    fn new(stream: S, side: Side, authority: &str, encoding: Encoding) -> Self {
        Self {
            inner: stream,
            side,
            rewriter: Rewriter::new(authority.as_bytes(), encoding),
            out: Vec::new(),
            sent: 0,
            raw: match side {
                Side::Server => vec![0; READ_BUFFER],
                Side::Client => Vec::new(),
            },
            raw_at: 0,
            raw_len: 0,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// Dials a gRPC server on a Unix socket with every request's `:authority` set to `authority`;
/// with the socket's path, the way the kubelet's plugin watcher (grpc-go) dials
/// `plugins_registry` sockets.
pub async fn connect(path: &Path, authority: &str) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_owned();
    let authority: Arc<str> = authority.into();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            let authority = authority.clone();
            async move {
                let stream = UnixStream::connect(path).await?;
                Ok::<_, io::Error>(TokioIo::new(Rewritten::client(stream, &authority)))
            }
        }))
        .await
}

impl<S: Connected> Connected for Rewritten<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncWrite + Unpin> Rewritten<S> {
    /// Writes the rewritten bytes still held to `inner`; client side only, where `out` holds
    /// what was written, not what is to be read.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.out[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.out.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewritten<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.side == Side::Client {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        loop {
            if this.rewriter.mode == Mode::Passing
                && this.sent == this.out.len()
                && this.raw_at >= this.raw_len
            {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            if this.sent < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.sent);
                buf.put_slice(&this.out[this.sent..this.sent + n]);
                this.sent += n;
                if this.sent == this.out.len() {
                    this.out.clear();
                    this.sent = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.raw_at < this.raw_len {
                if this.rewriter.decoded >= MAX_FIELDS {
                    // Decoding budget spent: let other tasks run before decoding more.
                    this.rewriter.decoded = 0;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                let raw = &this.raw[this.raw_at..this.raw_len];
                this.raw_at += this.rewriter.feed(raw, &mut this.out)?;
                continue;
            }
            let mut raw = ReadBuf::new(&mut this.raw);
            let read = Pin::new(&mut this.inner).poll_read(cx, &mut raw);
            if read.is_pending() {
                // The task yields anyway: the budget starts over.
                this.rewriter.decoded = 0;
            }
            ready!(read)?;
            if raw.filled().is_empty() {
                return Poll::Ready(Ok(()));
            }
            this.raw_at = 0;
            this.raw_len = raw.filled().len();
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewritten<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.side == Side::Server {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        ready!(this.poll_drain(cx))?;
        // What is written here comes from our own client, not a peer: no yield. With `out`
        // empty and the budget reset, at least one byte is taken when `buf` has any.
        this.rewriter.decoded = 0;
        let taken = this.rewriter.feed(buf, &mut this.out)?;
        // The bytes are taken either way; a pending write finishes on the next write or flush.
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(taken))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.side == Side::Server {
            return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        }
        let buf = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &**b);
        Pin::new(this).poll_write(cx, buf)
    }

    fn is_write_vectored(&self) -> bool {
        self.side == Side::Server && self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.side == Side::Client {
            ready!(this.poll_drain(cx))?;
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.side == Side::Client {
            ready!(this.poll_drain(cx))?;
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

fn refused(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// The client-to-server byte stream of one connection, rewritten as it goes: a state machine
/// fed with whatever the transport delivers, so frames may arrive split anywhere.
struct Rewriter {
    authority: Box<[u8]>,
    mode: Mode,
    decoder: Decoder<'static>,
    encoding: Encoding,
    state: State,
    head: [u8; HEAD_LEN],
    head_len: usize,
    /// The payload of the HEADERS or CONTINUATION frame being read.
    payload: Vec<u8>,
    /// The header block being assembled, until END_HEADERS.
    block: Option<Block>,
    /// Field representations decoded since the caller last reset it; [`Rewriter::feed`] takes
    /// no more input from [`MAX_FIELDS`] on.
    decoded: usize,
}

/// Whether header blocks are rewritten.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// Every block (what [`Rewriter::new`] makes).
    Rewriting,
    /// The first block decides (see [`Rewritten::server`]).
    Deciding,
    /// None: the first one needed nothing, and everything is passed through.
    Passing,
}

#[derive(Clone, Copy)]
enum State {
    Preface(usize),
    Head,
    /// Copying a frame's payload through; how much is left.
    Copy(usize),
    /// Reading a HEADERS or CONTINUATION payload; how much is left.
    Collect {
        left: usize,
        kind: u8,
        flags: u8,
        stream: u32,
    },
    Refused,
}

struct Block {
    stream: u32,
    end_stream: bool,
    fragment: Vec<u8>,
}

impl Rewriter {
    fn new(authority: &[u8], encoding: Encoding) -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(DEFAULT_TABLE);
        Self {
            authority: authority.into(),
            mode: Mode::Rewriting,
            decoder,
            encoding,
            state: State::Preface(0),
            head: [0; HEAD_LEN],
            head_len: 0,
            payload: Vec::new(),
            block: None,
            decoded: 0,
        }
    }

    /// Takes a prefix of `input`, appending what is to be sent on to `out`, and says how long
    /// it was: all of `input`, unless `out` reaches [`MAX_PENDING`] or `decoded` reaches
    /// [`MAX_FIELDS`] first. The caller hands `out` on (and resets `decoded`, when it has
    /// yielded) and feeds the rest later, so `out` never holds more than [`MAX_OUT`] bytes and
    /// one call decodes fewer than 2 × [`MAX_FIELDS`] fields. With `out` below [`MAX_PENDING`],
    /// `decoded` below [`MAX_FIELDS`] and `input` not empty, at least one byte is taken.
    fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<usize> {
        let fed = self.feed_inner(input, out);
        if fed.is_err() {
            self.state = State::Refused;
        }
        debug_assert!(out.len() <= MAX_OUT, "{} bytes held", out.len());
        fed
    }

    fn feed_inner(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<usize> {
        let whole = input.len();
        let mut input = input;
        while !input.is_empty() && out.len() < MAX_PENDING && self.decoded < MAX_FIELDS {
            match self.state {
                State::Refused => return Err(refused("connection already refused")),
                State::Preface(seen) => {
                    let n = (PREFACE.len() - seen).min(input.len());
                    if input[..n] != PREFACE[seen..seen + n] {
                        return Err(refused("not an HTTP/2 connection preface"));
                    }
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.state = if seen + n == PREFACE.len() {
                        State::Head
                    } else {
                        State::Preface(seen + n)
                    };
                }
                State::Head => {
                    let n = (HEAD_LEN - self.head_len).min(input.len());
                    self.head[self.head_len..self.head_len + n].copy_from_slice(&input[..n]);
                    self.head_len += n;
                    input = &input[n..];
                    if self.head_len == HEAD_LEN {
                        self.head_len = 0;
                        self.start_frame(out)?;
                    }
                }
                State::Copy(left) => {
                    let n = left.min(input.len()).min(MAX_PENDING - out.len());
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.state = if n == left {
                        State::Head
                    } else {
                        State::Copy(left - n)
                    };
                }
                State::Collect {
                    left,
                    kind,
                    flags,
                    stream,
                } => {
                    let n = left.min(input.len());
                    self.payload.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if n == left {
                        self.end_frame(kind, flags, stream, out)?;
                    } else {
                        self.state = State::Collect {
                            left: left - n,
                            kind,
                            flags,
                            stream,
                        };
                    }
                }
            }
        }
        Ok(whole - input.len())
    }

    fn start_frame(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        let h = self.head;
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let (kind, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let kind_here = if self.mode == Mode::Passing { 0 } else { kind };
        match (kind_here, &self.block) {
            (HEADERS, None) => {}
            (CONTINUATION, Some(block)) if block.stream == stream => {}
            (CONTINUATION, _) => return Err(refused("CONTINUATION without its HEADERS")),
            (_, Some(_)) => return Err(refused("frame inside a header block")),
            (_, None) => {
                out.extend_from_slice(&h);
                self.state = if len == 0 {
                    State::Head
                } else {
                    State::Copy(len)
                };
                return Ok(());
            }
        }
        let held = self.block.as_ref().map_or(0, |b| b.fragment.len());
        if held + len > MAX_BLOCK {
            return Err(refused("request header block over 64 KiB"));
        }
        self.payload.clear();
        if len == 0 {
            self.end_frame(kind, flags, stream, out)
        } else {
            self.state = State::Collect {
                left: len,
                kind,
                flags,
                stream,
            };
            Ok(())
        }
    }

    fn end_frame(&mut self, kind: u8, flags: u8, stream: u32, out: &mut Vec<u8>) -> io::Result<()> {
        self.state = State::Head;
        if kind == HEADERS {
            let mut p = &self.payload[..];
            let mut pad = 0;
            if flags & PADDED != 0 {
                let (&n, rest) = p
                    .split_first()
                    .ok_or_else(|| refused("HEADERS too short"))?;
                pad = usize::from(n);
                p = rest;
            }
            if flags & PRIORITY != 0 {
                p = p.get(5..).ok_or_else(|| refused("HEADERS too short"))?;
            }
            let end = p
                .len()
                .checked_sub(pad)
                .ok_or_else(|| refused("HEADERS padding too long"))?;
            self.block = Some(Block {
                stream,
                end_stream: flags & END_STREAM != 0,
                fragment: p[..end].to_vec(),
            });
        } else if let Some(block) = &mut self.block {
            block.fragment.extend_from_slice(&self.payload);
        }
        if flags & END_HEADERS != 0
            && let Some(block) = self.block.take()
        {
            self.rewrite(&block, out)?;
        }
        Ok(())
    }

    fn rewrite(&mut self, block: &Block, out: &mut Vec<u8>) -> io::Result<()> {
        self.decoded += check(&block.fragment).map_err(refused)?;
        // The usual first request (the kubelet's device manager sends `localhost`) is told
        // apart without the HPACK decoder, which would decode every string in the block: the
        // connection is passed through from here on, so its state is never needed.
        if self.mode == Mode::Deciding
            && let Some(sent) = first_authority(&block.fragment)
            && sent.as_deref().is_none_or(server_takes)
        {
            self.mode = Mode::Passing;
            put_block(block, &block.fragment, out);
            return Ok(());
        }
        let Self {
            authority,
            decoder,
            encoding,
            mode,
            ..
        } = self;
        let mut encoded = Vec::new();
        let mut size = 0;
        let mut sent = None;
        decoder
            .decode_with_cb(&block.fragment, |name, value| {
                let value = if &*name == b":authority" {
                    if *mode == Mode::Deciding {
                        sent = Some(value.to_vec());
                    }
                    &**authority
                } else {
                    &*value
                };
                // Past the limit the block is refused; `fluke-hpack` still decodes the rest
                // (at most MAX_FIELDS fields), but nothing more is copied.
                size += name.len() + value.len() + 32;
                if size <= MAX_LIST {
                    encoding.encode(&name, value, &mut encoded);
                }
            })
            .map_err(|_| refused("undecodable request header block"))?;
        if size > MAX_LIST {
            return Err(refused("request header list over 64 KiB"));
        }
        if *mode == Mode::Deciding {
            if sent.as_deref().is_none_or(server_takes) {
                // The server takes it as sent: from here on the connection is passed through, so
                // this block goes as it came, keeping the server's HPACK table the client's.
                *mode = Mode::Passing;
                encoded = block.fragment.clone();
            } else {
                *mode = Mode::Rewriting;
            }
        }
        put_block(block, &encoded, out);
        Ok(())
    }
}

/// Whether the HTTP/2 server behind the rewriter accepts `authority` as sent (`h2` parses it as
/// a URI authority and resets the stream when it does not parse).
fn server_takes(authority: &[u8]) -> bool {
    std::str::from_utf8(authority)
        .is_ok_and(|a| a.parse::<tonic::codegen::http::uri::Authority>().is_ok())
}

/// Sends `encoded` as `block`'s header block: a HEADERS frame, and CONTINUATION frames when it
/// is over [`MAX_FRAME`].
fn put_block(block: &Block, encoded: &[u8], out: &mut Vec<u8>) {
    let mut rest = encoded;
    let mut kind = HEADERS;
    let mut flags = if block.end_stream { END_STREAM } else { 0 };
    loop {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
        if tail.is_empty() {
            flags |= END_HEADERS;
        }
        put_head(out, chunk.len(), kind, flags, block.stream);
        out.extend_from_slice(chunk);
        if tail.is_empty() {
            return;
        }
        rest = tail;
        kind = CONTINUATION;
        flags = 0;
    }
}

/// HPACK's static table has 61 entries; `:authority` is the first (RFC 7541, appendix A).
const STATIC_ENTRIES: usize = 61;
const AUTHORITY_INDEX: usize = 1;

/// The `:authority` a connection's first header block sends (the last one, if several), read
/// without decoding the other fields: `Some(None)` when it sends none. `None` when the whole
/// HPACK decoder must decide: a field refers to the dynamic table (entries the block itself
/// inserted), a size update follows a field or ends the block (the decoder refuses those), the
/// block is larger than real requests' (over [`SCANNED_BLOCK`]: the list it decodes to could be
/// over [`MAX_LIST`]), or the `:authority` sent does not decode. `block` has passed [`check`].
///
/// Other strings are not decoded: a name is compared in its coded form (a string has one valid
/// Huffman coding), and one that does not decode, in a field passed through, is refused by the
/// server's own decoder (a compression error ends the connection), as it would be in any later
/// block of a connection passed through.
fn first_authority(block: &[u8]) -> Option<Option<Vec<u8>>> {
    if block.len() > SCANNED_BLOCK {
        return None;
    }
    let mut at = 0;
    let mut sent: Option<WireStr<'_>> = None;
    let (mut fields, mut last_was_update) = (0, false);
    while at < block.len() {
        let (field, used) = hpack_repr(&block[at..])?;
        at += used;
        last_was_update = matches!(field, Repr::SizeUpdate(_));
        match field {
            // A dynamic table size update: only before the first field.
            Repr::SizeUpdate(_) if fields > 0 => return None,
            Repr::SizeUpdate(_) => continue,
            Repr::Indexed(0) => return None,
            Repr::Indexed(index) | Repr::Literal { index, .. } if index > STATIC_ENTRIES => {
                return None;
            }
            // The static table's `:authority` entry has an empty value.
            Repr::Indexed(AUTHORITY_INDEX) => sent = Some((false, &[])),
            Repr::Indexed(_) => {}
            Repr::Literal { index, name, value } => {
                let is_authority = match name {
                    Some(name) => {
                        name == (false, &b":authority"[..])
                            || name == (true, &AUTHORITY_HUFFMAN[..])
                    }
                    None => index == AUTHORITY_INDEX,
                };
                if is_authority {
                    sent = Some(value);
                }
            }
        }
        fields += 1;
    }
    if last_was_update {
        return None;
    }
    match sent {
        None => Some(None),
        Some(value) => decoded(value).map(Some),
    }
}

/// The largest first block [`first_authority`] reads (real requests' take a few hundred
/// octets). Huffman coding at most multiplies a string by 8/5 and a one-octet field refers to at
/// most a static entry's name and value, so a block this size decodes to well under
/// [`MAX_LIST`].
const SCANNED_BLOCK: usize = 16 * 1024;

/// `:authority` in HPACK's Huffman code (RFC 7541, appendix B), padded with EOS's first bits.
const AUTHORITY_HUFFMAN: [u8; 8] = [0xb8, 0x3b, 0x53, 0x39, 0xec, 0x32, 0x7d, 0x7f];

/// `localhost`, what the kubelet's device manager sends, in the same code: known without
/// making a decoder (building one's table is most of what reading a first block costs).
const LOCALHOST_HUFFMAN: [u8; 6] = [0xa0, 0xe4, 0x1d, 0x13, 0x9d, 0x09];

/// An HPACK string as it is on the wire: Huffman-coded or not, and its octets.
type WireStr<'a> = (bool, &'a [u8]);

/// One field representation of a header block (RFC 7541, section 6), as it is on the wire.
enum Repr<'a> {
    /// An indexed field: its table index.
    Indexed(usize),
    /// A literal field: its name's table index, or 0 and the `name` that follows, and its value.
    Literal {
        index: usize,
        name: Option<WireStr<'a>>,
        value: WireStr<'a>,
    },
    /// A dynamic table size update: the new size.
    SizeUpdate(usize),
}

/// The field representation at the start of `buf` and the octets it takes; None when it is
/// incomplete.
fn hpack_repr(buf: &[u8]) -> Option<(Repr<'_>, usize)> {
    let first = *buf.first()?;
    if first & 0x80 != 0 {
        let (index, used) = hpack_int(buf, 7)?;
        return Some((Repr::Indexed(index), used));
    }
    if first & 0xe0 == 0x20 {
        let (size, used) = hpack_int(buf, 5)?;
        return Some((Repr::SizeUpdate(size), used));
    }
    // With incremental indexing (6-bit name index), or without indexing or never indexed
    // (4-bit).
    let prefix = if first & 0x40 != 0 { 6 } else { 4 };
    let (index, mut used) = hpack_int(buf, prefix)?;
    let name = if index == 0 {
        let (name, n) = hpack_str(buf.get(used..)?)?;
        used += n;
        Some(name)
    } else {
        None
    };
    let (value, n) = hpack_str(buf.get(used..)?)?;
    Some((Repr::Literal { index, name, value }, used + n))
}

/// The string at the start of `buf` (RFC 7541, 5.2) and the octets it takes.
fn hpack_str(buf: &[u8]) -> Option<(WireStr<'_>, usize)> {
    let huffman = buf.first()? & 0x80 != 0;
    let (len, used) = hpack_int(buf, 7)?;
    let end = used.checked_add(len)?;
    Some(((huffman, buf.get(used..end)?), end))
}

/// A string's octets, Huffman-decoded if they are coded. `fluke-hpack`'s decoder builds its
/// code table (hundreds of allocations) every time one is made, so each thread keeps one.
fn decoded((huffman, octets): WireStr<'_>) -> Option<Vec<u8>> {
    use std::cell::RefCell;
    if !huffman {
        return Some(octets.to_vec());
    }
    if octets == LOCALHOST_HUFFMAN {
        return Some(LOCALHOST.as_bytes().to_vec());
    }
    thread_local! {
        static DECODER: RefCell<fluke_hpack::huffman::HuffmanDecoder> =
            RefCell::new(fluke_hpack::huffman::HuffmanDecoder::new());
    }
    DECODER.with_borrow_mut(|decoder| decoder.decode(octets).ok())
}

/// The integer at the start of `buf` with an `prefix`-bit prefix (RFC 7541, 5.1), and the
/// octets it takes: at most four continuation octets, as `fluke-hpack` 0.3.1 reads them.
fn hpack_int(buf: &[u8], prefix: u8) -> Option<(usize, usize)> {
    let mask = (1u8 << prefix) - 1;
    let mut value = usize::from(buf.first()? & mask);
    if value < usize::from(mask) {
        return Some((value, 1));
    }
    for (k, &b) in buf.iter().skip(1).take(4).enumerate() {
        value += usize::from(b & 0x7f) << (7 * k);
        if b & 0x80 == 0 {
            return Some((value, k + 2));
        }
    }
    None
}

pub(crate) fn put_head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// How rewritten header blocks are encoded for the server.
enum Encoding {
    /// Literal without indexing, every field: the server's dynamic table is never written.
    Literal,
    /// Incremental indexing with a mirror of the server's dynamic table, as grpc-go encodes.
    Indexed(Table),
}

/// A header field: name, value.
type Field = (Box<[u8]>, Box<[u8]>);

#[derive(Default)]
struct Table {
    /// Newest first: entry `i` is HPACK index 62 + `i`.
    entries: VecDeque<Field>,
    size: usize,
}

impl Encoding {
    fn encode(&mut self, name: &[u8], value: &[u8], out: &mut Vec<u8>) {
        let Encoding::Indexed(table) = self else {
            return put_literal(out, 0x00, name, value);
        };
        if let Some(i) = table
            .entries
            .iter()
            .position(|(n, v)| **n == *name && **v == *value)
        {
            return put_int(out, 62 + i, 7, 0x80);
        }
        let size = name.len() + value.len() + 32;
        if size > DEFAULT_TABLE {
            return put_literal(out, 0x00, name, value);
        }
        while table.size + size > DEFAULT_TABLE {
            let Some((n, v)) = table.entries.pop_back() else {
                break;
            };
            table.size -= n.len() + v.len() + 32;
        }
        table.entries.push_front((name.into(), value.into()));
        table.size += size;
        put_literal(out, 0x40, name, value);
    }
}

/// A literal field with a literal name (`first` = 0x00: without indexing, 0x40: indexed).
pub(crate) fn put_literal(out: &mut Vec<u8>, first: u8, name: &[u8], value: &[u8]) {
    out.push(first);
    for s in [name, value] {
        put_int(out, s.len(), 7, 0x00);
        out.extend_from_slice(s);
    }
}

fn put_int(out: &mut Vec<u8>, mut value: usize, prefix: u8, first: u8) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 0x80 {
        out.push(0x80 | (value & 0x7f) as u8);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Checks `block` before `fluke-hpack` decodes it, and counts its field representations.
///
/// Every one must be complete: `fluke-hpack` 0.3.1 panics on a truncated or overlong
/// dynamic-table-size update instead of failing, so this follows its own integer rules (at most
/// four continuation octets). There may be at most [`MAX_FIELDS`] of them, so decoding one block
/// costs a bounded amount of work. No dynamic-table-size update may go above [`DEFAULT_TABLE`]
/// (the decoder refuses those too; this says why).
fn check(block: &[u8]) -> Result<usize, &'static str> {
    let mut at = 0;
    let mut fields = 0;
    while at < block.len() {
        fields += 1;
        if fields > MAX_FIELDS {
            return Err("request header block with over 100 fields");
        }
        let (field, used) = hpack_repr(&block[at..]).ok_or("malformed request header block")?;
        if let Repr::SizeUpdate(size) = field
            && size > DEFAULT_TABLE
        {
            return Err("HPACK table size update above 4096");
        }
        at += used;
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixListener;
    use tokio_stream::StreamExt;
    use tokio_stream::wrappers::UnixListenerStream;
    use tonic::codegen::http;
    use tonic::{Request, Response, Status};

    use super::*;
    use crate::pluginregistration::registration_client::RegistrationClient;
    use crate::pluginregistration::registration_server::{Registration, RegistrationServer};
    use crate::pluginregistration::{
        InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    };

    struct Plugin;

    #[tonic::async_trait]
    impl Registration for Plugin {
        async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
            Ok(Response::new(PluginInfo {
                r#type: "DevicePlugin".into(),
                name: "example.com/dev".into(),
                endpoint: String::new(),
                supported_versions: vec!["v1beta1".into()],
            }))
        }

        async fn notify_registration_status(
            &self,
            _: Request<RegistrationStatus>,
        ) -> Result<Response<RegistrationStatusResponse>, Status> {
            Ok(Response::new(RegistrationStatusResponse {}))
        }
    }

    /// What the server saw: each request's authority, and the connections accepted.
    #[derive(Default)]
    struct Seen {
        authorities: Mutex<Vec<Option<String>>>,
        connections: Mutex<usize>,
    }

    /// Serves `Plugin` on a fresh socket, its accepted streams rewritten when `rewrite`.
    fn serve(rewrite: bool) -> (tempfile::TempDir, std::path::PathBuf, Arc<Seen>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plugin.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let seen = Arc::new(Seen::default());
        let record = seen.clone();
        let layer =
            tower::util::MapRequestLayer::new(move |req: http::Request<tonic::body::Body>| {
                let authority = req.uri().authority().map(|a| a.to_string());
                record.authorities.lock().unwrap().push(authority);
                req
            });
        let count = seen.clone();
        let accepted = UnixListenerStream::new(listener).map(move |accepted| {
            *count.connections.lock().unwrap() += 1;
            accepted
        });
        let server = tonic::transport::Server::builder()
            .layer(layer)
            .add_service(RegistrationServer::new(Plugin));
        tokio::spawn(async move {
            if rewrite {
                let incoming = accepted.map(|a| a.map(|s| Rewritten::server(s, LOCALHOST)));
                server.serve_with_incoming(incoming).await
            } else {
                server.serve_with_incoming(accepted).await
            }
        });
        (dir, path, seen)
    }

    #[tokio::test]
    async fn a_plain_server_refuses_the_socket_path_as_authority() {
        let (_dir, path, seen) = serve(false);
        let channel = connect(&path, path.to_str().unwrap()).await.unwrap();
        let got = RegistrationClient::new(channel)
            .get_info(InfoRequest {})
            .await;
        let status = got.expect_err("h2 accepted the socket path as authority");
        assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
        assert!(seen.authorities.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_rewritten_server_answers_both_calls_on_one_connection() {
        let (_dir, path, seen) = serve(true);
        let channel = connect(&path, path.to_str().unwrap()).await.unwrap();
        let mut client = RegistrationClient::new(channel);
        let info = client.get_info(InfoRequest {}).await.unwrap().into_inner();
        assert_eq!(info.name, "example.com/dev");
        let status = RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        };
        client.notify_registration_status(status).await.unwrap();
        client.get_info(InfoRequest {}).await.unwrap();
        assert_eq!(
            *seen.authorities.lock().unwrap(),
            vec![Some(LOCALHOST.to_owned()); 3]
        );
        assert_eq!(*seen.connections.lock().unwrap(), 1);
    }

    #[tokio::test]
    async fn an_oversized_header_block_closes_the_connection() {
        let (_dir, path, _seen) = serve(true);
        let mut stream = UnixStream::connect(&path).await.unwrap();
        let mut input = PREFACE.to_vec();
        put_head(&mut input, 0, 0x4, 0, 0);
        let block = request_block(&mut Encoding::Literal, "/x", &"a".repeat(70_000));
        input.extend(frames(&block, 1, false));
        // The server may close before taking it all.
        let _ = stream.write_all(&input).await;
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut rest));
        let closed = read.await.expect("the connection stayed open");
        assert!(
            closed.is_ok() || closed.is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset)
        );
    }

    /// A gRPC request's header block as grpc-go would build it, with `authority`.
    fn request_block(encoding: &mut Encoding, authority: &str, padding: &str) -> Vec<u8> {
        let mut block = Vec::new();
        for (name, value) in request_headers(authority, padding) {
            encoding.encode(name.as_bytes(), value.as_bytes(), &mut block);
        }
        block
    }

    fn request_headers<'a>(authority: &'a str, padding: &'a str) -> Vec<(&'a str, &'a str)> {
        let mut headers = vec![
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/pluginregistration.Registration/GetInfo"),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("user-agent", "grpc-go/1.72.1"),
            ("te", "trailers"),
        ];
        if !padding.is_empty() {
            headers.push(("x-padding", padding));
        }
        headers
    }

    /// `block` as a HEADERS frame and CONTINUATIONs of at most 16 KiB.
    fn frames(block: &[u8], stream: u32, end_stream: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let chunks: Vec<&[u8]> = block.chunks(MAX_FRAME).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let kind = if i == 0 { HEADERS } else { CONTINUATION };
            let mut flags = if i == 0 && end_stream { END_STREAM } else { 0 };
            if i + 1 == chunks.len() {
                flags |= END_HEADERS;
            }
            put_head(&mut out, chunk.len(), kind, flags, stream);
            out.extend_from_slice(chunk);
        }
        out
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        put_head(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out
    }

    /// `input` sent by a client through a real socket to a server-side `Rewritten`: what the
    /// server reads, up to the client's EOF.
    async fn through_server(input: Vec<u8>) -> io::Result<Vec<u8>> {
        let (mut client, server) = UnixStream::pair()?;
        let mut server = Rewritten::server(server, LOCALHOST);
        let write = async move {
            let _ = client.write_all(&input).await;
            let _ = client.shutdown().await;
        };
        let read = async move {
            let mut out = Vec::new();
            server.read_to_end(&mut out).await.map(|_| out)
        };
        tokio::join!(write, read).1
    }

    struct Frame {
        kind: u8,
        flags: u8,
        stream: u32,
        payload: Vec<u8>,
    }

    fn parse(bytes: &[u8]) -> Vec<Frame> {
        let mut rest = bytes.strip_prefix(&PREFACE[..]).unwrap();
        let mut frames = Vec::new();
        while !rest.is_empty() {
            let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            frames.push(Frame {
                kind: rest[3],
                flags: rest[4],
                stream: u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]),
                payload: rest[HEAD_LEN..HEAD_LEN + len].to_vec(),
            });
            rest = &rest[HEAD_LEN + len..];
        }
        frames
    }

    fn decode(decoder: &mut Decoder<'_>, block: &[u8]) -> Vec<(String, String)> {
        let fields = decoder.decode(block).unwrap();
        let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
        fields
            .into_iter()
            .map(|(n, v)| (text(n), text(v)))
            .collect()
    }

    fn owned(headers: Vec<(&str, &str)>) -> Vec<(String, String)> {
        headers
            .into_iter()
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
            .collect()
    }

    const PATH: &str = "/var/lib/kubelet/plugins_registry/x.sock";

    #[tokio::test]
    async fn headers_with_padding_priority_and_continuation_are_rewritten() {
        let mut grpc_go = Encoding::Indexed(Table::default());
        let first = request_block(&mut grpc_go, PATH, "");
        let second = request_block(&mut grpc_go, PATH, "");
        assert!(second.iter().all(|b| b & 0x80 != 0), "not all indexed");

        let mut input = PREFACE.to_vec();
        let (a, b) = first.split_at(first.len() / 2);
        let mut padded = vec![3];
        padded.extend([0x80, 0, 0, 0, 16]);
        padded.extend(a);
        padded.extend([0; 3]);
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &padded));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        let data = frame(0x0, END_STREAM, 1, b"\0\0\0\0\0");
        input.extend(&data);
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM | PRIORITY, 3, &{
            let mut p = vec![0, 0, 0, 0, 16];
            p.extend(&second);
            p
        }));

        let frames = parse(&through_server(input).await.unwrap());
        assert_eq!(frames.len(), 3);
        let mut server = Decoder::new();
        let want = owned(request_headers(LOCALHOST, ""));
        assert_eq!(
            (frames[0].kind, frames[0].flags, frames[0].stream),
            (HEADERS, END_HEADERS, 1)
        );
        assert_eq!(decode(&mut server, &frames[0].payload), want);
        assert_eq!(
            frame(frames[1].kind, frames[1].flags, 1, &frames[1].payload),
            data
        );
        let flags = END_HEADERS | END_STREAM;
        assert_eq!(
            (frames[2].kind, frames[2].flags, frames[2].stream),
            (HEADERS, flags, 3)
        );
        assert_eq!(decode(&mut server, &frames[2].payload), want);
    }

    #[tokio::test]
    async fn a_block_over_one_frame_is_split_into_continuations() {
        let padding = "p".repeat(20_000);
        let block = request_block(&mut Encoding::Indexed(Table::default()), PATH, &padding);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_STREAM, 5, &block[..100]));
        input.extend(frame(CONTINUATION, 0, 5, &block[100..200]));
        input.extend(frame(CONTINUATION, END_HEADERS, 5, &block[200..]));

        let frames = parse(&through_server(input).await.unwrap());
        let heads: Vec<_> = frames.iter().map(|f| (f.kind, f.flags, f.stream)).collect();
        let cont = (CONTINUATION, END_HEADERS, 5);
        assert_eq!(heads, [(HEADERS, END_STREAM, 5), cont]);
        assert_eq!(frames[0].payload.len(), MAX_FRAME);
        let block: Vec<u8> = frames.iter().flat_map(|f| f.payload.clone()).collect();
        let got = decode(&mut Decoder::new(), &block);
        assert_eq!(got, owned(request_headers(LOCALHOST, &padding)));
    }

    #[tokio::test]
    async fn a_request_without_authority_stays_without() {
        let mut block = Vec::new();
        put_literal(&mut block, 0x40, b":method", b"POST");
        put_literal(&mut block, 0x40, b":path", b"/x");
        let mut input = PREFACE.to_vec();
        input.extend(frames(&block, 1, false));
        let frames = parse(&through_server(input).await.unwrap());
        let got = decode(&mut Decoder::new(), &frames[0].payload);
        assert_eq!(got, owned(vec![(":method", "POST"), (":path", "/x")]));
    }

    #[tokio::test]
    async fn a_table_size_update_is_consumed() {
        let mut block = Vec::new();
        put_int(&mut block, 0, 5, 0x20);
        put_int(&mut block, 100, 5, 0x20);
        put_literal(&mut block, 0x40, b":authority", PATH.as_bytes());
        let mut input = PREFACE.to_vec();
        input.extend(frames(&block, 1, false));
        let mut second = Vec::new();
        put_int(&mut second, 62, 7, 0x80);
        input.extend(frames(&second, 3, false));
        let frames = parse(&through_server(input).await.unwrap());
        let want = owned(vec![(":authority", LOCALHOST)]);
        for frame in &frames {
            assert_eq!(frame.payload[0], 0x00);
            assert_eq!(decode(&mut Decoder::new(), &frame.payload), want);
        }
    }

    #[tokio::test]
    async fn other_frames_pass_byte_identical() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 4, 0, 1, 0, 0, 0, 3, 0, 0, 0, 100]));
        input.extend(frame(0x4, 0x1, 0, &[]));
        input.extend(frame(0x8, 0, 0, &[0, 1, 0, 0]));
        input.extend(frame(0x6, 0, 0, b"12345678"));
        input.extend(frame(0x0, PADDED, 1, &[2, 1, 2, 3, 0, 0]));
        input.extend(frame(0x0, END_STREAM, 1, &[]));
        input.extend(frame(0x0, 0, 7, &vec![0xab; 100_000]));
        input.extend(frame(0x3, 0, 1, &[0, 0, 0, 8]));
        input.extend(frame(0xfa, 0xff, 9, b"unknown"));
        input.extend(frame(0x7, 0, 0, &[0, 0, 0, 1, 0, 0, 0, 0]));
        assert_eq!(through_server(input.clone()).await.unwrap(), input);
    }

    #[test]
    fn input_split_anywhere_gives_the_same_output() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 4, 0, 1, 0, 0]));
        let block = request_block(&mut Encoding::Indexed(Table::default()), PATH, "");
        input.extend(frame(HEADERS, PADDED, 1, &{
            let mut p = vec![1];
            p.extend(&block[..10]);
            p.push(0);
            p
        }));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, &block[10..]));
        input.extend(frame(0x0, END_STREAM, 1, b"hello"));

        let mut whole = Vec::new();
        Rewriter::new(b"localhost", Encoding::Literal)
            .feed(&input, &mut whole)
            .unwrap();
        let mut bytewise = Vec::new();
        let mut rewriter = Rewriter::new(b"localhost", Encoding::Literal);
        for byte in &input {
            rewriter
                .feed(std::slice::from_ref(byte), &mut bytewise)
                .unwrap();
        }
        assert_eq!(whole, bytewise);
        assert_eq!(parse(&whole).len(), 3);
    }

    /// The kubelet's device manager sends `localhost`: its connections are passed through byte
    /// for byte, whatever comes after. One that starts with the socket's path is rewritten.
    #[tokio::test]
    async fn a_connection_whose_first_request_needs_nothing_is_passed_through() {
        let mut grpc_go = Encoding::Indexed(Table::default());
        let mut input = PREFACE.to_vec();
        input.extend(frames(
            &request_block(&mut grpc_go, LOCALHOST, ""),
            1,
            false,
        ));
        input.extend(frame(0x0, END_STREAM, 1, b"hello"));
        input.extend(frames(&request_block(&mut grpc_go, PATH, ""), 3, true));
        assert_eq!(through_server(input.clone()).await.unwrap(), input);

        let mut grpc_go = Encoding::Indexed(Table::default());
        let mut input = PREFACE.to_vec();
        input.extend(frames(&request_block(&mut grpc_go, PATH, ""), 1, true));
        let out = through_server(input.clone()).await.unwrap();
        assert_ne!(out, input);
        let frames = parse(&out);
        let block: Vec<u8> = frames.iter().flat_map(|f| f.payload.clone()).collect();
        let fields = decode(&mut Decoder::new(), &block);
        assert!(
            fields.contains(&(":authority".to_string(), LOCALHOST.to_string())),
            "{fields:?}"
        );
    }

    /// RFC 7541's own examples (appendix C.4): requests whose strings are Huffman-coded.
    #[test]
    fn the_first_authority_is_read_without_the_decoder() {
        // C.4.1: `:authority: www.example.com`, a literal with the static table's name.
        let first = hex("828684418cf1e3c2e5f23a6ba0ab90f4ff");
        assert_eq!(
            first_authority(&first),
            Some(Some(b"www.example.com".to_vec()))
        );
        // It agrees with the decoder.
        let fields = decode(&mut Decoder::new(), &first);
        assert!(fields.contains(&(":authority".into(), "www.example.com".into())));
        // C.4.2, the next request on that connection, refers to the dynamic table (`be`): the
        // whole decoder is needed.
        assert_eq!(first_authority(&hex("828684be5886a8eb10649cbf")), None);
        // None sent; or the static table's entry, which has an empty value.
        assert_eq!(first_authority(&hex("828684")), Some(None));
        assert_eq!(first_authority(&hex("8281")), Some(Some(Vec::new())));
        // A literal name, Huffman-coded (the code of appendix B, as the decoder reads it), with
        // a raw value, and a size update before it.
        let name = huffman(":authority");
        assert_eq!(name, AUTHORITY_HUFFMAN);
        assert_eq!(huffman(LOCALHOST), LOCALHOST_HUFFMAN);
        // What grpc-go sends: `localhost`, Huffman-coded, with the static table's name.
        let mut block = vec![0x82, 0x41, 0x80 | LOCALHOST_HUFFMAN.len() as u8];
        block.extend(LOCALHOST_HUFFMAN);
        assert_eq!(first_authority(&block), Some(Some(LOCALHOST.into())));
        let mut block = vec![0x20, 0x00, 0x80 | name.len() as u8];
        block.extend(&name);
        put_int(&mut block, LOCALHOST.len(), 7, 0x00);
        block.extend(LOCALHOST.as_bytes());
        assert_eq!(first_authority(&block), Some(Some(LOCALHOST.into())));
        // A Huffman string that does not decode: the decoder decides (and refuses it).
        assert_eq!(first_authority(&hex("4182ffff")), None);
        // So does a size update after a field, or at the end, and a block larger than real
        // requests'.
        assert_eq!(first_authority(&hex("8220")), None);
        assert_eq!(first_authority(&hex("20")), None);
        let mut large = hex("828684");
        large.resize(SCANNED_BLOCK + 1, 0x82);
        assert_eq!(first_authority(&large), None);
        large.truncate(SCANNED_BLOCK);
        assert_eq!(first_authority(&large), Some(None));
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// HPACK's Huffman code of `s` (RFC 7541, appendix B), for the few characters the tests
    /// use; checked against `fluke-hpack`'s decoder.
    fn huffman(s: &str) -> Vec<u8> {
        let code = |c| match c {
            ':' => (0b1011100, 7),
            'a' => (0b00011, 5),
            'u' => (0b101101, 6),
            't' => (0b01001, 5),
            'h' => (0b100111, 6),
            'o' => (0b00111, 5),
            'r' => (0b101100, 6),
            'i' => (0b00110, 5),
            'y' => (0b1111010, 7),
            'c' => (0b00100, 5),
            'l' => (0b101000, 6),
            's' => (0b01000, 5),
            _ => panic!("no code for {c:?} here"),
        };
        let (mut bits, mut len, mut out) = (0u64, 0, Vec::new());
        for c in s.chars() {
            let (code, n) = code(c);
            bits = (bits << n) | code;
            len += n;
            while len >= 8 {
                len -= 8;
                out.push((bits >> len) as u8);
            }
        }
        if len > 0 {
            // Padded with the most significant bits of EOS (all ones).
            out.push(((bits << (8 - len)) as u8) | (0xff >> len));
        }
        let decoded = fluke_hpack::huffman::HuffmanDecoder::new().decode(&out);
        assert_eq!(
            decoded.as_deref(),
            Ok(s.as_bytes()),
            "the code table above is wrong"
        );
        out
    }

    async fn refused_kind(input: Vec<u8>) -> io::ErrorKind {
        through_server(input).await.unwrap_err().kind()
    }

    #[tokio::test]
    async fn a_block_over_the_limit_is_refused() {
        let block = request_block(&mut Encoding::Literal, PATH, &"a".repeat(70_000));
        let mut input = PREFACE.to_vec();
        input.extend(frames(&block, 1, false));
        assert_eq!(refused_kind(input).await, io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn a_header_list_over_the_limit_is_refused() {
        let mut grpc_go = Encoding::Indexed(Table::default());
        let mut block = Vec::new();
        grpc_go.encode(b"x-big", &[b'a'; 3000], &mut block);
        for _ in 0..30 {
            grpc_go.encode(b"x-big", &[b'a'; 3000], &mut block);
        }
        let mut input = PREFACE.to_vec();
        input.extend(frames(&block, 1, false));
        assert_eq!(refused_kind(input).await, io::ErrorKind::InvalidData);
    }

    /// A block that puts a 4037-byte entry (`x-big`: 4000 `a`s) in the dynamic table, as large
    /// as a 4096-byte table takes.
    fn big_entry() -> Vec<u8> {
        let mut block = Vec::new();
        put_literal(&mut block, 0x40, b"x-big", &[b'a'; 4000]);
        block
    }

    /// A block of one field: `:authority` = the socket's path, as a literal the table keeps not.
    fn path_authority() -> Vec<u8> {
        let mut block = Vec::new();
        put_literal(&mut block, 0x00, b":authority", PATH.as_bytes());
        block
    }

    /// A block of `n` references to the newest dynamic-table entry: one octet each.
    fn references(n: usize) -> Vec<u8> {
        vec![0x80 | 62; n]
    }

    fn rewritten(blocks: &[Vec<u8>]) -> io::Result<Vec<u8>> {
        let mut input = PREFACE.to_vec();
        for (i, block) in blocks.iter().enumerate() {
            input.extend(frames(block, 2 * i as u32 + 1, false));
        }
        let (mut all, mut out) = (Vec::new(), Vec::new());
        let mut rewriter = Rewriter::new(LOCALHOST.as_bytes(), Encoding::Literal);
        let mut at = 0;
        while at < input.len() {
            rewriter.decoded = 0;
            at += rewriter.feed(&input[at..], &mut out)?;
            all.append(&mut out);
        }
        Ok(all)
    }

    #[test]
    fn a_block_referencing_a_large_entry_many_times_is_bounded() {
        // 16 references: 64 592 bytes of header list, just under MAX_LIST, out of 16 octets.
        let out = rewritten(&[big_entry(), references(16)]).unwrap();
        let frames = parse(&out);
        let block: Vec<u8> = frames[1..].iter().flat_map(|f| f.payload.clone()).collect();
        assert!(block.len() <= MAX_LIST);
        assert_eq!(decode(&mut Decoder::new(), &block).len(), 16);
        // 17 are over it.
        let err = rewritten(&[big_entry(), references(17)]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("header list"), "{err}");
    }

    #[test]
    fn a_table_size_update_above_the_default_is_refused() {
        let update = |size| {
            let mut block = Vec::new();
            put_int(&mut block, size, 5, 0x20);
            block.push(0x82);
            block
        };
        rewritten(&[update(DEFAULT_TABLE)]).unwrap();
        let err = rewritten(&[update(DEFAULT_TABLE + 1)]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("table size"), "{err}");
        // The decoder refuses it too, should a block get past `check`.
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(DEFAULT_TABLE);
        assert!(decoder.decode(&update(DEFAULT_TABLE + 1)).is_err());
    }

    #[test]
    fn a_block_with_too_many_fields_is_refused() {
        rewritten(&[vec![0x82; MAX_FIELDS]]).unwrap();
        let err = rewritten(&[vec![0x82; MAX_FIELDS + 1]]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("fields"), "{err}");
        // Size updates count: they cost decoding work too.
        let mut updates = vec![0x20; MAX_FIELDS];
        updates.push(0x82);
        assert!(rewritten(&[updates]).is_err());
    }

    /// The most amplifying input there is: each 25-byte frame expands to a 64 KiB block.
    fn hostile_input(blocks: usize) -> Vec<u8> {
        let mut input = PREFACE.to_vec();
        // The socket's path first, as the plugin watcher sends it: the server side rewrites the
        // connection from then on (one that needs nothing is passed through untouched).
        input.extend(frames(&path_authority(), 1, false));
        input.extend(frames(&big_entry(), 1, false));
        for i in 0..blocks {
            input.extend(frames(&references(16), 2 * i as u32 + 3, false));
        }
        input
    }

    #[test]
    fn output_held_stays_bounded_whatever_the_input() {
        let blocks = 300;
        let input = hostile_input(blocks);
        let mut rewriter = Rewriter::new(LOCALHOST.as_bytes(), Encoding::Literal);
        let mut out = Vec::new();
        let (mut at, mut feeds, mut total) = (0, 0, 0);
        while at < input.len() {
            rewriter.decoded = 0;
            at += rewriter.feed(&input[at..], &mut out).unwrap();
            assert!(out.len() <= MAX_OUT, "{} bytes held", out.len());
            total += out.len();
            out.clear();
            feeds += 1;
        }
        assert!(feeds > blocks / 2, "{feeds} feeds took it all");
        assert!(total > blocks * 64_000, "{total} bytes out");
    }

    #[tokio::test]
    async fn a_server_side_read_holds_a_bounded_output() {
        let blocks = 300;
        let input = hostile_input(blocks);
        let (mut client, server) = UnixStream::pair().unwrap();
        let mut server = Rewritten::server(server, LOCALHOST);
        let write = tokio::spawn(async move {
            client.write_all(&input).await.unwrap();
            client.shutdown().await.unwrap();
        });
        let mut buf = vec![0; 4096];
        let mut total = 0;
        loop {
            let n = server.read(&mut buf).await.unwrap();
            assert!(
                server.out.len() <= MAX_OUT,
                "{} bytes held",
                server.out.len()
            );
            if n == 0 {
                break;
            }
            total += n;
        }
        write.await.unwrap();
        assert!(total > blocks * 64_000, "{total} bytes read");
    }

    #[tokio::test]
    async fn the_server_side_yields_between_decoding_budgets() {
        // Blocks of MAX_FIELDS Huffman-coded literals: the costliest to decode per byte.
        let block: Vec<u8> = [0x00, 0x81, 0x07, 0x81, 0x07].repeat(MAX_FIELDS);
        let mut blocks = vec![path_authority()];
        blocks.extend(vec![block; 8]);
        let want = rewritten(&blocks).unwrap();
        let mut input = PREFACE.to_vec();
        for (i, block) in blocks.iter().enumerate() {
            input.extend(frames(block, 2 * i as u32 + 1, false));
        }
        let (mut client, server) = UnixStream::pair().unwrap();
        client.write_all(&input).await.unwrap();
        client.shutdown().await.unwrap();
        let mut server = Rewritten::server(server, LOCALHOST);
        let (mut got, mut yields) = (Vec::new(), 0);
        let mut buf = vec![0; 1 << 16];
        loop {
            let n = std::future::poll_fn(|cx| {
                let mut read = ReadBuf::new(&mut buf);
                match Pin::new(&mut server).poll_read(cx, &mut read) {
                    Poll::Ready(done) => Poll::Ready(done.map(|()| read.filled().len())),
                    Poll::Pending => {
                        // With input left over, only a yield returns Pending.
                        yields += usize::from(server.raw_at < server.raw_len);
                        Poll::Pending
                    }
                }
            })
            .await
            .unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, want);
        assert!(yields >= blocks.len() - 2, "{yields} yields");
    }

    #[tokio::test]
    async fn malformed_input_is_refused_without_panicking() {
        let mut bad_preface = PREFACE.to_vec();
        bad_preface[0] = b'G';
        let mut cases = vec![bad_preface];
        for block in [
            &[0x3f][..],
            &[0x3f, 0xff, 0xff, 0xff, 0xff, 0x01],
            &[0x40, 5, b'a'],
        ] {
            let mut input = PREFACE.to_vec();
            input.extend(frames(block, 1, false));
            cases.push(input);
        }
        let mut orphan = PREFACE.to_vec();
        orphan.extend(frame(CONTINUATION, END_HEADERS, 1, &[0x82]));
        cases.push(orphan);
        let mut interleaved = PREFACE.to_vec();
        interleaved.extend(frame(HEADERS, 0, 1, &[0x82]));
        interleaved.extend(frame(0x8, 0, 0, &[0, 1, 0, 0]));
        cases.push(interleaved);
        let mut overpadded = PREFACE.to_vec();
        overpadded.extend(frame(HEADERS, PADDED | END_HEADERS, 1, &[5, 0x82]));
        cases.push(overpadded);
        for input in cases {
            assert_eq!(refused_kind(input).await, io::ErrorKind::InvalidData);
        }
    }

    #[tokio::test]
    async fn the_server_side_writes_only_what_the_server_writes() {
        let (mut client, server) = UnixStream::pair().unwrap();
        let mut server = Rewritten::server(server, LOCALHOST);
        let mut input = PREFACE.to_vec();
        input.extend(frames(
            &request_block(&mut Encoding::Literal, PATH, ""),
            1,
            true,
        ));
        client.write_all(&input).await.unwrap();
        let mut start = [0; 4];
        server.read_exact(&mut start).await.unwrap();
        server.write_all(b"reply").await.unwrap();
        server.flush().await.unwrap();
        server.shutdown().await.unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"reply");
    }

    #[tokio::test]
    async fn the_client_side_rewrites_what_it_writes() {
        let (client, mut server) = UnixStream::pair().unwrap();
        let mut client = Rewritten::client(client, PATH);
        let mut input = PREFACE.to_vec();
        input.extend(frames(
            &request_block(&mut Encoding::Literal, LOCALHOST, ""),
            1,
            true,
        ));
        input.extend(frames(
            &request_block(&mut Encoding::Literal, LOCALHOST, ""),
            3,
            true,
        ));
        client.write_all(&input).await.unwrap();
        client.shutdown().await.unwrap();
        let mut out = Vec::new();
        server.read_to_end(&mut out).await.unwrap();

        let frames = parse(&out);
        assert_eq!(frames.len(), 2);
        assert!(
            frames[1].payload.iter().all(|b| b & 0x80 != 0),
            "not all indexed"
        );
        let mut decoder = Decoder::new();
        for frame in &frames {
            assert_eq!(frame.flags, END_HEADERS | END_STREAM);
            let got = decode(&mut decoder, &frame.payload);
            assert_eq!(got, owned(request_headers(PATH, "")));
        }
    }
}
