//! The service as a leader among replicas (`Store::Shared`) over the fake provider and a mocked
//! API server: which sandboxes a replica taking over finds ready (those the old leader marked
//! ready on the provider), and the documents one leader keeps that the next one reads.

use std::collections::BTreeMap;
use std::sync::Mutex;

use http_body_util::BodyExt;
use sandman_provider::fake::FakeProvider;
use sandman_provider::{Record, ServerMeta};
use sandman_provider_kube::shared::Shared;
use sandman_wire::server::{CreateSandbox, JobSpec, Reason, SandboxState};

use super::*;
use crate::sandbox::now_ms;
use crate::store::Store;

type Mock = tower_test::mock::Handle<http::Request<kube::client::Body>, http::Response<String>>;

/// A mocked API server holding one ConfigMap (`GET`, `POST`, `PUT`) and one Secret (`GET`,
/// `POST`), both kept in `objects` (path → object) so that several replicas can share it.
fn api(objects: Arc<Mutex<BTreeMap<String, serde_json::Value>>>) -> kube::Client {
    let (svc, mut handle): (_, Mock) = tower_test::mock::pair();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let path = parts.uri.path().to_string();
            let mut objects = objects.lock().unwrap_or_else(|e| e.into_inner());
            let (status, answer) = match parts.method.as_str() {
                "GET" => match objects.get(&path) {
                    Some(o) => (200, o.clone()),
                    None => (404, serde_json::json!({"kind": "Status", "reason": "NotFound", "code": 404})),
                },
                "POST" => {
                    let name = body["metadata"]["name"].as_str().unwrap_or_default().to_string();
                    objects.insert(format!("{path}/{name}"), body.clone());
                    (201, body)
                }
                "PUT" => {
                    objects.insert(path, body.clone());
                    (200, body)
                }
                _ => (405, serde_json::json!({"kind": "Status", "reason": "MethodNotAllowed", "code": 405})),
            };
            let resp = http::Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(answer.to_string())
                .unwrap_or_else(|e| panic!("{e}"));
            send.send_response(resp);
        }
    });
    kube::Client::new(svc, "sandman-system")
}

/// A leader's service over `provider`, its documents in the shared `objects`.
async fn leader(
    dir: &std::path::Path,
    provider: FakeProvider,
    objects: Arc<Mutex<BTreeMap<String, serde_json::Value>>>,
) -> Arc<Service> {
    let shared = Shared::new(api(objects), "sandman-system");
    let documents = shared.documents(CancellationToken::new()).await.unwrap_or_else(|e| panic!("{e}"));
    let key = shared.key(|| vec![3u8; 32]).await.unwrap_or_else(|e| panic!("{e}"));
    let store = Store::Shared { documents, key: key.into() };
    let settings = Settings { create_rate: None, daemons: Daemons::Absent, store, ..Settings::new(dir.to_path_buf()) };
    let s = Service::new(settings, AnyProvider::Fake(provider), "t".into());
    s.start_background();
    s
}

fn record(id: &str, ready: bool) -> Record {
    let mut spec = sandman_provider::conformance::spec(id, "img");
    spec.labels.clear();
    spec.job = None;
    spec.resources = Default::default();
    spec.created_at_ms = now_ms();
    spec.server = ServerMeta { lease_s: 600, idempotency_key: Some(format!("key-{id}")), ..ServerMeta::default() };
    let endpoint = Endpoint::Unix(format!("/nowhere/{id}.sock").into());
    let ready = ready.then(|| crate::journal::ready_line(id, None));
    Record { spec, endpoint, ended: None, claim: None, paused: false, ready }
}

fn state(s: &Service, id: &str) -> (SandboxState, Option<Reason>) {
    let w = s.get(id).map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
    (w.state, w.reason)
}

#[tokio::test]
async fn a_replica_taking_over_finds_ready_only_the_sandboxes_the_old_leader_marked_ready() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let provider = FakeProvider::new(Endpoint::Unix(dir.path().join("x")));
    provider.restore(record("sb-ready", true));
    // Made by the old leader, which died before it was ready: no mark.
    provider.restore(record("sb-half", false));
    let s = leader(dir.path(), provider, Arc::default()).await;
    let (live, dead) = s.recover().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((live, dead), (1, 1));
    assert_eq!(state(&s, "sb-ready"), (SandboxState::Ready, None));
    assert_eq!(state(&s, "sb-half"), (SandboxState::Failed, Some(Reason::CreateInterrupted)));
    // Its key makes a new sandbox when the client retries; the ready one's key answers it.
    let retry = CreateSandbox {
        image: "img".into(),
        wait: true,
        idempotency_key: Some("key-sb-half".into()),
        ..CreateSandbox::default()
    };
    let made = s.create(retry).await.unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(made.id, "sb-half");
    assert_eq!(made.state, SandboxState::Ready);
    let same = CreateSandbox {
        image: "img".into(),
        wait: true,
        idempotency_key: Some("key-sb-ready".into()),
        ..CreateSandbox::default()
    };
    assert_eq!(s.create(same).await.unwrap_or_else(|e| panic!("{e}")).id, "sb-ready");
}

#[tokio::test]
async fn a_leader_marks_each_new_sandbox_ready_on_the_provider() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = leader(dir.path(), FakeProvider::new(Endpoint::Unix(dir.path().join("x"))), Arc::default()).await;
    let made = s.create(CreateSandbox { image: "img".into(), wait: true, ..CreateSandbox::default() }).await;
    let made = made.unwrap_or_else(|e| panic!("{e}"));
    let AnyProvider::Fake(fake) = &s.provider else { unreachable!() };
    let records = fake.list().await.unwrap_or_else(|e| panic!("{e}"));
    let marked = records.iter().find(|r| r.spec.id == made.id).and_then(|r| r.ready.clone());
    assert_eq!(marked.as_deref(), Some(made.id.as_str()), "a sandbox without a record: its id alone");
}

#[tokio::test]
async fn the_next_leader_has_the_jobs_pools_and_usage_the_last_one_kept() {
    let objects: Arc<Mutex<BTreeMap<String, serde_json::Value>>> = Arc::default();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let first = leader(dir.path(), FakeProvider::new(Endpoint::Unix(dir.path().join("x"))), objects.clone()).await;
    first.put_job("train", JobSpec { max_sandboxes: Some(3), ..JobSpec::default() }).unwrap_or_else(|e| panic!("{e}"));
    let made = first
        .create(CreateSandbox {
            image: "img".into(),
            wait: true,
            job: Some("train".into()),
            ..CreateSandbox::default()
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    first.release(&made.id, Reason::Released).await.unwrap_or_else(|e| panic!("{e}"));
    first.settings.store.saved().await.unwrap_or_else(|e| panic!("{e}"));
    // Another replica, with a state directory of its own (a new pod's emptyDir).
    let other = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let next = leader(other.path(), FakeProvider::new(Endpoint::Unix(other.path().join("x"))), objects).await;
    let job = next.job("train").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(job.spec.max_sandboxes, Some(3));
    let usage = next.accounting.usage("train").unwrap_or_else(|| panic!("no usage carried over"));
    assert_eq!(usage.sandboxes, 1);
    assert_eq!(
        next.signer.as_ref().map(|s| s.key_id().to_string()),
        first.signer.as_ref().map(|s| s.key_id().to_string()),
        "both sign with the one key"
    );
}
