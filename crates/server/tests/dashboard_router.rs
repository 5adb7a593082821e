//! The dashboard through the whole router: its assets, its token, and its table at 12,000
//! sandboxes on the fake provider.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use sandman_provider::Endpoint;
use sandman_provider::fake::FakeProvider;
use tower::ServiceExt;

use sandman_server::api::{Limits, router};
use sandman_server::provider::AnyProvider;
use sandman_server::service::{Daemons, Service, Settings};
use sandman_server::ui::{API_ROUTES, ASSETS};

fn fake_app(dir: &std::path::Path) -> (Router, Arc<Service>) {
    let settings = Settings { create_rate: None, daemons: Daemons::Absent, ..Settings::new(dir.to_path_buf()) };
    let provider = AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("none.sock"))));
    let service = Service::new(settings, provider, "t".into());
    service.start_background();
    let limits = Limits { request_timeout: Duration::from_secs(600), max_concurrent: 64 };
    (router(service.clone(), limits), service)
}

fn fake(service: &Service) -> &FakeProvider {
    match &service.provider {
        AnyProvider::Fake(f) => f,
        _ => panic!("not the fake provider"),
    }
}

fn req(method: &str, uri: &str, body: &str, token: Option<&str>) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(uri).header("content-type", "application/json");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    b.body(Body::from(body.to_string())).unwrap_or_default()
}

/// Status, headers and body of one call.
async fn raw(app: &Router, r: Request<Body>) -> (u16, http::HeaderMap, Vec<u8>) {
    let resp = app.clone().oneshot(r).await.unwrap_or_else(|e| match e {});
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20).await.unwrap_or_default();
    (status, headers, bytes.to_vec())
}

async fn json(app: &Router, uri: &str) -> serde_json::Value {
    let (status, _, body) = raw(app, req("GET", uri, "", Some("t"))).await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    assert_eq!(status, 200, "{uri}: {v}");
    v
}

fn ids(page: &serde_json::Value) -> Vec<String> {
    page["sandboxes"].as_array().into_iter().flatten().filter_map(|s| s["id"].as_str().map(str::to_string)).collect()
}

