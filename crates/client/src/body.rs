//! Bodies that are never held whole: [`UploadBody`] going out, [`ByteStream`] and
//! [`NdjsonStream`] (events parsed line by line as bytes arrive) coming in.

use std::fmt;
use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Stream, TryStreamExt};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Body, Frame, Incoming};
use tokio::io::AsyncRead;

use crate::error::ClientError;

/// The body of every request: a JSON document, bytes, or a stream of bytes sent as it is read.
pub(crate) type RequestBody = UnsyncBoxBody<Bytes, io::Error>;

/// What a file or archive upload sends: bytes already in memory, or a stream of bytes that is
/// sent as it is produced (chunked), so a large file is never held whole.
pub struct UploadBody(pub(crate) RequestBody, pub(crate) Option<Bytes>);

impl UploadBody {
    /// Bytes read from `stream` and sent as they come; an error ends the upload (the server sees
    /// a broken body and writes nothing).
    pub fn from_stream<S>(stream: S) -> Self
    where
        S: Stream<Item = io::Result<Bytes>> + Send + 'static,
    {
        UploadBody(StreamBody::new(stream.map_ok(Frame::data)).boxed_unsync(), None)
    }

    /// An empty upload.
    pub fn empty() -> Self {
        UploadBody(Empty::new().map_err(|never| match never {}).boxed_unsync(), Some(Bytes::new()))
    }
}

impl fmt::Debug for UploadBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UploadBody").field("size_hint", &self.0.size_hint()).finish()
    }
}

impl From<Bytes> for UploadBody {
    fn from(bytes: Bytes) -> Self {
        UploadBody(full(bytes.clone()), Some(bytes))
    }
}

impl From<Vec<u8>> for UploadBody {
    fn from(bytes: Vec<u8>) -> Self {
        Bytes::from(bytes).into()
    }
}

impl From<String> for UploadBody {
    fn from(text: String) -> Self {
        Bytes::from(text).into()
    }
}

impl From<&'static [u8]> for UploadBody {
    fn from(bytes: &'static [u8]) -> Self {
        Bytes::from_static(bytes).into()
    }
}

impl From<&'static str> for UploadBody {
    fn from(text: &'static str) -> Self {
        Bytes::from_static(text.as_bytes()).into()
    }
}

/// A body of bytes known in advance (a JSON document), sent with its length.
pub(crate) fn full(bytes: Bytes) -> RequestBody {
    Full::new(bytes).map_err(|never| match never {}).boxed_unsync()
}

pub(crate) fn empty() -> RequestBody {
    UploadBody::empty().0
}

/// The body of an answer as a stream of byte chunks, read as the server sends them (a file, an
/// archive). Dropping it closes the connection.
pub struct ByteStream {
    body: Incoming,
    call: String,
}

impl ByteStream {
    pub(crate) fn new(body: Incoming, call: String) -> Self {
        ByteStream { body, call }
    }

    /// The stream as an [`AsyncRead`], for `tokio::io::copy` and friends; errors become
    /// `io::Error`s whose source is the [`ClientError`].
    pub fn into_async_read(self) -> impl AsyncRead + Send + Unpin {
        StreamRead { stream: self, chunk: Bytes::new() }
    }

    /// Every remaining byte, in memory.
    pub async fn collect(mut self) -> Result<Bytes, ClientError> {
        use futures_util::StreamExt;
        let mut all = BytesMut::new();
        while let Some(chunk) = self.next().await {
            all.extend_from_slice(&chunk?);
        }
        Ok(all.freeze())
    }
}

impl fmt::Debug for ByteStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ByteStream").field("call", &self.call).finish_non_exhaustive()
    }
}

impl Stream for ByteStream {
    type Item = Result<Bytes, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if data.is_empty() => continue,
                    Ok(data) => return Poll::Ready(Some(Ok(data))),
                    // Trailers carry nothing for us.
                    Err(_) => continue,
                },
                Some(Err(source)) => {
                    return Poll::Ready(Some(Err(ClientError::Body { call: this.call.clone(), source })));
                }
                None => return Poll::Ready(None),
            }
        }
    }
}

