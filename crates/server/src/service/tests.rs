//! The service's behaviour over the fake provider: leases and timers, jobs, admission, pools,
//! recovery, setup commands and preparing images.

use std::collections::{BTreeMap, HashMap, HashSet};

use sandman_provider::ServerMeta;
use sandman_provider::fake::FakeProvider;
use sandman_wire::server::{
    CreateSandbox, JobSpec, PoolSpec, PreparePhase, PrepareRequest, Reason, SandboxState, UsageRecord,
};

use super::*;
use crate::pool::{Claim, POOL_LABEL};
use crate::sandbox::{Timers, now_ms};
use sandman_testkit::standin::StandIn;

fn settings(dir: &std::path::Path) -> Settings {
    Settings {
        default_lease: Duration::from_secs(30),
        max_ttl: None,
        ready_timeout: Duration::from_secs(5),
        gone_retention: Duration::from_secs(60),
        ..Settings::new(dir.to_path_buf())
    }
}

fn service_with(settings: Settings) -> Arc<Service> {
    let dir = settings.state_dir.clone();
    let provider = AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("nowhere.sock"))));
    let s = Service::new(settings, provider, "t".into());
    s.start_background();
    s
}

fn service(dir: &std::path::Path) -> Arc<Service> {
    service_with(settings(dir))
}

/// A service whose fake sandboxes are ready as soon as the provider has made them, with a
/// global create rate of `rate` a second, bursts of one.
fn admitting(dir: &std::path::Path, rate: f64, max_queue: usize) -> Arc<Service> {
    service_with(Settings {
        create_rate: Some(rate),
        create_burst: 1.0,
        max_queue,
        daemons: Daemons::Absent,
        ..settings(dir)
    })
}

fn fake(s: &Service) -> &FakeProvider {
    match &s.provider {
        AnyProvider::Fake(f) => f,
        _ => unreachable!(),
    }
}

/// A sandbox already in the provider's records, found by `recover` and so ready at once.
async fn ready_sandbox(
    s: &Arc<Service>,
    id: &str,
    job: Option<&str>,
    lease_s: u64,
    idle: Option<u64>,
    ttl: Option<u64>,
) {
    let mut spec = sandman_provider::conformance::spec(id, "any");
    spec.job = job.map(str::to_string);
    spec.created_at_ms = now_ms();
    spec.server = ServerMeta { lease_s, idle_timeout_s: idle, ttl_s: ttl, ..ServerMeta::default() };
    fake(s).create(&spec).await.unwrap_or_else(|e| panic!("{e}"));
    s.recover().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.get(id).map(|sb| sb.state()).ok(), Some(SandboxState::Ready));
}

async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

fn ended(s: &Service, id: &str) -> (SandboxState, Option<Reason>) {
    let w = s.get(id).map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
    (w.state, w.reason)
}

#[tokio::test(start_paused = true)]
async fn the_lease_reclaims_unless_renewed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready_sandbox(&s, "sb-a", None, 10, None, None).await;
    tokio::time::advance(Duration::from_secs(8)).await;
    settle().await;
    s.keepalive("sb-a").unwrap_or_else(|e| panic!("{e}"));
    tokio::time::advance(Duration::from_secs(8)).await;
    settle().await;
    assert_eq!(ended(&s, "sb-a").0, SandboxState::Ready, "reclaimed although renewed 8 s ago");
    tokio::time::advance(Duration::from_secs(3)).await;
    settle().await;
    assert_eq!(ended(&s, "sb-a"), (SandboxState::Gone, Some(Reason::LeaseExpired)));
    assert_eq!(fake(&s).count(), 0, "the provider still holds the reclaimed sandbox");
    // Calls on it answer gone with the reason, for the retention period, then not found.
    assert!(matches!(s.call_target("sb-a"), Err(ServerError::Gone { reason: Reason::LeaseExpired, .. })));
    tokio::time::advance(Duration::from_secs(61)).await;
    settle().await;
    assert!(matches!(s.get("sb-a"), Err(ServerError::NotFound(_))));
}

#[tokio::test(start_paused = true)]
async fn idle_timeout_and_lifetime_have_their_reasons() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready_sandbox(&s, "sb-idle", None, 1000, Some(20), None).await;
    ready_sandbox(&s, "sb-ttl", None, 1000, None, Some(30)).await;
    for _ in 0..4 {
        tokio::time::advance(Duration::from_secs(5)).await;
        settle().await;
        // Keepalives renew the lease but are not activity.
        let _ = s.keepalive("sb-idle");
        let _ = s.call_target("sb-ttl");
    }
    settle().await;
    assert_eq!(ended(&s, "sb-idle"), (SandboxState::Gone, Some(Reason::IdleExpired)));
    assert_eq!(ended(&s, "sb-ttl").0, SandboxState::Ready);
    tokio::time::advance(Duration::from_secs(11)).await;
    settle().await;
    assert_eq!(ended(&s, "sb-ttl"), (SandboxState::Gone, Some(Reason::TtlExpired)));
}

