//! `/e2b/envd`: envd's API for every sandbox at one URL, routed by the `E2b-Sandbox-Id` header
//! and opened by its `X-Access-Token`. Connect RPC calls (`POST /{package.Service}/{Method}`)
//! go to [`process`](super::process) and [`fs`](super::fs); `GET /health`, `GET /files` and
//! `POST /files` (multipart, or one octet-stream body) are plain HTTP, streamed both ways.
//! Plain HTTP errors are `{"code": <status>, "message": …}` as envd's.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, header};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::connect::{self, Code, RpcError};
use super::fs::query;
use super::{E2b, Sbx, process, read_limited, sandbox_of};

/// Files in one multipart upload.
const MAX_PARTS: usize = 1000;
/// Chunks of an uploaded part in flight to the daemon: a few, so a slow sandbox slows the
/// upload rather than filling memory.
const PART_CHUNKS: usize = 4;

pub fn router(e2b: Arc<E2b>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/files", get(read_file).post(write_files))
        .route("/{service}/{method}", post(rpc))
        .fallback(|| async { RpcError::new(Code::Unimplemented, "no such envd call in Sandman's E2B API") })
        .with_state(e2b)
}

/// An error of a plain HTTP envd call.
struct HttpError(RpcError);

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status = self.0.status();
        (status, axum::Json(json!({"code": status.as_u16(), "message": self.0.message}))).into_response()
    }
}

impl From<RpcError> for HttpError {
    fn from(e: RpcError) -> Self {
        HttpError(e)
    }
}

async fn rpc(
    State(e2b): State<Arc<E2b>>,
    Path((service, method)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    rpc_inner(&e2b, &service, &method, &headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn rpc_inner(
    e2b: &Arc<E2b>,
    service: &str,
    method: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, RpcError> {
    let stream = match service {
        "process.Process" => process::streams(method),
        "filesystem.Filesystem" => super::fs::streams(method),
        other => return Err(RpcError::new(Code::Unimplemented, format!("no service `{other}` in Sandman's E2B API"))),
    };
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let want = if stream { connect::STREAM_CONTENT_TYPE } else { connect::UNARY_CONTENT_TYPE };
    if content_type.split(';').next().unwrap_or_default().trim() != want {
        return Err(RpcError::invalid(format!(
            "{service}/{method} takes `{want}`, not `{content_type}`: only Connect's JSON codec is served"
        )));
    }
    let sbx = sandbox_of(e2b, headers)?;
    let bytes = read_limited(body, connect::MAX_REQUEST).await?;
    match service {
        "process.Process" => process::call(sbx, method, headers, &bytes).await,
        _ => super::fs::call(e2b, sbx, method, headers, &bytes).await,
    }
}

async fn health(State(e2b): State<Arc<E2b>>, headers: HeaderMap) -> Result<StatusCode, HttpError> {
    let sbx = sandbox_of(&e2b, &headers)?;
    sbx.call(Method::GET, "health", None, Body::empty(), None).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

fn file_query(uri: &http::Uri) -> Result<FileQuery, RpcError> {
    serde_urlencoded::from_str(uri.query().unwrap_or_default())
        .map_err(|e| RpcError::invalid(format!("bad query: {e}")))
}

/// `GET /files?path=`: the file's bytes, streamed.
async fn read_file(State(e2b): State<Arc<E2b>>, req: Request) -> Result<Response, HttpError> {
    let sbx = sandbox_of(&e2b, req.headers())?;
    let q = file_query(req.uri())?;
    let path = q.path.filter(|p| !p.is_empty()).ok_or_else(|| RpcError::invalid("`path` is required"))?;
    let resp = sbx.call(Method::GET, "files", Some(query(&[("path", &path)])), Body::empty(), None).await?;
    let (parts, body) = resp.into_parts();
    let mut out = Response::new(body);
    out.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/octet-stream"));
    if let Some(len) = parts.headers.get(header::CONTENT_LENGTH) {
        out.headers_mut().insert(header::CONTENT_LENGTH, len.clone());
    }
    Ok(out)
}

/// `POST /files`: one file as an octet-stream body (`path` in the query), or several as
/// multipart parts (each named by its filename, or the query's `path` for a single one).
async fn write_files(State(e2b): State<Arc<E2b>>, req: Request) -> Result<Response, HttpError> {
    let sbx = sandbox_of(&e2b, req.headers())?;
    let q = file_query(req.uri())?;
    if req.headers().get(header::CONTENT_ENCODING).is_some_and(|v| v.as_bytes() != b"identity") {
        return Err(
            RpcError::invalid("compressed uploads are not supported by Sandman: send the file without gzip").into()
        );
    }
    let content_type = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let user = q.username.filter(|u| !u.is_empty());
    let mut written = Vec::new();
    if content_type.starts_with("multipart/form-data") {
        let mut parts = Multipart::from_request(req, &())
            .await
            .map_err(|e| RpcError::invalid(format!("bad multipart body: {}", e.body_text())))?;
        let mut count = 0usize;
        while let Some(mut field) =
            parts.next_field().await.map_err(|e| RpcError::invalid(format!("bad multipart body: {}", e.body_text())))?
        {
            count += 1;
            if count > MAX_PARTS {
                return Err(RpcError::invalid(format!("more than {MAX_PARTS} files in one upload")).into());
            }
            let path = match (&q.path, field.file_name()) {
                (Some(p), _) if !p.is_empty() && count == 1 => p.clone(),
                (_, Some(name)) if !name.is_empty() => name.to_string(),
                _ => return Err(RpcError::invalid("a multipart part names no file (its filename is the path)").into()),
            };
            let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(PART_CHUNKS);
            let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|c| (c, rx))
            }));
            let upload = put_file(&sbx, &path, user.as_deref(), body);
            let feed = async move {
                loop {
                    match field.chunk().await {
                        Ok(Some(chunk)) => {
                            if tx.send(Ok(chunk)).await.is_err() {
                                return Ok(());
                            }
                        }
                        Ok(None) => return Ok(()),
                        Err(e) => {
                            let text = e.body_text();
                            let _ = tx.send(Err(std::io::Error::other(text.clone()))).await;
                            return Err(RpcError::invalid(format!("bad multipart body: {text}")));
                        }
                    }
                }
            };
            let (up, fed) = tokio::join!(upload, feed);
            fed?;
            up?;
            written.push(path);
        }
    } else {
        let path = q.path.filter(|p| !p.is_empty()).ok_or_else(|| RpcError::invalid("`path` is required"))?;
        put_file(&sbx, &path, user.as_deref(), req.into_body()).await?;
        written.push(path);
    }
    let infos: Vec<serde_json::Value> =
        written.iter().map(|p| json!({"name": p.rsplit('/').next().unwrap_or(p), "type": "file", "path": p})).collect();
    Ok(axum::Json(infos).into_response())
}

async fn put_file(sbx: &Sbx, path: &str, user: Option<&str>, body: Body) -> Result<(), RpcError> {
    let mut pairs = vec![("path", path)];
    if let Some(u) = user {
        pairs.push(("user", u));
    }
    sbx.call(Method::PUT, "files", Some(query(&pairs)), body, Some("application/octet-stream")).await.map(drop)
}