/// An [`AsyncRead`] over a [`ByteStream`], holding at most one chunk.
struct StreamRead {
    stream: ByteStream,
    chunk: Bytes,
}

impl AsyncRead for StreamRead {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        while this.chunk.is_empty() {
            match ready!(Pin::new(&mut this.stream).poll_next(cx)) {
                Some(Ok(chunk)) => this.chunk = chunk,
                Some(Err(err)) => return Poll::Ready(Err(io::Error::other(err))),
                None => return Poll::Ready(Ok(())),
            }
        }
        let n = this.chunk.len().min(buf.remaining());
        buf.put_slice(&this.chunk[..n]);
        this.chunk.advance(n);
        Poll::Ready(Ok(()))
    }
}

/// The longest NDJSON line accepted. Events carry output in chunks far smaller than this; a
/// longer line means something is wrong, and holding it would only grow memory.
pub const MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// Turns one line into an item, or `None` for a line to skip (a keep-alive).
type Decode<T> = fn(&[u8]) -> Result<Option<T>, serde_json::Error>;

/// An NDJSON answer parsed line by line as its bytes arrive: never more than one partial line
/// is held. Keep-alive events are consumed here and never yielded. Dropping the stream closes
/// the connection (for an exec, the daemon then kills the command).
pub struct NdjsonStream<T> {
    body: Incoming,
    call: String,
    /// Bytes received and not yet yielded: at most one partial line once complete lines are cut.
    buf: BytesMut,
    /// How much of `buf` is known to hold no newline, so a long line is scanned once.
    scanned: usize,
    decode: Decode<T>,
    done: bool,
    _item: PhantomData<fn() -> T>,
}

impl<T> NdjsonStream<T> {
    pub(crate) fn new(body: Incoming, call: String, decode: Decode<T>) -> Self {
        NdjsonStream { body, call, buf: BytesMut::new(), scanned: 0, decode, done: false, _item: PhantomData }
    }

    /// Cuts the next complete line off `buf`, if there is one.
    fn next_line(&mut self) -> Option<Bytes> {
        let newline = self.buf[self.scanned..].iter().position(|b| *b == b'\n');
        match newline {
            Some(at) => {
                let line = self.buf.split_to(self.scanned + at + 1).freeze();
                self.scanned = 0;
                Some(line)
            }
            None => {
                self.scanned = self.buf.len();
                None
            }
        }
    }

    /// The item of one line, `None` for blank lines and skipped events.
    fn item(&mut self, line: &[u8]) -> Option<Result<T, ClientError>> {
        if line.iter().all(u8::is_ascii_whitespace) {
            return None;
        }
        match (self.decode)(line) {
            Ok(item) => item.map(Ok),
            Err(source) => {
                self.done = true;
                Some(Err(ClientError::Decode { call: self.call.clone(), source }))
            }
        }
    }
}

impl<T> Stream for NdjsonStream<T> {
    type Item = Result<T, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(line) = this.next_line() {
                match this.item(&line) {
                    Some(item) => return Poll::Ready(Some(item)),
                    None => continue,
                }
            }
            if this.buf.len() > MAX_LINE_BYTES {
                this.done = true;
                return Poll::Ready(Some(Err(ClientError::LineTooLong {
                    call: this.call.clone(),
                    limit: MAX_LINE_BYTES,
                })));
            }
            match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        this.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(source)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(ClientError::Body { call: this.call.clone(), source })));
                }
                None => {
                    // The last line may lack its newline.
                    this.done = true;
                    let rest = std::mem::take(&mut this.buf).freeze();
                    if let Some(item) = this.item(&rest) {
                        return Poll::Ready(Some(item));
                    }
                }
            }
        }
    }
}

impl<T> fmt::Debug for NdjsonStream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NdjsonStream")
            .field("call", &self.call)
            .field("buffered", &self.buf.len())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}
