//! The client's retries against servers that go away: a TCP server that reads each request and
//! then drops the connection without an answer, the first N times (a replica killed mid-call),
//! and a Unix socket nothing listens on yet (a replica not yet up: connection refused). What is
//! idempotent is sent again and succeeds; what is not is sent exactly once; every failure says
//! how many attempts were made.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandman_client::{Client, ClientError, RetryPolicy};
use sandman_wire::daemon::{ExecRequest, ExecResult};
use sandman_wire::server::CreateSandbox;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

const SANDBOX: &str = r#"{"id":"sb-1","image":"host","provider":"process","state":"ready",
  "profile":"default","network":"egress","resources":{},"created_at_ms":1,"lease_s":60}"#;

/// A policy that retries quickly enough for a test and often enough for any drop count used.
fn policy() -> RetryPolicy {
    RetryPolicy { retries: 5, deadline: Duration::from_secs(60) }
}

/// What the flaky server saw: every request as `METHOD /path`, with its body.
#[derive(Default)]
struct Seen {
    requests: Mutex<Vec<(String, String)>>,
}

impl Seen {
    fn count(&self, call: &str) -> usize {
        self.requests.lock().unwrap().iter().filter(|(c, _)| c == call).count()
    }

    fn bodies(&self, call: &str) -> Vec<String> {
        self.requests.lock().unwrap().iter().filter(|(c, _)| c == call).map(|(_, b)| b.clone()).collect()
    }
}

/// A server that reads each request whole, then for its first `drops[call]` requests of `call`
/// closes the connection without answering, and answers the rest.
async fn flaky(drops: &[(&str, usize)]) -> (String, Arc<Seen>) {
    serve_failing(drops, false).await
}

/// As [`flaky`], but the first requests get what a server replica answers when the leader it
/// passed the call on to went away with it: `503` with `X-Sandman-Unanswered`.
async fn replica_losing_its_leader(drops: &[(&str, usize)]) -> (String, Arc<Seen>) {
    serve_failing(drops, true).await
}

