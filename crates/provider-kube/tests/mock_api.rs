//! The provider against a mocked API server (`tower_test::mock` behind `kube::Client::new`): the
//! conformance suite on a small fake cluster, then create, watch and delete flows answered with
//! the recorded bodies, including 409, 422, 429 with `Retry-After` (a plain-text body), a watch
//! `410 Gone` arriving as an ERROR event, and a watch that drops.
#![allow(clippy::unwrap_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Cluster, MISSING_IMAGE, NAMESPACE, Reply, Watches, as_ours, client_on, event, json, mock, ok, pod_list};
use http::StatusCode;
use sandman_image::{ImageStore, Progress, StoreConfig};
use sandman_provider::conformance::{self, spec};
use sandman_provider::{Claim, Endpoint, NamedDir, Provider, ProviderError, ProviderEvent, SandboxSpec, SnapshotScope};
use sandman_provider_kube::api::KubeApi;
use sandman_provider_kube::config::SnapshotsConfig;
use sandman_provider_kube::pace::Pacer;
use sandman_provider_kube::pod::build_pod;
use sandman_provider_kube::status::PodState;
use sandman_provider_kube::{CapacityConfig, Footprint, IdentityCheck, KubeConfig, KubeProvider, TokenDelivery};
use sandman_testkit::registry::{Auth, Compression, LayerBuilder, Registry, TestImage, host_arch};
use sandman_testkit::standin::StandIn;
use sandman_wire::server::Reason;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The mocked API server scripts the watches it serves, in order: capacity-aware admission (on by
/// default) would take two of them for its cluster-wide watches of nodes and pods. Its gate has
/// tests of its own (`capacity`), and the real API server's e2e suite runs with it on.
fn config() -> KubeConfig {
    KubeConfig {
        namespace: NAMESPACE.into(),
        daemon_image: "sandmand:test".into(),
        capacity: CapacityConfig::disabled(),
        ..KubeConfig::default()
    }
}

/// The provider on a mocked API server, whose pod IPs no daemon listens at: addresses are
/// trusted (the identity check has tests of its own, below and in `identity`).
fn provider(client: kube::Client) -> KubeProvider {
    provider_with(client, config())
}

fn provider_with(client: kube::Client, config: KubeConfig) -> KubeProvider {
    KubeProvider::new(client, config).unwrap_or_else(|e| panic!("{e}")).with_identity_check(IdentityCheck::Trust)
}

/// A recorded pod given another sandbox id (its name and label).
fn relabel(mut pod: Value, id: &str) -> Value {
    pod["metadata"]["name"] = format!("sandman-{id}").into();
    pod["metadata"]["labels"]["sandman.dev/sandbox"] = id.into();
    pod
}

/// The sandbox id a recorded pod carries.
fn id_of(pod: &Value) -> String {
    pod["metadata"]["labels"]["sandman.dev/sandbox"].as_str().unwrap().to_string()
}

/// The next provider event, within 10 s.
async fn next_event(events: &mut mpsc::Receiver<ProviderEvent>) -> ProviderEvent {
    tokio::time::timeout(Duration::from_secs(10), events.recv())
        .await
        .unwrap_or_else(|_| panic!("no provider event within 10 s"))
        .unwrap_or_else(|| panic!("the event stream ended"))
}

fn is(req: &common::Seen, method: &str, suffix: &str) -> bool {
    req.method == method && req.path.ends_with(suffix)
}

// ---- the conformance suite, on a fake cluster ----

/// The daemon check of the suite, on the fake cluster: the endpoint is the pod's IP, and the
/// token its Secret holds is the sandbox's.
fn check_daemon(cluster: common::Shared) -> impl Fn(Endpoint, String) -> std::future::Ready<Result<(), String>> {
    move |endpoint, token| {
        let c = cluster.lock().unwrap();
        let Endpoint::Tcp(addr) = &endpoint else { return std::future::ready(Err(format!("{endpoint:?}"))) };
        let Some(pod) = c.pod_at(addr) else { return std::future::ready(Err(format!("no pod at {addr}"))) };
        let name = pod["metadata"]["name"].as_str().unwrap();
        let stored = &c.secrets[name]["data"]["token"];
        let want = serde_json::to_value(k8s_openapi::ByteString(token.into_bytes())).unwrap();
        std::future::ready(if *stored == want { Ok(()) } else { Err(format!("secret holds {stored}")) })
    }
}

#[tokio::test]
async fn the_kubernetes_provider_passes_the_conformance_suite_on_a_mocked_api() {
    let cluster = Cluster::shared();
    let (client, _mock) = client_on(&cluster);
    let p = provider(client);
    conformance::create_list_delete(&p, spec("c1", "busybox:1"), check_daemon(cluster.clone())).await;
    conformance::many_at_once(&p, (0..20).map(|i| spec(&format!("m{i}"), "busybox:1")).collect()).await;
    conformance::refuses_clearly(&p, spec("r1", MISSING_IMAGE), "nonexistent.invalid").await;
    let mut pids = spec("r2", "busybox:1");
    pids.resources.pids = Some(64);
    conformance::refuses_clearly(&p, pids, "podPidsLimit").await;
    let (client2, _mock2) = client_on(&cluster);
    let second = provider(client2);
    conformance::found_again_after_restart(&p, &second, spec("f1", "busybox:1")).await;
    let killer = cluster.clone();
    conformance::death_is_reported(&p, spec("d1", "busybox:1"), |endpoint| async move {
        let Endpoint::Tcp(addr) = endpoint else { panic!("not TCP") };
        let mut c = killer.lock().unwrap();
        let mut pod = c.pod_at(&addr).unwrap();
        pod["status"] = json("status-oomkilled.json")["status"].clone();
        c.update(pod);
    })
    .await;
    let left: Vec<String> = cluster.lock().unwrap().pods.keys().cloned().collect();
    assert!(left.is_empty(), "pods left behind: {left:?}");
    assert!(cluster.lock().unwrap().secrets.is_empty(), "secrets left behind");
}

// ---- create ----

/// A mocked server whose watch streams the test feeds; pods and secrets are created as posted.
fn scripted(watches: Arc<Mutex<Watches>>) -> (kube::Client, common::Mock) {
    mock(move |req| {
        if is(req, "GET", "/pods") && req.is_watch() {
            return watches.lock().unwrap().next();
        }
        if is(req, "GET", "/pods") {
            return ok(pod_list("882", vec![]));
        }
        if is(req, "POST", "/pods") {
            let mut pod = req.json();
            pod["metadata"]["uid"] = "0292c379-16d0-4bdb-b9b5-5d0914c57894".into();
            return Reply::Json(StatusCode::CREATED, pod);
        }
        if is(req, "POST", "/secrets") {
            return Reply::Json(StatusCode::CREATED, req.json());
        }
        if req.method == "DELETE" {
            return ok(json("pod-delete-existing-200.json"));
        }
        Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
    })
}

#[tokio::test]
async fn create_answers_the_pods_ip_once_the_watch_shows_it_running() {
    let watches = Arc::new(Mutex::new(Watches::default()));
    let feed = watches.lock().unwrap().push();
    let (client, mock) = mock({
        let watches = watches.clone();
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.lock().unwrap().next();
            }
            if is(req, "GET", "/pods") {
                return ok(pod_list("882", vec![]));
            }
            if is(req, "POST", "/pods") {
                return Reply::Json(StatusCode::CREATED, json("pod-create-201.json"));
            }
            if is(req, "POST", "/secrets") {
                return Reply::Json(StatusCode::CREATED, req.json());
            }
            Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
        }
    });
    let p = provider(client);
    let mut s = spec("sbx-0001", "busybox:local");
    s.job = Some("job-a".into());
    let feeder = async {
        mock.until("the secret's create", |seen| seen.iter().any(|r| is(r, "POST", "/secrets"))).await;
        feed.send(event("ADDED", &json("pod-create-201.json"))).await.unwrap();
        // Pending, no IP: not yet.
        feed.send(event("MODIFIED", &json("status-init-running.json"))).await.unwrap();
        feed.send(event("MODIFIED", &json("pod-running-ready.json"))).await.unwrap();
    };
    let (endpoint, ()) = tokio::join!(p.create(&s), feeder);
    assert_eq!(endpoint.unwrap(), Endpoint::Tcp("10.244.0.26:7778".into()));
    let writes = mock.writes();
    assert_eq!(writes.len(), 2, "one pod and one secret: {writes:#?}");
    assert_eq!(writes[0].path, format!("/api/v1/namespaces/{NAMESPACE}/pods"));
    assert_eq!(writes[0].query.get("fieldManager").map(String::as_str), Some("sandman"));
    assert_eq!(writes[0].json(), serde_json::to_value(build_pod(&s, &config()).unwrap()).unwrap());
    let secret = writes[1].json();
    assert_eq!(secret["metadata"]["ownerReferences"][0]["uid"], "0292c379-16d0-4bdb-b9b5-5d0914c57894");
    assert_eq!(secret["stringData"]["token"], s.token.as_str());
}

