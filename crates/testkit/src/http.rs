//! A small HTTP/1.1 client for the tests: one connection to a server's TCP address or a daemon's
//! Unix socket ([`Conn`]), requests with an optional bearer token and a [`Body`] sent whole or
//! chunk by chunk. Start at [`Conn::tcp`].

use std::path::Path;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// What a request carries.
pub enum Body {
    Empty,
    /// Sent as `application/json`.
    Json(serde_json::Value),
    /// Raw bytes, no content type.
    Bytes(Vec<u8>),
    /// Raw bytes sent as `application/octet-stream`.
    Octets(Vec<u8>),
    /// Sent chunk by chunk, never whole.
    Chunks(Box<dyn Iterator<Item = Bytes> + Send>),
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Body::Empty => f.write_str("Empty"),
            Body::Json(v) => f.debug_tuple("Json").field(v).finish(),
            Body::Bytes(b) => f.debug_tuple("Bytes").field(&b.len()).finish(),
            Body::Octets(b) => f.debug_tuple("Octets").field(&b.len()).finish(),
            Body::Chunks(_) => f.write_str("Chunks(..)"),
        }
    }
}

impl Body {
    /// These bytes, sent as `application/octet-stream`.
    pub fn octet_stream(self) -> Body {
        match self {
            Body::Bytes(b) => Body::Octets(b),
            other => other,
        }
    }

    /// The content type it is sent with, and the body itself.
    fn into_parts(self) -> (Option<&'static str>, UnsyncBoxBody<Bytes, std::io::Error>) {
        let whole = |bytes: Vec<u8>| Full::new(Bytes::from(bytes)).map_err(|e| match e {}).boxed_unsync();
        match self {
            Body::Empty => (None, whole(Vec::new())),
            Body::Json(v) => {
                let bytes = serde_json::to_vec(&v).unwrap_or_else(|e| panic!("cannot serialise {v}: {e}"));
                (Some("application/json"), whole(bytes))
            }
            Body::Bytes(b) => (None, whole(b)),
            Body::Octets(b) => (Some("application/octet-stream"), whole(b)),
            Body::Chunks(it) => {
                let stream = futures_util::stream::iter(it.map(|b| Ok::<_, std::io::Error>(Frame::data(b))));
                (None, StreamBody::new(stream).boxed_unsync())
            }
        }
    }
}

/// One HTTP/1.1 connection; requests on it go one after another.
pub struct Conn {
    sender: http1::SendRequest<UnsyncBoxBody<Bytes, std::io::Error>>,
    /// The `host` header of its requests.
    host: &'static str,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("host", &self.host).finish_non_exhaustive()
    }
}

impl Conn {
    /// Connects to `addr` (`host:port`); fails the test when it cannot.
    pub async fn tcp(addr: &str, host: &'static str) -> Conn {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        Conn::over(stream, host).await
    }

    /// Connects to the Unix socket `socket`; fails the test when it cannot.
    pub async fn unix(socket: &Path, host: &'static str) -> Conn {
        let stream = tokio::net::UnixStream::connect(socket)
            .await
            .unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
        Conn::over(stream, host).await
    }

    async fn over<S>(stream: S, host: &'static str) -> Conn
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let (sender, conn) =
            http1::handshake(TokioIo::new(stream)).await.unwrap_or_else(|e| panic!("HTTP handshake: {e}"));
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { sender, host }
    }

    /// Sends one request once the connection is free, with `Authorization: Bearer <token>` when
    /// given; answers the response with its body still to read.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Body,
    ) -> hyper::Result<Response<Incoming>> {
        let mut req = Request::builder().method(method).uri(path).header("host", self.host);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let (content_type, body) = body.into_parts();
        if let Some(c) = content_type {
            req = req.header("content-type", c);
        }
        let req = req.body(body).unwrap_or_else(|e| panic!("a bad request {method} {path}: {e}"));
        self.sender.ready().await?;
        self.sender.send_request(req).await
    }
}