#[tokio::test(start_paused = true)]
async fn one_heartbeat_keeps_a_whole_job_alive_and_delete_releases_it() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    for i in 0..5 {
        ready_sandbox(&s, &format!("sb-j{i}"), Some("train"), 10, None, None).await;
    }
    ready_sandbox(&s, "sb-other", Some("other"), 10, None, None).await;
    for _ in 0..3 {
        tokio::time::advance(Duration::from_secs(6)).await;
        settle().await;
        assert_eq!(s.heartbeat("train").map(|a| a.sandboxes).ok(), Some(5));
    }
    assert_eq!(ended(&s, "sb-other"), (SandboxState::Gone, Some(Reason::LeaseExpired)));
    for i in 0..5 {
        assert_eq!(ended(&s, &format!("sb-j{i}")).0, SandboxState::Ready);
    }
    let action = s.delete_job("train").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(action.sandboxes, 5);
    for i in 0..5 {
        assert_eq!(ended(&s, &format!("sb-j{i}")), (SandboxState::Gone, Some(Reason::JobDeleted)));
    }
    assert_eq!(fake(&s).count(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_failed_create_reports_its_reason_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    fake(&s).fail_image("ghost:latest");
    let req = CreateSandbox { image: "ghost:latest".into(), wait: true, ..Default::default() };
    match s.create(req).await {
        Err(ServerError::Failed { reason, message, .. }) => {
            assert_eq!(reason, Reason::ImagePullFailed);
            assert!(message.contains("ghost:latest"), "{message}");
        }
        other => panic!("expected a failed create, got {other:?}"),
    }
    assert_eq!(fake(&s).count(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_spec_the_provider_cannot_run_is_refused_before_anything_exists() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    let req =
        CreateSandbox { image: sandman_provider::fake::UNSUPPORTED_IMAGE.into(), wait: false, ..Default::default() };
    let err = s.create(req).await.err().unwrap_or_else(|| panic!("accepted"));
    assert_eq!(err.code(), sandman_wire::ErrorCode::InvalidArgument);
    assert_eq!(s.count(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_reused_idempotency_key_with_another_request_is_a_conflict() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    let req =
        CreateSandbox { image: "any".into(), wait: false, idempotency_key: Some("k2".into()), ..Default::default() };
    s.create(req.clone()).await.unwrap_or_else(|e| panic!("{e}"));
    let other = CreateSandbox { image: "other".into(), ..req };
    let err = s.create(other).await.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("different image"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_deleted_job_is_not_found() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready_sandbox(&s, "sb-d1", Some("gone-job"), 100, None, None).await;
    assert!(s.job("gone-job").is_ok());
    s.delete_job("gone-job").await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(s.job("gone-job"), Err(ServerError::NotFound(_))));
}

#[tokio::test(start_paused = true)]
async fn idempotent_creates_return_one_sandbox() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    let req =
        CreateSandbox { image: "any".into(), wait: false, idempotency_key: Some("k1".into()), ..Default::default() };
    let a = s.create(req.clone()).await.unwrap_or_else(|e| panic!("{e}"));
    let b = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.id, b.id);
    settle().await;
    assert_eq!(fake(&s).count(), 1);
    assert_eq!(s.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn job_quota_is_enforced_and_named() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    s.put_job("q", JobSpec { max_sandboxes: Some(2), ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
    let req = CreateSandbox { image: "any".into(), wait: false, job: Some("q".into()), ..Default::default() };
    s.create(req.clone()).await.unwrap_or_else(|e| panic!("{e}"));
    s.create(req.clone()).await.unwrap_or_else(|e| panic!("{e}"));
    match s.create(req).await {
        Err(e @ ServerError::QuotaExceeded(_)) => assert!(e.to_string().contains("max_sandboxes"), "{e}"),
        other => panic!("expected quota_exceeded, got {other:?}"),
    }
    assert!(s.put_job("q", JobSpec { create_rate: Some(-5.0), ..Default::default() }).is_err());
    assert!(s.put_job("q", JobSpec { weight: Some(0.0), ..Default::default() }).is_err());
    assert!(s.put_job("q", JobSpec { create_rate: Some(5.0), weight: Some(2.0), ..Default::default() }).is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_sandbox_the_provider_sees_die_is_failed_with_its_reason() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready_sandbox(&s, "sb-oom", None, 100, None, None).await;
    fake(&s).kill("sb-oom", Reason::OomKilled, "OOMKilled").await;
    settle().await;
    let w = s.get("sb-oom").map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (w.state, w.reason, w.message.as_deref()),
        (SandboxState::Failed, Some(Reason::OomKilled), Some("OOMKilled"))
    );
}

fn create_req(job: Option<&str>, wait: bool) -> CreateSandbox {
    CreateSandbox { image: "any".into(), wait, job: job.map(str::to_string), ..Default::default() }
}

fn states_of(s: &Service, job: &str) -> HashMap<SandboxState, usize> {
    let mut out = HashMap::new();
    let q = ListQuery { job: Some(job.into()), ..Default::default() };
    for sb in s.list(&q).unwrap_or_default() {
        *out.entry(sb.state).or_default() += 1;
    }
    out
}

#[tokio::test(start_paused = true)]
async fn two_jobs_queueing_share_the_create_rate_by_weight() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 100.0, 100_000);
    s.put_job("light", JobSpec { weight: Some(1.0), ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
    s.put_job("heavy", JobSpec { weight: Some(3.0), ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
    let mut ids = HashSet::new();
    for _ in 0..1500 {
        for job in ["light", "heavy"] {
            let sb = s.create(create_req(Some(job), false)).await.unwrap_or_else(|e| panic!("{e}"));
            assert!(ids.insert(sb.id));
        }
    }
    // 10 s of a 100/s rate: about 1000 creates, while both jobs still queue.
    tokio::time::sleep(Duration::from_secs(10)).await;
    settle().await;
    let light = states_of(&s, "light").get(&SandboxState::Ready).copied().unwrap_or(0) as f64;
    let heavy = states_of(&s, "heavy").get(&SandboxState::Ready).copied().unwrap_or(0) as f64;
    assert!((light + heavy - 1000.0).abs() <= 3.0, "the global rate was not held: {}", light + heavy);
    let ratio = heavy / light;
    assert!((ratio - 3.0).abs() / 3.0 < 0.10, "heavy/light = {ratio} ({light} vs {heavy})");
    assert_eq!(fake(&s).count() as f64, light + heavy, "every admitted create made exactly one sandbox");
    assert_eq!(s.queued() as f64, 3000.0 - light - heavy);
}

#[tokio::test(start_paused = true)]
async fn past_the_queue_bound_a_create_is_refused_with_a_retry_time() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1.0, 5);
    for _ in 0..6 {
        s.create(create_req(None, false)).await.unwrap_or_else(|e| panic!("{e}"));
    }
    match s.create(create_req(None, false)).await {
        Err(ServerError::QueueFull { queued: 5, retry_after_s }) => assert!(retry_after_s >= 1),
        other => panic!("expected a full queue, got {other:?}"),
    }
    assert_eq!(s.count(), 6, "the refused create left nothing behind");
}

#[tokio::test(start_paused = true)]
async fn a_create_still_queued_at_its_wait_timeout_is_taken_off_the_queue() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 0.1, 100);
    s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
    let req = CreateSandbox { wait_timeout_s: Some(2), ..create_req(Some("j"), true) };
    match s.create(req).await {
        Err(ServerError::Timeout(m)) => assert!(m.contains("queue_timeout"), "{m}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(states_of(&s, "j").get(&SandboxState::Gone), Some(&1));
    let gone = s.list(&ListQuery { job: Some("j".into()), ..Default::default() }).unwrap_or_default();
    assert_eq!(gone[0].reason, Some(Reason::QueueTimeout));
    assert_eq!(s.queued(), 0);
    tokio::time::sleep(Duration::from_secs(20)).await;
    let made = fake(&s).list().await.unwrap_or_default();
    assert_eq!(made.len(), 1);
    assert!(made.iter().all(|r| r.spec.job.is_none()), "the timed-out create was made anyway");
}

#[tokio::test(start_paused = true)]
async fn a_queued_create_whose_caller_goes_away_is_taken_off_the_queue_and_a_retry_starts_anew() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 0.1, 100);
    s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
    let req = CreateSandbox { idempotency_key: Some("k".into()), ..create_req(Some("j"), true) };
    let waiting = {
        let (s, req) = (s.clone(), req.clone());
        tokio::spawn(async move { s.create(req).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.queued(), 1);
    // The caller hangs up: its request future is dropped.
    waiting.abort();
    let _ = waiting.await;
    assert_eq!(s.queued(), 0);
    let gone = s.list(&ListQuery { job: Some("j".into()), ..Default::default() }).unwrap_or_default();
    assert_eq!((gone.len(), gone[0].state, gone[0].reason), (1, SandboxState::Gone, Some(Reason::Released)));
    assert!(gone[0].message.as_deref().is_some_and(|m| m.contains("went away")), "{:?}", gone[0].message);
    // A retry with the same key is a new create, not the abandoned one.
    let retry = s.create(CreateSandbox { wait: false, ..req }).await.unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(retry.id, gone[0].id);
    assert_eq!(retry.state, SandboxState::Queued);
    tokio::time::sleep(Duration::from_secs(30)).await;
    let made: Vec<String> = fake(&s).list().await.unwrap_or_default().into_iter().map(|r| r.spec.id).collect();
    assert!(made.contains(&retry.id) && !made.contains(&gone[0].id), "{made:?}");
}

#[tokio::test(start_paused = true)]
async fn queued_creates_hear_their_place_move_a_few_times_not_at_every_admission() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 10.0, 10_000);
    let mut ids = Vec::new();
    for _ in 0..200 {
        ids.push(s.create(create_req(Some("q"), false)).await.unwrap_or_else(|e| panic!("{e}")).id);
    }
    tokio::time::sleep(Duration::from_secs(25)).await;
    let events = s.events.list(&crate::events::Filter { job: Some("q"), idempotency_key: None }, 0);
    let told = |id: &str| -> Vec<u64> {
        events
            .iter()
            .filter(|e| e.sandbox == id && e.state == Some(SandboxState::Queued))
            .filter_map(|e| e.queue_position)
            .collect()
    };
    let last = told(&ids[199]);
    // First told its place at the back, then told again as it moved up, always forward.
    assert!(last.len() >= 4, "{last:?}");
    assert!(last.windows(2).all(|w| w[1] < w[0]), "{last:?}");
    assert!(last[0] >= 190 && *last.last().unwrap_or(&u64::MAX) <= 10, "{last:?}");
    // About log2(position) times each, not once per admission (that would be ~20,000).
    let all: usize = ids.iter().map(|id| told(id).len()).sum();
    assert!(all < 200 * 10, "{all}");
    let waits: Vec<u64> = events
        .iter()
        .filter(|e| e.sandbox == ids[199] && e.state == Some(SandboxState::Queued))
        .filter_map(|e| e.estimated_wait_ms)
        .collect();
    assert!(waits.windows(2).all(|w| w[1] < w[0]), "{waits:?}");
}

#[tokio::test(start_paused = true)]
async fn a_job_create_rate_and_quota_hold_while_others_go_on() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    let spec = JobSpec { max_sandboxes: Some(30), create_rate: Some(2.0), ..Default::default() };
    s.put_job("capped", spec).unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..30 {
        s.create(create_req(Some("capped"), false)).await.unwrap_or_else(|e| panic!("{e}"));
    }
    // Queued creates count against the quota.
    match s.create(create_req(Some("capped"), false)).await {
        Err(e @ ServerError::QuotaExceeded(_)) => assert!(e.to_string().contains("max_sandboxes"), "{e}"),
        other => panic!("expected quota_exceeded, got {other:?}"),
    }
    for _ in 0..50 {
        s.create(create_req(Some("free"), false)).await.unwrap_or_else(|e| panic!("{e}"));
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    settle().await;
    // Its bucket: 2 at once, then 2 a second.
    let capped = states_of(&s, "capped").get(&SandboxState::Ready).copied().unwrap_or(0);
    assert!((11..=13).contains(&capped), "capped job got {capped} in 5 s");
    assert_eq!(states_of(&s, "free").get(&SandboxState::Ready), Some(&50));
}

#[tokio::test(start_paused = true)]
async fn a_job_deleted_mid_burst_releases_what_it_had_and_what_it_queued() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 10.0, 10_000);
    for _ in 0..100 {
        s.create(create_req(Some("doomed"), false)).await.unwrap_or_else(|e| panic!("{e}"));
        s.create(create_req(Some("other"), false)).await.unwrap_or_else(|e| panic!("{e}"));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    let before = states_of(&s, "doomed");
    assert!(before.get(&SandboxState::Ready).is_some_and(|n| *n >= 5), "{before:?}");
    assert!(before.get(&SandboxState::Queued).is_some_and(|n| *n >= 80), "{before:?}");
    let action = s.delete_job("doomed").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(action.sandboxes, 100);
    let after = s.list(&ListQuery { job: Some("doomed".into()), ..Default::default() }).unwrap_or_default();
    assert!(after.iter().all(|sb| sb.state == SandboxState::Gone && sb.reason == Some(Reason::JobDeleted)));
    tokio::time::sleep(Duration::from_secs(10)).await;
    settle().await;
    let made: Vec<_> = fake(&s).list().await.unwrap_or_default();
    assert!(made.iter().all(|r| r.spec.job.as_deref() == Some("other")), "a deleted job's create was made");
    assert_eq!(s.job_usage("other").map(|u| u.live).ok(), Some(100));
}

fn pool_spec(min: u64) -> PoolSpec {
    PoolSpec { image: "any".into(), min_ready: min, ..Default::default() }
}

async fn pool_ready(s: &Service, name: &str) -> u64 {
    settle().await;
    s.pool(name).map(|p| p.ready).unwrap_or(0)
}

#[tokio::test(start_paused = true)]
async fn a_pool_fills_claims_hand_out_distinct_sandboxes_and_it_refills() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    s.put_pool("warm", pool_spec(20)).unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool_ready(&s, "warm").await, 20);
    let mut claims = Vec::new();
    for i in 0..20 {
        let s = s.clone();
        claims.push(tokio::spawn(async move {
            let req = CreateSandbox {
                pool: Some("warm".into()),
                image: String::new(),
                job: Some("j".into()),
                labels: BTreeMap::from([("n".to_string(), i.to_string())]),
                env: BTreeMap::from([("TASK".to_string(), i.to_string())]),
                ..Default::default()
            };
            s.create(req).await.unwrap_or_else(|e| panic!("{e}"))
        }));
    }
    let mut ids = HashSet::new();
    for c in claims {
        let sb = c.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sb.state, SandboxState::Ready);
        assert_eq!(sb.labels.get(POOL_LABEL).map(String::as_str), Some("warm"));
        let n = sb.labels.get("n").cloned().unwrap_or_default();
        let target = s.call_target(&sb.id).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(target.route.env.get("TASK"), Some(&n), "the claimer's env is kept for its calls");
        assert!(ids.insert(sb.id), "a sandbox was handed out twice");
    }
    assert_eq!(s.job("j").map(|j| j.live).ok(), Some(20));
    let p = s.pool("warm").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((p.claimed, p.claims), (20, 20));
    // Claims made no sandbox of their own: 20 made to fill, 20 to refill.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool_ready(&s, "warm").await, 20);
    assert_eq!(fake(&s).count(), 40);
    // A claimed sandbox is its job's: its lease reclaims it, while the pool's idle ones stay.
    tokio::time::sleep(Duration::from_secs(31)).await;
    settle().await;
    // Never PUT and with no live sandbox left, the job no longer exists.
    assert!(matches!(s.job("j"), Err(ServerError::NotFound(_))));
    assert_eq!(pool_ready(&s, "warm").await, 20);
    // Deleting the pool releases its unclaimed sandboxes.
    s.delete_pool("warm").unwrap_or_else(|e| panic!("{e}"));
    settle().await;
    assert_eq!(fake(&s).count(), 0);
    assert!(s.pool("warm").is_err());
}

