//! Exec through the real daemon: argv and shell strings, env, cwd, user, stdin, timeouts that kill
//! whole trees, output caps, usage, and the streamed form.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{Body, Daemon, Events, TOKEN, alive, eventually};
use serde_json::json;

#[tokio::test]
async fn argv_exec_returns_output_exit_code_and_usage() {
    let d = Daemon::start().await;
    let r = d.exec(json!({"argv": ["/bin/sh", "-c", "echo out; echo err >&2; exit 7"]})).await;
    assert_eq!(r["exit_code"], 7);
    assert_eq!(r["stdout"], "out\n");
    assert_eq!(r["stderr"], "err\n");
    assert_eq!(r["timed_out"], false);
    assert!(r["signal"].is_null());
    assert!(r["usage"]["max_rss_kib"].as_u64().unwrap() > 0, "{r}");
    assert!(r["duration_ms"].as_u64().is_some());
}

#[tokio::test]
async fn shell_string_env_cwd_and_stdin() {
    let d = Daemon::start().await;
    let r = d
        .exec(json!({"command": "pwd; echo \"$GREETING\"; cat", "env": {"GREETING": "hi there"}, "cwd": "/tmp", "stdin": "from stdin"}))
        .await;
    assert_eq!(r["stdout"], "/tmp\nhi there\nfrom stdin", "{r}");
    assert_eq!(r["exit_code"], 0);
}

#[tokio::test]
async fn the_daemon_token_never_reaches_commands() {
    let d = Daemon::start().await;
    let r = d.exec(json!({"command": "env"})).await;
    let env = r["stdout"].as_str().unwrap();
    assert!(!env.contains("SANDMAN_"), "{env}");
    assert!(!env.contains(TOKEN), "{env}");
    assert!(env.contains("PATH="), "{env}");
}

#[tokio::test]
async fn dropped_prefixes_never_reach_commands_but_a_call_may_set_them() {
    // The test process's environment carries CARGO_*; the daemon passes it on unless told not to.
    let kept = Daemon::start().await;
    let env = kept.exec(json!({"command": "env"})).await;
    assert!(env["stdout"].as_str().unwrap().contains("CARGO_PKG_NAME="), "{env}");
    let d = Daemon::start_with(&["--drop-env", "CARGO_PKG_", "--drop-env", "CARGO_MANIFEST_"], None).await;
    let r = d.exec(json!({"command": "env", "env": {"CARGO_PKG_ASKED": "yes"}})).await;
    let env = r["stdout"].as_str().unwrap();
    assert!(!env.contains("CARGO_PKG_NAME=") && !env.contains("CARGO_MANIFEST_DIR="), "{env}");
    assert!(env.contains("CARGO_PKG_ASKED=yes") && env.contains("PATH="), "{env}");
}

#[tokio::test]
async fn numeric_user_needs_no_passwd_entry() {
    let d = Daemon::start().await;
    let r = d.exec(json!({"argv": ["/usr/bin/id", "-u"], "user": "4321:4321", "cwd": "/"})).await;
    assert_eq!(r["stdout"], "4321\n", "{r}");
    let r = d.exec(json!({"argv": ["/usr/bin/id", "-un"], "user": "nobody", "cwd": "/"})).await;
    assert_eq!(r["stdout"], "nobody\n", "{r}");
    let bad = d.json("POST", "/v1/exec", json!({"argv": ["true"], "user": "no-such-user"})).await;
    let msg = bad.error(400, "invalid_argument");
    assert!(msg.contains("no-such-user"), "{msg}");
}

#[tokio::test]
async fn timeout_kills_the_whole_tree_and_keeps_partial_output() {
    let d = Daemon::start().await;
    let marker = format!("sandman-timeout-{}", std::process::id());
    let started = Instant::now();
    let r = d
        .exec(json!({
            "command": format!("echo before; sleep 100 & echo $! > {marker}.pid; sleep 100"),
            "cwd": d.dir().display().to_string(),
            "timeout_ms": 300
        }))
        .await;
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    assert_eq!(r["timed_out"], true, "{r}");
    assert_eq!(r["signal"], 9, "{r}");
    assert_eq!(r["stdout"], "before\n");
    let grandchild: i32 =
        std::fs::read_to_string(d.dir().join(format!("{marker}.pid"))).unwrap().trim().parse().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || !alive(grandchild)).await,
        "grandchild {grandchild} survived the timeout"
    );
}

