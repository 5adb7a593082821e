//! Request extractors that answer bad input with the wire error body: JSON bodies and query
//! strings become typed requests that refuse unknown fields, naming them.

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use sandman_wire::ErrorCode;
use serde::de::DeserializeOwned;

/// Largest JSON body accepted (exec stdin travels in it).
pub const MAX_JSON_BODY: usize = 16 << 20;

/// Why a request could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadRequest {
    TooLarge { limit: u64 },
    Invalid(String),
}

impl std::fmt::Display for BadRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadRequest::TooLarge { limit } => write!(f, "request body is larger than the limit of {limit} bytes"),
            BadRequest::Invalid(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for BadRequest {}

impl BadRequest {
    pub fn code(&self) -> ErrorCode {
        match self {
            BadRequest::TooLarge { .. } => ErrorCode::TooLarge,
            BadRequest::Invalid(_) => ErrorCode::InvalidArgument,
        }
    }
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

/// Reads a whole body, refusing it past `limit` bytes.
pub async fn read_limited(body: Body, limit: usize) -> Result<bytes::Bytes, BadRequest> {
    match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => Ok(bytes),
        Err(err) if is_length_limit(&err) => Err(BadRequest::TooLarge { limit: limit as u64 }),
        Err(err) => Err(BadRequest::Invalid(format!("cannot read request body: {err}"))),
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
