//! What server replicas share through the API server (`shared`), against a mocked API server:
//! the documents' ConfigMap written after each change with the `resourceVersion` last seen, a
//! conflict fencing the writer, and the conditions key made once and read by every replica.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::sync::{Arc, Mutex};

use common::{Reply, mock, ok};
use http::StatusCode;
use sandman_provider_kube::shared::{DOCUMENTS, KEY_SECRET, LEASE, Shared};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const NS: &str = "sandman-system";

fn status(code: u16, reason: &str) -> Reply {
    Reply::Json(
        StatusCode::from_u16(code).unwrap(),
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code, "message": reason}),
    )
}

/// One ConfigMap and one Secret, with resource versions checked as the API server checks them.
#[derive(Default)]
struct Objects {
    configmap: Option<Value>,
    secret: Option<Value>,
    lease: Option<Value>,
    rv: u64,
    /// Another writer's update lands before the next replace.
    someone_else_writes: bool,
}

/// Makes the object of `slot` from `body`, with a new resource version: 409 when it exists.
fn create(slot: &mut Option<Value>, rv: &mut u64, mut body: Value) -> Reply {
    if slot.is_some() {
        return status(409, "AlreadyExists");
    }
    *rv += 1;
    body["metadata"]["resourceVersion"] = rv.to_string().into();
    *slot = Some(body.clone());
    Reply::Json(StatusCode::CREATED, body)
}

/// Replaces the object of `slot` with `body`, as the API server does: only when `body` carries
/// the resource version stored (else 409), and with a new one.
fn replace(slot: &mut Option<Value>, rv: &mut u64, mut body: Value) -> Reply {
    let stored = slot.as_ref().map(|o| o["metadata"]["resourceVersion"].clone());
    if stored.is_none() || stored != Some(body["metadata"]["resourceVersion"].clone()) {
        return status(409, "Conflict");
    }
    *rv += 1;
    body["metadata"]["resourceVersion"] = rv.to_string().into();
    *slot = Some(body.clone());
    ok(body)
}

impl Objects {
    fn handle(&mut self, method: &str, path: &str, body: Value) -> Reply {
        let leases = format!("/apis/coordination.k8s.io/v1/namespaces/{NS}/leases");
        let configmaps = format!("/api/v1/namespaces/{NS}/configmaps");
        let secrets = format!("/api/v1/namespaces/{NS}/secrets");
        let (slot, named) = if path.starts_with(&leases) {
            (&mut self.lease, format!("{leases}/{LEASE}"))
        } else if path.starts_with(&configmaps) {
            if method == "PUT" && std::mem::take(&mut self.someone_else_writes) {
                self.rv += 1;
                if let Some(cm) = self.configmap.as_mut() {
                    cm["metadata"]["resourceVersion"] = self.rv.to_string().into();
                }
            }
            (&mut self.configmap, format!("{configmaps}/{DOCUMENTS}"))
        } else if path.starts_with(&secrets) {
            (&mut self.secret, format!("{secrets}/{KEY_SECRET}"))
        } else {
            return status(404, "NotFound");
        };
        match method {
            "GET" if path == named => slot.clone().map_or_else(|| status(404, "NotFound"), ok),
            "POST" if path != named => create(slot, &mut self.rv, body),
            "PUT" if path == named => replace(slot, &mut self.rv, body),
            _ => status(404, "NotFound"),
        }
    }
}

fn cluster() -> (Shared, Arc<Mutex<Objects>>, common::Mock) {
    let objects = Arc::new(Mutex::new(Objects::default()));
    let seen = objects.clone();
    let (client, mock) = mock(move |req| seen.lock().unwrap().handle(&req.method, &req.path, req.json()));
    (Shared::new(client, NS), objects, mock)
}

