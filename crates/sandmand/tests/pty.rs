//! Processes on a pseudo-terminal through the real daemon: interactive programs (`python3 -i`,
//! `less`, a shell) see a terminal, answer input written raw, and see a resize.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Body, Daemon, Events, TOKEN};
use serde_json::{Value, json};

/// A process on a terminal, with its followed output.
struct Term<'a> {
    d: &'a Daemon,
    id: String,
    events: Events,
    seen: String,
}

impl<'a> Term<'a> {
    async fn start(d: &'a Daemon, body: Value) -> Term<'a> {
        let r = d.json("POST", "/v1/processes", body).await;
        assert_eq!(r.status, 201, "{}", r.text());
        let id = r.json()["id"].as_str().unwrap().to_string();
        let mut conn = d.connect().await;
        let resp = conn
            .send("GET", &format!("/v1/processes/{id}/output?follow=true"), Some(TOKEN), Body::Empty)
            .await
            .unwrap();
        Term { d, id, events: Events::new(resp), seen: String::new() }
    }

    /// Reads output until `needle` has appeared after everything `expect` matched before; returns
    /// what came up to it. Bounded: the process is external, so this polls with a deadline.
    async fn expect(&mut self, needle: &str) -> String {
        let found = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                if let Some(at) = self.seen.find(needle) {
                    let upto: String = self.seen.drain(..at + needle.len()).collect();
                    return Some(upto);
                }
                let ev = self.events.next().await?;
                match ev["event"].as_str() {
                    Some("data") => self.seen.push_str(ev["data"].as_str().unwrap()),
                    Some("exit") => return None,
                    _ => {}
                }
            }
        })
        .await;
        match found {
            Ok(Some(upto)) => upto,
            _ => panic!("`{needle}` never came; output so far: {:?}", self.seen),
        }
    }

    async fn write(&self, text: &str) {
        let r = self
            .d
            .call(
                "POST",
                &format!("/v1/processes/{}/stdin", self.id),
                Some(TOKEN),
                Body::Bytes(text.as_bytes().to_vec()).octet_stream(),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }

    async fn resize(&self, rows: u16, cols: u16) -> Value {
        let r = self
            .d
            .json("POST", &format!("/v1/processes/{}/resize", self.id), json!({"rows": rows, "cols": cols}))
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }

    async fn wait(&self) -> Value {
        let r = self.d.json("POST", &format!("/v1/processes/{}/wait", self.id), json!({"timeout_ms": 20000})).await;
        let v = r.json();
        assert_eq!(v["state"], "exited", "{v}");
        v
    }
}

#[tokio::test]
async fn a_shell_on_a_terminal_sees_one_and_its_size_follows_resizes() {
    let d = Daemon::start().await;
    let mut t = Term::start(&d, json!({"argv": ["sh"], "pty": {"rows": 24, "cols": 80}, "tag": "sh"})).await;
    let info = d.get("/v1/processes/sh").await.json();
    assert_eq!(
        (info["pty"]["rows"].as_u64(), info["pty"]["cols"].as_u64(), info["stdin_open"].as_bool()),
        (Some(24), Some(80), Some(true))
    );
    // The terminal echoes input: the quotes keep the typed line from matching the output.
    t.write("test -t 0 && test -t 1 && test -t 2 && echo is-a-''tty; echo \"T=$TERM\"\n").await;
    t.expect("is-a-tty").await;
    t.expect("T=xterm-256color").await;
    t.write("stty size\n").await;
    t.expect("24 80").await;
    let resized = t.resize(40, 100).await;
    assert_eq!(resized["pty"], json!({"rows": 40, "cols": 100}));
    t.write("stty size\n").await;
    t.expect("40 100").await;
    // The terminal is its controlling terminal: `/dev/tty` opens.
    t.write("echo via-tty > /dev/tty && echo op''ened\n").await;
    t.expect("opened").await;
    // Ctrl-D at the prompt ends the shell; a terminal's `close` sends it.
    let r = d
        .call("POST", "/v1/processes/sh/stdin?close=true", Some(TOKEN), Body::Bytes(Vec::new()).octet_stream())
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(t.wait().await["exit"]["exit_code"], 0);
    // Output is one stream: stderr has nothing.
    assert_eq!(d.get("/v1/processes/sh/output?stream=stderr").await.json()["data"], "");
    let r = d.json("POST", "/v1/processes/sh/resize", json!({"rows": 10, "cols": 10})).await;
    r.error(409, "conflict");
}