#[tokio::test(start_paused = true)]
async fn an_autoscaled_pool_keeps_what_demand_asks_for_within_its_bounds() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    fake(&s).set_create_delay(Duration::from_secs(2));
    let spec = PoolSpec { max: Some(40), autoscale: true, ..pool_spec(2) };
    s.put_pool("auto", spec).unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = s.pool("auto").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((p.ready, p.target, p.claim_rate), (2, 2, Some(0.0)), "{p:?}");
    // 10 creates a second for 40 s (the rate is over the last 30 s), each refill taking 2 s:
    // about 20 wanted at once.
    let claim = || CreateSandbox { pool: Some("auto".into()), image: String::new(), wait: false, ..Default::default() };
    for _ in 0..400 {
        s.create(claim()).await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let p = s.pool("auto").unwrap_or_else(|e| panic!("{e}"));
    let rate = p.claim_rate.unwrap_or(0.0);
    let refill = p.refill_seconds.unwrap_or(0.0);
    assert!((9.0..=11.0).contains(&rate), "{p:?}");
    assert!((1.9..=2.3).contains(&refill), "{p:?}");
    assert!((18..=24).contains(&p.target), "{p:?}");
    assert!(p.ready + p.creating >= p.target - 1, "not refilling to its target: {p:?}");
    // A burst past the bound is held to `max`.
    for _ in 0..600 {
        s.create(claim()).await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let p = s.pool("auto").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.target, 40, "{p:?}");
    assert!(p.ready + p.creating <= 40, "{p:?}");
    // Demand gone, the target falls back to `min_ready`.
    tokio::time::sleep(Duration::from_secs(40)).await;
    let p = s.pool("auto").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((p.target, p.claim_rate), (2, Some(0.0)), "{p:?}");
}

