//! `/v1/sandboxes/{id}/…`: every daemon call, forwarded to the sandbox's daemon with its own
//! token. Bodies stream both ways; nothing is buffered whole.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use http::header::{self, HeaderName};

use crate::daemon;
use crate::error::{ServerError, ServerResult};
use crate::service::Service;

/// Headers that belong to one hop and are not forwarded.
const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

pub async fn forward(
    State(service): State<Arc<Service>>,
    Path((id, rest)): Path<(String, String)>,
    req: Request,
) -> ServerResult<Response> {
    let (endpoint, token) = service.call_target(&id)?;
    service.metrics.proxied.inc();
    let path_and_query = match req.uri().query() {
        Some(q) => format!("/v1/{rest}?{q}"),
        None => format!("/v1/{rest}"),
    };
    let uri =
        daemon::uri(&endpoint, &path_and_query).map_err(|e| ServerError::InvalidArgument(format!("bad path: {e}")))?;
    let (parts, body) = req.into_parts();
    let mut out = http::Request::builder().method(parts.method).uri(uri);
    if let Some(headers) = out.headers_mut() {
        for (name, value) in &parts.headers {
            if HOP_BY_HOP.contains(name)
                || name == header::HOST
                || name == header::AUTHORIZATION
                || name.as_str() == "keep-alive"
            {
                continue;
            }
            headers.append(name.clone(), value.clone());
        }
        if let Ok(v) = format!("Bearer {token}").parse() {
            headers.insert(header::AUTHORIZATION, v);
        }
    }
    let out = out.body(body).map_err(|e| ServerError::Internal(format!("cannot build the daemon request: {e}")))?;
    let resp = service
        .daemons
        .request(out)
        .await
        .map_err(|e| ServerError::Unavailable(format!("sandbox `{id}` did not answer: {e}")))?;
    let (mut parts, body) = resp.into_parts();
    for h in HOP_BY_HOP {
        parts.headers.remove(h);
    }
    Ok(Response::from_parts(parts, Body::new(body)).into_response())
}