#[tokio::test]
async fn the_assets_are_served_with_their_types_without_the_token() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (app, _) = fake_app(dir.path());
    for (path, kind, body) in ASSETS {
        let (status, headers, got) = raw(&app, req("GET", path, "", None)).await;
        assert_eq!(status, 200, "{path}");
        assert_eq!(headers.get("content-type").and_then(|v| v.to_str().ok()), Some(*kind), "{path}");
        assert_eq!(got, body.as_bytes(), "{path}");
        let csp = headers.get("content-security-policy").and_then(|v| v.to_str().ok()).unwrap_or_default();
        assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"), "{path}: {csp}");
        assert_eq!(headers.get("x-content-type-options").and_then(|v| v.to_str().ok()), Some("nosniff"));
    }
    let (_, _, index) = raw(&app, req("GET", "/ui", "", None)).await;
    let index = String::from_utf8_lossy(&index);
    // The page loads its own script and style only, and asks for the token in a form.
    assert!(index.contains(r#"<script src="/ui/app.js">"#) && index.contains(r#"type="password""#), "{index}");
    assert!(!index.contains("<script>") && !index.contains("style="), "inline code would break the CSP");
    // An asset name that does not exist is a 404 with the error body, not the page.
    let (status, _, body) = raw(&app, req("GET", "/ui/nothing.js", "", None)).await;
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
}

#[tokio::test]
async fn the_dashboard_calls_need_the_token() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (app, _) = fake_app(dir.path());
    for (method, path) in API_ROUTES {
        let uri = path.replace("{id}", "sb-x");
        for token in [None, Some("wrong"), Some("")] {
            let (status, _, body) = raw(&app, req(method, &uri, "", token)).await;
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            assert_eq!((status, v["error"]["code"].as_str()), (401, Some("unauthorized")), "{method} {path} {token:?}");
        }
        let (status, _, _) = raw(&app, req(method, &uri, "", Some("t"))).await;
        assert_eq!(status, 200, "{method} {path}");
    }
    // Bad pages are refused naming what is wrong.
    for (query, named) in
        [("limit=0", "`limit`"), ("limit=501", "`limit`"), ("state=sleepy", "`sleepy`"), ("color=red", "color")]
    {
        let (status, _, body) = raw(&app, req("GET", &format!("/ui/api/sandboxes?{query}"), "", Some("t"))).await;
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(status, 400, "{query}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(named)), "{query}: {v}");
    }
}

/// Waits (on the paused clock) until no create is queued or creating.
async fn settle(app: &Router) -> serde_json::Value {
    for _ in 0..10_000 {
        let s = json(app, "/ui/api/summary").await;
        if s["by_state"]["queued"] == 0 && s["by_state"]["creating"] == 0 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the creates never settled");
}

/// The issue's scale: 12,000 sandboxes of two jobs, some failed. Every page comes from the
/// server's table alone (the fake's sandboxes have no daemon: asking one would fail), pages
/// never overlap nor skip, and each filter gives exactly the sandboxes it names.
#[tokio::test(start_paused = true)]
async fn the_table_pages_and_filters_12000_sandboxes_on_the_server() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (app, service) = fake_app(dir.path());
    fake(&service).fail_image("bad/image");
    let mut by_job: [HashSet<String>; 2] = Default::default();
    let mut labelled = HashSet::new();
    let mut failed = HashSet::new();
    for i in 0..12_000 {
        let job = ["train", "eval"][i % 2];
        let image = if i % 1000 == 7 { "bad/image" } else { "python:3.12" };
        let body =
            format!(r#"{{"image": "{image}", "job": "{job}", "wait": false, "labels": {{"task": "t{}"}}}}"#, i % 40);
        let (status, _, sb) = raw(&app, req("POST", "/v1/sandboxes", &body, Some("t"))).await;
        let sb: serde_json::Value = serde_json::from_slice(&sb).unwrap_or_default();
        assert_eq!(status, 200, "{sb}");
        let id = sb["id"].as_str().unwrap_or_default().to_string();
        by_job[i % 2].insert(id.clone());
        if i % 40 == 13 {
            labelled.insert(id.clone());
        }
        if image == "bad/image" {
            failed.insert(id);
        }
    }
    let summary = settle(&app).await;
    assert_eq!(summary["total"], 12_000, "{summary}");
    assert_eq!(summary["by_state"]["ready"], 12_000 - failed.len(), "{summary}");
    assert_eq!(summary["by_state"]["failed"], failed.len(), "{summary}");
    assert_eq!(
        summary["failures"]["by_reason"]["image_pull_failed"]
            .as_array()
            .map(|b| b.iter().filter_map(|n| n.as_u64()).sum::<u64>()),
        Some(failed.len() as u64),
        "{summary}"
    );
    let jobs: Vec<(String, u64)> = summary["jobs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|j| (j["job"].as_str().unwrap_or_default().to_string(), j["live"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(jobs, [("train".to_string(), 6000), ("eval".to_string(), 5988)], "{summary}");

    // Every page of one job, newest first, adds up to exactly that job's sandboxes.
    let mut seen = Vec::new();
    let mut created = Vec::new();
    let mut offset = 0;
    loop {
        let page = json(&app, &format!("/ui/api/sandboxes?job=train&limit=500&offset={offset}")).await;
        assert_eq!(page["total"], 6000, "{}", page["total"]);
        let got = ids(&page);
        if got.is_empty() {
            break;
        }
        created.extend(page["sandboxes"].as_array().into_iter().flatten().map(|s| s["created_at_ms"].as_u64()));
        seen.extend(got);
        offset += 500;
    }
    let unique: HashSet<String> = seen.iter().cloned().collect();
    assert_eq!(seen.len(), 6000, "pages overlapped or skipped");
    assert!(unique == by_job[0], "the pages of `train` are not its sandboxes");
    assert!(created.windows(2).all(|w| w[0] >= w[1]), "not newest first");

    // A state, a label, an id, a reason: each filter names exactly its sandboxes.
    let page = json(&app, "/ui/api/sandboxes?state=failed&limit=500").await;
    assert_eq!(ids(&page).into_iter().collect::<HashSet<_>>(), failed);
    assert!(page["sandboxes"].as_array().into_iter().flatten().all(|s| s["reason"] == "image_pull_failed"));
    let page = json(&app, "/ui/api/sandboxes?q=task%3Dt13&limit=500").await;
    assert_eq!(ids(&page).into_iter().collect::<HashSet<_>>(), labelled);
    let one = by_job[1].iter().next().cloned().unwrap_or_default();
    let page = json(&app, &format!("/ui/api/sandboxes?q={}", one.to_uppercase())).await;
    assert_eq!((page["total"].as_u64(), ids(&page)), (Some(1), vec![one]));
    let page = json(&app, "/ui/api/sandboxes?q=PULL_FAILED&job=eval&limit=500").await;
    let want: HashSet<String> = failed.intersection(&by_job[1]).cloned().collect();
    assert_eq!(ids(&page).into_iter().collect::<HashSet<_>>(), want);
    let page = json(&app, "/ui/api/sandboxes?state=live&offset=11900&limit=500").await;
    assert_eq!((page["total"].as_u64(), ids(&page).len()), (Some(11_988), 88));

    // Nothing of it was a call on a sandbox.
    let metrics = service.metrics.encode();
    assert!(metrics.contains("sandman_proxied_requests_total 0"), "{metrics}");
}

#[tokio::test(start_paused = true)]
async fn a_sandboxs_events_and_the_jobs_table_follow_a_release() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (app, _service) = fake_app(dir.path());
    let (status, _, _) = raw(&app, req("PUT", "/v1/jobs/j1", r#"{"max_sandboxes": 10, "weight": 2}"#, Some("t"))).await;
    assert_eq!(status, 200);
    let mut made = Vec::new();
    for _ in 0..3 {
        let (_, _, sb) = raw(&app, req("POST", "/v1/sandboxes", r#"{"image": "x", "job": "j1"}"#, Some("t"))).await;
        let sb: serde_json::Value = serde_json::from_slice(&sb).unwrap_or_default();
        made.push(sb["id"].as_str().unwrap_or_default().to_string());
    }
    let jobs = json(&app, "/ui/api/jobs").await;
    let j1 = &jobs["jobs"][0];
    assert_eq!(
        (j1["name"].as_str(), j1["live"].as_u64(), j1["by_state"]["ready"].as_u64()),
        (Some("j1"), Some(3), Some(3)),
        "{jobs}"
    );
    assert_eq!((j1["spec"]["weight"].as_f64(), j1["usage"]["live"].as_u64()), (Some(2.0), Some(3)), "{jobs}");

    let (status, _, _) = raw(&app, req("DELETE", &format!("/v1/sandboxes/{}", made[0]), "", Some("t"))).await;
    assert_eq!(status, 200);
    let events = json(&app, &format!("/ui/api/sandboxes/{}/events", made[0])).await;
    let states: Vec<&str> =
        events["events"].as_array().into_iter().flatten().filter_map(|e| e["state"].as_str()).collect();
    assert_eq!(states.first(), Some(&"creating"), "{events}");
    assert_eq!(states.last(), Some(&"gone"), "{events}");
    assert!(events["events"].as_array().into_iter().flatten().all(|e| e["sandbox"] == made[0].as_str()));
    let last = events["events"].as_array().and_then(|e| e.last()).cloned().unwrap_or_default();
    assert_eq!(last["reason"], "released", "{events}");

    // Release-all as the jobs page does it: every other sandbox of the job ends.
    let (status, _, _) = raw(&app, req("DELETE", "/v1/jobs/j1", "", Some("t"))).await;
    assert_eq!(status, 200);
    let jobs = json(&app, "/ui/api/jobs").await;
    assert_eq!(jobs["jobs"].as_array().map(Vec::len), Some(0), "{jobs}");
    let page = json(&app, "/ui/api/sandboxes?job=j1&state=gone").await;
    let reasons: BTreeSet<&str> =
        page["sandboxes"].as_array().into_iter().flatten().filter_map(|s| s["reason"].as_str()).collect();
    assert_eq!((page["total"].as_u64(), reasons), (Some(3), BTreeSet::from(["job_deleted", "released"])));
}

/// Sample names a `/metrics` text can carry, from its `# TYPE` lines (every family has one, with
/// or without series yet).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let mut parts = line.strip_prefix("# TYPE ").unwrap_or_default().split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else { continue };
        match kind {
            "counter" => names.extend([format!("{name}_total")]),
            "histogram" => names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}"))),
            _ => names.extend([name.to_string()]),
        }
    }
    names
}

/// PromQL functions and keywords with an underscore, which are not metric names.
const PROMQL_WORDS: &[&str] = &["histogram_quantile", "label_values", "clamp_min", "group_left", "group_right"];
/// Metrics of other exporters the alert rules read on purpose: the Kubernetes API server's.
const EXTERNAL: &[&str] = &["apiserver_request_total"];

/// The metric names an expression reads: its identifiers with an underscore, quoted label
/// values and `$variables` left out.
fn metric_names(expr: &str) -> Vec<String> {
    let mut unquoted = String::new();
    let mut quoted = false;
    for c in expr.chars() {
        if c == '"' {
            quoted = !quoted;
            unquoted.push(' ');
        } else if !quoted {
            unquoted.push(c);
        }
    }
    unquoted
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '$'))
        .filter(|t| t.contains('_') && !t.starts_with('$') && !t.starts_with(|c: char| c.is_ascii_digit()))
        .filter(|t| !PROMQL_WORDS.contains(t))
        .map(str::to_string)
        .collect()
}

fn panels_of(v: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    for p in v["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(panels_of(p));
    }
    out
}

/// The Grafana dashboard and the alert rules parse, and every metric they read is one that a
/// live `/metrics` of this server declares (or, for the rules, a named exporter's).
#[tokio::test(start_paused = true)]
async fn the_grafana_dashboard_and_the_alerts_read_only_metrics_the_server_exports() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (app, service) = fake_app(dir.path());
    // A family shows in /metrics once it has a series: give every one a series, by the calls
    // that make them (a job, a pool and a claim from it, releases).
    let call = |m: &'static str, uri: &'static str, body: &'static str| {
        let app = app.clone();
        async move {
            let (status, _, body) = raw(&app, req(m, uri, body, Some("t"))).await;
            assert_eq!(status, 200, "{m} {uri}: {}", String::from_utf8_lossy(&body));
            serde_json::from_slice::<serde_json::Value>(&body).unwrap_or_default()
        }
    };
    call("PUT", "/v1/jobs/j", r#"{"weight": 1}"#).await;
    call("PUT", "/v1/pools/p", r#"{"image": "x", "min_ready": 1}"#).await;
    for _ in 0..1000 {
        if call("GET", "/v1/pools/p", "").await["ready"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let claimed = call("POST", "/v1/sandboxes", r#"{"pool": "p", "job": "j"}"#).await;
    let cold = call("POST", "/v1/sandboxes", r#"{"image": "x", "job": "j"}"#).await;
    call("POST", "/v1/jobs/j/heartbeat", "").await;
    let (status, _, _) =
        raw(&app, req("DELETE", &format!("/v1/sandboxes/{}", cold["id"].as_str().unwrap_or_default()), "", Some("t")))
            .await;
    assert_eq!(status, 200);
    assert_eq!(claimed["state"], "ready", "{claimed}");
    // The fake's sandboxes have no daemon to report CPU at release: account one record with it,
    // as a release does when the daemon answers.
    service.metrics.accounted(&sandman_wire::server::UsageRecord {
        job: Some("j".into()),
        cpu_seconds: Some(1.5),
        ..serde_json::from_value(serde_json::json!({
            "sandbox": "sb-x", "image": "x", "provider": "fake", "created_ms": 0, "ended_ms": 1,
            "state": "gone", "reason": "released", "wall_seconds": 1.0
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    });
    let (status, _, text) = raw(&app, req("GET", "/metrics", "", Some("t"))).await;
    assert_eq!(status, 200);
    let exported = exported(&String::from_utf8_lossy(&text));
    for want in
        ["sandman_sandboxes", "sandman_job_sandboxes", "sandman_pool_claims_total", "sandman_job_cpu_seconds_total"]
    {
        assert!(exported.contains(want), "/metrics lacks {want}: {exported:?}");
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");

    let text = std::fs::read_to_string(root.join("deploy/grafana/sandman.json")).unwrap_or_else(|e| panic!("{e}"));
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("sandman.json: {e}"));
    assert_eq!(dash["uid"], "sandman");
    let mut exprs: Vec<(String, String)> = Vec::new();
    let panels = panels_of(&dash);
    assert!(panels.len() >= 15, "{} panels", panels.len());
    for p in panels.iter().filter(|p| p["type"] != "row") {
        let title = p["title"].as_str().unwrap_or_default().to_string();
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        assert!(!targets.is_empty(), "panel `{title}` has no query");
        for t in targets {
            exprs.push((title.clone(), t["expr"].as_str().unwrap_or_default().to_string()));
        }
    }
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(q) = v["query"]["query"].as_str() {
            exprs.push((format!("variable {}", v["name"]), q.to_string()));
        }
    }
    let text =
        std::fs::read_to_string(root.join("deploy/prometheus/sandman-rules.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let rules: serde_json::Value = serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("sandman-rules.yaml: {e}"));
    assert_eq!(
        (rules["apiVersion"].as_str(), rules["kind"].as_str()),
        (Some("monitoring.coreos.com/v1"), Some("PrometheusRule"))
    );
    let mut alerts = BTreeSet::new();
    for rule in rules["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
    {
        let name = rule["alert"].as_str().unwrap_or_default().to_string();
        assert!(rule["for"].is_string() && rule["labels"]["severity"].is_string(), "{name}: {rule}");
        assert!(rule["annotations"]["summary"].is_string() && rule["annotations"]["description"].is_string(), "{name}");
        exprs.push((format!("alert {name}"), rule["expr"].as_str().unwrap_or_default().to_string()));
        alerts.insert(name);
    }
    // The issue's alerts: queue wait, failure rate by reason, sandboxes past their lease, 429s.
    for want in
        ["SandmanQueueWaitHigh", "SandmanFailureRateHigh", "SandmanSandboxesPastDeadline", "SandmanKubeAPIThrottled"]
    {
        assert!(alerts.contains(want), "no {want} in {alerts:?}");
    }
    for (what, expr) in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{what}: `{expr}` reads no metric");
        for n in names {
            let known = exported.contains(&n) || (what.starts_with("alert") && EXTERNAL.contains(&n.as_str()));
            assert!(known, "{what}: `{n}` is not a metric the server exports (`{expr}`)");
        }
    }
}

#[test]
fn metric_names_leave_out_label_values_and_functions() {
    let names = metric_names(
        r#"histogram_quantile(0.9, sum by (le) (rate(sandman_x_bucket{reason!~"job_deleted|a_b",job=~"$job"}[5m])))"#,
    );
    assert_eq!(names, ["sandman_x_bucket"]);
}
