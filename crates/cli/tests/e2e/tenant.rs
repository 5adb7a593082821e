//! What the attack suites do as a sandbox's tenant: make a sandbox, run shell scripts in it, and
//! read which of their probes got through.

use serde_json::{Value, json};

use super::Http;

/// A ready sandbox's id.
pub async fn sandbox(http: &Http, body: Value) -> String {
    let sb = http.create(body).await;
    assert_eq!(sb["state"], "ready", "{sb}");
    sb["id"].as_str().unwrap().to_string()
}

/// Runs `script` with `sh -c` in `id`, as `user` (the sandbox's root when `None`).
pub async fn sh(http: &Http, id: &str, user: Option<&str>, script: &str) -> Value {
    let mut body = json!({"argv": ["sh", "-c", script], "timeout_ms": 120_000});
    if let Some(u) = user {
        body["user"] = json!(u);
    }
    http.exec(id, body).await
}

pub fn stdout(v: &Value) -> &str {
    v["stdout"].as_str().unwrap_or_default()
}

/// Runs `script` and answers each line `name=<exit code>` it printed, in order.
pub async fn codes(http: &Http, id: &str, user: Option<&str>, script: &str) -> Vec<(String, String)> {
    let out = sh(http, id, user, script).await;
    stdout(&out).lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Asserts every `name=code` line reports a failure.
pub fn all_refused(what: &str, codes: &[(String, String)]) {
    assert!(!codes.is_empty(), "{what}: the script printed nothing");
    for (name, code) in codes {
        assert_ne!(code, "0", "{what}: `{name}` succeeded: {codes:?}");
    }
}
