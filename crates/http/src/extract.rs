//! Request extractors that answer bad input with the wire error body: JSON bodies and query
//! strings become typed requests that refuse unknown fields, naming them.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use sandman_wire::ErrorCode;
use serde::de::DeserializeOwned;

/// Largest JSON body accepted (exec stdin travels in it).
pub const MAX_JSON_BODY: usize = 16 << 20;

/// Longest wait for the next piece of a request body: a client that stops sending midway is
/// answered `408` and its connection freed, rather than held for as long as it likes.
pub const BODY_STALL: Duration = Duration::from_secs(30);

/// Why a request could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadRequest {
    TooLarge {
        limit: u64,
    },
    /// No piece of the body came for [`BODY_STALL`].
    Stalled,
    Invalid(String),
}

impl std::fmt::Display for BadRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadRequest::TooLarge { limit } => write!(f, "request body is larger than the limit of {limit} bytes"),
            BadRequest::Stalled => {
                write!(f, "the request body stalled: nothing came for {} s", BODY_STALL.as_secs())
            }
            BadRequest::Invalid(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for BadRequest {}

impl BadRequest {
    pub fn code(&self) -> ErrorCode {
        match self {
            BadRequest::TooLarge { .. } => ErrorCode::TooLarge,
            BadRequest::Stalled => ErrorCode::Timeout,
            BadRequest::Invalid(_) => ErrorCode::InvalidArgument,
        }
    }
}

/// The error a body stream ends with when it stalls (see [`unstalled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyStalled;

impl std::fmt::Display for BodyStalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body stalled: nothing came for {} s", BODY_STALL.as_secs())
    }
}

impl std::error::Error for BodyStalled {}

/// The body's data, ending with a [`BodyStalled`] error when no piece comes for [`BODY_STALL`].
pub fn unstalled(body: Body) -> impl Stream<Item = Result<Bytes, axum::Error>> + Send + Unpin {
    Box::pin(futures_util::stream::unfold(Some(body.into_data_stream()), |state| async move {
        let mut data = state?;
        match tokio::time::timeout(BODY_STALL, data.next()).await {
            Ok(Some(item)) => Some((item, Some(data))),
            Ok(None) => None,
            Err(_) => Some((Err(axum::Error::new(BodyStalled)), None)),
        }
    }))
}

/// True when a body error is a stall, found by walking `source()`.
pub fn is_stalled(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.is::<BodyStalled>() {
            return true;
        }
        cur = e.source();
    }
    false
}

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        crate::error_response(self.code(), self.to_string(), None)
    }
}

/// A JSON body parsed with the wire errors.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = BadRequest;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_limited(req.into_body(), MAX_JSON_BODY).await?;
        if bytes.is_empty() {
            return Err(BadRequest::Invalid("request body must be a JSON object".into()));
        }
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let value = serde_path_to_error::deserialize(&mut de)
            .map_err(|e| BadRequest::Invalid(format!("invalid JSON body: {}", named(e.path(), e.inner()))))?;
        de.end().map_err(|e| BadRequest::Invalid(format!("invalid JSON body: {e}")))?;
        Ok(ApiJson(value))
    }
}

/// A parse error with the field it is about in front (`lease_s: invalid value: …`), where the
/// error is about one.
fn named(path: &serde_path_to_error::Path, err: &dyn std::fmt::Display) -> String {
    let path = path.to_string();
    if path.is_empty() || path == "." { err.to_string() } else { format!("{path}: {err}") }
}

/// Reads a whole body, refusing it past `limit` bytes or when it stalls.
pub async fn read_limited(body: Body, limit: usize) -> Result<Bytes, BadRequest> {
    // Read up to the limit even when the length says it is over: answering before the body
    // is taken would cut off a client still sending it, which then never sees the answer.
    let too_large = BadRequest::TooLarge { limit: limit as u64 };
    let mut chunks = unstalled(body);
    let mut whole = bytes::BytesMut::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|err| {
            if is_stalled(&err) {
                BadRequest::Stalled
            } else if is_length_limit(&err) {
                too_large.clone()
            } else {
                BadRequest::Invalid(format!("cannot read request body: {err}"))
            }
        })?;
        if whole.len().saturating_add(chunk.len()) > limit {
            drain(chunks, limit).await;
            return Err(too_large);
        }
        whole.extend_from_slice(&chunk);
    }
    Ok(whole.freeze())
}

