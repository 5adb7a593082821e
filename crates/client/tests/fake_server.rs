//! The client against a small axum server on 127.0.0.1 that answers canned wire JSON: decoding,
//! error bodies, NDJSON split across chunks and read as it arrives, streamed uploads.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use futures_util::StreamExt;
use sandman_client::{Client, ClientError};
use sandman_wire::ErrorCode;
use sandman_wire::daemon::{ExecEvent, ExecRequest, OutputEvent, OutputQuery, StreamName};
use sandman_wire::server::{EventsQuery, ListQuery, Quantity, Reason, SandboxState};
use tokio::sync::mpsc;

const TOKEN: &str = "test-token";

const SANDBOX: &str = r#"{
  "id": "sb-1", "image": "host", "provider": "process", "state": "ready",
  "job": "j", "labels": {"team": "rl"}, "profile": "default", "network": "egress",
  "resources": {"cpu": "500m", "memory": 1073741824},
  "created_at_ms": 1700000000000, "ready_at_ms": 1700000000100, "lease_s": 60
}"#;

/// `POST /exec/stream`'s body: lines cut mid-JSON and mid-character, a keep-alive, a blank
/// line, and a last line without its newline.
const EXEC_CHUNKS: &[&[u8]] = &[
    b"{\"event\":\"started\",\"pid\":42}\n{\"event\":\"std",
    b"out\",\"data\":\"hel",
    b"lo\\n\"}\n",
    b"{\"event\":\"keepalive\"}\n",
    b"{\"event\":\"stderr\",\"data\":\"\xc3",
    b"\xa9\"}\n\n",
    b"{\"event\":\"exit\",\"exit_code\":3,\"signal\":null,\"timed_out\":false,\"duration_ms\":5,",
    b"\"usage\":{\"cpu_user_ms\":1,\"cpu_system_ms\":0,\"max_rss_kib\":900},",
    b"\"stdout_truncated\":false,\"stderr_truncated\":false}",
];

/// What the fake server shares with the test.
#[derive(Default)]
struct Shared {
    /// The content type, transfer encoding, query and bytes of the last upload.
    uploaded: Mutex<Option<Upload>>,
    /// Held by the exec stream after its first chunk until the test has read the first event.
    gate: tokio::sync::Mutex<Option<mpsc::Receiver<()>>>,
    /// The queries of every follow of `p-resume`'s output.
    follows: Mutex<Vec<String>>,
}

#[derive(Debug, Clone)]
struct Upload {
    content_type: Option<String>,
    chunked: bool,
    query: String,
    bytes: Vec<u8>,
}

fn json(status: StatusCode, body: &str) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_owned()).into_response()
}

fn ndjson(body: Body) -> Response {
    ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response()
}

fn authorized(headers: &HeaderMap) -> bool {
    headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
}