#[tokio::test(start_paused = true)]
async fn a_pool_sandbox_another_server_claimed_first_is_left_to_it_and_another_is_claimed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    s.put_pool("warm", pool_spec(3)).unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool_ready(&s, "warm").await, 3);
    fake(&s).claim_elsewhere(2);
    let req =
        CreateSandbox { pool: Some("warm".into()), image: String::new(), job: Some("j".into()), ..Default::default() };
    let sb = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));
    let lost = fake(&s).claimed_elsewhere();
    assert_eq!(lost.len(), 2);
    assert!(!lost.contains(&sb.id));
    assert_eq!((sb.state, sb.labels.get(POOL_LABEL).map(String::as_str)), (SandboxState::Ready, Some("warm")));
    // The claim is in the provider's records; the lost ones are the other server's: not
    // deleted, not known here any more.
    let records = fake(&s).list().await.unwrap_or_default();
    let mine = records.iter().find(|r| r.spec.id == sb.id).and_then(|r| r.claim.clone());
    assert_eq!(mine.map(|c| c.spec.job), Some(Some("j".to_string())));
    for id in &lost {
        assert!(records.iter().any(|r| &r.spec.id == id), "a sandbox claimed elsewhere was deleted");
        assert!(matches!(s.get(id), Err(ServerError::NotFound(_))), "{id} is still known here");
    }
    assert_eq!(s.job("j").map(|j| j.live).ok(), Some(1));
    // The pool makes up for all three.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool_ready(&s, "warm").await, 3);
}

