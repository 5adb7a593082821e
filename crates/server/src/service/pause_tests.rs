//! Pause and resume over the fake provider, on a paused clock: which timers a paused sandbox
//! keeps, what a call on it does, and how it is reclaimed.

use sandman_provider::fake::FakeProvider;
use sandman_provider::{Record, ServerMeta};
use sandman_wire::ErrorCode;
use sandman_wire::server::{Reason, SandboxState};

use super::super::*;
use crate::events::Filter;
use crate::sandbox::now_ms;

fn service(dir: &std::path::Path) -> Arc<Service> {
    let settings = Settings {
        default_lease: Duration::from_secs(30),
        max_ttl: None,
        gone_retention: Duration::from_secs(600),
        ..Settings::new(dir.to_path_buf())
    };
    let provider = AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("nowhere.sock"))));
    let s = Service::new(settings, provider, "t".into());
    s.start_background();
    s
}

fn fake(s: &Service) -> &FakeProvider {
    match &s.provider {
        AnyProvider::Fake(f) => f,
        _ => unreachable!(),
    }
}

/// The record of a sandbox an earlier server made (found by `recover`, so ready at once).
fn record(id: &str, job: Option<&str>, lease_s: u64, idle: Option<u64>, ttl: Option<u64>, auto_resume: bool) -> Record {
    let mut spec = sandman_provider::conformance::spec(id, "any");
    spec.job = job.map(str::to_string);
    spec.created_at_ms = now_ms();
    spec.server = ServerMeta { lease_s, idle_timeout_s: idle, ttl_s: ttl, auto_resume, ..ServerMeta::default() };
    let endpoint = Endpoint::Unix(format!("/nowhere/{id}.sock").into());
    Record { spec, endpoint, ended: None, claim: None, paused: false, ready: None }
}

async fn ready(s: &Arc<Service>, rec: Record) {
    let id = rec.spec.id.clone();
    fake(s).restore(rec);
    s.recover().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(state(s, &id), (SandboxState::Ready, None));
}

async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

async fn pass(secs: u64) {
    tokio::time::advance(Duration::from_secs(secs)).await;
    settle().await;
}

fn state(s: &Service, id: &str) -> (SandboxState, Option<Reason>) {
    let w = s.get(id).map(|sb| sb.to_wire()).unwrap_or_else(|e| panic!("{e}"));
    (w.state, w.reason)
}

#[tokio::test(start_paused = true)]
async fn a_paused_sandbox_outlives_its_lease_and_idle_timeout_but_not_its_lifetime() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready(&s, record("sb-p", None, 10, Some(5), Some(100), false)).await;
    let paused = s.pause("sb-p").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(paused.state, SandboxState::Paused);
    assert!(paused.paused_at_ms.is_some() && paused.lease_expires_at_ms.is_none(), "{paused:?}");
    assert!(fake(&s).is_paused("sb-p"), "the provider was not asked to freeze it");
    for _ in 0..9 {
        pass(10).await;
        assert_eq!(state(&s, "sb-p"), (SandboxState::Paused, None), "reclaimed while paused");
    }
    pass(11).await;
    assert_eq!(state(&s, "sb-p"), (SandboxState::Gone, Some(Reason::TtlExpired)));
    assert_eq!(fake(&s).count(), 0, "the provider still holds the reclaimed sandbox");
}

#[tokio::test(start_paused = true)]
async fn a_paused_sandbox_of_a_job_that_ends_is_reclaimed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready(&s, record("sb-j", Some("train"), 10, None, None, false)).await;
    s.pause("sb-j").await.unwrap_or_else(|e| panic!("{e}"));
    pass(60).await;
    assert_eq!(state(&s, "sb-j").0, SandboxState::Paused);
    let action = s.delete_job("train").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(action.sandboxes, 1);
    assert_eq!(state(&s, "sb-j"), (SandboxState::Gone, Some(Reason::JobDeleted)));
    assert_eq!(fake(&s).count(), 0);
}

