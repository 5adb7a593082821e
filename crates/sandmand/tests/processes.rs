//! Background processes through the real daemon: tags, status, retained output read again by a
//! new client, follow, stdin, signals, wait and kill.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Body, Daemon, Events, TOKEN, alive, eventually};
use serde_json::json;

#[tokio::test]
async fn output_is_read_again_after_the_starting_client_has_gone() {
    let d = Daemon::start().await;
    {
        // The starting client: its own connection, closed at the end of this block.
        let mut conn = d.connect().await;
        let r = conn
            .call(
                "POST",
                "/v1/processes",
                Some(TOKEN),
                Body::Json(json!({"command": "echo hello; echo oops >&2", "tag": "job"})),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 201, "{}", r.text());
        assert_eq!(r.json()["tag"], "job");
    }
    let waited = d.json("POST", "/v1/processes/job/wait", json!({"timeout_ms": 5000})).await.json();
    assert_eq!(waited["state"], "exited");
    assert_eq!(waited["exit"]["exit_code"], 0);
    let out = d.get("/v1/processes/job/output?offset=0").await.json();
    assert_eq!(out["data"], "hello\n");
    assert_eq!(out["eof"], true);
    assert_eq!(out["next_offset"], 6);
    let err = d.get("/v1/processes/job/output?stream=stderr").await.json();
    assert_eq!(err["data"], "oops\n");
    let again = d.get("/v1/processes/job/output?offset=2").await.json();
    assert_eq!(again["data"], "llo\n");
    // Status by id works as well as by tag.
    let id = waited["id"].as_str().unwrap();
    assert_eq!(d.get(&format!("/v1/processes/{id}")).await.json()["tag"], "job");
}

#[tokio::test]
async fn retention_is_bounded_and_counts_dropped_bytes() {
    let d = Daemon::start().await;
    let r = d.json("POST", "/v1/processes", json!({"command": "seq 1 10000", "retain_bytes": 100})).await.json();
    let id = r["id"].as_str().unwrap().to_string();
    d.json("POST", &format!("/v1/processes/{id}/wait"), json!({})).await;
    let out = d.get(&format!("/v1/processes/{id}/output?offset=0")).await.json();
    let total = d.get(&format!("/v1/processes/{id}")).await.json()["stdout_bytes"].as_u64().unwrap();
    assert_eq!(out["data"].as_str().unwrap().len(), 100);
    assert!(out["data"].as_str().unwrap().ends_with("10000\n"));
    assert_eq!(out["dropped"].as_u64().unwrap(), total - 100);
    assert_eq!(out["offset"].as_u64().unwrap(), total - 100);
}

/// Before, retained output had no total bound: many processes each keeping their share grew the
/// daemon without limit. Past `--max-buffered-output`, each keeps its newest output only.
#[tokio::test]
async fn retained_output_over_all_processes_is_bounded() {
    let d = Daemon::start_with(&["--max-buffered-output", "3000"], None).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let r = d.json("POST", "/v1/processes", json!({"command": "seq 1 10000", "retain_bytes": 2000})).await.json();
        let id = r["id"].as_str().unwrap().to_string();
        d.json("POST", &format!("/v1/processes/{id}/wait"), json!({})).await;
        ids.push(id);
    }
    let mut held = 0;
    for id in &ids {
        let out = d.get(&format!("/v1/processes/{id}/output?offset=0")).await.json();
        let data = out["data"].as_str().unwrap();
        let total = d.get(&format!("/v1/processes/{id}")).await.json()["stdout_bytes"].as_u64().unwrap();
        assert_eq!(out["dropped"].as_u64().unwrap() + data.len() as u64, total, "{out}");
        assert!(data.is_empty() || data.ends_with("10000\n"), "not the newest output: {data}");
        held += data.len();
    }
    assert!(held <= 3000, "{held} bytes retained over a budget of 3000");
    assert_eq!(
        d.get(&format!("/v1/processes/{}/output?offset=0", ids[0])).await.json()["data"].as_str().map(str::len),
        Some(2000)
    );
    // Deleting a process gives its share back to the next.
    d.call("DELETE", &format!("/v1/processes/{}", ids[0]), Some(TOKEN), Body::Empty).await.unwrap();
    let r = d.json("POST", "/v1/processes", json!({"command": "seq 1 10000", "retain_bytes": 2000})).await.json();
    let id = r["id"].as_str().unwrap().to_string();
    d.json("POST", &format!("/v1/processes/{id}/wait"), json!({})).await;
    let out = d.get(&format!("/v1/processes/{id}/output?offset=0")).await.json();
    assert_eq!(out["data"].as_str().map(str::len), Some(2000));
}

#[tokio::test]
async fn follow_streams_output_then_the_exit() {
    let d = Daemon::start().await;
    let r = d.json("POST", "/v1/processes", json!({"command": "echo a; sleep 0.2; echo b; exit 4", "tag": "f"})).await;
    assert_eq!(r.status, 201);
    let mut conn = d.connect().await;
    let resp = conn.send("GET", "/v1/processes/f/output?follow=true", Some(TOKEN), Body::Empty).await.unwrap();
    let mut events = Events::new(resp);
    let mut data = String::new();
    let exit = loop {
        let e = events.next().await.unwrap();
        match e["event"].as_str().unwrap() {
            "data" => data.push_str(e["data"].as_str().unwrap()),
            "exit" => break e,
            other => panic!("unexpected {other}"),
        }
    };
    assert_eq!(data, "a\nb\n");
    assert_eq!(exit["exit_code"], 4);
    assert_eq!(exit["next_offset"], 4);
}

