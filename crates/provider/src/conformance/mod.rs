//! The provider conformance suite: one set of checks every provider passes, run by each
//! provider's tests (the fake's here, the process provider's and Docker's in their crates).
//! Each check panics with a message naming what the provider got wrong.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use sandman_wire::server::{Network, Profile, Resources};

use crate::{Endpoint, Provider, ProviderError, ProviderEvent, SandboxSpec, ServerMeta};
use tokio::sync::mpsc;

pub mod daemon;

/// The next event for `id`, within 20 s.
pub async fn next_event(events: &mut mpsc::Receiver<ProviderEvent>, id: &str) -> ProviderEvent {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let e = events.recv().await.expect("event stream ended");
            if e.id == id {
                return e;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no event for {id} within 20 s"))
}

/// A spec with recognisable job, labels and bookkeeping, for checking the record round trip.
pub fn spec(id: &str, image: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.to_string(),
        image: image.to_string(),
        resources: Resources::default(),
        env: BTreeMap::from([("CONFORMANCE".to_string(), "yes".to_string())]),
        labels: BTreeMap::from([
            ("suite".to_string(), "conformance".to_string()),
            ("case".to_string(), id.to_string()),
        ]),
        job: Some("conformance-job".to_string()),
        profile: Profile::Default,
        network: Network::Egress,
        token: format!("token-{id}"),
        daemon_lease_s: 300,
        created_at_ms: 1_700_000_000_000,
        server: ServerMeta {
            lease_s: 120,
            idle_timeout_s: Some(600),
            ttl_s: Some(3600),
            idempotency_key: Some(format!("key-{id}")),
            user: None,
            weight: Some(2.5),
            auto_resume: false,
        },
    }
}

async fn listed<P: Provider>(p: &P, id: &str) -> Option<crate::Record> {
    p.list().await.unwrap_or_else(|e| panic!("{}: list failed: {e}", p.name())).into_iter().find(|r| r.spec.id == id)
}

/// Create, find it in the records with its spec intact, reach its daemon, delete, and delete again.
pub async fn create_list_delete<P, C, F>(p: &P, spec: SandboxSpec, check_daemon: C)
where
    P: Provider,
    C: Fn(Endpoint, String) -> F,
    F: Future<Output = Result<(), String>>,
{
    let endpoint = p.create(&spec).await.unwrap_or_else(|e| panic!("{}: create failed: {e}", p.name()));
    let record = listed(p, &spec.id).await.unwrap_or_else(|| panic!("{}: created sandbox not listed", p.name()));
    assert_eq!(record.spec, spec, "{}: the record does not keep the spec", p.name());
    assert_eq!(record.endpoint, endpoint, "{}: listed endpoint differs from the created one", p.name());
    assert!(record.ended.is_none(), "{}: a fresh sandbox is reported ended: {:?}", p.name(), record.ended);
    check_daemon(endpoint, spec.token.clone())
        .await
        .unwrap_or_else(|e| panic!("{}: daemon check failed: {e}", p.name()));
    p.delete(&spec.id).await.unwrap_or_else(|e| panic!("{}: delete failed: {e}", p.name()));
    assert!(listed(p, &spec.id).await.is_none(), "{}: deleted sandbox still listed", p.name());
    p.delete(&spec.id).await.unwrap_or_else(|e| panic!("{}: second delete failed: {e}", p.name()));
}

/// `n` sandboxes created at once are all listed, then all deleted, leaving none.
pub async fn many_at_once<P: Provider>(p: &P, specs: Vec<SandboxSpec>) {
    let creates = specs.iter().map(|s| p.create(s));
    for (res, s) in futures_join_all(creates).await.into_iter().zip(&specs) {
        res.unwrap_or_else(|e| panic!("{}: create of {} failed: {e}", p.name(), s.id));
    }
    let ids: Vec<String> = p.list().await.unwrap().into_iter().map(|r| r.spec.id).collect();
    for s in &specs {
        assert!(ids.contains(&s.id), "{}: {} not listed", p.name(), s.id);
    }
    for res in futures_join_all(specs.iter().map(|s| p.delete(&s.id))).await {
        res.unwrap_or_else(|e| panic!("{}: delete failed: {e}", p.name()));
    }
    let left: Vec<String> =
        p.list().await.unwrap().into_iter().map(|r| r.spec.id).filter(|id| specs.iter().any(|s| &s.id == id)).collect();
    assert!(left.is_empty(), "{}: left behind: {left:?}", p.name());
}

/// A request the provider cannot honour is refused with a reason, and nothing is left behind.
pub async fn refuses_clearly<P: Provider>(p: &P, spec: SandboxSpec, says: &str) {
    let outcome = match p.check(&spec) {
        Err(e) => Err(e),
        Ok(()) => p.create(&spec).await.map(|_| ()),
    };
    match outcome {
        Ok(_) => panic!("{}: accepted a spec it should refuse ({says})", p.name()),
        Err(e @ (ProviderError::Unsupported(_) | ProviderError::Failed { .. })) => {
            let msg = e.to_string();
            assert!(msg.contains(says), "{}: refusal `{msg}` does not mention `{says}`", p.name());
        }
        Err(e) => panic!("{}: refused with an unclear error: {e}", p.name()),
    }
    assert!(listed(p, &spec.id).await.is_none(), "{}: a refused sandbox was left behind", p.name());
}

