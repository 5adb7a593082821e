//! `ANY /v1/ports/{port}/{*path}`: HTTP to a port inside the sandbox, `127.0.0.1:{port}`, so a
//! web task or a service started in a sandbox answers from outside on every provider (network
//! `none` included). Bodies stream both ways; a WebSocket (any HTTP/1.1 upgrade) is spliced
//! through once both sides agree on it. The daemon's token never reaches the app.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::error::{DaemonError, DaemonResult};
use crate::state::Daemon;

/// Headers of one hop, never forwarded (but for an upgrade's `Connection` and `Upgrade`).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// `/v1/ports/{port}` with no path: the app's root.
pub async fn forward_root(State(daemon): State<Arc<Daemon>>, Path(port): Path<String>, req: Request) -> Response {
    respond(forward_to(&daemon, &port, "", req).await)
}

/// `/v1/ports/{port}/{*path}`.
pub async fn forward(
    State(daemon): State<Arc<Daemon>>,
    Path((port, path)): Path<(String, String)>,
    req: Request,
) -> Response {
    respond(forward_to(&daemon, &port, &path, req).await)
}

fn respond(r: DaemonResult<Response>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

/// Parses a port: 1 to 65535.
pub fn parse_port(text: &str) -> DaemonResult<u16> {
    match text.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(DaemonError::InvalidArgument(format!("`{text}` is not a port (1 to 65535)"))),
    }
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade")))
}

/// Copies `from` into `to` but the hop-by-hop headers, those `Connection` names, and
/// `Authorization` (the daemon's token); an upgrade keeps `Connection: upgrade` and `Upgrade`.
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap, upgrade: bool, drop_auth: bool) {
    let named: Vec<String> = from
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|t| t.trim().to_ascii_lowercase()))
        .filter(|t| t != "upgrade")
        .collect();
    for (name, value) in from {
        if HOP_BY_HOP.contains(name)
            || name.as_str() == "keep-alive"
            || named.iter().any(|n| n == name.as_str())
            || (drop_auth && (name == header::AUTHORIZATION || name == header::HOST))
        {
            continue;
        }
        to.append(name.clone(), value.clone());
    }
    if upgrade {
        to.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        if let Some(u) = from.get(header::UPGRADE) {
            to.insert(header::UPGRADE, u.clone());
        }
    }
}

async fn forward_to(daemon: &Daemon, port: &str, path: &str, mut req: Request) -> DaemonResult<Response> {
    let port = parse_port(port)?;
    let upgrade = is_upgrade(req.headers());
    // The path as the client wrote it, percent-encoding kept (`Path` decodes it: a `%20` would
    // become a space no URI may hold, a `%2F` a separator).
    let raw = req.uri().path().strip_prefix("/v1/ports/").and_then(|r| r.split_once('/')).map(|(_, p)| p);
    let path = raw.unwrap_or(path);
    let path_and_query = match req.uri().query() {
        Some(q) => format!("/{path}?{q}"),
        None => format!("/{path}"),
    };
    let stream = TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| {
        DaemonError::Unavailable(format!("nothing answers on port {port} in the sandbox (127.0.0.1:{port}): {e}"))
    })?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| DaemonError::Unavailable(format!("port {port} in the sandbox: {e}")))?;
    // One connection per request, owned by this task: it ends when the app or the client closes.
    daemon.tasks.spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let inbound = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let mut out = hyper::Request::builder().method(parts.method).uri(&path_and_query);
    if let Some(headers) = out.headers_mut() {
        copy_headers(&parts.headers, headers, upgrade, true);
        if let Ok(host) = HeaderValue::from_str(&format!("127.0.0.1:{port}")) {
            headers.insert(header::HOST, host);
        }
    }
    let out = out.body(body).map_err(|e| DaemonError::InvalidArgument(format!("cannot forward the request: {e}")))?;
    let mut resp = sender
        .send_request(out)
        .await
        .map_err(|e| DaemonError::Unavailable(format!("port {port} in the sandbox did not answer: {e}")))?;
    let switching = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    if let (true, Some(inbound)) = (switching, inbound) {
        let outbound = hyper::upgrade::on(&mut resp);
        daemon.tasks.spawn(async move {
            let (Ok(client), Ok(app)) = (inbound.await, outbound.await) else { return };
            let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(client), &mut TokioIo::new(app)).await;
        });
    }
    let (parts, body) = resp.into_parts();
    let mut back = Response::builder().status(parts.status);
    if let Some(headers) = back.headers_mut() {
        copy_headers(&parts.headers, headers, switching, false);
    }
    back.body(Body::new(body)).map_err(|e| DaemonError::Internal(format!("cannot build the answer: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_one_to_65535() {
        assert_eq!(parse_port("8000").ok(), Some(8000));
        assert!(parse_port("0").is_err() && parse_port("65536").is_err() && parse_port("http").is_err());
    }

    #[test]
    fn the_token_and_hop_headers_stay_behind_but_an_upgrade_goes_on() {
        let mut from = HeaderMap::new();
        from.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer daemon-token"));
        from.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, Upgrade, x-private"));
        from.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        from.insert("x-private", HeaderValue::from_static("1"));
        from.insert("sec-websocket-key", HeaderValue::from_static("k"));
        let mut to = HeaderMap::new();
        copy_headers(&from, &mut to, is_upgrade(&from), true);
        assert!(to.get(header::AUTHORIZATION).is_none() && to.get("x-private").is_none());
        assert_eq!(to.get(header::UPGRADE).and_then(|v| v.to_str().ok()), Some("websocket"));
        assert_eq!(to.get(header::CONNECTION).and_then(|v| v.to_str().ok()), Some("upgrade"));
        assert!(to.get("sec-websocket-key").is_some());
        let mut plain = HeaderMap::new();
        from.remove(header::UPGRADE);
        copy_headers(&from, &mut plain, is_upgrade(&from), true);
        assert!(plain.get(header::CONNECTION).is_none() && plain.get(header::UPGRADE).is_none());
    }
}