/// Before, a followed `data` event had only its start: a client resuming after it computed the
/// end from the text, which is wrong where bytes are not UTF-8 (one byte arrives as U+FFFD, three
/// bytes of text). `next_offset` says where the event's bytes end, and the start of a character
/// that a read cut is carried into the next event, never counted in this one.
#[tokio::test]
async fn followed_data_says_where_its_bytes_end_so_a_follow_resumes_exactly() {
    let d = Daemon::start().await;
    // `x`, an invalid byte, `y`, then the first two bytes of `€` (E2 82 AC); the rest once a
    // line comes on stdin.
    let script = r"printf 'x\377y\342\202'; read l; printf '\254z'";
    let r = d.json("POST", "/v1/processes", json!({"command": script, "stdin": true, "tag": "u"})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let d = &d;
    let follow = |offset: u64| async move {
        let mut conn = d.connect().await;
        let path = format!("/v1/processes/u/output?follow=true&offset={offset}");
        Events::new(conn.send("GET", &path, Some(TOKEN), Body::Empty).await.unwrap())
    };
    let mut events = follow(0).await;
    let (mut text, mut next) = (String::new(), 0);
    while !text.contains('y') {
        let e = events.next().await.unwrap();
        assert_eq!(e["event"], "data", "{e}");
        assert_eq!(e["offset"].as_u64(), Some(next), "an event starts where the last ended: {e}");
        text.push_str(e["data"].as_str().unwrap());
        next = e["next_offset"].as_u64().unwrap();
    }
    assert_eq!(text, "x\u{FFFD}y");
    // Three bytes of text (`x`, `y` and U+FFFD's three make five) but three bytes of output: the
    // half of `€` is not in it.
    assert_eq!(next, 3);
    drop(events);

    d.json("POST", "/v1/processes/u/stdin", json!({"data": "go\n"})).await;
    let mut events = follow(next).await;
    let mut rest = String::new();
    let exit = loop {
        let e = events.next().await.unwrap();
        match e["event"].as_str().unwrap() {
            "data" => {
                assert_eq!(e["offset"].as_u64(), Some(next), "{e}");
                rest.push_str(e["data"].as_str().unwrap());
                next = e["next_offset"].as_u64().unwrap();
            }
            "exit" => break e,
            other => panic!("unexpected {other}: {e}"),
        }
    };
    assert_eq!((rest.as_str(), next), ("€z", 7));
    assert_eq!(exit["next_offset"], 7);
}

#[tokio::test]
async fn stdin_is_written_then_closed() {
    let d = Daemon::start().await;
    let r = d.json("POST", "/v1/processes", json!({"argv": ["cat"], "stdin": true, "tag": "cat"})).await.json();
    assert_eq!(r["stdin_open"], true);
    d.json("POST", "/v1/processes/cat/stdin", json!({"data": "line one\n"})).await;
    d.json("POST", "/v1/processes/cat/stdin", json!({"data": "line two\n", "close": true})).await;
    let w = d.json("POST", "/v1/processes/cat/wait", json!({"timeout_ms": 5000})).await.json();
    assert_eq!(w["state"], "exited");
    assert_eq!(d.get("/v1/processes/cat/output").await.json()["data"], "line one\nline two\n");
    let closed = d.json("POST", "/v1/processes/cat/stdin", json!({"data": "more"})).await;
    closed.error(409, "conflict");
}

#[tokio::test]
async fn signal_wait_and_kill() {
    let d = Daemon::start().await;
    let r = d.json("POST", "/v1/processes", json!({"argv": ["sleep", "100"], "tag": "s"})).await.json();
    let pid = r["pid"].as_i64().unwrap() as i32;
    let w = d.json("POST", "/v1/processes/s/wait", json!({"timeout_ms": 100})).await.json();
    assert_eq!(w["state"], "running");
    d.json("POST", "/v1/processes/s/signal", json!({"signal": "TERM"})).await;
    let w = d.json("POST", "/v1/processes/s/wait", json!({"timeout_ms": 5000})).await.json();
    assert_eq!(w["exit"]["signal"], 15);
    assert!(!alive(pid));
    d.json("POST", "/v1/processes/s/signal", json!({"signal": "BOGUS"})).await.error(400, "invalid_argument");

    let r = d.json("POST", "/v1/processes", json!({"command": "sleep 100 & sleep 100", "tag": "tree"})).await.json();
    let leader = r["pid"].as_i64().unwrap() as i32;
    let del = d.call("DELETE", "/v1/processes/tree", Some(TOKEN), Body::Empty).await.unwrap();
    assert_eq!(del.status, 204);
    assert!(eventually(Duration::from_secs(5), || !alive(leader)).await);
    d.get("/v1/processes/tree").await.error(404, "not_found");
}

#[tokio::test]
async fn tags_are_unique_and_listed() {
    let d = Daemon::start().await;
    d.json("POST", "/v1/processes", json!({"argv": ["sleep", "5"], "tag": "one"})).await;
    d.json("POST", "/v1/processes", json!({"argv": ["sleep", "5"], "tag": "one"})).await.error(409, "conflict");
    d.json("POST", "/v1/processes", json!({"argv": ["true"], "tag": "p-3"})).await.error(400, "invalid_argument");
    let list = d.get("/v1/processes").await.json();
    assert_eq!(list["processes"].as_array().unwrap().len(), 1);
    assert_eq!(list["processes"][0]["tag"], "one");
    d.get("/v1/processes/nope").await.error(404, "not_found");
}

#[tokio::test]
async fn background_timeout_kills_the_tree() {
    let d = Daemon::start().await;
    d.json("POST", "/v1/processes", json!({"command": "sleep 100 & sleep 100", "tag": "t", "timeout_ms": 200})).await;
    let w = d.json("POST", "/v1/processes/t/wait", json!({"timeout_ms": 5000})).await.json();
    assert_eq!(w["exit"]["timed_out"], true, "{w}");
}