#[tokio::test(start_paused = true)]
async fn a_claim_the_provider_kept_is_recovered_without_the_claims_file() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    // A pool sandbox claimed by an earlier server whose state directory is gone: no pools,
    // no claims file here, only what the provider kept.
    let mut pooled = sandman_provider::conformance::spec("sb-pooled", "any");
    pooled.labels = BTreeMap::from([(POOL_LABEL.to_string(), "gone-pool".to_string())]);
    pooled.created_at_ms = now_ms();
    pooled.server = ServerMeta { lease_s: 600, ..Default::default() };
    fake(&s).create(&pooled).await.unwrap_or_else(|e| panic!("{e}"));
    let mut claimed = pooled.clone();
    claimed.job = Some("j".into());
    claimed.labels.insert("task".into(), "7".into());
    let claim = Claim {
        spec: claimed,
        env: BTreeMap::from([("TASK".to_string(), "7".to_string())]),
        claimed_ms: now_ms(),
        pool_created_ms: pooled.created_at_ms,
    };
    fake(&s).claim(&claim).await.unwrap_or_else(|e| panic!("{e}"));
    s.recover().await.unwrap_or_else(|e| panic!("{e}"));
    settle().await;
    let sb = s.get("sb-pooled").map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((sb.state, sb.job.as_deref()), (SandboxState::Ready, Some("j")));
    assert_eq!(s.call_target("sb-pooled").map(|t| t.route.env.get("TASK").cloned()).ok(), Some(Some("7".into())));
    // Not an orphan of a pool this server does not know: still in the provider.
    assert_eq!(fake(&s).count(), 1);
}

