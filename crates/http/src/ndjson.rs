//! NDJSON response bodies: one JSON event a line from a bounded channel, with a keep-alive event
//! whenever nothing else was sent for a while.

use std::time::Duration;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Serialize;
use tokio::sync::mpsc;

/// Idle time after which a keep-alive event is sent on a stream.
pub const KEEPALIVE_EVERY: Duration = Duration::from_secs(15);

pub const CONTENT_TYPE: &str = "application/x-ndjson";

/// A streamed NDJSON body of the events received on `rx`, ending when every sender is dropped.
pub fn response<T, K>(rx: mpsc::Receiver<T>, keepalive: K) -> Response
where
    T: Serialize + Send + 'static,
    K: Fn() -> T + Send + 'static,
{
    let events = futures_util::stream::unfold((rx, keepalive), |(mut rx, keepalive)| async move {
        let event = match tokio::time::timeout(KEEPALIVE_EVERY, rx.recv()).await {
            Ok(Some(event)) => event,
            Ok(None) => return None,
            Err(_) => keepalive(),
        };
        Some((Ok::<_, std::io::Error>(line(&event)), (rx, keepalive)))
    });
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], Body::from_stream(events)).into_response()
}

/// One event serialised as a line.
pub fn line<T: Serialize>(event: &T) -> Bytes {
    let mut buf = serde_json::to_vec(event)
        .unwrap_or_else(|e| format!(r#"{{"event":"error","message":"cannot encode event: {e}"}}"#).into_bytes());
    buf.push(b'\n');
    Bytes::from(buf)
}
