//! The E2B routes through the whole server router, on the fake provider: credentials, error
//! shapes, bounds and refusals (the real SDK's suite is python/harness/e2b).

use axum::body::Body;
use sandman_provider::Endpoint;
use sandman_provider::fake::FakeProvider;
use tower::ServiceExt;

use sandman_server::api::{Limits, router};
use sandman_server::service::{Daemons, Service, Settings};

fn app(dir: &std::path::Path) -> axum::Router {
    let settings = Settings { create_rate: None, daemons: Daemons::Absent, ..Settings::new(dir.to_path_buf()) };
    let provider =
        sandman_server::provider::AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("none.sock"))));
    let service = Service::new(settings, provider, "t".into());
    service.start_background();
    router(service, Limits { request_timeout: std::time::Duration::from_secs(30), max_concurrent: 16 })
}

async fn call(
    app: &axum::Router,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, serde_json::Value) {
    let mut b = http::Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = app.clone().oneshot(b.body(Body::from(body.to_string())).unwrap_or_default()).await;
    let resp = resp.unwrap_or_else(|e| match e {});
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap_or_default();
    (status, serde_json::from_slice(&bytes).unwrap_or_default())
}

const KEY: (&str, &str) = ("x-api-key", "t");
const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test]
async fn control_errors_are_the_sdks_shape() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let app = app(dir.path());
    let (s, v) = call(&app, "GET", "/e2b/v2/sandboxes", &[("x-api-key", "wrong")], "").await;
    assert_eq!((s, v["code"].as_u64()), (401, Some(401)), "{v}");
    // Sandman's own bearer token does not open it, nor E2B's key Sandman's API.
    let (s, _) = call(&app, "GET", "/e2b/v2/sandboxes", &[("authorization", "Bearer t")], "").await;
    assert_eq!(s, 401);
    let (s, _) = call(&app, "GET", "/v1/sandboxes", &[KEY], "").await;
    assert_eq!(s, 401);
    let (s, v) = call(&app, "GET", "/e2b/v2/sandboxes", &[KEY], "").await;
    assert_eq!((s, v), (200, serde_json::json!([])));
    let (s, v) = call(&app, "DELETE", "/e2b/sandboxes/sb-none", &[KEY], "").await;
    assert_eq!((s, v["code"].as_u64()), (404, Some(404)), "{v}");
    let (s, v) = call(&app, "POST", "/e2b/sandboxes/sb-none/pause", &[KEY, JSON], "{}").await;
    assert_eq!((s, v["code"].as_u64()), (404, Some(404)), "{v}");
    let (s, v) = call(&app, "POST", "/e2b/templates", &[KEY, JSON], "{}").await;
    assert_eq!(s, 501, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| m.contains("not supported")), "{v}");
}

#[tokio::test]
async fn every_number_of_the_control_plane_is_bounded() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let app = app(dir.path());
    for body in [
        r#"{"templateID":"x","timeout":0}"#,
        r#"{"templateID":"x","timeout":86401}"#,
        r#"{"templateID":"x","timeout":18446744073709551615}"#,
        r#"{"templateID":"x","timeout":-1}"#,
        r#"{"templateID":""}"#,
        r#"{"templateID":"x","autoPause":true}"#,
    ] {
        let (s, v) = call(&app, "POST", "/e2b/v2/sandboxes", &[KEY, JSON], body).await;
        assert_eq!((s, v["code"].as_u64()), (400, Some(400)), "{body}: {v}");
    }
    for q in ["limit=0", "limit=101", "limit=-1", "nextToken=nonsense", "state=frozen", "order=sideways"] {
        let (s, v) = call(&app, "GET", &format!("/e2b/v2/sandboxes?{q}"), &[KEY], "").await;
        assert_eq!((s, v["code"].as_u64()), (400, Some(400)), "{q}: {v}");
    }
}

#[tokio::test]
async fn envd_calls_need_the_sandboxs_access_token() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let app = app(dir.path());
    let (s, _) = call(&app, "GET", "/e2b/envd/health", &[("e2b-sandbox-id", "sb-1")], "").await;
    assert_eq!(s, 401);
    let other = sandman_server::e2b::access_token("t", "sb-2");
    let (s, _) =
        call(&app, "GET", "/e2b/envd/health", &[("e2b-sandbox-id", "sb-1"), ("x-access-token", &other)], "").await;
    assert_eq!(s, 401);
    // The right token for a sandbox that is not there: E2B's "was not found" 502.
    let token = sandman_server::e2b::access_token("t", "sb-1");
    let (s, v) =
        call(&app, "GET", "/e2b/envd/health", &[("e2b-sandbox-id", "sb-1"), ("x-access-token", &token)], "").await;
    assert_eq!(s, 502, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| m.contains("was not found")), "{v}");
    let headers =
        [("e2b-sandbox-id", "sb-1"), ("x-access-token", token.as_str()), ("content-type", "application/json")];
    let (s, v) = call(&app, "POST", "/e2b/envd/filesystem.Filesystem/Stat", &headers, r#"{"path":"/"}"#).await;
    assert_eq!((s, v["code"].as_str()), (502, Some("unavailable")), "{v}");
    let (s, v) = call(&app, "POST", "/e2b/envd/process.Process/StreamInput", &headers, "{}").await;
    assert_eq!((s, v["code"].as_str()), (501, Some("unimplemented")), "{v}");
    // A stream must be asked for as one.
    let (s, v) = call(&app, "POST", "/e2b/envd/process.Process/Start", &headers, "{}").await;
    assert_eq!((s, v["code"].as_str()), (400, Some("invalid_argument")), "{v}");
}