/// A record an older server wrote with a lease no timer can hold: before, the restarted
/// server panicked at start and stayed down. Now it is ended with the reason, its remains
/// removed, and everything else served.
#[tokio::test(start_paused = true)]
async fn a_restart_after_an_unrecoverable_record_reports_it_ended_and_serves() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    let mut bad = sandman_provider::conformance::spec("sb-huge", "any");
    bad.created_at_ms = now_ms();
    bad.daemon_lease_s = 59; // what `u64::MAX + 60` wrapped to
    bad.server = ServerMeta { lease_s: u64::MAX, ttl_s: Some(u64::MAX), ..Default::default() };
    fake(&s).create(&bad).await.unwrap_or_else(|e| panic!("{e}"));
    let mut good = sandman_provider::conformance::spec("sb-good", "any");
    good.created_at_ms = now_ms();
    good.server = ServerMeta { lease_s: 600, ..Default::default() };
    fake(&s).create(&good).await.unwrap_or_else(|e| panic!("{e}"));
    let (live, dead) = s.recover().await.unwrap_or_else(|e| panic!("{e}"));
    settle().await;
    assert_eq!((live, dead), (1, 1));
    let sb = s.get("sb-huge").map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((sb.state, sb.reason), (SandboxState::Failed, Some(Reason::ProviderError)));
    let message = sb.message.unwrap_or_default();
    assert!(
        message.contains("cannot be recovered") && message.contains("`lease_s` is 18446744073709551615"),
        "{message}"
    );
    // Its remains are gone; the good one, the list and the reaper go on.
    assert_eq!(fake(&s).count(), 1);
    let listed = s.list(&ListQuery::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(listed.len(), 2);
    tokio::time::advance(Duration::from_secs(601)).await;
    settle().await;
    assert_eq!(ended(&s, "sb-good"), (SandboxState::Gone, Some(Reason::LeaseExpired)));
}

/// Timers saturate rather than overflow, whatever a record holds.
#[tokio::test(start_paused = true)]
async fn timers_of_any_length_never_overflow() {
    let t0 = Instant::now();
    let t = Timers::new(t0, Duration::MAX, Some(Duration::MAX), Some(Duration::from_secs(u64::MAX)));
    assert!(t.next_deadline().0 > t0 + Duration::from_secs(365 * 86400));
    assert_eq!(t.due(t0 + Duration::from_secs(86400)), None);
}

#[tokio::test(start_paused = true)]
async fn a_create_matching_a_pool_claims_from_it_and_a_pool_that_cannot_fill_backs_off() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    s.put_pool("warm", pool_spec(2)).unwrap_or_else(|e| panic!("{e}"));
    settle().await;
    let sb = s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sb.labels.get(POOL_LABEL).map(String::as_str), Some("warm"), "not claimed");
    fake(&s).fail_image("ghost");
    s.put_pool("broken", PoolSpec { image: "ghost".into(), min_ready: 3, ..Default::default() })
        .unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(Duration::from_secs(30)).await;
    settle().await;
    let p = s.pool("broken").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.ready, 0);
    assert!(p.last_error.is_some_and(|e| e.contains("ghost")));
    // Backing off: a handful of tries in 30 s, not a hot loop.
    let failed = s.metrics.encode();
    let tries = failed
        .lines()
        .find(|l| l.starts_with("sandman_sandboxes_ended_total{reason=\"image_pull_failed\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    assert!((3..=40).contains(&tries), "{tries} failed refills in 30 s");
}

#[tokio::test(start_paused = true)]
async fn setup_commands_that_cannot_run_fail_the_sandbox_with_their_reason() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    let req = CreateSandbox { setup: vec!["pip install x".into()], ..create_req(Some("j"), true) };
    match s.create(req).await {
        Err(ServerError::Failed { reason: Reason::SetupFailed, message, .. }) => {
            assert!(message.contains("pip install x"), "{message}")
        }
        other => panic!("expected setup_failed, got {other:?}"),
    }
    settle().await;
    assert_eq!(fake(&s).count(), 0);
    let u = s.job_usage("j").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((u.sandboxes, u.by_reason.get("setup_failed")), (1, Some(&1)));
}