#[tokio::test]
async fn timeout_also_kills_descendants_that_left_the_group() {
    let d = Daemon::start().await;
    let pidfile = d.dir().join("escaped.pid");
    let r = d
        .exec(json!({
            "command": format!("setsid sleep 100 & echo $! > {}; sleep 100", pidfile.display()),
            "timeout_ms": 300
        }))
        .await;
    assert_eq!(r["timed_out"], true);
    let escaped: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    assert!(eventually(Duration::from_secs(5), || !alive(escaped)).await, "setsid child {escaped} survived");
}

#[tokio::test]
async fn output_cap_keeps_the_head_and_flags_truncation() {
    let d = Daemon::start().await;
    let r = d
        .exec(json!({"command": "head -c 100000 /dev/zero | tr '\\0' a; echo done >&2", "max_output_bytes": 1000}))
        .await;
    assert_eq!(r["stdout"].as_str().unwrap().len(), 1000);
    assert_eq!(r["stdout_truncated"], true);
    assert_eq!(r["stderr"], "done\n");
    assert_eq!(r["stderr_truncated"], false);
    assert_eq!(r["exit_code"], 0);
}

#[tokio::test]
async fn a_background_child_holding_the_pipe_does_not_hang_exec() {
    let d = Daemon::start().await;
    let started = Instant::now();
    let r = d.exec(json!({"command": "sleep 30 & echo quick"})).await;
    assert_eq!(r["stdout"], "quick\n");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

#[tokio::test]
async fn missing_program_and_bad_cwd_are_clear_errors() {
    let d = Daemon::start().await;
    let r = d.json("POST", "/v1/exec", json!({"argv": ["/no/such/program"]})).await;
    let msg = r.error(404, "not_found");
    assert!(msg.contains("/no/such/program"), "{msg}");
    let r = d.json("POST", "/v1/exec", json!({"argv": ["true"], "cwd": "relative"})).await;
    assert!(r.error(400, "invalid_argument").contains("not absolute"));
    let r = d.json("POST", "/v1/exec", json!({"argv": ["true"], "command": "true"})).await;
    r.error(400, "invalid_argument");
}

#[tokio::test]
async fn streamed_exec_sends_output_as_it_comes_then_exit() {
    let d = Daemon::start().await;
    let mut conn = d.connect().await;
    let resp = conn
        .send(
            "POST",
            "/v1/exec/stream",
            Some(TOKEN),
            Body::Json(json!({"command": "echo one; sleep 0.3; echo two >&2; exit 3"})),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let mut events = Events::new(resp);
    let started = events.next().await.unwrap();
    assert_eq!(started["event"], "started");
    assert!(started["pid"].as_u64().unwrap() > 0);
    let t0 = Instant::now();
    let first = events.next().await.unwrap();
    assert_eq!(first, json!({"event": "stdout", "data": "one\n"}));
    let second = events.next().await.unwrap();
    assert_eq!(second, json!({"event": "stderr", "data": "two\n"}));
    assert!(t0.elapsed() >= Duration::from_millis(200), "stderr came before the sleep ended");
    let exit = events.next().await.unwrap();
    assert_eq!(exit["event"], "exit");
    assert_eq!(exit["exit_code"], 3);
    assert!(events.next().await.is_none());
}

/// Streams `script` (which must write its shell's pid to `$PIDFILE`), waits for that pid, drops
/// the client, and asserts the command dies.
async fn stream_then_leave(script: &str) {
    let d = Daemon::start().await;
    let pidfile = d.dir().join("streamed.pid");
    let mut conn = d.connect().await;
    let body = Body::Json(json!({"command": script, "env": {"PIDFILE": pidfile.display().to_string()}}));
    let resp = conn.send("POST", "/v1/exec/stream", Some(TOKEN), body).await.unwrap();
    let mut events = Events::new(resp);
    assert_eq!(events.next().await.unwrap()["event"], "started");
    let written = || std::fs::read_to_string(&pidfile).unwrap_or_default().ends_with('\n');
    assert!(eventually(Duration::from_secs(5), written).await);
    let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    assert!(alive(pid));
    drop(events);
    drop(conn);
    assert!(eventually(Duration::from_secs(5), || !alive(pid)).await, "command {pid} outlived its client");
}

#[tokio::test]
async fn a_streamed_exec_whose_client_leaves_is_killed() {
    stream_then_leave("echo $$ > $PIDFILE; while true; do echo tick; sleep 0.05; done").await;
}

/// Regression: a silent command (no output to fail sending) outlived its streaming client.
#[tokio::test]
async fn a_silent_streamed_exec_whose_client_leaves_is_killed() {
    stream_then_leave("echo $$ > $PIDFILE; exec sleep 60").await;
}

#[tokio::test]
async fn concurrent_execs_all_complete() {
    let d = std::sync::Arc::new(Daemon::start().await);
    let mut handles = Vec::new();
    for i in 0..32 {
        let d = d.clone();
        handles.push(tokio::spawn(async move {
            let r = d.exec(json!({"argv": ["/bin/echo", i.to_string()]})).await;
            assert_eq!(r["stdout"], format!("{i}\n"));
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
}

#[tokio::test]
async fn an_exec_whose_client_leaves_is_killed() {
    let d = Daemon::start().await;
    let pidfile = d.dir().join("plain.pid");
    let mut conn = d.connect().await;
    let body = Body::Json(json!({"command": format!("echo $$ > {}; exec sleep 60", pidfile.display())}));
    let call = tokio::spawn(async move {
        let _ = conn.send("POST", "/v1/exec", Some(TOKEN), body).await;
    });
    assert!(eventually(Duration::from_secs(5), || pidfile.exists()).await);
    let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    assert!(alive(pid));
    call.abort();
    let _ = call.await;
    assert!(eventually(Duration::from_secs(5), || !alive(pid)).await, "command {pid} outlived its client");
}

#[tokio::test]
async fn merged_output_keeps_the_order_written_on_one_stream() {
    let d = Daemon::start().await;
    let script = "for i in 1 2 3; do echo out$i; echo err$i >&2; done";
    let r = d.exec(json!({"command": script, "merge_output": true})).await;
    assert_eq!(r["stdout"], "out1\nerr1\nout2\nerr2\nout3\nerr3\n");
    assert_eq!(r["stderr"], "");
    let apart = d.exec(json!({"command": script})).await;
    assert_eq!(
        (apart["stdout"].as_str(), apart["stderr"].as_str()),
        (Some("out1\nout2\nout3\n"), Some("err1\nerr2\nerr3\n"))
    );

    let streamed = d.json("POST", "/v1/exec/stream", json!({"command": script, "merge_output": true})).await.lines();
    let text: String =
        streamed.iter().filter(|e| e["event"] == "stdout").map(|e| e["data"].as_str().unwrap()).collect();
    assert_eq!(text, "out1\nerr1\nout2\nerr2\nout3\nerr3\n");
    assert!(streamed.iter().all(|e| e["event"] != "stderr"));

    let p = d.json("POST", "/v1/processes", json!({"command": script, "merge_output": true, "tag": "m"})).await;
    assert_eq!(p.status, 201, "{}", p.text());
    d.json("POST", "/v1/processes/m/wait", json!({})).await;
    assert_eq!(d.get("/v1/processes/m/output").await.json()["data"], "out1\nerr1\nout2\nerr2\nout3\nerr3\n");
    assert_eq!(d.get("/v1/processes/m").await.json()["stderr_bytes"], 0);
}

/// A daemon started from a shell's background job (`sandmand &`) inherits SIGINT and SIGQUIT
/// ignored; its commands must not (regression: interrupts did nothing in any sandbox).
#[tokio::test]
async fn commands_start_with_default_signals_whatever_the_daemon_inherited() {
    let d = Daemon::start_with(&[], Some(&["sh", "-c", "trap '' INT QUIT HUP TERM USR1; exec \"$0\" \"$@\""])).await;
    let daemon_ignores = std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap();
    assert!(daemon_ignores.lines().any(|l| l.starts_with("SigIgn:") && !l.ends_with("0000000000000000")));
    let r = d.exec(json!({"argv": ["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"]})).await;
    assert_eq!(r["stdout"], "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n");
    let p = d.json("POST", "/v1/processes", json!({"argv": ["sleep", "30"], "tag": "s"})).await;
    assert_eq!(p.status, 201);
    d.json("POST", "/v1/processes/s/signal", json!({"signal": "INT"})).await;
    let waited = d.json("POST", "/v1/processes/s/wait", json!({"timeout_ms": 10000})).await.json();
    assert_eq!(waited["exit"]["signal"], 2, "{waited}");
}

/// Every Rust program ignores SIGPIPE, the daemon too, and a start without a fork
/// (`posix_spawn`) passed that on: `yes | head -1` ended in `Broken pipe` errors. A daemon started
/// by a Rust program (this test, the server) also inherits one of glibc's own signals ignored;
/// none of that reaches a command.
#[tokio::test]
async fn commands_never_inherit_the_daemons_ignored_sigpipe() {
    let d = Daemon::start().await;
    let r = d.exec(json!({"argv": ["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"]})).await;
    assert_eq!(r["stdout"], "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n");
    let r = d.exec(json!({"command": "yes | head -n 1"})).await;
    assert_eq!((&r["stdout"], &r["stderr"], &r["exit_code"]), (&json!("y\n"), &json!(""), &json!(0)), "{r}");
}

/// Before, a `timeout_ms` of u64::MAX overflowed adding it to the start instant: a panic, and in
/// the shipped build (`panic = "abort"`) the whole daemon died with every process in it.
#[tokio::test]
async fn a_timeout_of_u64_max_is_refused_and_the_daemon_lives_on() {
    let d = Daemon::start().await;
    for (call, body) in [
        ("/v1/exec", json!({"argv": ["/bin/true"], "timeout_ms": u64::MAX})),
        ("/v1/exec/stream", json!({"argv": ["/bin/true"], "timeout_ms": u64::MAX})),
        ("/v1/processes", json!({"argv": ["/bin/true"], "timeout_ms": u64::MAX})),
    ] {
        let msg = d.json("POST", call, body).await.error(400, "invalid_argument");
        assert!(
            msg.contains("`timeout_ms` is 18446744073709551615; it must be between 0 and 604800000 (7 days)"),
            "{msg}"
        );
    }
    assert_eq!(d.exec(json!({"argv": ["/bin/echo", "alive"]})).await["stdout"], "alive\n");
}

/// Before, `max_output_bytes` had no ceiling: a sandbox of 100 MB drove its daemon to 2.1 GB.
#[tokio::test]
async fn max_output_bytes_over_the_ceiling_is_refused_but_a_stream_takes_any() {
    let d = Daemon::start_with(&["--max-output-bytes", "1000"], None).await;
    let msg = d
        .json("POST", "/v1/exec", json!({"argv": ["/bin/true"], "max_output_bytes": 1001}))
        .await
        .error(400, "invalid_argument");
    assert!(msg.contains("`max_output_bytes` is 1001; it must be between 0 and 1000"), "{msg}");
    // Without one, the ceiling is the cap.
    let r = d.exec(json!({"command": "head -c 5000 /dev/zero | tr '\\0' a"})).await;
    assert_eq!((r["stdout"].as_str().map(str::len), r["stdout_truncated"].as_bool()), (Some(1000), Some(true)));
    // A stream holds nothing: any cap will do.
    let resp = d.json("POST", "/v1/exec/stream", json!({"argv": ["/bin/true"], "max_output_bytes": u64::MAX})).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
}

/// Output held at once over every exec is bounded by `--max-buffered-output`: what does not fit
/// is cut and marked truncated, never held.
#[tokio::test]
async fn buffered_output_over_all_execs_is_bounded() {
    let d = Daemon::start_with(&["--max-buffered-output", "4096"], None).await;
    let r = d.exec(json!({"command": "head -c 100000 /dev/zero | tr '\\0' a"})).await;
    assert_eq!((r["stdout"].as_str().map(str::len), r["stdout_truncated"].as_bool()), (Some(4096), Some(true)));
    // Given back once answered.
    let r = d.exec(json!({"command": "head -c 3000 /dev/zero | tr '\\0' a"})).await;
    assert_eq!((r["stdout"].as_str().map(str::len), r["stdout_truncated"].as_bool()), (Some(3000), Some(false)));
}