#[tokio::test]
async fn documents_are_written_with_the_version_last_seen_and_a_conflict_fences_the_writer() {
    let (shared, objects, mock) = cluster();
    let cancel = CancellationToken::new();
    let docs = shared.documents(cancel.clone()).await.unwrap();
    assert_eq!(docs.get("jobs.json"), None, "made empty");
    let v = docs.set("jobs.json", r#"{"a":1}"#.into());
    docs.written(v).await.unwrap();
    let v = docs.set("pools.json", r#"{"p":2}"#.into());
    docs.written(v).await.unwrap();
    let stored = objects.lock().unwrap().configmap.clone().unwrap();
    assert_eq!(stored["data"], json!({"jobs.json": r#"{"a":1}"#, "pools.json": r#"{"p":2}"#}));
    // Every replace carried the version the one before answered.
    let puts: Vec<String> = mock
        .seen()
        .iter()
        .filter(|s| s.method == "PUT")
        .map(|s| s.json()["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(puts, ["1", "2"]);

    // A second replica reads what the first wrote.
    let (other, other_objects, _other_mock) = cluster();
    *other_objects.lock().unwrap() = Objects { configmap: Some(stored), rv: 3, ..Objects::default() };
    let read = other.documents(cancel.clone()).await.unwrap();
    assert_eq!(read.get("pools.json").as_deref(), Some(r#"{"p":2}"#));

    // Someone else wrote meanwhile: the write is refused, the change is not called kept, and the
    // writer is fenced (its replica must stop leading).
    objects.lock().unwrap().someone_else_writes = true;
    let v = docs.set("jobs.json", r#"{"a":2}"#.into());
    let why = docs.written(v).await.unwrap_err();
    assert!(why.contains("two replicas acted as leader"), "{why}");
    assert!(docs.fenced().is_cancelled());
    cancel.cancel();
}

#[tokio::test]
async fn the_conditions_key_is_made_once_and_read_by_every_replica() {
    let (shared, objects, _mock) = cluster();
    let key = shared.key(|| vec![7u8; 32]).await.unwrap();
    assert_eq!(key, vec![7u8; 32]);
    // Another replica finds it and never makes its own.
    let again = shared.key(|| panic!("a second key was made")).await.unwrap();
    assert_eq!(again, key);
    // A Secret too short to be a key is refused, naming it.
    objects.lock().unwrap().secret = Some(json!({"metadata": {"name": KEY_SECRET}, "data": {"key": "c2hvcnQ="}}));
    let err = shared.key(|| vec![1u8; 32]).await.unwrap_err().to_string();
    assert!(err.contains(KEY_SECRET) && err.contains("5 bytes"), "{err}");
}

fn holder(objects: &Mutex<Objects>) -> Option<String> {
    objects.lock().unwrap().lease.as_ref().and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
}

/// Two replicas' shared state on one mocked API server, and the objects it holds.
fn two_replicas() -> (Arc<Mutex<Objects>>, Shared, Shared, common::Mock) {
    let objects = Arc::new(Mutex::new(Objects::default()));
    let shared_objects = objects.clone();
    let (client, mock) = mock(move |req| shared_objects.lock().unwrap().handle(&req.method, &req.path, req.json()));
    (objects, Shared::new(client.clone(), NS), Shared::new(client, NS), mock)
}

/// Two replicas campaign on one Lease: one leads, the other waits as long as the leader renews,
/// takes over at its next look once the leader releases it, and a leader whose Lease someone
/// else wrote stops leading at its next renewal.
#[tokio::test(start_paused = true)]
async fn one_replica_leads_until_it_releases_the_lease_or_another_writes_it() {
    let (objects, a, b, _mock) = two_replicas();
    let (mut a_leads, a_task) = a.elect("10.0.0.1:7777").await.unwrap();
    a_leads.wait_for(|l| *l).await.unwrap();
    assert_eq!(holder(&objects).as_deref(), Some("10.0.0.1:7777"));
    let (mut b_leads, _b_task) = b.elect("10.0.0.2:7777").await.unwrap();
    // A minute of renewals: the follower never finds the Lease unchanged for its duration.
    tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    assert!(!*b_leads.borrow(), "two leaders");
    assert!(*a_leads.borrow());
    // The leader lets go: the follower takes over at its next look, long before 15 s.
    let released = tokio::time::Instant::now();
    drop(a_leads);
    a_task.await.unwrap();
    b_leads.wait_for(|l| *l).await.unwrap();
    assert!(released.elapsed() < std::time::Duration::from_secs(5), "{:?}", released.elapsed());
    assert_eq!(holder(&objects).as_deref(), Some("10.0.0.2:7777"));
    // Someone else writes the Lease (a replica that took it after missing renewals): the
    // leader's next renewal finds it and it stops leading.
    {
        let mut o = objects.lock().unwrap();
        o.rv += 1;
        let rv = o.rv.to_string();
        let lease = o.lease.as_mut().unwrap();
        lease["spec"]["holderIdentity"] = "10.0.0.3:7777".into();
        lease["metadata"]["resourceVersion"] = rv.into();
    }
    b_leads.wait_for(|l| !*l).await.unwrap();
    assert_eq!(holder(&objects).as_deref(), Some("10.0.0.3:7777"), "the deposed leader wrote the Lease back");
}

/// A leader that dies without letting go: a follower takes the Lease once it has seen it
/// unchanged for the Lease's duration, and not before.
#[tokio::test(start_paused = true)]
async fn a_follower_takes_over_from_a_dead_leader_after_the_lease_duration() {
    let (objects, a, b, _mock) = two_replicas();
    let (mut a_leads, a_task) = a.elect("10.0.0.1:7777").await.unwrap();
    a_leads.wait_for(|l| *l).await.unwrap();
    let (mut b_leads, _b_task) = b.elect("10.0.0.2:7777").await.unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    // Killed: no more renewals, no release.
    a_task.abort();
    let died = tokio::time::Instant::now();
    b_leads.wait_for(|l| *l).await.unwrap();
    let took = died.elapsed();
    let duration = std::time::Duration::from_secs(sandman_provider_kube::shared::LEASE_DURATION_S);
    assert!(took >= duration - std::time::Duration::from_secs(2), "took over after {took:?}, before the Lease ran out");
    assert!(took <= duration + std::time::Duration::from_secs(3), "took over only after {took:?}");
    assert_eq!(holder(&objects).as_deref(), Some("10.0.0.2:7777"));
}