#[tokio::test(start_paused = true)]
async fn prepare_reports_each_image_and_each_node() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    fake(&s).fail_image("ghost");
    fake(&s).set_nodes(3, Duration::from_secs(1));
    let req = PrepareRequest {
        images: vec!["any".into(), "ghost".into(), sandman_provider::fake::UNSUPPORTED_IMAGE.into()],
        job: Some("j".into()),
        hold_until: None,
    };
    let out = s.prepare(req).await.unwrap_or_else(|e| panic!("{e}"));
    let oks: Vec<bool> = out.images.iter().map(|i| i.ok).collect();
    assert_eq!(oks, [true, false, false]);
    assert_eq!((out.images[0].nodes_ready, out.images[0].nodes_total), (3, 3));
    assert!(out.images[1].message.as_deref().is_some_and(|m| m.contains("pull access denied")));
    let events = s.events.list(&crate::events::Filter { job: Some("j"), idempotency_key: None }, 0);
    assert!(events.iter().all(|e| e.kind == sandman_wire::server::EventKind::Prepare && e.image.is_some()));
    let ready: Vec<(Option<u32>, Option<u32>)> = events
        .iter()
        .filter(|e| e.phase == Some(PreparePhase::Pulling) && e.message.as_deref() == Some("any is ready"))
        .map(|e| (e.nodes_ready, e.nodes_total))
        .collect();
    assert_eq!(ready, [(Some(1), Some(3)), (Some(2), Some(3)), (Some(3), Some(3))]);
    // Started and an end for each image, and a pulling and a ready line per node for `any`.
    assert_eq!(events.len(), 6 + 6);
}

#[tokio::test(start_paused = true)]
async fn a_prepare_holds_its_jobs_creates_until_enough_nodes_have_the_image() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    fake(&s).set_nodes(4, Duration::from_secs(10));
    let bad = PrepareRequest { images: vec!["host".into()], job: None, hold_until: Some(0.5) };
    assert!(matches!(s.prepare(bad).await, Err(ServerError::InvalidArgument(_))));
    let bad = PrepareRequest { images: vec!["host".into()], job: Some("j".into()), hold_until: Some(1.5) };
    assert!(matches!(s.prepare(bad).await, Err(ServerError::InvalidArgument(_))));

    let started = Instant::now();
    let prep = {
        let s = s.clone();
        let req = PrepareRequest { images: vec!["any".into()], job: Some("j".into()), hold_until: Some(0.5) };
        tokio::spawn(async move { s.prepare(req).await })
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    // A held create waits as long as its wait_timeout_s allows (the ready timeout is 10 s).
    let held = CreateSandbox { wait_timeout_s: Some(60), ..create_req(Some("j"), true) };
    let (held, other) = tokio::join!(s.create(held), s.create(create_req(Some("k"), true)));
    let held = held.unwrap_or_else(|e| panic!("{e}"));
    other.unwrap_or_else(|e| panic!("{e}"));
    // Two of the four nodes have it after 20 s: the held create went on then, not before.
    assert_eq!(held.state, SandboxState::Ready);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(20) && waited < Duration::from_secs(30), "{waited:?}");
    let out = prep.await.unwrap_or_else(|e| panic!("{e}")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((out.images[0].nodes_ready, out.images[0].nodes_total), (4, 4));
    // The gate is gone with the prepare: a later create is not held.
    let again = Instant::now();
    s.create(create_req(Some("j"), true)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(again.elapsed() < Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn every_ended_sandbox_has_an_accounting_record() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    let a = s.create(create_req(Some("acct"), true)).await.unwrap_or_else(|e| panic!("{e}"));
    let _b = s.create(create_req(Some("acct"), true)).await.unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    s.release(&a.id, Reason::Released).await.unwrap_or_else(|e| panic!("{e}"));
    s.delete_job("acct").await.unwrap_or_else(|e| panic!("{e}"));
    let u = s.job_usage("acct").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((u.sandboxes, u.live), (2, 0));
    assert_eq!((u.by_reason.get("released"), u.by_reason.get("job_deleted")), (Some(&1), Some(&1)));
    let lines = std::fs::read_to_string(dir.path().join(crate::accounting::FILE)).unwrap_or_default();
    let recs: Vec<UsageRecord> = lines.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert_eq!(recs.len(), 2);
    assert!(recs.iter().all(|r| r.provider == "fake" && r.ready_ms.is_some() && r.cpu_seconds.is_none()));
}

#[tokio::test(start_paused = true)]
async fn a_pulls_progress_is_an_event_of_its_create_tagged_with_the_idempotency_key() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = admitting(dir.path(), 1000.0, 10_000);
    fake(&s).pull_progress("slow:1", &["pulling slow:1: 0/2 layers", "pulling slow:1: 1/2 layers, 3/8 MiB"]);
    let mut live = s.events.subscribe();
    let req = CreateSandbox {
        image: "slow:1".into(),
        idempotency_key: Some("k-1".into()),
        job: Some("j".into()),
        wait: true,
        ..Default::default()
    };
    let sb = s.create(req).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sb.state, SandboxState::Ready);
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let e = tokio::time::timeout(Duration::from_secs(5), live.recv())
            .await
            .unwrap_or_else(|_| panic!("no progress event; saw {seen:?}"))
            .unwrap_or_else(|e| panic!("{e}"));
        if e.idempotency_key.is_some() {
            seen.push(e);
        }
    }
    let filter = crate::events::Filter { job: None, idempotency_key: Some("k-1") };
    let listed = s.events.list(&filter, 0);
    assert_eq!(listed, seen, "GET /v1/events?idempotency_key= lists what followers saw");
    for e in &listed {
        assert_eq!(
            (e.sandbox.as_str(), e.state, e.job.as_deref()),
            (sb.id.as_str(), Some(SandboxState::Creating), Some("j"))
        );
    }
    assert_eq!(listed[1].message.as_deref(), Some("pulling slow:1: 1/2 layers, 3/8 MiB"));
    // Another create's events are not tagged: the filter leaves them out.
    s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.events.list(&filter, 0).len(), 2);
}