#[tokio::test(start_paused = true)]
async fn resuming_counts_as_a_call_and_the_lease_runs_again() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready(&s, record("sb-r", None, 10, None, None, false)).await;
    s.pause("sb-r").await.unwrap_or_else(|e| panic!("{e}"));
    pass(50).await;
    let resumed = s.resume("sb-r").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((resumed.state, resumed.paused_at_ms), (SandboxState::Ready, None));
    assert!(!fake(&s).is_paused("sb-r"), "the provider was not asked to thaw it");
    assert!(s.call_target("sb-r").is_ok());
    pass(9).await;
    assert_eq!(state(&s, "sb-r").0, SandboxState::Ready);
    pass(2).await;
    assert_eq!(state(&s, "sb-r"), (SandboxState::Gone, Some(Reason::LeaseExpired)));
}

#[tokio::test(start_paused = true)]
async fn a_call_on_a_paused_sandbox_fails_with_paused_unless_it_auto_resumes() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready(&s, record("sb-strict", None, 100, None, None, false)).await;
    ready(&s, record("sb-auto", None, 100, None, None, true)).await;
    for id in ["sb-strict", "sb-auto"] {
        s.pause(id).await.unwrap_or_else(|e| panic!("{e}"));
    }
    let err = s.call_target_resuming("sb-strict").await.err().unwrap_or_else(|| panic!("a paused sandbox answered"));
    assert_eq!((err.code(), err.code().http_status()), (ErrorCode::Paused, 409));
    assert!(err.to_string().contains("is paused") && err.to_string().contains("auto_resume"), "{err}");
    assert_eq!(state(&s, "sb-strict").0, SandboxState::Paused);
    assert!(fake(&s).is_paused("sb-strict"));

    let target = s.call_target_resuming("sb-auto").await;
    assert!(target.is_ok(), "{:?}", target.err());
    assert_eq!(state(&s, "sb-auto").0, SandboxState::Ready);
    assert!(!fake(&s).is_paused("sb-auto"));
    assert_eq!(s.metrics.auto_resumes.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn pause_and_resume_are_idempotent_events_and_metrics_say_so() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready(&s, record("sb-e", Some("j"), 100, None, None, false)).await;
    let after = s.events.last_seq();
    s.pause("sb-e").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.pause("sb-e").await.map(|w| w.state).ok(), Some(SandboxState::Paused));
    let metrics = s.metrics.encode();
    assert!(metrics.contains("sandman_sandboxes{state=\"paused\"} 1"), "{metrics}");
    assert!(metrics.contains("sandman_pause_seconds_count 1"), "{metrics}");
    s.resume("sb-e").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.resume("sb-e").await.map(|w| w.state).ok(), Some(SandboxState::Ready));
    let states: Vec<_> = s.events.list(&Filter::default(), after).into_iter().map(|e| (e.state, e.message)).collect();
    assert_eq!(states, vec![(Some(SandboxState::Paused), None), (Some(SandboxState::Ready), Some("resumed".into()))]);
    assert!(s.metrics.encode().contains("sandman_sandboxes{state=\"paused\"} 0"));
    // Listing by state finds it as it is.
    let q = ListQuery { state: Some(SandboxState::Paused), ..Default::default() };
    assert!(s.list(&q).unwrap_or_default().is_empty());
}

#[tokio::test(start_paused = true)]
async fn only_a_ready_sandbox_is_paused_and_an_ended_one_is_gone() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    ready(&s, record("sb-x", None, 100, None, None, false)).await;
    s.release("sb-x", Reason::Released).await.unwrap_or_else(|e| panic!("{e}"));
    let err = s.pause("sb-x").await.err().unwrap_or_else(|| panic!("paused a released sandbox"));
    assert_eq!(err.code(), ErrorCode::Gone);
    assert_eq!(s.resume("sb-x").await.err().map(|e| e.code()), Some(ErrorCode::Gone));
    assert_eq!(s.pause("sb-none").await.err().map(|e| e.code()), Some(ErrorCode::NotFound));
}

#[tokio::test(start_paused = true)]
async fn a_restarted_server_finds_a_paused_sandbox_paused() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s = service(dir.path());
    let mut rec = record("sb-frozen", None, 10, None, None, false);
    rec.paused = true;
    ready_or_paused(&s, rec).await;
    assert_eq!(state(&s, "sb-frozen").0, SandboxState::Paused);
    pass(60).await;
    assert_eq!(state(&s, "sb-frozen").0, SandboxState::Paused, "its lease ran while paused");
}

async fn ready_or_paused(s: &Arc<Service>, rec: Record) {
    fake(s).restore(rec);
    s.recover().await.unwrap_or_else(|e| panic!("{e}"));
}