#[tokio::test]
async fn failures_in_the_pod_status_fail_the_create_at_once_and_remove_the_pod() {
    let cases = [
        ("status-errimagepull.json", Reason::ImagePullFailed, "no such host"),
        ("status-unschedulable.json", Reason::Unschedulable, "Insufficient cpu"),
        ("status-oomkilled.json", Reason::OomKilled, "OOM-killed"),
        ("status-init-container-failed.json", Reason::DaemonStartFailed, "init container"),
        ("status-start-error-command-not-found.json", Reason::DaemonStartFailed, "/no/such/daemon"),
        ("status-daemon-exit-127.json", Reason::DaemonStartFailed, "exited with status 127"),
        ("status-deadline-exceeded.json", Reason::TtlExpired, "activeDeadlineSeconds"),
    ];
    let watches = Arc::new(Mutex::new(Watches::default()));
    let feed = watches.lock().unwrap().push();
    let (client, mock) = scripted(watches);
    let p = provider(client);
    assert_eq!(p.config().create_timeout_s, 600, "the create timeout is long; failures must not wait for it");
    for (fixture, reason, says) in cases {
        let recorded = json(fixture);
        let id = id_of(&recorded);
        let s = spec(&id, "busybox:local");
        let secrets_before = mock.seen().iter().filter(|r| is(r, "POST", "/secrets")).count();
        let feeder = async {
            mock.until("the secret's create", |seen| {
                seen.iter().filter(|r| is(r, "POST", "/secrets")).count() > secrets_before
            })
            .await;
            feed.send(event("MODIFIED", &recorded)).await.unwrap();
        };
        let started = Instant::now();
        let (result, ()) = tokio::join!(tokio::time::timeout(Duration::from_secs(10), p.create(&s)), feeder);
        match result.unwrap_or_else(|_| panic!("{fixture}: the create did not fail within 10 s")) {
            Err(ProviderError::Failed { reason: r, message }) => {
                assert_eq!(r, reason, "{fixture}: {message}");
                assert!(message.contains(says), "{fixture}: `{message}` does not say `{says}`");
            }
            other => panic!("{fixture}: {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            mock.seen().iter().any(|r| r.method == "DELETE" && r.path.ends_with(&format!("/pods/sandman-{id}"))),
            "{fixture}: the failed pod was not deleted"
        );
    }
}

/// Creates `sbx-0001` whose pod runs at 127.0.0.1, where a daemon stand-in holding `token`
/// answers; the provider checks identities.
async fn create_at_a_daemon_holding(token: &str) -> (Result<Endpoint, ProviderError>, StandIn, String, common::Mock) {
    let (standin, daemon) = StandIn::tcp(Some(token)).await;
    let port = daemon.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap();
    let watches = Arc::new(Mutex::new(Watches::default()));
    let feed = watches.lock().unwrap().push();
    let (client, mock) = scripted(watches);
    let config = KubeConfig { daemon_port: port, ..config() };
    let p = KubeProvider::new(client, config).unwrap();
    assert!(p.proves_daemon(), "a provider checking identities must say so, or the server checks again");
    let s = spec("sbx-0001", "busybox:local");
    let mut running = json("pod-running-ready.json");
    running["status"]["podIP"] = "127.0.0.1".into();
    running["status"]["podIPs"] = serde_json::json!([{"ip": "127.0.0.1"}]);
    let feeder = async {
        mock.until("the secret's create", |seen| seen.iter().any(|r| is(r, "POST", "/secrets"))).await;
        feed.send(event("MODIFIED", &running)).await.unwrap();
    };
    let (result, ()) = tokio::join!(tokio::time::timeout(Duration::from_secs(30), p.create(&s)), feeder);
    (result.unwrap_or_else(|_| panic!("the create did not end within 30 s")), standin, daemon, mock)
}

/// A provider that trusts pod addresses has proven nothing: the server must check the daemon.
#[tokio::test]
async fn a_provider_trusting_pod_addresses_leaves_the_daemons_proof_to_the_server() {
    let (client, _mock) = scripted(Arc::new(Mutex::new(Watches::default())));
    assert!(!provider(client).proves_daemon());
}

/// One health round trip proves the daemon, and the token is never sent with it.
#[tokio::test]
async fn a_create_hands_out_its_address_once_the_daemon_there_proves_the_sandboxs_token() {
    let (result, standin, daemon, mock) = create_at_a_daemon_holding("token-sbx-0001").await;
    assert_eq!(result.unwrap(), Endpoint::Tcp(daemon));
    assert_eq!((standin.health_calls(), standin.calls_with_a_token()), (1, 0));
    assert!(!mock.seen().iter().any(|r| r.method == "DELETE"), "the pod of a good create was deleted");
}

#[tokio::test]
async fn a_reused_pod_ip_answered_by_another_sandboxs_daemon_fails_the_create_and_removes_the_pod() {
    let (result, _standin, daemon, mock) = create_at_a_daemon_holding("token-of-another-sandbox").await;
    match result {
        Err(ProviderError::Failed { reason: Reason::DaemonStartFailed, message }) => {
            assert!(message.contains(&daemon) && message.contains("another sandbox"), "{message}")
        }
        other => panic!("a stranger's daemon was taken for the sandbox's: {other:?}"),
    }
    assert!(
        mock.seen().iter().any(|r| r.method == "DELETE" && r.path.ends_with("/pods/sandman-sbx-0001")),
        "the pod was not deleted"
    );
}

#[tokio::test]
async fn a_create_conflicting_with_another_pod_fails_and_a_retried_create_goes_on() {
    let ours = spec("sbx-0001", "busybox:local");
    let stored = Arc::new(Mutex::new(json("pod-create-201.json")));
    let watches = Arc::new(Mutex::new(Watches::default()));
    let feed = watches.lock().unwrap().push();
    let (client, mock) = mock({
        let (stored, watches) = (stored.clone(), watches.clone());
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.lock().unwrap().next();
            }
            if is(req, "GET", "/pods") {
                return ok(pod_list("882", vec![]));
            }
            if is(req, "POST", "/pods") {
                return Reply::Json(StatusCode::CONFLICT, json("error-409-already-exists.json"));
            }
            if is(req, "GET", "/pods/sandman-sbx-0001") {
                return ok(stored.lock().unwrap().clone());
            }
            if is(req, "POST", "/secrets") {
                return Reply::Json(StatusCode::CREATED, req.json());
            }
            ok(json("pod-delete-existing-200.json"))
        }
    });
    let p = provider(client);
    // The recorded pod is not this sandbox's: a conflict.
    match p.create(&ours).await {
        Err(ProviderError::Backend(m)) => assert!(m.contains("exists already"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(!mock.seen().iter().any(|r| is(r, "POST", "/secrets")), "a secret was made for a foreign pod");
    assert!(!mock.seen().iter().any(|r| r.method == "DELETE"), "the foreign pod was deleted");
    // The same pod, made from this very spec (a create retried after a lost answer): it goes on.
    *stored.lock().unwrap() = as_ours(json("pod-create-201.json"), &ours);
    let feeder = async {
        mock.until("the secret's create", |seen| seen.iter().any(|r| is(r, "POST", "/secrets"))).await;
        feed.send(event("MODIFIED", &json("pod-running-ready.json"))).await.unwrap();
    };
    let (endpoint, ()) = tokio::join!(p.create(&ours), feeder);
    assert_eq!(endpoint.unwrap(), Endpoint::Tcp("10.244.0.26:7778".into()));
}

#[tokio::test]
async fn an_invalid_pod_is_refused_with_the_api_servers_message_and_nothing_more_is_written() {
    let mut watches = Watches::default();
    let (client, mock) = mock(move |req| {
        if is(req, "GET", "/pods") && req.is_watch() {
            return watches.next();
        }
        if is(req, "GET", "/pods") {
            return ok(pod_list("882", vec![]));
        }
        if is(req, "POST", "/pods") {
            return Reply::Json(StatusCode::UNPROCESSABLE_ENTITY, json("error-422-invalid-label.json"));
        }
        Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
    });
    let p = provider(client);
    match p.create(&spec("sbx-bad-label", "busybox:local")).await {
        Err(ProviderError::Unsupported(m)) => assert!(m.contains("Invalid value: \"job a\""), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(mock.writes().len(), 1, "{:#?}", mock.writes());
}

#[tokio::test(start_paused = true)]
async fn a_429_holds_every_write_for_its_retry_after() {
    let cluster = Cluster::shared();
    cluster.lock().unwrap().throttle_next = 1;
    let (client, mock) = client_on(&cluster);
    let p = provider(client);
    let s = spec("sbx-429", "busybox:local");
    let other = async {
        // Asked for while the hold is on: it must wait too.
        mock.until("the 429", |seen| seen.iter().any(|r| is(r, "POST", "/pods"))).await;
        p.delete("sbx-unrelated").await
    };
    let (created, deleted) = tokio::join!(p.create(&s), other);
    created.unwrap();
    deleted.unwrap();
    let writes = mock.writes();
    let posts: Vec<Instant> = writes.iter().filter(|r| is(r, "POST", "/pods")).map(|r| r.at).collect();
    assert_eq!(posts.len(), 2, "the throttled create was not retried once: {writes:#?}");
    assert!(
        posts[1] - posts[0] >= Duration::from_secs(1),
        "retried {:?} after a Retry-After of 1 s",
        posts[1] - posts[0]
    );
    let delete = writes.iter().find(|r| r.method == "DELETE").unwrap().at;
    assert!(delete - posts[0] >= Duration::from_secs(1), "a write went during the hold");
}

#[tokio::test(start_paused = true)]
async fn writes_keep_to_the_configured_rate() {
    let cluster = Cluster::shared();
    let (client, mock) = client_on(&cluster);
    let (qps, burst) = (5.0, 3);
    let p = provider_with(client, KubeConfig { write_qps: qps, write_burst: burst, ..config() });
    let specs: Vec<SandboxSpec> = (0..15).map(|i| spec(&format!("rate{i}"), "busybox:1")).collect();
    let started = Instant::now();
    let results = futures_util::future::join_all(specs.iter().map(|s| p.create(s))).await;
    for r in results {
        r.unwrap();
    }
    let writes: Vec<Instant> = mock.writes().iter().map(|r| r.at).collect();
    assert_eq!(writes.len(), 30, "two writes per create");
    for window_ms in [200u64, 1000, 2000, 4000] {
        let window = Duration::from_millis(window_ms);
        let most =
            writes.iter().map(|s| writes.iter().filter(|t| **t >= *s && **t < *s + window).count()).max().unwrap();
        let allowed = burst as f64 + qps * window.as_secs_f64();
        assert!(most as f64 <= allowed, "{most} writes within {window:?}; at most {allowed} allowed");
    }
    // (30 - 3) writes at 5 per second after the burst.
    assert!(started.elapsed() >= Duration::from_millis(5400), "finished in {:?}", started.elapsed());
}

/// A call the mocked server holds: its answer's body goes on the sender; the posted object.
type HeldCall = (mpsc::Sender<bytes::Bytes>, Value);

#[tokio::test(start_paused = true)]
async fn calls_in_flight_never_exceed_api_concurrency() {
    // Pod creates are answered only when the test says: until then each holds its call.
    let held: Arc<Mutex<Vec<HeldCall>>> = Arc::default();
    let mut watches = Watches::default();
    let (client, mock) = mock({
        let held = held.clone();
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.next();
            }
            if is(req, "GET", "/pods") {
                return ok(pod_list("1", vec![]));
            }
            let (tx, rx) = mpsc::channel(1);
            held.lock().unwrap().push((tx, req.json()));
            Reply::Stream(rx)
        }
    });
    let p = Arc::new(provider_with(client, KubeConfig { api_concurrency: 3, ..config() }));
    let creates: Vec<_> = (0..8)
        .map(|i| {
            let p = p.clone();
            tokio::spawn(async move { p.create(&spec(&format!("fl{i}"), "busybox:1")).await })
        })
        .collect();
    let posts = || mock.writes().iter().filter(|w| is(w, "POST", "/pods")).count();
    // On the paused clock, everything that could be sent has been once the runtime idles.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(posts(), 3, "calls in flight beyond api_concurrency");
    // One answered: one more goes.
    let (tx, pod) = held.lock().unwrap().remove(0);
    tx.send(bytes::Bytes::from(serde_json::to_vec(&pod).unwrap())).await.unwrap();
    drop(tx);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(posts(), 4);
    for c in creates {
        c.abort();
    }
}

// ---- shared token Secrets ----

/// A token as the API server stores it.
fn stored_token(token: &str) -> Value {
    serde_json::to_value(k8s_openapi::ByteString(token.as_bytes().to_vec())).unwrap()
}

#[tokio::test]
async fn a_burst_shares_one_token_secret_each_pod_mounting_only_its_own_key_and_owning_it() {
    let cluster = Cluster::shared();
    let (client, mock) = client_on(&cluster);
    let config = KubeConfig { token: TokenDelivery::SharedSecret, ..config() };
    let p = provider_with(client, config.clone());
    let specs: Vec<SandboxSpec> = (0..30).map(|i| spec(&format!("sh{i:02}"), "busybox:1")).collect();
    for r in futures_util::future::join_all(specs.iter().map(|s| p.create(s))).await {
        r.unwrap();
    }
    // The owners are written once the last pod of the Secret is made.
    mock.until("the owners of the token Secret", |seen| {
        seen.iter().any(|r| is(r, "PATCH", "") && r.path.contains("/secrets/"))
    })
    .await;
    let writes = mock.writes();
    let secret_posts: Vec<&common::Seen> = writes.iter().filter(|w| is(w, "POST", "/secrets")).collect();
    // Every create had sent its deposit before the writer ran: one Secret for all.
    assert_eq!(secret_posts.len(), 1, "{:?}", writes.iter().map(|w| (&w.method, &w.path)).collect::<Vec<_>>());
    assert_eq!(writes.len(), 30 + 2, "a pod each, the Secret, its owners");
    let c = cluster.lock().unwrap().clone_state();
    let (name, secret) = c.secrets.iter().next().unwrap();
    assert!(name.starts_with("sandman-tokens-"), "{name}");
    assert_eq!(secret["immutable"], true);
    assert_eq!(secret["metadata"]["labels"]["sandman.dev/tokens"], "shared");
    let owners = secret["metadata"]["ownerReferences"].as_array().unwrap();
    assert_eq!(owners.len(), 30);
    for s in &specs {
        let pod = &c.pods[&format!("sandman-{}", s.id)];
        let volume = pod["spec"]["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "sandman-token").unwrap();
        assert_eq!(volume["secret"]["secretName"], name.as_str());
        // Only its own key is mounted, as the file the daemon reads.
        assert_eq!(volume["secret"]["items"], serde_json::json!([{"key": s.id, "path": "token"}]));
        assert_eq!(secret["data"][&s.id], stored_token(&s.token), "{}", s.id);
        assert!(owners.iter().any(|o| o["uid"] == pod["metadata"]["uid"] && o["kind"] == "Pod"), "{}", s.id);
        assert!(!pod.to_string().contains(&s.token), "the token is in the pod object");
    }

    // A second server finds every token.
    let (client2, _mock2) = client_on(&cluster);
    let second = provider_with(client2, config);
    let mut records = second.list().await.unwrap();
    records.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
    assert_eq!(
        records.iter().map(|r| r.spec.token.clone()).collect::<Vec<_>>(),
        specs.iter().map(|s| s.token.clone()).collect::<Vec<_>>()
    );
    assert!(records.iter().all(|r| r.ended.is_none()));

    // The Secret goes with the last of its pods.
    for s in &specs[..29] {
        p.delete(&s.id).await.unwrap();
    }
    assert_eq!(cluster.lock().unwrap().secrets.len(), 1, "the Secret went before its last pod");
    p.delete(&specs[29].id).await.unwrap();
    assert!(cluster.lock().unwrap().secrets.is_empty(), "the Secret outlived its pods");
}

#[tokio::test]
async fn a_shared_token_secret_none_of_whose_pods_was_made_is_deleted() {
    let cluster = Cluster::shared();
    // A pod of that name exists already, made from another spec: the create fails, no pod made.
    let other = spec("taken", "alpine:3");
    let existing = build_pod(&other, &config()).unwrap();
    cluster.lock().unwrap().pods.insert("sandman-taken".into(), serde_json::to_value(existing).unwrap());
    let (client, mock) = client_on(&cluster);
    let p = provider_with(client, KubeConfig { token: TokenDelivery::SharedSecret, ..config() });
    let err = p.create(&spec("taken", "busybox:1")).await.unwrap_err();
    assert!(err.to_string().contains("is not sandbox"), "{err}");
    mock.until("the Secret's deletion", |seen| {
        seen.iter().any(|r| r.method == "DELETE" && r.path.contains("/secrets/"))
    })
    .await;
    assert!(cluster.lock().unwrap().secrets.is_empty(), "a token Secret no pod mounts was left");
}

#[tokio::test]
async fn a_retried_create_with_shared_token_secrets_takes_its_pod_only_with_the_same_token() {
    let cluster = Cluster::shared();
    let config = KubeConfig { token: TokenDelivery::SharedSecret, ..config() };
    let (client, _mock) = client_on(&cluster);
    let first = provider_with(client, config.clone());
    let s = spec("again", "busybox:1");
    let endpoint = first.create(&s).await.unwrap();

    // The same create tried again by another server: the pod is its own, with its token.
    let (client, mock) = client_on(&cluster);
    let second = provider_with(client, config.clone());
    assert_eq!(second.create(&s).await.unwrap(), endpoint);
    // Its own deposit made no pod: that Secret is deleted.
    mock.until("the unused Secret's deletion", |seen| {
        seen.iter().any(|r| r.method == "DELETE" && r.path.contains("/secrets/"))
    })
    .await;
    assert_eq!(cluster.lock().unwrap().secrets.len(), 1, "only the Secret the pod mounts is left");

    // Another token for the same id is refused.
    let (client, _mock) = client_on(&cluster);
    let third = provider_with(client, config);
    let mut other = s.clone();
    other.token = "another-token".into();
    let err = third.create(&other).await.unwrap_err();
    assert!(err.to_string().contains("with another token"), "{err}");
}

// ---- the watch ----

#[tokio::test]
async fn a_watch_410_relists_and_reports_what_changed_meanwhile() {
    let watches = Arc::new(Mutex::new(Watches::default()));
    let first = watches.lock().unwrap().push();
    let lists = Arc::new(AtomicUsize::new(0));
    let running = json("watch-initial-list.json")["items"][0].clone();
    let oom_ready = relabel(json("pod-running-ready.json"), "sbx-oom");
    let (client, mock) = mock({
        let (watches, lists) = (watches.clone(), lists.clone());
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.lock().unwrap().next();
            }
            if is(req, "GET", "/pods") {
                return match lists.fetch_add(1, Ordering::SeqCst) {
                    0 => ok(pod_list("882", vec![running.clone(), oom_ready.clone()])),
                    // After the 410: sbx-0002 is gone, sbx-oom was OOM-killed meanwhile.
                    _ => ok(pod_list("1250", vec![json("status-oomkilled.json")])),
                };
            }
            Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
        }
    });
    let p = provider(client);
    let mut events = p.events().unwrap();
    p.wait_synced().await;
    // The recorded ERROR event: HTTP 200, then a Status 410 in the stream.
    first.send(bytes::Bytes::from(common::fixture("watch-410-too-old-resource-version.ndjson"))).await.unwrap();
    let mut got = [next_event(&mut events).await, next_event(&mut events).await];
    got.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(got[0].id, "sbx-0002");
    assert_eq!(got[0].ended.reason, Reason::ProviderError);
    assert_eq!(got[0].ended.message, "the pod disappeared while the watch was interrupted");
    assert_eq!(got[1].id, "sbx-oom");
    assert_eq!(got[1].ended.reason, Reason::OomKilled);
    assert_eq!(lists.load(Ordering::SeqCst), 2, "a 410 must make the watch list again");
    let watches_seen: Vec<_> = mock.seen().into_iter().filter(common::Seen::is_watch).collect();
    assert_eq!(watches_seen[0].query.get("resourceVersion").map(String::as_str), Some("882"));
}

#[tokio::test]
async fn a_dropped_watch_resumes_from_the_last_version_without_relisting() {
    let lines: Vec<String> = common::fixture("watch-lifecycle.ndjson").lines().map(str::to_string).collect();
    let watches = Arc::new(Mutex::new(Watches::default()));
    let first = watches.lock().unwrap().push();
    let second = watches.lock().unwrap().push();
    let (client, mock) = mock({
        let watches = watches.clone();
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.lock().unwrap().next();
            }
            if is(req, "GET", "/pods") {
                return ok(pod_list("882", vec![]));
            }
            Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
        }
    });
    let p = provider(client);
    let mut events = p.events().unwrap();
    // Up to Running (rv 899), then the connection drops.
    for line in &lines[..=6] {
        first.send(bytes::Bytes::from(format!("{line}\n"))).await.unwrap();
    }
    drop(first);
    for line in &lines[7..] {
        second.send(bytes::Bytes::from(format!("{line}\n"))).await.unwrap();
    }
    let ev = next_event(&mut events).await;
    assert_eq!(ev.id, "sbx-0003");
    assert_eq!(ev.ended.reason, Reason::ProviderError);
    assert_eq!(ev.ended.message, "the pod was deleted by someone other than sandman");
    let seen = mock.seen();
    let rvs: Vec<_> = seen
        .iter()
        .filter(|r| r.is_watch())
        .map(|r| r.query.get("resourceVersion").cloned().unwrap_or_default())
        .collect();
    assert_eq!(&rvs[..2], ["882", "899"], "the watch did not resume from the last version it saw");
    assert_eq!(seen.iter().filter(|r| is(r, "GET", "/pods") && !r.is_watch()).count(), 1, "a dropped watch relisted");
    // The tracker saw it all too: nothing of the pod is left.
    assert!(p.watched("sbx-0003").is_none());
}