/// A service over the fake whose every sandbox's daemon is a stand-in at a socket of its own,
/// holding the sandbox's token (or, for a `stranger`, another one); the stand-ins stay in the
/// list answered, to be asked how often they were called.
fn with_standins(
    dir: &std::path::Path,
    proves_daemon: bool,
    stranger: bool,
) -> (Arc<Service>, Arc<std::sync::Mutex<Vec<StandIn>>>) {
    let standins = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (kept, sockets) = (standins.clone(), dir.to_path_buf());
    let fake = FakeProvider::each_at(move |spec| {
        let socket = sockets.join(format!("{}.sock", spec.id));
        let token = if stranger { format!("not-{}", spec.token) } else { spec.token.clone() };
        kept.lock().unwrap_or_else(|e| panic!("{e}")).push(StandIn::unix(&socket, Some(&token)));
        Endpoint::Unix(socket)
    });
    fake.set_proves_daemon(proves_daemon);
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap_or_else(|e| panic!("{e}"));
    let s = Service::new(settings(&state), AnyProvider::Fake(fake), "t".into());
    s.start_background();
    (s, standins)
}

/// The health calls each stand-in has answered, in create order.
fn health_calls(standins: &std::sync::Mutex<Vec<StandIn>>) -> Vec<usize> {
    standins.lock().unwrap_or_else(|e| panic!("{e}")).iter().map(StandIn::health_calls).collect()
}

/// A daemon its provider proved during the create gets no health check of the server's: only
/// the challenge of the one connection its first call (the conditions record) opens.
#[tokio::test]
async fn a_daemon_the_provider_proved_in_its_create_is_asked_only_its_connections_proof() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (s, standins) = with_standins(dir.path(), true, false);
    for _ in 0..3 {
        let sb = s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sb.state, SandboxState::Ready);
    }
    assert_eq!(health_calls(&standins), [1, 1, 1], "the server checked a daemon its provider had proven");
}

/// Otherwise the server waits for the daemon's health on a connection it has proven: the
/// connection's challenge, then the health call on it, which the sandbox's first calls reuse.
#[tokio::test]
async fn a_daemon_the_provider_did_not_prove_is_proven_by_the_server_once() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (s, standins) = with_standins(dir.path(), false, false);
    for _ in 0..3 {
        let sb = s.create(create_req(None, true)).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sb.state, SandboxState::Ready);
    }
    assert_eq!(health_calls(&standins), [2, 2, 2]);
    for standin in standins.lock().unwrap_or_else(|e| panic!("{e}")).iter() {
        assert_eq!(standin.calls_with_a_token(), 1, "the conditions record's call, on the proven connection");
    }
}

#[tokio::test]
async fn a_stranger_at_the_address_of_a_provider_that_did_not_prove_fails_the_create() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (s, standins) = with_standins(dir.path(), false, true);
    match s.create(create_req(None, true)).await {
        Err(ServerError::Failed { reason: Reason::DaemonStartFailed, message, .. }) => {
            assert!(message.contains("another sandbox"), "{message}")
        }
        other => panic!("another sandbox's daemon was taken for this one's: {other:?}"),
    }
    assert_eq!(health_calls(&standins), [1]);
}

/// A provider that shares room between jobs (the kubernetes provider's capacity-aware
/// admission) learns each create's job weight from its spec.
#[tokio::test]
async fn a_create_carries_its_jobs_weight_to_the_provider() {
    use sandman_provider::Provider;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    s.put_job("heavy", JobSpec { weight: Some(3.0), ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
    s.put_job("plain", JobSpec::default()).unwrap_or_else(|e| panic!("{e}"));
    let mut want = HashMap::new();
    for (job, weight) in [(Some("heavy"), Some(3.0)), (Some("plain"), None), (None, None)] {
        let sb = s.create(create_req(job, false)).await.unwrap_or_else(|e| panic!("{e}"));
        want.insert(sb.id, weight);
    }
    // Made in the background (the create did not wait): until the provider holds all three.
    while fake(&s).count() < want.len() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let records = fake(&s).list().await.unwrap_or_else(|e| panic!("{e}"));
    let got: HashMap<String, Option<f64>> = records.into_iter().map(|r| (r.spec.id, r.spec.server.weight)).collect();
    assert_eq!(got, want);
}
