//! SandboxFusion's API on the real `sandman serve` (process provider, isolated, image `host`):
//! its models field by field, every language this machine has, the credentials (the server's
//! token, a job's capability URL and its revocation), isolation between calls, queueing with 504
//! only past a call's own timeout, `run_jupyter`, and the failures of the service told apart
//! from the program's in answers, metrics and events. verl's own client is run against it by
//! `./scripts/test-harnesses verl`.
#![allow(clippy::unwrap_used)]

mod e2e;

use std::time::{Duration, Instant};

use base64::Engine;
use e2e::{Body, Http, Server, cli};
use serde_json::{Value, json};

/// A caller with no credentials, as verl is.
fn anonymous(server: &Server) -> Http {
    Http { addr: server.addr.clone(), token: None }
}

async fn run(http: &Http, path: &str, body: Value) -> Value {
    let r = http.post(path, body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// Whether this machine (the `host` image) passes a shell test, on the PATH a sandbox has (not
/// the test's own, which may hold a user's interpreters).
fn passes(test: &str) -> bool {
    std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(test)
        .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Whether this machine has `tool` on a sandbox's PATH.
fn has(tool: &str) -> bool {
    passes(&format!("command -v {tool}"))
}

#[tokio::test]
async fn run_code_answers_with_sandboxfusions_models() {
    let server = Server::start();
    let http = server.client();
    let r = run(
        &http,
        "/fusion/run_code",
        json!({
            "code": "import sys\nname = sys.stdin.read().strip()\nprint('hello', name)\nimport os; os.makedirs('out')\nopen('out/answer.txt', 'w').write(open('data/in.txt').read().upper())\nsys.stderr.write('note')",
            "stdin": "world",
            "language": "python",
            "files": {"data/in.txt": b64("from a file"), "skipped.txt": null},
            "fetch_files": ["out/answer.txt", "missing.txt"],
            "compile_timeout": 5,
            "run_timeout": 20,
            "memory_limit_MB": 256,
            "an_unknown_field": "ignored, as SandboxFusion does",
        }),
    )
    .await;
    assert_eq!(r["status"], "Success", "{r}");
    assert_eq!(r["message"], "");
    assert!(r["compile_result"].is_null(), "{r}");
    let run_result = &r["run_result"];
    assert_eq!(run_result["status"], "Finished");
    assert_eq!(run_result["return_code"], 0);
    assert_eq!(run_result["stdout"], "hello world\n");
    assert_eq!(run_result["stderr"], "note");
    assert!(run_result["execution_time"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(r["files"], json!({"out/answer.txt": b64("FROM A FILE")}), "only files that exist come back");
    let sandbox = r["executor_pod_name"].as_str().unwrap();
    assert!(sandbox.starts_with("sb-"), "{r}");
    // The call's sandbox is released once it answered.
    let gone = e2e::eventually(Duration::from_secs(10), async || {
        http.get(&format!("/v1/sandboxes/{sandbox}")).await.json()["state"] == "gone"
    })
    .await;
    assert!(gone, "the call's sandbox was not released");

    // `language` absent is python, as verl's tutorial tool sends only `code`.
    let r = run(&http, "/fusion/run_code", json!({"code": "print(6 * 7)"})).await;
    assert_eq!((r["status"].clone(), r["run_result"]["stdout"].clone()), (json!("Success"), json!("42\n")), "{r}");

    let ping = http.get("/fusion/v1/ping").await;
    assert_eq!((ping.status, ping.json()), (200, json!("pong")));
}

#[tokio::test]
async fn a_programs_own_failures_are_failed_and_the_services_are_sandbox_error() {
    let server = Server::start();
    let http = server.client();
    let exit3 = run(&http, "/fusion/run_code", json!({"code": "import sys; print('x'); sys.exit(3)"})).await;
    assert_eq!(exit3["status"], "Failed", "{exit3}");
    assert_eq!(exit3["run_result"]["status"], "Finished");
    assert_eq!(exit3["run_result"]["return_code"], 3);
    assert_eq!(exit3["run_result"]["stdout"], "x\n");

    let raised = run(&http, "/fusion/run_code", json!({"code": "raise ValueError('boom')"})).await;
    assert_eq!((raised["status"].clone(), raised["run_result"]["return_code"].clone()), (json!("Failed"), json!(1)));
    assert!(raised["run_result"]["stderr"].as_str().unwrap().contains("ValueError: boom"), "{raised}");

    let killed =
        run(&http, "/fusion/run_code", json!({"code": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"}))
            .await;
    assert_eq!(killed["run_result"]["return_code"], -9, "a signal is -N, as Python's returncode: {killed}");

    let slow = run(
        &http,
        "/fusion/run_code",
        json!({"code": "import time\nprint('started', flush=True)\ntime.sleep(30)", "run_timeout": 1}),
    )
    .await;
    assert_eq!(slow["status"], "Failed", "{slow}");
    assert_eq!(slow["run_result"]["status"], "TimeLimitExceeded");
    assert!(slow["run_result"]["return_code"].is_null());
    assert_eq!(slow["run_result"]["stdout"], "started\n", "the output before the timeout is kept");

    // A language the image lacks is the service's failure, naming the language and the image.
    let missing = ["julia", "ruby", "lua", "Rscript"].into_iter().find(|t| !has(t)).unwrap();
    let language = if missing == "Rscript" { "R" } else { missing };
    let r = run(&http, "/fusion/run_code", json!({"code": "1", "language": language})).await;
    assert_eq!(r["status"], "SandboxError", "{r}");
    let message = r["message"].as_str().unwrap();
    assert!(message.contains(&format!("`{language}`")) && message.contains("`host`"), "{message}");
    // One SandboxFusion names but this server does not serve: the same.
    let r = run(&http, "/fusion/run_code", json!({"code": "1", "language": "verilog"})).await;
    assert_eq!(r["status"], "SandboxError", "{r}");
    assert!(r["message"].as_str().unwrap().contains("`verilog`"), "{r}");

    // Not a request: FastAPI's 422, naming each field.
    let bad = http
        .post(
            "/fusion/run_code",
            json!({"code": "1", "language": "cobol", "run_timeout": 1e9, "memory_limit_MB": 1_000_000}),
        )
        .await;
    assert_eq!(bad.status, 422, "{}", String::from_utf8_lossy(&bad.body));
    let fields: Vec<Value> = bad.json()["detail"].as_array().unwrap().iter().map(|d| d["loc"][1].clone()).collect();
    assert_eq!(fields, [json!("language"), json!("run_timeout"), json!("memory_limit_MB")]);
    let no_code = http.post("/fusion/run_code", json!({"language": "python"})).await;
    assert_eq!(no_code.status, 422);

    // The metric tells the program's failures from the service's.
    let metrics = String::from_utf8_lossy(&http.get("/metrics").await.body).into_owned();
    for (outcome, n) in [("failed", 4), ("sandbox_error", 2), ("invalid", 2)] {
        let line = format!("sandman_fusion_calls_total{{job=\"\",outcome=\"{outcome}\"}} {n}");
        assert!(metrics.lines().any(|l| l == line), "{line} missing from:\n{metrics}");
    }
    // And the events carry the service's failures, with why.
    let events = http.get("/v1/events").await.json();
    let fusion: Vec<&Value> = events["events"].as_array().unwrap().iter().filter(|e| e["kind"] == "fusion").collect();
    assert!(fusion.iter().any(|e| e["message"].as_str().unwrap_or_default().contains("`verilog`")), "{events}");
}

#[tokio::test]
async fn every_language_this_machine_has_runs_and_compiles() {
    let server = Server::start();
    let http = server.client();
    // (language, tool it needs, a program printing `ok` and the number read from stdin)
    let programs = [
        ("python", "python3", "print('ok', int(input()) + 1)"),
        ("bash", "bash", "read n; echo ok $((n + 1))"),
        ("perl", "perl", "my $n = <STDIN>; print 'ok ', $n + 1, \"\\n\";"),
        (
            "cpp",
            "g++",
            "#include <iostream>\nint main() { int n; std::cin >> n; std::cout << \"ok \" << n + 1 << std::endl; }",
        ),
        ("go", "go", "package main\nimport \"fmt\"\nfunc main() { var n int; fmt.Scan(&n); fmt.Println(\"ok\", n+1) }"),
        (
            "java",
            "javac",
            "import java.util.*;\npublic class Main { public static void main(String[] a) { int n = new Scanner(System.in).nextInt(); System.out.println(\"ok \" + (n + 1)); } }",
        ),
        ("nodejs", "node", "const n = parseInt(require('fs').readFileSync(0, 'utf8')); console.log('ok', n + 1);"),
        (
            "rust",
            "rustc",
            "fn main() { let mut s = String::new(); std::io::stdin().read_line(&mut s).unwrap(); let n: i32 = s.trim().parse().unwrap(); println!(\"ok {}\", n + 1); }",
        ),
        ("ruby", "ruby", "puts \"ok #{gets.to_i + 1}\""),
        ("lua", "lua", "print('ok ' .. io.read('n') + 1)"),
        ("php", "php", "echo 'ok ' . (intval(trim(fgets(STDIN))) + 1) . \"\\n\";"),
    ];
    let mut ran = Vec::new();
    for (language, tool, code) in programs {
        let r = run(
            &http,
            "/fusion/run_code",
            json!({"code": code, "language": language, "stdin": "41\n", "run_timeout": 60, "compile_timeout": 60}),
        )
        .await;
        if has(tool) {
            assert_eq!(r["status"], "Success", "{language}: {r}");
            assert_eq!(r["run_result"]["stdout"].as_str().unwrap().trim_end(), "ok 42", "{language}: {r}");
            ran.push(language);
        } else {
            assert_eq!(r["status"], "SandboxError", "{language} without {tool}: {r}");
            assert!(r["message"].as_str().unwrap().contains(tool), "{language}: {r}");
        }
    }
    // The test machine's own: scripts/test installs g++ and pytest.
    for needed in ["python", "bash", "cpp"] {
        assert!(ran.contains(&needed), "{needed} did not run here (install it: scripts/test does); ran {ran:?}");
    }
    // A compiled language's compile step: its result, and no run after it failed.
    let broken = run(&http, "/fusion/run_code", json!({"code": "int main() { return x; }", "language": "cpp"})).await;
    assert_eq!(broken["status"], "Failed", "{broken}");
    assert_eq!(broken["compile_result"]["status"], "Finished");
    assert_ne!(broken["compile_result"]["return_code"], 0);
    assert!(broken["compile_result"]["stderr"].as_str().unwrap().contains("error"), "{broken}");
    assert!(broken["run_result"].is_null(), "{broken}");
    let ok = run(&http, "/fusion/run_code", json!({"code": "int main() { return 0; }", "language": "cpp"})).await;
    assert_eq!(
        (ok["compile_result"]["return_code"].clone(), ok["run_result"]["return_code"].clone()),
        (json!(0), json!(0))
    );
    // pytest: a passing and a failing test file.
    if passes("python3 -c 'import pytest'") {
        let pass = run(
            &http,
            "/fusion/run_code",
            json!({"code": "def test_one():\n    assert 1 + 1 == 2\n", "language": "pytest"}),
        )
        .await;
        assert_eq!(pass["status"], "Success", "{pass}");
        let fail = run(
            &http,
            "/fusion/run_code",
            json!({"code": "def test_one():\n    assert 1 == 2\n", "language": "pytest"}),
        )
        .await;
        assert_eq!(
            (fail["status"].clone(), fail["run_result"]["return_code"].clone()),
            (json!("Failed"), json!(1)),
            "{fail}"
        );
    }
}

#[tokio::test]
async fn a_job_url_needs_no_header_belongs_to_the_job_and_is_revocable() {
    let server = Server::start();
    let http = server.client();
    let nobody = anonymous(&server);
    // No credentials, or wrong ones: refused.
    assert_eq!(nobody.post("/fusion/run_code", json!({"code": "print(1)"})).await.status, 401);
    let wrong = Http { addr: server.addr.clone(), token: Some("not-the-token".into()) };
    assert_eq!(wrong.post("/fusion/run_code", json!({"code": "print(1)"})).await.status, 401);
    assert_eq!(nobody.get("/fusion/v1/ping").await.status, 401);
    assert_eq!(nobody.post("/fusion/job/0123abcd/run_code", json!({"code": "print(1)"})).await.status, 401);
    // Making a key needs the token.
    assert_eq!(nobody.post("/v1/jobs/rl/fusion-key", json!({})).await.status, 401);

    let (code, url, err) = cli(&server, &["job", "fusion-url", "rl"]);
    assert_eq!(code, 0, "{err}");
    let url = url.trim().to_string();
    let prefix = format!("{}/fusion/job/", server.url);
    assert!(url.starts_with(&prefix) && url.len() == prefix.len() + 64, "{url}");
    let path = url.strip_prefix(&server.url).unwrap().to_string();
    // Asked again, the same URL.
    assert_eq!(cli(&server, &["job", "fusion-url", "rl"]).1.trim(), url);

    let r = run(&nobody, &format!("{path}/run_code"), json!({"code": "print('as the job')"})).await;
    assert_eq!(r["run_result"]["stdout"], "as the job\n", "{r}");
    assert_eq!(nobody.get(&format!("{path}/v1/ping")).await.json(), json!("pong"));
    // Accounted to the job like any sandbox.
    let counted = e2e::eventually(Duration::from_secs(10), async || {
        http.get("/v1/jobs/rl/usage").await.json()["sandboxes"].as_u64() == Some(1)
    })
    .await;
    assert!(counted, "{}", http.get("/v1/jobs/rl/usage").await.json());
    let metrics = String::from_utf8_lossy(&http.get("/metrics").await.body).into_owned();
    assert!(metrics.contains("sandman_fusion_calls_total{job=\"rl\",outcome=\"success\"} 1"), "{metrics}");

    let (code, out, err) = cli(&server, &["job", "fusion-url", "rl", "--revoke"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("revoked"), "{out}");
    assert_eq!(nobody.post(&format!("{path}/run_code"), json!({"code": "print(1)"})).await.status, 401);
    // Revoking twice says there is none; a new URL is a new key.
    let (code, _, err) = cli(&server, &["job", "fusion-url", "rl", "--revoke"]);
    assert_ne!(code, 0);
    assert!(err.contains("no SandboxFusion key"), "{err}");
    let (_, fresh, _) = cli(&server, &["job", "fusion-url", "rl"]);
    assert_ne!(fresh.trim(), url);
    // Deleting the job revokes it too.
    http.call("DELETE", "/v1/jobs/rl", Body::Empty).await.ok();
    let fresh_path = fresh.trim().strip_prefix(&server.url).unwrap().to_string();
    assert_eq!(nobody.post(&format!("{fresh_path}/run_code"), json!({"code": "print(1)"})).await.status, 401);
}

#[tokio::test]
async fn each_call_has_a_sandbox_of_its_own_with_no_network_and_nothing_of_the_last() {
    let server = Server::start();
    let http = server.client();
    let first = run(
        &http,
        "/fusion/run_code",
        json!({"code": "open('/tmp/left-behind', 'w').write('x')\nimport os\nprint(os.getpid(), os.getuid())"}),
    )
    .await;
    assert_eq!(first["status"], "Success", "{first}");
    let check = "import os, socket\n\
                 print(os.path.exists('/tmp/left-behind'))\n\
                 print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n\
                 print(len([p for p in os.listdir('/proc') if p.isdigit()]) < 10)\n\
                 s = socket.socket()\n\
                 s.settimeout(2)\n\
                 try:\n    s.connect(('203.0.113.10', 80)); print('reached')\n\
                 except OSError as e:\n    print('unreachable')\n";
    let second = run(&http, "/fusion/run_code", json!({"code": check})).await;
    assert_eq!(second["run_result"]["stdout"], "False\n['lo']\nTrue\nunreachable\n", "{second}");
    assert_ne!(first["executor_pod_name"], second["executor_pod_name"]);
}

#[tokio::test]
async fn calls_past_the_slots_queue_and_get_504_only_past_their_own_timeout() {
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server = Server::start_in(&dir.path().join("state"), &["--fusion-max-calls", "2"]);
    let http = server.client();
    // Twelve calls of 0.3 s through two slots: all queue, all answered.
    let started = Instant::now();
    let mut calls = Vec::new();
    for i in 0..12 {
        let http = http.clone();
        calls.push(tokio::spawn(async move {
            run(
                &http,
                "/fusion/run_code",
                json!({"code": format!("import time; time.sleep(0.3); print({i})"), "run_timeout": 30}),
            )
            .await
        }));
    }
    for (i, c) in calls.into_iter().enumerate() {
        let r = c.await.unwrap();
        assert_eq!(
            (r["status"].clone(), r["run_result"]["stdout"].clone()),
            (json!("Success"), json!(format!("{i}\n"))),
            "{r}"
        );
    }
    // Twelve of 0.3 s through two slots take at least six rounds.
    assert!(started.elapsed() >= Duration::from_millis(1800), "{:?}", started.elapsed());

    // Both slots held by long calls: a call with a 1 s timeout cannot start, and says so with
    // 504 (the one status verl retries), after about its timeout, not at once.
    let mut long = Vec::new();
    for _ in 0..2 {
        let http = http.clone();
        long.push(tokio::spawn(async move {
            run(&http, "/fusion/run_code", json!({"code": "import time; time.sleep(4)", "run_timeout": 30})).await
        }));
    }
    let busy = e2e::eventually(Duration::from_secs(20), async || {
        http.get("/v1/sandboxes?state=ready").await.json()["sandboxes"].as_array().unwrap().len() == 2
    })
    .await;
    assert!(busy);
    let asked = Instant::now();
    let late = http.post("/fusion/run_code", json!({"code": "print(1)", "run_timeout": 1})).await;
    assert_eq!(late.status, 504, "{}", String::from_utf8_lossy(&late.body));
    assert!(asked.elapsed() >= Duration::from_millis(900), "answered 504 before its timeout: {:?}", asked.elapsed());
    for l in long {
        assert_eq!(l.await.unwrap()["status"], "Success");
    }
    let metrics = String::from_utf8_lossy(&http.get("/metrics").await.body).into_owned();
    assert!(metrics.contains("outcome=\"not_started\"} 1"), "{metrics}");
}

#[tokio::test]
async fn run_jupyter_runs_cells_in_one_kernel() {
    let server = Server::start();
    let http = server.client();
    let has_kernel = passes("python3 -c 'import jupyter_client, ipykernel'");
    let r = run(
        &http,
        "/fusion/run_jupyter",
        json!({
            "cells": ["a = 123", "a", "print(a)", "import sys; sys.stderr.write('to stderr')", "raise RuntimeError('boom')"],
            "files": {"data.txt": b64("hi")},
            "fetch_files": ["data.txt"],
        }),
    )
    .await;
    assert!(has_kernel, "this machine needs python3-ipykernel and python3-jupyter-client (scripts/test installs them)");
    assert_eq!(r["status"], "Success", "{r}");
    let cells = r["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 5, "{r}");
    assert_eq!(cells[1]["display"][0]["text/plain"], "123", "{r}");
    assert_eq!(cells[2]["stdout"], "123\n");
    assert_eq!(cells[3]["stderr"], "to stderr");
    assert_eq!(cells[4]["error"][0]["ename"], "RuntimeError", "{r}");
    assert_eq!(r["files"]["data.txt"], b64("hi"));
    assert_eq!(r["driver"]["status"], "Finished");

    // A cell past the total timeout.
    let slow =
        run(&http, "/fusion/run_jupyter", json!({"cells": ["import time; time.sleep(30)"], "total_timeout": 2})).await;
    assert_eq!(slow["status"], "Failed", "{slow}");
}

#[tokio::test]
async fn run_jupyter_in_an_image_without_a_kernel_is_a_sandbox_error() {
    // The busybox test image (scripts/test-images) has no python3 at all, and no bash.
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let server =
        Server::start_in(&dir.path().join("state"), &["--fusion-image", "docker-daemon:sandman-test/busybox:latest"]);
    let http = server.client();
    let r = run(&http, "/fusion/run_jupyter", json!({"cells": ["1"]})).await;
    assert_eq!(r["status"], "SandboxError", "{r}");
    assert!(r["message"].as_str().unwrap().contains("Python kernel"), "{r}");
    let r = run(&http, "/fusion/run_code", json!({"code": "print(1)"})).await;
    assert_eq!(r["status"], "SandboxError", "{r}");
    assert!(r["message"].as_str().unwrap().contains("python3"), "{r}");
    let r = run(&http, "/fusion/run_code", json!({"code": "echo hi", "language": "bash"})).await;
    assert_eq!(r["status"], "SandboxError", "{r}");
    assert!(r["message"].as_str().unwrap().contains("/bin/bash"), "{r}");
    let events = http.get("/v1/events").await.json();
    assert!(events["events"].as_array().unwrap().iter().any(|e| e["kind"] == "fusion"), "{events}");
}