#[tokio::test]
async fn a_node_lost_after_ready_is_reported_once() {
    let lines: Vec<String> = common::fixture("watch-node-lost.ndjson").lines().map(str::to_string).collect();
    let watches = Arc::new(Mutex::new(Watches::default()));
    let feed = watches.lock().unwrap().push();
    let (client, mock) = scripted(watches);
    let p = provider(client);
    let mut events = p.events().unwrap();
    let s = spec("sbx-nodelost", "busybox:local");
    let feeder = async {
        mock.until("the secret's create", |seen| seen.iter().any(|r| is(r, "POST", "/secrets"))).await;
        for line in &lines[..2] {
            feed.send(bytes::Bytes::from(format!("{line}\n"))).await.unwrap();
        }
    };
    let (endpoint, ()) = tokio::join!(p.create(&s), feeder);
    assert_eq!(endpoint.unwrap(), Endpoint::Tcp("10.244.9.7:7778".into()));
    for line in &lines[2..] {
        feed.send(bytes::Bytes::from(format!("{line}\n"))).await.unwrap();
    }
    let ev = next_event(&mut events).await;
    assert_eq!((ev.id.as_str(), ev.ended.reason), ("sbx-nodelost", Reason::NodeLost));
    assert!(tokio::time::timeout(Duration::from_millis(300), events.recv()).await.is_err(), "a death told twice");
}