#[tokio::test]
async fn python_repl_prompts_and_answers_on_a_terminal() {
    let d = Daemon::start().await;
    let mut t = Term::start(&d, json!({"argv": ["python3", "-i", "-q"], "pty": {"rows": 24, "cols": 80}})).await;
    t.expect(">>> ").await;
    t.write("print(6 * 7)\r").await;
    let answer = t.expect(">>> ").await;
    assert!(answer.contains("42\r\n"), "{answer:?}");
    t.write("import os; os.get_terminal_size()\r").await;
    t.expect("os.terminal_size(columns=80, lines=24)").await;
    t.resize(30, 120).await;
    t.write("os.get_terminal_size()\r").await;
    t.expect("os.terminal_size(columns=120, lines=30)").await;
    // Ctrl-C is KeyboardInterrupt at the prompt, not the end of the REPL.
    t.write("while True: pass\r").await;
    t.write("\r").await;
    t.write("\x03").await;
    t.expect("KeyboardInterrupt").await;
    t.expect(">>> ").await;
    t.write("raise SystemExit(3)\r").await;
    assert_eq!(t.wait().await["exit"]["exit_code"], 3);
}

#[tokio::test]
async fn less_pages_a_file_and_quits_on_q() {
    let d = Daemon::start().await;
    let file = d.dir().join("numbers.txt");
    std::fs::write(&file, (1..=1000).map(|n| format!("line {n}\n")).collect::<String>()).unwrap();
    let mut t = Term::start(
        &d,
        json!({"argv": ["less", file.display().to_string()], "pty": {"rows": 10, "cols": 40}, "env": {"LESS": ""}}),
    )
    .await;
    // One screen: nine lines and the prompt line.
    let first = t.expect("line 9").await;
    assert!(first.contains("line 1"), "{first:?}");
    t.write("G").await;
    t.expect("line 1000").await;
    t.write("q").await;
    assert_eq!(t.wait().await["exit"]["exit_code"], 0);
}

#[tokio::test]
async fn terminal_sizes_and_options_are_checked() {
    let d = Daemon::start().await;
    for size in [json!({"rows": 0, "cols": 80}), json!({"rows": 24, "cols": 1001})] {
        let r = d.json("POST", "/v1/processes", json!({"argv": ["true"], "pty": size})).await;
        assert!(r.error(400, "invalid_argument").contains("out of range"));
    }
    let r = d
        .json("POST", "/v1/processes", json!({"argv": ["true"], "pty": {"rows": 1, "cols": 1}, "merge_output": true}))
        .await;
    r.error(400, "invalid_argument");
    let p = d.json("POST", "/v1/processes", json!({"argv": ["sleep", "30"], "tag": "plain"})).await;
    assert_eq!(p.status, 201);
    assert!(p.json().get("pty").is_none());
    let r = d.json("POST", "/v1/processes/plain/resize", json!({"rows": 10, "cols": 10})).await;
    assert!(r.error(409, "conflict").contains("no terminal"));
    let r = d.json("POST", "/v1/processes/plain/resize", json!({"rows": 10, "cols": 10, "x": 1})).await;
    r.error(400, "invalid_argument");
    // Raw stdin refuses unknown query parameters, as JSON bodies refuse unknown fields.
    let r = d
        .call("POST", "/v1/processes/plain/stdin?closed=true", Some(TOKEN), Body::Bytes(b"x".to_vec()).octet_stream())
        .await
        .unwrap();
    r.error(400, "invalid_argument");
    d.call("DELETE", "/v1/processes/plain", Some(TOKEN), Body::Empty).await.unwrap();
}

#[tokio::test]
async fn raw_stdin_carries_bytes_json_cannot() {
    let d = Daemon::start().await;
    let p = d.json("POST", "/v1/processes", json!({"argv": ["od", "-An", "-tx1"], "stdin": true, "tag": "od"})).await;
    assert_eq!(p.status, 201, "{}", p.text());
    let r = d
        .call(
            "POST",
            "/v1/processes/od/stdin?close=true",
            Some(TOKEN),
            Body::Bytes(vec![0xff, 0x00, 0x41]).octet_stream(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stdin_open"], false);
    d.json("POST", "/v1/processes/od/wait", json!({})).await;
    let out = d.get("/v1/processes/od/output").await.json();
    assert_eq!(out["data"].as_str().unwrap().trim(), "ff 00 41");
}