/// Reads and drops what is left of a refused body, up to `most` bytes more, so that a client
/// sending a body a little over the limit has sent it all and reads the answer: one cut off
/// mid-send (the connection closed under it) sees a broken pipe, not the 413. Past `most` it
/// stops, and the connection is closed on the rest: the work a refused body costs is bounded.
async fn drain(mut chunks: impl Stream<Item = Result<Bytes, axum::Error>> + Unpin, most: usize) {
    let mut dropped = 0usize;
    while dropped <= most {
        match chunks.next().await {
            Some(Ok(chunk)) => dropped = dropped.saturating_add(chunk.len()),
            _ => return,
        }
    }
}

/// True when a body error was caused by a length limit, found by walking `source()`.
pub fn is_length_limit(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// A query string parsed into `T`, refusing unknown parameters with a wire error.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = BadRequest;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or_default();
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(ApiQuery)
            .map_err(|e| BadRequest::Invalid(format!("invalid query string: {}", named(e.path(), e.inner()))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::routing::post;
    use tower::ServiceExt;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Req {
        a: u32,
    }

    async fn call(body: &'static [u8], query: &str) -> (u16, String) {
        let app: Router =
            Router::new().route("/", post(|ApiQuery(_q): ApiQuery<Req>, ApiJson(_r): ApiJson<Req>| async { "ok" }));
        let req = axum::http::Request::post(format!("/?{query}")).body(Body::from(body)).unwrap_or_default();
        let resp = app.oneshot(req).await.unwrap_or_else(|e| match e {});
        let status = resp.status().as_u16();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap_or_default();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_is_refused_with_408() {
        let first = futures_util::stream::once(async { Ok::<_, std::io::Error>(Bytes::from_static(b"{\"a\":")) });
        let body = Body::from_stream(first.chain(futures_util::stream::pending()));
        assert_eq!(read_limited(body, 1 << 10).await, Err(BadRequest::Stalled));
        assert_eq!(BadRequest::Stalled.code().http_status(), 408);
        let whole = read_limited(Body::from("{}"), 1 << 10).await;
        assert_eq!(whole.ok().as_deref(), Some(&b"{}"[..]));
        assert!(matches!(read_limited(Body::from("{}"), 1).await, Err(BadRequest::TooLarge { limit: 1 })));
    }

    /// A body of `n` chunks of 1 KiB, counting the chunks read.
    fn counted(n: usize) -> (Body, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let read = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = read.clone();
        let chunks = futures_util::stream::iter(0..n).map(move |_| {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, std::io::Error>(Bytes::from(vec![b' '; 1024]))
        });
        (Body::from_stream(chunks), read)
    }

    #[tokio::test]
    async fn a_body_a_little_over_the_limit_is_read_to_its_end_before_the_413_but_no_further() {
        use std::sync::atomic::Ordering;
        let (body, read) = counted(3);
        assert!(matches!(read_limited(body, 1024).await, Err(BadRequest::TooLarge { limit: 1024 })));
        assert_eq!(read.load(Ordering::SeqCst), 3, "the client had sent it all when it was answered");
        let (body, read) = counted(100);
        assert!(matches!(read_limited(body, 1024).await, Err(BadRequest::TooLarge { limit: 1024 })));
        assert_eq!(read.load(Ordering::SeqCst), 4, "at most the limit again is read past the limit");
    }

    #[tokio::test]
    async fn unknown_fields_are_named_in_the_error_body() {
        let (status, body) = call(br#"{"a":1,"b":2}"#, "a=1").await;
        assert_eq!(status, 400);
        assert!(body.contains(r#""code":"invalid_argument""#) && body.contains("unknown field `b`"), "{body}");
        let (status, body) = call(br#"{"a":1}"#, "a=1&zz=1").await;
        assert_eq!(status, 400);
        assert!(body.contains("zz"), "{body}");
        assert_eq!(call(br#"{"a":1}"#, "a=1").await.0, 200);
    }
}