#[tokio::test]
async fn every_failure_of_the_recorded_watch_is_one_event_with_its_reason() {
    let watches = Arc::new(Mutex::new(Watches::default()));
    let feed = watches.lock().unwrap().push();
    let (client, _mock) = scripted(watches);
    let p = provider(client);
    let mut events = p.events().unwrap();
    feed.send(bytes::Bytes::from(common::fixture("watch-states.ndjson"))).await.unwrap();
    let mut got = BTreeMap::new();
    for _ in 0..10 {
        let ev = next_event(&mut events).await;
        assert!(got.insert(ev.id.clone(), ev.ended.reason).is_none(), "{} told twice", ev.id);
    }
    let want: BTreeMap<String, Reason> = [
        ("sbx-applet", Reason::ProviderError),
        ("sbx-deadline", Reason::TtlExpired),
        ("sbx-exit3", Reason::LeaseExpired),
        ("sbx-imgpull", Reason::ImagePullFailed),
        ("sbx-initdelete", Reason::ProviderError),
        ("sbx-initfail", Reason::DaemonStartFailed),
        ("sbx-nocmd", Reason::DaemonStartFailed),
        ("sbx-oom", Reason::OomKilled),
        ("sbx-succeeded", Reason::ProviderError),
        // Never scheduled, then deleted by the recording's deletecollection.
        ("sbx-unsched", Reason::ProviderError),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(got, want);
}

// ---- delete and list ----

#[tokio::test]
async fn releasing_a_job_is_one_deletecollection_and_its_deaths_are_not_news() {
    let cluster = Cluster::shared();
    let (client, mock) = client_on(&cluster);
    let p = provider(client);
    let mut events = p.events().unwrap();
    let mut specs = Vec::new();
    for i in 0..5 {
        let mut s = spec(&format!("job-x-{i}"), "busybox:1");
        s.job = Some("job x".into());
        specs.push(s);
    }
    let mut keep = spec("job-y-0", "busybox:1");
    keep.job = Some("job-y".into());
    specs.push(keep);
    for r in futures_util::future::join_all(specs.iter().map(|s| p.create(s))).await {
        r.unwrap();
    }
    let writes_before = mock.writes().len();
    let mut ids = p.delete_job("job x").await.unwrap();
    ids.sort();
    assert_eq!(ids, (0..5).map(|i| format!("job-x-{i}")).collect::<Vec<_>>());
    let writes = mock.writes();
    assert_eq!(writes.len(), writes_before + 1, "release-all is one write");
    let collection = writes.last().unwrap();
    assert_eq!(
        (collection.method.as_str(), collection.path.as_str()),
        ("DELETE", "/api/v1/namespaces/sandman-fixtures/pods")
    );
    assert!(collection.query["labelSelector"].contains("sandman.dev/job=job_x-"), "{:?}", collection.query);
    assert_eq!(collection.json()["propagationPolicy"], "Background");
    // The released pods' deaths are not reported; the next death is.
    {
        let mut c = cluster.lock().unwrap();
        let mut pod = c.pods["sandman-job-y-0"].clone();
        pod["status"] = json("status-oomkilled.json")["status"].clone();
        c.update(pod);
    }
    let ev = next_event(&mut events).await;
    assert_eq!((ev.id.as_str(), ev.ended.reason), ("job-y-0", Reason::OomKilled));
    // Deleting a sandbox that is gone already is fine (the recorded 404).
    p.delete("job-x-0").await.unwrap();
    p.delete("never-existed").await.unwrap();
}

/// Five sandboxes of one job, created on `cluster`.
async fn five_of_a_job(p: &KubeProvider) {
    for i in 0..5 {
        let mut s = spec(&format!("job-x-{i}"), "busybox:1");
        s.job = Some("job x".into());
        p.create(&s).await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_release_all_that_outlasts_the_api_servers_timeout_is_called_again_and_names_every_pod() {
    let cluster = Cluster::shared();
    let (client, mock) = client_on(&cluster);
    let p = provider(client);
    five_of_a_job(&p).await;
    // Each deletecollection deletes one pod, then answers the recorded 504 naming none: four
    // tries (one call and its retries) delete four, the next call the last and answers it alone.
    cluster.lock().unwrap().collection_cut = Some(1);
    let writes_before = mock.writes().len();
    let ids = p.delete_job("job x").await.unwrap();
    assert_eq!(ids, (0..5).map(|i| format!("job-x-{i}")).collect::<Vec<_>>(), "every released pod named");
    assert!(cluster.lock().unwrap().pods.is_empty(), "pods left");
    let collections: Vec<common::Seen> =
        mock.writes()[writes_before..].iter().filter(|w| w.method == "DELETE").cloned().collect();
    assert_eq!(collections.len(), 5);
    // Each answered with the deleted pods' metadata only, not thousands of whole pods.
    for c in &collections {
        assert!(c.accept.as_deref().is_some_and(|a| a.contains("as=PartialObjectMetadataList")), "{:?}", c.accept);
    }
    // The pods were read first (their metadata only), and again after the call that failed.
    let reads: Vec<common::Seen> = mock
        .seen()
        .into_iter()
        .filter(|r| r.method == "GET" && r.query.get("labelSelector").is_some_and(|l| l.contains("sandman.dev/job=")))
        .collect();
    assert_eq!(reads.len(), 2, "{reads:?}");
    // Nothing of the released sandboxes stays in the provider once the watch has seen them go
    // (most went while the release-all was still calling).
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.footprint() != Footprint::default() {
        assert!(Instant::now() < deadline, "the provider still holds {:?}", p.footprint());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_release_all_that_deletes_nothing_in_the_api_servers_time_fails_with_its_answer() {
    let cluster = Cluster::shared();
    let (client, _mock) = client_on(&cluster);
    let p = provider(client);
    five_of_a_job(&p).await;
    cluster.lock().unwrap().collection_cut = Some(0);
    let err = p.delete_job("job x").await.unwrap_err().to_string();
    assert!(err.contains("504") && err.contains("did not complete within the allotted timeout"), "{err}");
    assert_eq!(cluster.lock().unwrap().pods.len(), 5);
}

#[tokio::test]
async fn list_recovers_specs_and_tokens_and_starts_over_an_expired_paginated_list() {
    let a = spec("sbx-0002", "busybox:local");
    let b = spec("sbx-oom", "busybox:local");
    let c = spec("sbx-gone", "busybox:local");
    let page1 = {
        let mut l = json("list-page1-limit1.json");
        l["items"][0] = as_ours(l["items"][0].clone(), &a);
        l
    };
    let full = pod_list(
        "1300",
        vec![
            page1["items"][0].clone(),
            as_ours(json("status-oomkilled.json"), &b),
            as_ours(relabel(json("pod-terminating.json"), "sbx-gone"), &c),
            // Not ours: no spec annotation.
            relabel(json("pod-running-ready.json"), "sbx-foreign"),
        ],
    );
    let secrets = serde_json::json!({"kind": "SecretList", "apiVersion": "v1", "metadata": {"resourceVersion": "1300"},
        "items": [
            {"metadata": {"name": "sandman-sbx-0002", "labels": {"sandman.dev/sandbox": "sbx-0002"}},
             "data": {"token": serde_json::to_value(k8s_openapi::ByteString(a.token.clone().into_bytes())).unwrap()}},
            {"metadata": {"name": "sandman-sbx-oom", "labels": {"sandman.dev/sandbox": "sbx-oom"}},
             "data": {"token": serde_json::to_value(k8s_openapi::ByteString(b.token.clone().into_bytes())).unwrap()}}]});
    let lists = Arc::new(AtomicUsize::new(0));
    let mut watches = Watches::default();
    let (client, _mock) = mock({
        let lists = lists.clone();
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.next();
            }
            if is(req, "GET", "/secrets") {
                return ok(secrets.clone());
            }
            if is(req, "GET", "/pods") {
                let n = lists.fetch_add(1, Ordering::SeqCst);
                let continued = req.query.contains_key("continue");
                return match (n, continued) {
                    // The watch's own list.
                    (0, _) => ok(pod_list("1175", vec![])),
                    (1, false) => ok(page1.clone()),
                    (2, true) => Reply::Json(StatusCode::GONE, json("error-410-list-continue-expired.json")),
                    (3, false) => ok(full.clone()),
                    other => panic!("unexpected list {other:?}: {:?}", req.query),
                };
            }
            Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
        }
    });
    let p = provider(client);
    p.wait_synced().await;
    let mut records = p.list().await.unwrap();
    records.sort_by(|x, y| x.spec.id.cmp(&y.spec.id));
    assert_eq!(lists.load(Ordering::SeqCst), 4, "the expired list was not started over");
    assert_eq!(records.len(), 2, "{records:#?}");
    assert_eq!(records[0].spec, a);
    assert_eq!(records[0].endpoint, Endpoint::Tcp("10.244.0.27:7778".into()));
    assert_eq!(records[0].ended, None);
    assert_eq!(records[1].spec, b);
    assert_eq!(records[1].ended.as_ref().map(|e| e.reason), Some(Reason::OomKilled));
}

// ---- applied ----

#[tokio::test]
async fn applied_reads_the_pod_back_and_a_missing_pod_is_not_found() {
    let mut watches = Watches::default();
    let (client, mock) = mock(move |req| {
        if is(req, "GET", "/pods") && req.is_watch() {
            return watches.next();
        }
        if is(req, "GET", "/pods") {
            return ok(pod_list("882", vec![]));
        }
        if is(req, "GET", "/pods/sandman-sbx-0001") {
            return ok(json("pod-running-ready.json"));
        }
        Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
    });
    let p = provider_with(client, KubeConfig { pod_pids_limit: Some(4096), ..config() });
    let a = p.applied("sbx-0001").await.unwrap();
    assert_eq!(a.image.as_deref(), Some("sha256:c0966323d8fdf2e5ca2a03565cd3bd6d24d9d19a25e2c4aeb1f7005767e4adba"));
    assert_eq!((a.cpu, a.memory, a.pids), (Some(1.0), Some(268_435_456), Some(4096)));
    assert_eq!(a.details["resourceVersion"], "854");
    let reads: Vec<_> = mock.seen().into_iter().filter(|r| r.path.contains("/pods/")).collect();
    assert_eq!(reads.len(), 1);
    assert_eq!(
        (reads[0].method.as_str(), reads[0].path.as_str()),
        ("GET", "/api/v1/namespaces/sandman-fixtures/pods/sandman-sbx-0001")
    );
    match p.applied("sbx-gone").await {
        Err(ProviderError::NotFound(id)) => assert_eq!(id, "sbx-gone"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(p.applied("Not_A_Sandbox").await, Err(ProviderError::NotFound(_))));
}

// ---- prepare ----

const PREPARED: &str = "busybox:local";

/// The provider's config for prepare: the recorded fake node's label and taint.
fn prepare_config() -> KubeConfig {
    KubeConfig {
        node_selector: BTreeMap::from([("sandman.dev/fake".into(), "true".into())]),
        tolerations: vec![k8s_openapi::api::core::v1::Toleration {
            key: Some("sandman.dev/fake".into()),
            operator: Some("Exists".into()),
            ..Default::default()
        }],
        ..config()
    }
}

/// The recorded Node under another name: Ready (as its kubelet would report), cordoned, or as the
/// node controller left it once the kubelet stopped posting status.
fn node(name: &str, state: &str) -> Value {
    let mut node = json("node-create-fake-201.json");
    node["metadata"]["name"] = name.into();
    node["metadata"]["labels"]["kubernetes.io/hostname"] = name.into();
    node["spec"]["taints"] = serde_json::json!([{"key": "sandman.dev/fake", "value": "true", "effect": "NoSchedule"}]);
    match state {
        "lost" => node["status"] = json("node-fake-unreachable.json")["status"].clone(),
        _ => {
            node["status"]["conditions"] =
                serde_json::json!([{"type": "Ready", "status": "True", "reason": "KubeletReady"}]);
        }
    }
    if state == "cordoned" {
        node["spec"]["unschedulable"] = true.into();
    }
    node
}

/// A recorded pod status given to a pull pod: its container named `pull`, running `image`.
fn pull_status(fixture: &str, image: &str) -> Value {
    let mut status = json(fixture)["status"].clone();
    for c in status["containerStatuses"].as_array_mut().unwrap() {
        c["name"] = "pull".into();
        c["image"] = image.into();
    }
    status
}

/// What one prepare did: its answer, its progress lines, and the requests it sent.
struct PrepareRun {
    result: Result<sandman_provider::Prepared, ProviderError>,
    progress: Vec<sandman_provider::NodeProgress>,
    seen: Vec<common::Seen>,
}

/// Runs one prepare against a mocked API server listing `nodes`, of which `eligible` may run
/// sandboxes; once their pull pods are created, the watch of the pull pods shows each the
/// statuses `outcome` gives for its node, in order.
async fn prepare_on(
    nodes: Vec<Value>,
    eligible: usize,
    config: KubeConfig,
    outcome: impl Fn(&str) -> Vec<Value>,
) -> PrepareRun {
    let feed_watches = Arc::new(Mutex::new(Watches::default()));
    let feed = feed_watches.lock().unwrap().push();
    let mut sandbox_watches = Watches::default();
    let (client, mock) = mock(move |req| {
        if req.path == "/api/v1/nodes" {
            let list = serde_json::json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "1200"},
                "items": nodes});
            return ok(list);
        }
        let preparing = req.query.get("labelSelector").is_some_and(|s| s.contains("sandman.dev/prepare="));
        if is(req, "GET", "/pods") && req.is_watch() {
            return if preparing { feed_watches.lock().unwrap().next() } else { sandbox_watches.next() };
        }
        if is(req, "GET", "/pods") {
            return ok(pod_list("1200", vec![]));
        }
        if is(req, "POST", "/pods") {
            let mut pod = req.json();
            pod["metadata"]["uid"] = format!("uid-{}", pod["metadata"]["name"].as_str().unwrap()).into();
            pod["metadata"]["resourceVersion"] = "1201".into();
            pod["status"] = serde_json::json!({"phase": "Pending", "qosClass": "Guaranteed"});
            return Reply::Json(StatusCode::CREATED, pod);
        }
        if is(req, "DELETE", "/pods") {
            return ok(pod_list("1300", vec![]));
        }
        Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
    });
    let p = provider_with(client, config);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let creates = |seen: &[common::Seen]| seen.iter().filter(|r| is(r, "POST", "/pods")).cloned().collect::<Vec<_>>();
    let feeder = async {
        if eligible == 0 {
            return;
        }
        mock.until("the pull pods' creates", |seen| creates(seen).len() == eligible).await;
        let mut rv = 1210;
        for posted in creates(&mock.seen()) {
            let mut pod = posted.json();
            pod["metadata"]["uid"] = format!("uid-{}", pod["metadata"]["name"].as_str().unwrap()).into();
            let node = pod["spec"]["nodeName"].as_str().unwrap().to_string();
            for status in outcome(&node) {
                rv += 1;
                pod["metadata"]["resourceVersion"] = rv.to_string().into();
                pod["status"] = status;
                feed.send(event("MODIFIED", &pod)).await.unwrap();
            }
        }
    };
    let (result, ()) = tokio::join!(p.prepare(PREPARED, tx), feeder);
    let mut progress = Vec::new();
    while let Ok(line) = rx.try_recv() {
        progress.push(line);
    }
    PrepareRun { result, progress, seen: mock.seen() }
}

/// The progress lines of one node, as (state, message).
fn lines_of(run: &PrepareRun, node: &str) -> Vec<(sandman_provider::NodeState, String)> {
    run.progress.iter().filter(|l| l.node == node).map(|l| (l.state, l.message.clone())).collect()
}

#[tokio::test]
async fn prepare_pulls_on_each_eligible_node_reports_each_and_deletes_its_pods() {
    use sandman_provider::NodeState::{Failed, Pulling, Ready};
    let nodes =
        vec![node("node-b", "ready"), node("node-a", "ready"), node("node-c", "lost"), node("node-d", "cordoned")];
    let run = prepare_on(nodes, 2, prepare_config(), |node| match node {
        // Initialising, then done: `sandmand --version` exited 0.
        "node-a" => {
            vec![pull_status("status-init-running.json", PREPARED), pull_status("status-succeeded.json", PREPARED)]
        }
        // The recorded first pull failure.
        _ => vec![pull_status("status-errimagepull.json", PREPARED)],
    })
    .await;
    assert_eq!(*run.result.as_ref().unwrap(), sandman_provider::Prepared { nodes_ready: 1, nodes_total: 2 });

    // The progress: Pulling once each pod is made, then Ready or Failed with the kubelet's reason.
    let a = lines_of(&run, "node-a");
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(a[0], (Pulling, format!("pulling `{PREPARED}`")));
    assert_eq!(a[1].0, Ready);
    assert!(a[1].1.contains("sha256:c0966323d8fd"), "the digest pulled: {}", a[1].1);
    let b = lines_of(&run, "node-b");
    assert_eq!(b.len(), 2, "{b:?}");
    assert_eq!(b[0].0, Pulling);
    assert_eq!(b[1].0, Failed);
    assert!(b[1].1.contains("ErrImagePull") && b[1].1.contains("no such host"), "{}", b[1].1);
    assert!(run.progress.iter().all(|l| l.nodes_total == 2));
    assert!(lines_of(&run, "node-c").is_empty() && lines_of(&run, "node-d").is_empty(), "skipped nodes reported");

    // The nodes were listed with the provider's node selector.
    let listed: Vec<_> = run.seen.iter().filter(|r| r.path == "/api/v1/nodes").collect();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].query.get("labelSelector").map(String::as_str), Some("sandman.dev/fake=true"));

    // One pod per eligible node, exactly the pull pod: its node, the image, IfNotPresent, our
    // labels, no privileges.
    let creates: Vec<Value> = run.seen.iter().filter(|r| is(r, "POST", "/pods")).map(common::Seen::json).collect();
    assert_eq!(creates.len(), 2);
    let prepare_run = creates[0]["metadata"]["labels"]["sandman.dev/prepare"].as_str().unwrap().to_string();
    let mut on: Vec<&str> = Vec::new();
    for pod in &creates {
        let node = pod["spec"]["nodeName"].as_str().unwrap();
        on.push(node);
        let name = pod["metadata"]["name"].as_str().unwrap();
        let want =
            sandman_provider_kube::prepare::build_pull_pod(PREPARED, node, name, &prepare_run, &prepare_config());
        assert_eq!(*pod, serde_json::to_value(want).unwrap());
        let c = &pod["spec"]["containers"][0];
        assert_eq!((c["image"].as_str(), c["imagePullPolicy"].as_str()), (Some(PREPARED), Some("IfNotPresent")));
        assert_eq!(pod["metadata"]["labels"]["app.kubernetes.io/managed-by"], "sandman");
        assert_eq!(pod["metadata"]["labels"]["sandman.dev/node"], node);
        assert_eq!(c["securityContext"]["privileged"], false);
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
        assert_eq!(c["securityContext"]["capabilities"]["drop"], serde_json::json!(["ALL"]));
        assert!(pod["spec"].get("hostNetwork").is_none() && pod["spec"].get("hostPID").is_none());
    }
    on.sort();
    assert_eq!(on, ["node-a", "node-b"]);

    // One watch on the run's label (no poll per pod), then one deletecollection of its pods.
    let selector = sandman_provider_kube::prepare::selector("sandman", &prepare_run);
    let watches: Vec<_> = run
        .seen
        .iter()
        .filter(|r| r.is_watch() && r.query.get("labelSelector").is_some_and(|s| s.contains("sandman.dev/prepare")))
        .collect();
    assert!(!watches.is_empty());
    assert!(watches.iter().all(|w| w.query["labelSelector"] == selector));
    assert!(
        !run.seen.iter().any(|r| is(r, "GET", "/pods/sandman-prepare-") || r.path.contains("/pods/sandman-prepare"))
    );
    let deletes: Vec<_> = run.seen.iter().filter(|r| r.method == "DELETE").collect();
    assert_eq!(deletes.len(), 1, "{deletes:#?}");
    assert_eq!(deletes[0].path, "/api/v1/namespaces/sandman-fixtures/pods");
    assert_eq!(deletes[0].query["labelSelector"], selector);
}