/// A second provider instance over the same records (a restarted server) finds the sandbox with
/// its spec, and can delete it.
pub async fn found_again_after_restart<P: Provider>(first: &P, second: &P, spec: SandboxSpec) {
    first.create(&spec).await.unwrap_or_else(|e| panic!("{}: create failed: {e}", first.name()));
    let record = listed(second, &spec.id).await.unwrap_or_else(|| panic!("{}: not found after restart", second.name()));
    assert_eq!(record.spec, spec, "{}: spec changed across the restart", second.name());
    second.delete(&spec.id).await.unwrap();
    assert!(listed(first, &spec.id).await.is_none());
}

/// A sandbox killed behind the provider's back is reported as an event and as ended in the records.
pub async fn death_is_reported<P, K, F>(p: &P, spec: SandboxSpec, kill: K)
where
    P: Provider,
    K: FnOnce(Endpoint) -> F,
    F: Future<Output = ()>,
{
    let mut events = p.events().unwrap_or_else(|| panic!("{}: events already taken", p.name()));
    let endpoint = p.create(&spec).await.unwrap_or_else(|e| panic!("{}: create failed: {e}", p.name()));
    kill(endpoint).await;
    let event = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let e = events.recv().await.unwrap_or_else(|| panic!("{}: event stream ended", p.name()));
            if e.id == spec.id {
                return e;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{}: no event for a killed sandbox within 20 s", p.name()));
    let record = listed(p, &spec.id).await;
    if let Some(record) = record {
        assert_eq!(record.ended.as_ref(), Some(&event.ended), "{}: records disagree with the event", p.name());
    }
    p.delete(&spec.id).await.unwrap();
}

/// What a sandbox's commands may read to learn where it lives: its working directory, `HOME`,
/// the current directory as the kernel names it, its mounts, and its PID 1's command line.
pub const WHERE_AM_I: &str = "pwd; echo \"$HOME\"; readlink /proc/self/cwd; cat /proc/self/mountinfo; \
     tr '\\0' ' ' < /proc/1/cmdline; echo";

/// Nothing of the host's layout shows inside a sandbox: [`WHERE_AM_I`], run by `run` (the
/// endpoint, the token and a shell script, answering its stdout), names none of `host_paths`
/// (the server's state directory, the sandbox's directory there).
pub async fn shows_no_host_paths<P, R, F>(p: &P, spec: SandboxSpec, host_paths: &[String], run: R)
where
    P: Provider,
    R: Fn(Endpoint, String, &'static str) -> F,
    F: Future<Output = Result<String, String>>,
{
    let endpoint = p.create(&spec).await.unwrap_or_else(|e| panic!("{}: create failed: {e}", p.name()));
    let seen = run(endpoint, spec.token.clone(), WHERE_AM_I)
        .await
        .unwrap_or_else(|e| panic!("{}: cannot look around inside: {e}", p.name()));
    assert!(seen.lines().count() > 4, "{}: the sandbox printed too little: {seen}", p.name());
    for path in host_paths {
        assert!(!seen.contains(path.as_str()), "{}: the host path `{path}` shows inside a sandbox:\n{seen}", p.name());
    }
    p.delete(&spec.id).await.unwrap_or_else(|e| panic!("{}: delete failed: {e}", p.name()));
}

/// Runs futures concurrently on the current task.
async fn futures_join_all<F: Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut set: Vec<std::pin::Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..set.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in set.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.unwrap()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeProvider;
    use sandman_wire::server::Reason;

    fn fake() -> FakeProvider {
        FakeProvider::new(Endpoint::Unix("/run/fake.sock".into()))
    }

    #[tokio::test]
    async fn the_fake_passes_the_suite() {
        let p = fake();
        create_list_delete(&p, spec("c1", "any"), |ep, token| async move {
            if ep == Endpoint::Unix("/run/fake.sock".into()) && token == "token-c1" {
                Ok(())
            } else {
                Err(format!("{ep:?}"))
            }
        })
        .await;
        many_at_once(&p, (0..50).map(|i| spec(&format!("m{i}"), "any")).collect()).await;
        p.fail_image("missing:latest");
        refuses_clearly(&p, spec("r1", "missing:latest"), "missing:latest").await;
        refuses_clearly(&p, spec("r2", crate::fake::UNSUPPORTED_IMAGE), "never supported").await;
        death_is_reported(&p, spec("d1", "any"), |_| async { p.kill("d1", Reason::OomKilled, "oom").await }).await;
        assert_eq!(p.count(), 0);
    }
}