async fn serve_failing(drops: &[(&str, usize)], unanswered: bool) -> (String, Arc<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Seen::default());
    let left: Arc<Mutex<HashMap<String, usize>>> =
        Arc::new(Mutex::new(drops.iter().map(|(c, n)| (c.to_string(), *n)).collect()));
    let shared = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let (seen, left) = (Arc::clone(&shared), Arc::clone(&left));
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                // Kept-alive connections carry several requests.
                loop {
                    let mut head = Vec::new();
                    loop {
                        let mut line = String::new();
                        if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        head.push(line);
                    }
                    let call = head[0].split_whitespace().take(2).collect::<Vec<_>>().join(" ");
                    let length = head
                        .iter()
                        .find_map(|h| {
                            h.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string())
                        })
                        .and_then(|v| v.parse::<usize>().ok())
                        .unwrap_or(0);
                    let mut body = vec![0u8; length];
                    stream.read_exact(&mut body).await.unwrap();
                    seen.requests.lock().unwrap().push((call.clone(), String::from_utf8_lossy(&body).into_owned()));
                    let drop_it = match left.lock().unwrap().get_mut(&call) {
                        Some(n) if *n > 0 => {
                            *n -= 1;
                            true
                        }
                        _ => false,
                    };
                    if drop_it && unanswered {
                        let body = r#"{"error":{"code":"unavailable","message":"the leader went away","reason":"leader_lost"}}"#;
                        let response = format!(
                            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
                             x-sandman-unanswered: 1\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if stream.get_mut().write_all(response.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    if drop_it {
                        // Gone mid-call, as a killed replica: the request was read, no answer comes.
                        return;
                    }
                    let answer = if call.ends_with("/exec") {
                        serde_json::to_string(&ExecResult { stdout: "hi\n".into(), ..Default::default() }).unwrap()
                    } else {
                        SANDBOX.replace('\n', "")
                    };
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                        answer.len()
                    );
                    if stream.get_mut().write_all(response.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, seen)
}

#[tokio::test]
async fn an_idempotent_call_cut_off_twice_succeeds_on_its_third_attempt() {
    let (url, seen) = flaky(&[("GET /v1/sandboxes/sb-1", 2)]).await;
    let client = Client::new(&url, "t").unwrap().with_retry(policy());
    let sandbox = client.get("sb-1").await.unwrap();
    assert_eq!(sandbox.id, "sb-1");
    assert_eq!(seen.count("GET /v1/sandboxes/sb-1"), 3);
}

#[tokio::test]
async fn an_exec_cut_off_is_sent_exactly_once_and_says_why() {
    let (url, seen) = flaky(&[("POST /v1/sandboxes/sb-1/exec", 1)]).await;
    let client = Client::new(&url, "t").unwrap().with_retry(policy());
    let req = ExecRequest { argv: Some(vec!["echo".into(), "hi".into()]), ..Default::default() };
    let err = client.exec("sb-1", &req).await.unwrap_err();
    assert_eq!(seen.count("POST /v1/sandboxes/sb-1/exec"), 1, "an exec was sent again");
    assert!(matches!(err, ClientError::Retried { attempts: 1, not_idempotent: true, .. }), "{err:?}");
    assert!(err.to_string().contains("not idempotent"), "{err}");
    assert!(err.is_broken_connection());
    // The next exec, on a server that now answers, runs once.
    assert_eq!(client.exec("sb-1", &req).await.unwrap().stdout, "hi\n");
    assert_eq!(seen.count("POST /v1/sandboxes/sb-1/exec"), 2);
}

/// A create carries an idempotency key (a fresh one when the caller gave none), so it is sent
/// again with the same key, and the server answers the sandbox made under it.
#[tokio::test]
async fn a_create_cut_off_is_sent_again_with_the_same_idempotency_key() {
    let (url, seen) = flaky(&[("POST /v1/sandboxes", 2)]).await;
    let client = Client::new(&url, "t").unwrap().with_retry(policy());
    let sandbox = client.create(&CreateSandbox { image: "host".into(), ..Default::default() }).await.unwrap();
    assert_eq!(sandbox.id, "sb-1");
    let keys: Vec<String> = seen
        .bodies("POST /v1/sandboxes")
        .iter()
        .map(|b| serde_json::from_str::<serde_json::Value>(b).unwrap()["idempotency_key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|k| *k == keys[0] && !k.is_empty()), "{keys:?}");
}

#[tokio::test]
async fn the_last_error_says_how_many_attempts_were_made_and_none_turns_retries_off() {
    let (url, seen) = flaky(&[("GET /v1/sandboxes/sb-1", 100)]).await;
    let client = Client::new(&url, "t").unwrap().with_retry(RetryPolicy { retries: 3, ..policy() });
    let err = client.get("sb-1").await.unwrap_err();
    assert_eq!(err.attempts(), 4);
    assert_eq!(err.to_string(), "GET /v1/sandboxes/sb-1 failed after 4 attempts");
    assert_eq!(seen.count("GET /v1/sandboxes/sb-1"), 4);
    let once = Client::new(&url, "t").unwrap().with_retry(RetryPolicy::none());
    let err = once.get("sb-1").await.unwrap_err();
    assert_eq!(err.attempts(), 1);
    assert_eq!(seen.count("GET /v1/sandboxes/sb-1"), 5);
}

/// Connection refused means the request never left: even an exec is sent again, and it runs
/// once the server is there.
#[tokio::test]
async fn a_refused_connection_is_tried_again_until_the_server_listens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sandman.sock");
    // Bound and closed: the file stays, and connecting to it is refused.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let refused = Client::new(&format!("unix:{}", path.display()), "t")
        .unwrap()
        .with_retry(RetryPolicy { retries: 2, deadline: Duration::from_secs(60) });
    let req = ExecRequest { argv: Some(vec!["true".into()]), ..Default::default() };
    let err = refused.exec("sb-1", &req).await.unwrap_err();
    assert!(err.is_connection_refused(), "{err:?}");
    assert_eq!(err.attempts(), 3, "{err}");

    // A server that comes up while the client retries: it answers the call the client keeps
    // sending. Whether the first attempt is refused or not, the call must succeed once, here.
    let client = Client::new(&format!("unix:{}", path.display()), "t")
        .unwrap()
        .with_retry(RetryPolicy { retries: 100, deadline: Duration::from_secs(60) });
    let up = {
        let path = path.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            std::fs::remove_file(&path).unwrap();
            let listener = tokio::net::UnixListener::bind(&path).unwrap();
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut reader = BufReader::new(&mut stream);
            let mut line = String::new();
            let mut length = 0;
            while reader.read_line(&mut line).await.unwrap() > 0 && line != "\r\n" {
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap();
                }
                line.clear();
            }
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).await.unwrap();
            let answer = serde_json::to_string(&ExecResult::default()).unwrap();
            let response = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{answer}", answer.len());
            stream.write_all(response.as_bytes()).await.unwrap();
            String::from_utf8(body).unwrap()
        })
    };
    let result = client.exec("sb-1", &req).await.unwrap();
    assert_eq!(result, ExecResult::default());
    assert!(up.await.unwrap().contains("\"true\""));
}

/// A replica whose leader went away with the call under way: a keyed create is sent again (and
/// answers the sandbox made under its key), an exec is not.
#[tokio::test]
async fn a_replicas_unanswered_503_resends_only_idempotent_calls() {
    let (url, seen) =
        replica_losing_its_leader(&[("POST /v1/sandboxes", 2), ("POST /v1/sandboxes/sb-1/exec", 1)]).await;
    let client = Client::new(&url, "t").unwrap().with_retry(policy());
    let sandbox = client.create(&CreateSandbox { image: "host".into(), ..Default::default() }).await.unwrap();
    assert_eq!(sandbox.id, "sb-1");
    assert_eq!(seen.count("POST /v1/sandboxes"), 3);
    let req = ExecRequest { argv: Some(vec!["true".into()]), ..Default::default() };
    let err = client.exec("sb-1", &req).await.unwrap_err();
    assert_eq!(seen.count("POST /v1/sandboxes/sb-1/exec"), 1, "an exec was sent again");
    assert!(matches!(err, ClientError::Retried { attempts: 1, not_idempotent: true, .. }), "{err:?}");
    assert!(format!("{err:?}").contains("the leader went away"), "{err:?}");
}