#[tokio::test]
async fn prepare_fails_when_no_node_can_pull_the_image_and_still_deletes_its_pods() {
    let nodes = vec![node("node-a", "ready"), node("node-b", "ready")];
    let run = prepare_on(nodes, 2, prepare_config(), |node| match node {
        "node-a" => vec![pull_status("status-errimagepull.json", PREPARED)],
        _ => vec![pull_status("status-imagepullbackoff.json", PREPARED)],
    })
    .await;
    match &run.result {
        Err(ProviderError::Failed { reason: Reason::ImagePullFailed, message }) => {
            assert!(message.contains(PREPARED) && message.contains("2 tried"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(lines_of(&run, "node-b")[1].1.contains("ImagePullBackOff"));
    assert_eq!(run.seen.iter().filter(|r| r.method == "DELETE").count(), 1);
}

#[tokio::test]
async fn prepare_with_no_node_to_run_sandboxes_names_the_selector_and_makes_nothing() {
    let nodes = vec![node("node-c", "lost"), node("node-d", "cordoned")];
    let run = prepare_on(nodes, 0, prepare_config(), |_| vec![]).await;
    match run.result {
        Err(ProviderError::Failed { reason: Reason::Unschedulable, message }) => {
            assert!(message.contains("node_selector `sandman.dev/fake=true`"), "{message}");
            assert!(message.contains("node-c: not Ready") && message.contains("node-d: cordoned"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(run.seen.iter().all(|r| !r.is_write()), "a write with no node to prepare");
    assert!(run.progress.is_empty());
}

#[tokio::test(start_paused = true)]
async fn nodes_not_done_by_the_prepare_deadline_are_failed() {
    let config = KubeConfig { prepare_timeout_s: 30, ..prepare_config() };
    let run = prepare_on(vec![node("node-a", "ready")], 1, config, |_| {
        vec![pull_status("status-init-running.json", PREPARED)]
    })
    .await;
    assert!(
        matches!(run.result, Err(ProviderError::Failed { reason: Reason::ImagePullFailed, .. })),
        "{:?}",
        run.result
    );
    let a = lines_of(&run, "node-a");
    assert_eq!(a.last().map(|l| l.0), Some(sandman_provider::NodeState::Failed));
    assert!(a.last().unwrap().1.contains("was not pulled within 30 s"), "{a:?}");
    assert_eq!(run.seen.iter().filter(|r| r.method == "DELETE").count(), 1);
}

#[tokio::test]
async fn prepare_without_the_right_to_list_nodes_says_which_role_grants_it() {
    let mut watches = Watches::default();
    let (client, mock) = mock(move |req| {
        if req.path == "/api/v1/nodes" {
            return Reply::Json(StatusCode::FORBIDDEN, json("error-403-forbidden.json"));
        }
        if is(req, "GET", "/pods") && req.is_watch() {
            return watches.next();
        }
        ok(pod_list("1", vec![]))
    });
    let p = provider_with(client, prepare_config());
    let (tx, _rx) = mpsc::unbounded_channel();
    match p.prepare(PREPARED, tx).await {
        Err(ProviderError::Backend(m)) => {
            assert!(m.contains("sandman-server-nodes") && m.contains("cannot list resource \"nodes\""), "{m}")
        }
        other => panic!("{other:?}"),
    }
    assert!(mock.writes().is_empty());
}

// ---- warm-pool claims ----

/// A warm pool's sandbox, as the server makes it: no job yet, the pool's label.
fn pool_spec(id: &str) -> SandboxSpec {
    let mut s = spec(id, "busybox:local");
    s.job = None;
    s.labels = BTreeMap::from([("sandman.dev/pool".to_string(), "warm".to_string())]);
    s
}

/// A create's claim of pool sandbox `pool`, as the server makes it: the same sandbox (id, image,
/// token) under the claimer's job, labels, lease and key.
fn claim_by(pool: &SandboxSpec, job: Option<&str>, claimed_ms: u64) -> Claim {
    let mut s = pool.clone();
    s.job = job.map(str::to_string);
    s.labels.insert("team".into(), format!("team-of-{}", job.unwrap_or("nobody")));
    s.created_at_ms = claimed_ms;
    s.server.idempotency_key = Some(format!("key-{claimed_ms}"));
    Claim {
        spec: s,
        env: BTreeMap::from([("CLAIMER".to_string(), job.unwrap_or("nobody").to_string())]),
        claimed_ms,
        pool_created_ms: pool.created_at_ms,
    }
}

/// `claim` with its token left out, as the pod keeps it.
fn stored(claim: &Claim) -> Claim {
    let mut c = claim.clone();
    c.spec.token = String::new();
    c
}

/// A recorded running pod made the pod of `pool` (its labels, its spec annotation).
fn pool_pod(pool: &SandboxSpec) -> Value {
    as_ours(json("pod-running-ready.json"), pool)
}

/// `pod` as another server's claim left it, at resource version `rv`.
fn claimed_pod(mut pod: Value, claim: &Claim, rv: &str) -> Value {
    let patch = sandman_provider_kube::pod::claim_patch(claim, "ignored").unwrap();
    common::merge_patch(&mut pod, &patch);
    pod["metadata"]["resourceVersion"] = rv.into();
    pod
}

/// Requests to one pod (not lists, not watches), as (method, path).
fn pod_calls(seen: &[common::Seen]) -> Vec<(String, String)> {
    seen.iter().filter(|r| r.path.contains("/pods/")).map(|r| (r.method.clone(), r.path.clone())).collect()
}

#[tokio::test]
async fn a_claim_reads_the_pod_then_patches_it_on_the_version_read_without_the_token() {
    let pool = pool_spec("pool-0");
    let claim = claim_by(&pool, Some("claimer job"), 1_700_000_100_000);
    let stored_pod = Arc::new(Mutex::new(pool_pod(&pool)));
    let mut watches = Watches::default();
    let (client, mock) = mock({
        let stored_pod = stored_pod.clone();
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.next();
            }
            if is(req, "GET", "/pods") {
                return ok(pod_list("882", vec![]));
            }
            if is(req, "GET", "/pods/sandman-pool-0") {
                return ok(stored_pod.lock().unwrap().clone());
            }
            if is(req, "PATCH", "/pods/sandman-pool-0") {
                let mut pod = stored_pod.lock().unwrap();
                common::merge_patch(&mut pod, &req.json());
                pod["metadata"]["resourceVersion"] = "900".into();
                return ok(pod.clone());
            }
            Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
        }
    });
    let p = provider(client);
    p.claim(&claim).await.unwrap_or_else(|e| panic!("{e}"));

    let pod_path = format!("/api/v1/namespaces/{NAMESPACE}/pods/sandman-pool-0");
    assert_eq!(pod_calls(&mock.seen()), [("GET".to_string(), pod_path.clone()), ("PATCH".to_string(), pod_path)]);
    let patch = mock.writes().into_iter().find(|r| r.method == "PATCH").unwrap();
    assert_eq!(patch.content_type.as_deref(), Some("application/merge-patch+json"));
    assert_eq!(patch.query.get("fieldManager").map(String::as_str), Some("sandman"));
    let body = patch.json();
    let job_label = sandman_provider_kube::pod::label_value("claimer job");
    assert_ne!(job_label, "claimer job", "the job needs its label form");
    let annotations = &body["metadata"]["annotations"];
    assert_eq!(
        body,
        serde_json::json!({"metadata": {
            // The version read: the API server refuses the patch if the pod changed since.
            "resourceVersion": "854",
            // The pool's label comes off: the sandbox, and the room it holds, are the claimer's.
            "labels": {"sandman.dev/claimed": "true", "sandman.dev/job": job_label, "sandman.dev/pool": null},
            "annotations": {"sandman.dev/claim": annotations["sandman.dev/claim"].clone(),
                            "sandman.dev/spec": annotations["sandman.dev/spec"].clone()},
        }})
    );
    let claim_json: Claim = serde_json::from_str(annotations["sandman.dev/claim"].as_str().unwrap()).unwrap();
    assert_eq!(claim_json, stored(&claim));
    // The spec annotation is the claimed spec, written as create writes it.
    assert_eq!(
        annotations["sandman.dev/spec"].as_str().unwrap(),
        sandman_provider_kube::pod::spec_annotation(&claim.spec).unwrap()
    );
    let text = String::from_utf8(patch.body.to_vec()).unwrap();
    assert!(!text.contains(&claim.spec.token), "the token went into the pod: {text}");
}

#[tokio::test]
async fn a_409_on_the_claim_patch_means_another_server_claimed_it_first() {
    let pool = pool_spec("pool-0");
    let ours = claim_by(&pool, Some("job-a"), 1_700_000_100_000);
    let theirs = claim_by(&pool, Some("job-b"), 1_700_000_100_001);
    let reads = Arc::new(AtomicUsize::new(0));
    let mut watches = Watches::default();
    let (client, mock) = mock({
        let (reads, pool, theirs) = (reads.clone(), pool.clone(), theirs.clone());
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.next();
            }
            if is(req, "GET", "/pods") {
                return ok(pod_list("882", vec![]));
            }
            if is(req, "GET", "/pods/sandman-pool-0") {
                return match reads.fetch_add(1, Ordering::SeqCst) {
                    0 => ok(pool_pod(&pool)),
                    // Read again after the conflict: the other server's claim is there.
                    _ => ok(claimed_pod(pool_pod(&pool), &theirs, "855")),
                };
            }
            if is(req, "PATCH", "/pods/sandman-pool-0") {
                return Reply::Json(StatusCode::CONFLICT, common::conflict("sandman-pool-0"));
            }
            Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
        }
    });
    let p = provider(client);
    match p.claim(&ours).await {
        Err(ProviderError::Claimed(m)) => assert_eq!(m, "another server claimed pool sandbox `pool-0` first"),
        other => panic!("{other:?}"),
    }
    let calls: Vec<String> = pod_calls(&mock.seen()).into_iter().map(|(m, _)| m).collect();
    assert_eq!(calls, ["GET", "PATCH", "GET"], "one conditional patch, then a read to see who won");
    assert_eq!(mock.writes()[0].json()["metadata"]["resourceVersion"], "854");
}

#[tokio::test]
async fn a_pool_sandbox_claimed_already_is_refused_without_a_patch() {
    let pool = pool_spec("pool-0");
    let theirs = claim_by(&pool, Some("job-b"), 1_700_000_100_001);
    let mut watches = Watches::default();
    let (client, mock) = mock({
        let (pool, theirs) = (pool.clone(), theirs.clone());
        move |req| {
            if is(req, "GET", "/pods") && req.is_watch() {
                return watches.next();
            }
            if is(req, "GET", "/pods") {
                return ok(pod_list("882", vec![]));
            }
            if is(req, "GET", "/pods/sandman-pool-0") {
                return ok(claimed_pod(pool_pod(&pool), &theirs, "855"));
            }
            Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
        }
    });
    let p = provider(client);
    match p.claim(&claim_by(&pool, Some("job-a"), 1_700_000_100_000)).await {
        Err(ProviderError::Claimed(m)) => {
            assert!(m.contains("`pool-0` is claimed already") && m.contains("sandman.dev/claimed"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    assert!(mock.writes().is_empty(), "{:#?}", mock.writes());
    // The same claim, found recorded (its answer was lost and it was tried again): done.
    p.claim(&theirs).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(mock.writes().is_empty());
    // A pod that is not there.
    match p.claim(&claim_by(&pool_spec("pool-gone"), Some("job-a"), 1)).await {
        Err(ProviderError::NotFound(id)) => assert_eq!(id, "pool-gone"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_claim_that_meets_another_write_to_the_pod_is_tried_again_on_the_new_version() {
    let cluster = Cluster::shared();
    let status_changes = Arc::new(AtomicUsize::new(0));
    let (client, mock) = mock({
        let (cluster, status_changes) = (cluster.clone(), status_changes.clone());
        move |req| {
            let mut c = cluster.lock().unwrap();
            if req.method == "PATCH" && status_changes.fetch_add(1, Ordering::SeqCst) == 0 {
                // The kubelet writes the pod between the claim's read and its patch.
                let mut pod = c.pods["sandman-pool-0"].clone();
                pod["status"]["conditions"][0]["lastProbeTime"] = "2026-11-29T19:00:00Z".into();
                c.update(pod);
            }
            c.handle(req)
        }
    });
    let p = provider(client);
    let pool = pool_spec("pool-0");
    p.create(&pool).await.unwrap();
    let claim = claim_by(&pool, Some("job-a"), 1_700_000_100_000);
    p.claim(&claim).await.unwrap_or_else(|e| panic!("{e}"));

    let patches: Vec<common::Seen> = mock.writes().into_iter().filter(|r| r.method == "PATCH").collect();
    assert_eq!(patches.len(), 2, "the conflicting patch was not tried again: {patches:#?}");
    let rv = |r: &common::Seen| r.json()["metadata"]["resourceVersion"].as_str().unwrap().parse::<u64>().unwrap();
    assert!(rv(&patches[1]) > rv(&patches[0]), "tried again on the version it had read before");
    let pod = cluster.lock().unwrap().pods["sandman-pool-0"].clone();
    assert_eq!(pod["metadata"]["labels"]["sandman.dev/claimed"], "true");
    assert_eq!(pod["metadata"]["labels"]["sandman.dev/job"], "job-a");
    let recorded: Claim =
        serde_json::from_str(pod["metadata"]["annotations"]["sandman.dev/claim"].as_str().unwrap()).unwrap();
    assert_eq!(recorded, stored(&claim));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_claiming_the_same_pool_sandboxes_at_once_never_both_win() {
    let cluster = Cluster::shared();
    let (c1, _m1) = client_on(&cluster);
    let (c2, _m2) = client_on(&cluster);
    let (first, second) = (Arc::new(provider(c1)), Arc::new(provider(c2)));
    let pools: Vec<SandboxSpec> = (0..8).map(|i| pool_spec(&format!("pool-{i}"))).collect();
    for r in futures_util::future::join_all(pools.iter().map(|s| first.create(s))).await {
        r.unwrap();
    }
    let mut tasks = Vec::new();
    for (i, pool) in pools.iter().enumerate() {
        for (n, p) in [(0u64, first.clone()), (1, second.clone())] {
            let claim = claim_by(pool, Some(&format!("job-{n}")), 1_700_000_100_000 + i as u64 * 2 + n);
            tasks.push(tokio::spawn(async move { (claim.clone(), p.claim(&claim).await) }));
        }
    }
    let mut winners: BTreeMap<String, Claim> = BTreeMap::new();
    for t in tasks {
        let (claim, result) = t.await.unwrap();
        match result {
            Ok(()) => assert!(winners.insert(claim.spec.id.clone(), claim).is_none(), "two claims of one sandbox won"),
            Err(ProviderError::Claimed(m)) => assert!(m.contains(&claim.spec.id), "{m}"),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(winners.len(), pools.len(), "a pool sandbox nobody claimed: {:?}", winners.keys());
    // The pod holds the winner's claim, which a third server lists.
    let (c3, _m3) = client_on(&cluster);
    let third = provider(c3);
    for r in third.list().await.unwrap() {
        let won = &winners[&r.spec.id];
        assert_eq!(r.claim.as_ref(), Some(won), "{}", r.spec.id);
        assert_eq!(r.spec, won.spec, "the listed spec is the claimed one, token and all");
    }
}

#[tokio::test]
async fn list_answers_the_claim_of_a_claimed_pod_and_releasing_the_claimers_job_takes_it_quietly() {
    let cluster = Cluster::shared();
    let (client, _mock) = client_on(&cluster);
    let p = provider(client);
    let mut events = p.events().unwrap();
    // Made by a refill under the pool's own job; claimed by a create with none.
    let mut pool = pool_spec("pool-0");
    pool.job = Some("refill".into());
    let idle = pool_spec("pool-1");
    let broken = pool_spec("pool-2");
    for s in [&pool, &idle, &broken] {
        p.create(s).await.unwrap();
    }
    let claim = claim_by(&pool, None, 1_700_000_100_000);
    p.claim(&claim).await.unwrap();
    let labels = cluster.lock().unwrap().pods["sandman-pool-0"]["metadata"]["labels"].clone();
    assert!(labels.get("sandman.dev/job").is_none(), "the pool's job label stayed on the claimed pod: {labels}");
    {
        let mut c = cluster.lock().unwrap();
        let mut pod = c.pods["sandman-pool-2"].clone();
        pod["metadata"]["labels"]["sandman.dev/claimed"] = "true".into();
        pod["metadata"]["annotations"]["sandman.dev/claim"] = "{not a claim".into();
        c.update(pod);
    }

    let mut records = p.list().await.unwrap();
    records.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
    let ids: Vec<&str> = records.iter().map(|r| r.spec.id.as_str()).collect();
    assert_eq!(ids, ["pool-0", "pool-1", "pool-2"]);
    assert_eq!(records[0].claim.as_ref(), Some(&claim), "the claim, its token recovered from the Secret");
    assert_eq!(records[0].spec, claim.spec);
    assert_eq!(records[1].claim, None);
    assert_eq!(records[1].spec, idle);
    assert_eq!(records[2].claim, None, "an unreadable claim is no claim (with a warning)");

    // Claimed into job `claimer`: releasing that job takes it, and its end is not news.
    let claim = claim_by(&idle, Some("claimer"), 1_700_000_100_001);
    p.claim(&claim).await.unwrap();
    assert_eq!(p.delete_job("claimer").await.unwrap(), ["pool-1"]);
    {
        let mut c = cluster.lock().unwrap();
        let mut pod = c.pods["sandman-pool-2"].clone();
        pod["status"] = json("status-oomkilled.json")["status"].clone();
        c.update(pod);
    }
    let ev = next_event(&mut events).await;
    assert_eq!((ev.id.as_str(), ev.ended.reason), ("pool-2", Reason::OomKilled), "{ev:?}");
}

// ---- image-volume injection on runtimes that cannot mount image volumes ----

/// `injection: image_volume` on nodes whose runtime cannot mount image volumes (the recorded
/// kubelet's containerd 1.6.20) is refused at start, naming the nodes and what to use instead;
/// with one node that can, it starts; other injections do not look.
#[tokio::test]
async fn image_volume_injection_is_refused_when_no_eligible_node_can_mount_image_volumes() {
    let old = json("node-kubelet-ready.json");
    let mut new = old.clone();
    new["metadata"]["name"] = "node-2".into();
    new["status"]["nodeInfo"]["containerRuntimeVersion"] = "containerd://2.1.4".into();
    let on = |nodes: Vec<Value>| {
        mock(move |req| {
            if req.path == "/api/v1/nodes" {
                return ok(serde_json::json!({"kind": "NodeList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": "1200"}, "items": nodes}));
            }
            Reply::Json(StatusCode::NOT_FOUND, json("error-404-get-missing-pod.json"))
        })
    };
    let image_volume = KubeConfig { injection: sandman_provider_kube::Injection::ImageVolume, ..config() };

    let (client, _mock) = on(vec![old.clone()]);
    match sandman_provider_kube::check_runtimes(&client, &image_volume).await {
        Err(ProviderError::Unsupported(m)) => {
            assert!(m.contains("node-1 (containerd://1.6.20)"), "{m}");
            assert!(m.contains("containerd 2.1+") && m.contains("init_container"), "{m}");
        }
        other => panic!("image_volume on containerd 1.6 was not refused: {other:?}"),
    }
    let (client, _mock) = on(vec![old.clone(), new]);
    sandman_provider_kube::check_runtimes(&client, &image_volume).await.unwrap_or_else(|e| panic!("{e}"));
    let (client, mock) = on(vec![old]);
    sandman_provider_kube::check_runtimes(&client, &config()).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(mock.seen().is_empty(), "init-container injection listed the nodes");
}

/// The shared watch keeps no pod: what the provider knows of a sandbox pod is its state (read
/// from the recorded pod, its managed fields and spec annotation left behind), and nothing of
/// it once the pod is gone.
#[tokio::test]
async fn the_watch_keeps_each_pods_state_not_the_pod() {
    let mut pod = json("pod-running-ready.json");
    let id = id_of(&pod);
    let spec = spec(&id, "busybox:1");
    pod["metadata"]["annotations"] = serde_json::json!({"sandman.dev/spec": serde_json::to_string(&spec).unwrap()});
    let watches = Arc::new(Mutex::new(Watches::default()));
    let feed = watches.lock().unwrap().push();
    let (client, _mock) = scripted(watches);
    feed.send(bytes::Bytes::from(format!("{}\n", serde_json::json!({"type": "ADDED", "object": pod})))).await.unwrap();
    let p = provider(client);
    let deadline = Instant::now() + Duration::from_secs(10);
    let (state, seen) = loop {
        if let Some(w) = p.watched(&id) {
            break w;
        }
        assert!(Instant::now() < deadline, "the pod was never seen");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let ip = pod["status"]["podIP"].as_str().unwrap().to_string();
    assert_eq!(state, PodState::Ready { ip });
    assert_eq!(seen, None, "a running pod needs no description");
    assert_eq!(p.footprint(), Footprint { watched_pods: 1, tracked: 1, pending_secrets: 0 });
    feed.send(bytes::Bytes::from(format!("{}\n", serde_json::json!({"type": "DELETED", "object": pod}))))
        .await
        .unwrap();
    while p.footprint() != Footprint::default() {
        assert!(Instant::now() < deadline, "the provider still holds {:?}", p.footprint());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(p.watched(&id).is_none());
}

/// A pod write keeps nothing of the pod while it waits for its slot of the pacer (in a burst,
/// thousands wait at once, and a parsed pod is kilobytes): its future borrows nothing of the
/// pod, which this test drops before awaiting it (it would not compile otherwise), and it asks
/// for the answer as metadata only (the API server need not encode the pod), of which it reads
/// the uid.
#[tokio::test]
async fn a_pod_write_keeps_nothing_of_the_pod_while_it_waits() {
    let cluster = Cluster::shared();
    let (client, mock) = client_on(&cluster);
    let api = KubeApi::new(client, NAMESPACE, Pacer::new(1000.0, 1), 4);
    let pod = build_pod(&spec("sbx-write", "busybox:1"), &config()).unwrap();
    let sent = api.create_pod(&pod);
    drop(pod);
    assert_eq!(sent.await.unwrap(), "uid-sandman-sbx-write");
    assert!(cluster.lock().unwrap().pods.contains_key("sandman-sbx-write"));
    let post = mock.writes().into_iter().find(|w| w.method == "POST").unwrap();
    assert!(post.accept.as_deref().is_some_and(|a| a.contains("as=PartialObjectMetadata;")), "{:?}", post.accept);
}

/// A snapshot of the whole file system is refused at once, naming the provider and why; one of
/// named directories, and a create from a snapshot, are refused at once when no registry is
/// configured, asking the API server nothing.
#[tokio::test]
async fn a_snapshot_is_refused_at_once_naming_the_provider_and_the_reason() {
    let watches = Arc::new(Mutex::new(Watches::default()));
    let (client, api) = scripted(watches);
    let p = provider(client);
    let before = api.seen().len();
    let refused = p.snapshot("sb-1", "snap-1").await.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        refused.starts_with("the kubernetes provider cannot snapshot a sandbox's whole file system: "),
        "{refused}"
    );
    assert!(refused.contains("container runtime") && refused.contains("`paths`"), "{refused}");
    assert!(matches!(p.snapshot_scope(), SnapshotScope::Named { why, .. } if why.contains("container runtime")));

    let no_registry = |r: Result<_, ProviderError>| match r {
        Err(ProviderError::Unsupported(m)) => assert!(m.contains("`snapshots: {registry:"), "{m}"),
        other => panic!("expected a refusal, got {other:?}"),
    };
    no_registry(p.check_snapshot());
    no_registry(p.snapshot_dirs("sb-1", "snap-1", Vec::new()).await.map(|_| ()));
    no_registry(p.check(&spec("sb-2", "snapshot:snap-1")));
    assert_eq!(api.seen().len(), before, "the refusal asked the API server");
}

fn snapshots_config(registry: &Registry) -> KubeConfig {
    KubeConfig {
        snapshots: Some(SnapshotsConfig {
            registry: format!("{}/sandman/snapshots", registry.addr()),
            insecure: false,
            auth_file: None,
            max_bytes: 1 << 20,
        }),
        ..config()
    }
}

/// A tar of `files` (names relative to the directory), as the daemon's `GET /v1/archive` makes.
fn archive(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, *data).unwrap();
    }
    b.into_inner().unwrap()
}

fn dir(path: &str, files: &[(&str, &[u8])]) -> NamedDir {
    NamedDir { path: path.into(), mode: 0o755, uid: 0, gid: 0, tar: archive(files) }
}

/// A snapshot of named directories is pushed to the configured registry as the pod's image with
/// one more layer (its files under their absolute paths, the image's config kept); a create
/// from it runs that image; a snapshot of a sandbox made from a snapshot grows it again without
/// sending the image's layers twice.
#[tokio::test]
async fn a_snapshot_pushes_the_named_directories_over_the_pods_image_and_a_create_runs_it() {
    let scratch = tempfile::tempdir_in(sandman_testkit::scratch!()).unwrap();
    let registry = Registry::start(Auth::Anonymous, scratch.path());
    let base_layer = LayerBuilder::new().dir("etc").file("etc/os-release", b"ID=base\n").build(Compression::Gzip);
    let run = serde_json::json!({ "WorkingDir": "/workspace", "Env": ["PATH=/bin", "BASE=1"] });
    registry.push("task", "1", &TestImage::with_config(vec![base_layer], host_arch(), run)).await;
    let base = registry.reference("task", "1");

    let cluster = Cluster::shared();
    let (client, _mock) = client_on(&cluster);
    let config = snapshots_config(&registry);
    let api = KubeApi::new(client.clone(), NAMESPACE, Pacer::new(1000.0, 1), 4);
    api.create_pod(&build_pod(&spec("sb-snap", &base), &config).unwrap()).await.unwrap();
    let p = provider_with(client, config.clone());

    let dirs = vec![
        dir("/workspace", &[("notes.txt", b"before the snapshot"), ("src/lib.rs", b"pub fn f() {}")]),
        dir("/root/.cache", &[("pip", b"cached")]),
    ];
    let made = p.snapshot_dirs("sb-snap", "snap-one", dirs).await.unwrap();
    let pushed = made.pushed.clone().unwrap();
    let expected = format!("{}/sandman/snapshots:snap-one@sha256:", registry.addr());
    assert!(pushed.starts_with(&expected), "{pushed}");
    assert!(made.size.unwrap() > 0);

    // Pulled back: the base's layer and the snapshot's, the base's config, the files absolute.
    let store = ImageStore::open({
        let mut c = StoreConfig::new(scratch.path().join("images"));
        c.docker_socket = Some(scratch.path().join("no-engine.sock"));
        c
    })
    .unwrap();
    let reference = format!("{}/sandman/snapshots:snap-one", registry.addr());
    let image = store.resolve(&reference, Progress::none()).await.unwrap();
    assert_eq!(image.layers.len(), 2);
    assert_eq!(image.config.workdir.as_deref(), Some("/workspace"));
    assert_eq!(image.config.env.get("BASE").map(String::as_str), Some("1"));
    let top = &image.layers[1];
    assert_eq!(std::fs::read(top.join("workspace/notes.txt")).unwrap(), b"before the snapshot");
    assert_eq!(std::fs::read(top.join("workspace/src/lib.rs")).unwrap(), b"pub fn f() {}");
    assert_eq!(std::fs::read(top.join("root/.cache/pip")).unwrap(), b"cached");
    assert!(!top.join("etc").exists(), "the snapshot's layer holds only the named directories");

    // A create from the snapshot runs its image.
    let child = build_pod(&spec("sb-child", "snapshot:snap-one"), &config).unwrap();
    let task = child.spec.as_ref().unwrap().containers.iter().find(|c| c.name == "task").unwrap();
    assert_eq!(task.image.as_deref(), Some(reference.as_str()));

    // A snapshot of that child: one more layer, the image's own blobs found in the registry.
    api.create_pod(&child).await.unwrap();
    let pushes_before = registry.requests("PUT", "/v2/sandman/snapshots/blobs/uploads/");
    let again = p.snapshot_dirs("sb-child", "snap-two", vec![dir("/workspace", &[("more.txt", b"x")])]).await.unwrap();
    assert!(again.pushed.is_some());
    let two =
        store.resolve(&format!("{}/sandman/snapshots:snap-two", registry.addr()), Progress::none()).await.unwrap();
    assert_eq!(two.layers.len(), 3);
    assert!(two.layers[2].join("workspace/more.txt").is_file());
    assert!(!two.layers[2].join("workspace/notes.txt").exists());
    let pushes = registry.requests("PUT", "/v2/sandman/snapshots/blobs/uploads/") - pushes_before;
    assert!(pushes <= 2, "the second snapshot sent {pushes} blobs: only its layer and config are new");

    // A sandbox the cluster does not have.
    let missing = p.snapshot_dirs("sb-none", "snap-three", Vec::new()).await;
    assert!(matches!(missing, Err(ProviderError::NotFound(_))), "{missing:?}");
}

// ---- pause ----

#[tokio::test]
async fn pause_and_resume_are_refused_at_once_naming_the_provider_and_why() {
    let cluster = Cluster::shared();
    let (client, _mock) = client_on(&cluster);
    let p = provider(client);
    for refused in [p.pause("pz").await, p.resume("pz").await] {
        match refused {
            Err(ProviderError::Unsupported(m)) => {
                assert!(m.contains("kubernetes provider") && m.contains("`pz`"), "{m}");
                assert!(m.contains("a pod cannot be frozen without a runtime's help"), "{m}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    assert!(cluster.lock().unwrap().pods.is_empty(), "a refused pause touched the cluster");
}