async fn get_sandbox(headers: HeaderMap, Path(id): Path<String>) -> Response {
    if !authorized(&headers) {
        return json(StatusCode::UNAUTHORIZED, r#"{"error":{"code":"unauthorized","message":"bad token"}}"#);
    }
    match id.as_str() {
        "sb-1" => json(StatusCode::OK, SANDBOX),
        "sb-gone" => json(
            StatusCode::GONE,
            r#"{"error":{"code":"gone","message":"sandbox `sb-gone` is gone","reason":"lease_expired"}}"#,
        ),
        "sb-proxy" => (StatusCode::BAD_GATEWAY, "<html>Bad Gateway</html>").into_response(),
        other => json(StatusCode::NOT_FOUND, &format!(r#"{{"error":{{"code":"not_found","message":"{other}"}}}}"#)),
    }
}

/// Answers the raw query as the image, so the test sees exactly what was sent.
async fn list(RawQuery(query): RawQuery) -> Response {
    let sandbox = SANDBOX.replace(r#""image": "host""#, &format!(r#""image": "{}""#, query.unwrap_or_default()));
    json(StatusCode::OK, &format!(r#"{{"sandboxes":[{sandbox}]}}"#))
}

async fn exec_stream(State(shared): State<Arc<Shared>>, body: String) -> Response {
    let req: ExecRequest = serde_json::from_str(&body).unwrap();
    assert_eq!(req.argv, Some(vec!["sh".to_owned(), "-c".to_owned(), "x".to_owned()]));
    let mut gate = shared.gate.lock().await.take().unwrap();
    // One chunk in flight at a time, so nothing is sent ahead of the gate.
    let (tx, rx) = mpsc::channel::<Bytes>(1);
    tokio::spawn(async move {
        for (i, chunk) in EXEC_CHUNKS.iter().enumerate() {
            if i == 1 {
                gate.recv().await;
            }
            if tx.send(Bytes::from_static(chunk)).await.is_err() {
                return;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (Ok::<_, Infallible>(chunk), rx))
    });
    ndjson(Body::from_stream(stream))
}

async fn events(RawQuery(query): RawQuery) -> Response {
    let event = r#"{"seq":7,"time_ms":1700000000000,"sandbox":"sb-1","state":"gone","reason":"released"}"#;
    if query.as_deref().is_some_and(|q| q.contains("follow=true")) {
        let body = format!("{{\"event\":\"keepalive\"}}\n{}\n", event.replacen('{', "{\"event\":\"sandbox\",", 1));
        ndjson(Body::from(body))
    } else {
        json(StatusCode::OK, &format!(r#"{{"events":[{event}]}}"#))
    }
}

async fn output(
    State(shared): State<Arc<Shared>>,
    Path((_, process)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> Response {
    let query = query.unwrap_or_default();
    if process == "p-resume" {
        return resumed_output(&shared, &query);
    }
    if process == "p-missing" {
        return json(StatusCode::NOT_FOUND, r#"{"error":{"code":"not_found","message":"no process `p-missing`"}}"#);
    }
    if query.contains("follow=true") {
        ndjson(Body::from(concat!(
            "{\"event\":\"data\",\"offset\":0,\"next_offset\":1,\"data\":\"a\"}\n",
            "{\"event\":\"keepalive\"}\n",
            "{\"event\":\"dropped\",\"offset\":1,\"bytes\":10}\n",
            "{\"event\":\"exit\",\"exit_code\":0,\"signal\":null,\"timed_out\":false,\"duration_ms\":1,",
            "\"usage\":{\"cpu_user_ms\":0,\"cpu_system_ms\":0,\"max_rss_kib\":0},\"next_offset\":11}\n",
        )))
    } else {
        json(
            StatusCode::OK,
            &format!(r#"{{"stream":"stderr","offset":5,"next_offset":6,"dropped":0,"data":"{query}","eof":true}}"#),
        )
    }
}

/// A followed output whose first answer breaks off before `exit`: `x`, an invalid byte (U+FFFD,
/// three bytes of text for one of output) and `y` cover bytes 0 to 3. Every query is recorded.
fn resumed_output(shared: &Shared, query: &str) -> Response {
    let first = {
        let mut asked = shared.follows.lock().unwrap();
        asked.push(query.to_owned());
        asked.len() == 1
    };
    if first {
        return ndjson(Body::from("{\"event\":\"data\",\"offset\":0,\"next_offset\":3,\"data\":\"x\u{FFFD}y\"}\n"));
    }
    ndjson(Body::from(concat!(
        "{\"event\":\"data\",\"offset\":3,\"next_offset\":5,\"data\":\"z\\n\"}\n",
        "{\"event\":\"exit\",\"exit_code\":0,\"signal\":null,\"timed_out\":false,\"duration_ms\":1,",
        "\"usage\":{\"cpu_user_ms\":0,\"cpu_system_ms\":0,\"max_rss_kib\":0},\"next_offset\":5}\n",
    )))
}

async fn process(Path((_, process)): Path<(String, String)>) -> Response {
    // The tag comes back as the argv, decoded by axum as the server would.
    json(
        StatusCode::OK,
        &serde_json::json!({
            "id": "p-1", "tag": process, "pid": 9, "argv": [process], "state": "running",
            "started_at_ms": 1, "stdout_bytes": 0, "stderr_bytes": 0, "stdin_open": false
        })
        .to_string(),
    )
}

async fn upload(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    body: Body,
) -> Response {
    let mut bytes = Vec::new();
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        bytes.extend_from_slice(&chunk.unwrap());
    }
    let size = bytes.len();
    let header = |name| headers.get(name).and_then(|v: &header::HeaderValue| v.to_str().ok()).map(str::to_owned);
    *shared.uploaded.lock().unwrap() = Some(Upload {
        content_type: header(header::CONTENT_TYPE),
        chunked: header(header::TRANSFER_ENCODING).as_deref() == Some("chunked"),
        query: query.unwrap_or_default(),
        bytes,
    });
    json(
        StatusCode::OK,
        &format!(r#"{{"path":"/f","kind":"file","size":{size},"mode":420,"uid":0,"gid":0,"mtime_ms":0}}"#),
    )
}

async fn read_file() -> Response {
    ([(header::CONTENT_TYPE, "application/octet-stream")], Body::from(vec![7u8; 100_000])).into_response()
}

async fn start() -> (Client, Arc<Shared>) {
    let shared = Arc::new(Shared::default());
    let app = Router::new()
        .route("/v1/sandboxes", get(list))
        .route("/v1/sandboxes/{id}", get(get_sandbox))
        .route("/v1/sandboxes/{id}/exec/stream", post(exec_stream))
        .route("/v1/sandboxes/{id}/processes/{process}", get(process).delete(|| async { StatusCode::NO_CONTENT }))
        .route("/v1/sandboxes/{id}/processes/{process}/output", get(output))
        .route("/v1/sandboxes/{id}/files", put(upload).get(read_file))
        .route("/v1/sandboxes/{id}/sessions/{session}", delete(|| async { StatusCode::NO_CONTENT }))
        .route("/v1/events", get(events))
        .with_state(Arc::clone(&shared));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (Client::new(&format!("http://{addr}"), TOKEN).unwrap(), shared)
}

#[tokio::test]
async fn a_sandbox_decodes_and_the_token_is_sent() {
    let (client, _) = start().await;
    let sandbox = client.get("sb-1").await.unwrap();
    assert_eq!(sandbox.id, "sb-1");
    assert_eq!(sandbox.state, SandboxState::Ready);
    assert_eq!(sandbox.job.as_deref(), Some("j"));
    assert_eq!(sandbox.resources.cpu, Some(Quantity::Text("500m".into())));
    assert_eq!(sandbox.lease_s, 60);
}

#[tokio::test]
async fn error_bodies_become_api_errors_with_code_and_reason() {
    let (client, _) = start().await;
    let err = client.get("sb-gone").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Gone));
    assert_eq!(err.reason(), Some(Reason::LeaseExpired.as_str()));
    assert_eq!(err.status(), Some(410));
    assert_eq!(err.to_string(), "sandbox `sb-gone` is gone (lease_expired)");

    let wrong = Client::new(client.base_url(), "wrong").unwrap();
    let err = wrong.get("sb-1").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Unauthorized));
}

#[tokio::test]
async fn an_error_without_an_error_body_keeps_its_status() {
    let (client, _) = start().await;
    let err = client.get("sb-proxy").await.unwrap_err();
    assert_eq!(err.code(), None);
    assert!(matches!(&err, ClientError::UnexpectedStatus { status: 502, snippet } if snippet.contains("Bad Gateway")));
}

#[tokio::test]
async fn list_queries_are_encoded() {
    let (client, _) = start().await;
    let query = ListQuery { job: Some("j 1".into()), state: Some(SandboxState::Ready), label: Some("team=rl".into()) };
    let list = client.list(&query).await.unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].image, "job=j+1&state=ready&label=team%3Drl");
    let all = client.list(&ListQuery::default()).await.unwrap();
    assert_eq!(all[0].image, "");
}

#[tokio::test]
async fn exec_stream_parses_lines_across_chunks_as_they_arrive() {
    let (client, shared) = start().await;
    let (open_gate, gate) = mpsc::channel(1);
    *shared.gate.lock().await = Some(gate);
    let req = ExecRequest { argv: Some(vec!["sh".into(), "-c".into(), "x".into()]), ..ExecRequest::default() };
    let mut stream = client.exec_stream("sb-1", &req).await.unwrap();
    // The server holds the rest of the body until this first event has been read: a client that
    // waited for the whole body would never see it.
    let first = tokio::time::timeout(Duration::from_secs(10), stream.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(first, ExecEvent::Started { pid: 42 });
    open_gate.send(()).await.unwrap();
    let rest: Vec<ExecEvent> = stream.map(Result::unwrap).collect().await;
    assert_eq!(rest.len(), 3, "{rest:?}");
    assert_eq!(rest[0], ExecEvent::Stdout { data: "hello\n".into() });
    assert_eq!(rest[1], ExecEvent::Stderr { data: "é".into() });
    match &rest[2] {
        ExecEvent::Exit { status, .. } => {
            assert_eq!(status.exit_code, Some(3));
            assert_eq!(status.usage.max_rss_kib, 900);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn events_list_and_follow_skip_keepalives() {
    let (client, _) = start().await;
    let listed = client.events(&EventsQuery { follow: true, ..EventsQuery::default() }).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].reason, Some(Reason::Released));
    let followed: Vec<_> = client.follow_events(&EventsQuery::default()).await.unwrap().collect().await;
    assert_eq!(followed.len(), 1);
    assert_eq!(followed[0].as_ref().unwrap().seq, 7);
}

#[tokio::test]
async fn process_output_read_and_followed() {
    let (client, _) = start().await;
    let query = OutputQuery { offset: 5, stream: StreamName::Stderr, follow: true, max_bytes: None };
    let chunk = client.process_output("sb-1", "p-1", &query).await.unwrap();
    assert_eq!(chunk.data, "offset=5&stream=stderr&follow=false");
    assert!(chunk.eof);
    let events: Vec<OutputEvent> =
        client.follow_output("sb-1", "p-1", &query).await.unwrap().map(Result::unwrap).collect().await;
    assert_eq!(events.len(), 3);
    assert_eq!(events[0], OutputEvent::Data { offset: 0, next_offset: 1, data: "a".into() });
    assert_eq!(events[1], OutputEvent::Dropped { offset: 1, bytes: 10 });
    assert!(matches!(events[2], OutputEvent::Exit { next_offset: 11, .. }));
}

#[tokio::test]
async fn process_tags_are_one_path_segment() {
    let (client, _) = start().await;
    let info = client.process("sb-1", "my tag/1").await.unwrap();
    assert_eq!(info.argv, vec!["my tag/1".to_owned()]);
    client.kill_process("sb-1", "p-1").await.unwrap();
    client.delete_session("sb-1", "s-1").await.unwrap();
}

#[tokio::test]
async fn a_streamed_upload_arrives_intact() {
    let (client, shared) = start().await;
    let chunks: Vec<Bytes> = (0..200u32).map(|i| Bytes::from(vec![(i % 251) as u8; 8191])).collect();
    let expected: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
    let body = sandman_client::UploadBody::from_stream(futures_util::stream::iter(chunks.into_iter().map(Ok)));
    let stat = client.write_file("sb-1", "/work/a b.bin", Some(0o755), body).await.unwrap();
    assert_eq!(stat.size, expected.len() as u64);
    let upload = shared.uploaded.lock().unwrap().clone().unwrap();
    assert!(upload.bytes == expected, "the upload differs");
    assert!(upload.chunked, "a stream is sent chunked, not buffered to learn its length");
    assert_eq!(upload.content_type.as_deref(), Some("application/octet-stream"));
    assert_eq!(upload.query, "path=%2Fwork%2Fa+b.bin&mode=755");

    client.write_file("sb-1", "/small", None, "hello").await.unwrap();
    let upload = shared.uploaded.lock().unwrap().clone().unwrap();
    assert_eq!(upload.bytes, b"hello");
    assert!(!upload.chunked);
}

#[tokio::test]
async fn files_read_whole_and_streamed() {
    let (client, _) = start().await;
    let bytes = client.read_file("sb-1", "/f", 0, None).await.unwrap();
    assert_eq!(bytes.len(), 100_000);
    let stream = client.read_file_stream("sb-1", "/f", 0, Some(10)).await.unwrap();
    let mut read = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut stream.into_async_read(), &mut read).await.unwrap();
    assert_eq!(read, vec![7u8; 100_000]);
}

#[tokio::test]
async fn a_closed_port_is_connection_refused() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let client = Client::new(&format!("http://{addr}"), TOKEN).unwrap().with_retry(sandman_client::RetryPolicy::none());
    let err = client.get("sb-1").await.unwrap_err();
    assert!(err.is_connection_refused(), "{err:?}");
    assert_eq!(err.to_string(), "GET /v1/sandboxes/sb-1 failed (1 attempt)");
    assert!(err.is_connect());
    assert_eq!(err.code(), None);
}

/// A follow whose connection breaks before the process's exit opens again where the last event
/// ended, by its `next_offset` (not by the length of its text, which an invalid byte makes 5
/// where the output had 3), and neither repeats nor loses a byte.
#[tokio::test]
async fn a_broken_follow_resumes_at_the_next_offset_of_its_last_event() {
    let (client, shared) = start().await;
    let query = OutputQuery { offset: 0, stream: StreamName::Stdout, follow: false, max_bytes: None };
    let mut follow = client.follow_output_resuming("sb-1", "p-resume", &query);
    let mut events = Vec::new();
    while let Some(event) = follow.next().await {
        events.push(event.unwrap());
    }
    assert_eq!(
        events[..2],
        [
            OutputEvent::Data { offset: 0, next_offset: 3, data: "x\u{FFFD}y".into() },
            OutputEvent::Data { offset: 3, next_offset: 5, data: "z\n".into() },
        ]
    );
    assert!(matches!(events[2], OutputEvent::Exit { next_offset: 5, .. }), "{events:?}");
    assert_eq!(events.len(), 3);
    assert_eq!(follow.offset(), 5);
    let asked = shared.follows.lock().unwrap().clone();
    assert_eq!(asked, ["offset=0&stream=stdout&follow=true", "offset=3&stream=stdout&follow=true"]);
}

/// An error answer (the process is gone) is not a broken connection: it is answered at once.
#[tokio::test]
async fn a_follow_refused_by_the_server_is_not_reopened() {
    let (client, _) = start().await;
    let query = OutputQuery::default();
    let mut follow = client.follow_output_resuming("sb-1", "p-missing", &query);
    let err = follow.next().await.unwrap().unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotFound), "{err}");
    assert!(follow.next().await.is_none());
}
