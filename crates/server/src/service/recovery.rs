//! Recovery at start: every sandbox in the provider's records found again (claimed ones as
//! their claimers made them, unclaimed ones back in their pools, interrupted creates ended), and
//! what the provider reports afterwards (progress on a create, a sandbox that died).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sandman_provider::{Progress, Provider, ProviderEvent, SandboxSpec};
use sandman_wire::bounds;
use sandman_wire::server::{Reason, SandboxState};
use tokio::time::Instant;

use super::{DAEMON_LEASE_SLACK_S, Service};
use crate::error::{ServerError, ServerResult};
use crate::sandbox::{Recorded, Sandbox, Timers, now_ms};

impl Service {
    /// Finds every sandbox in the provider's records again after a (re)start: claimed pool
    /// sandboxes as their claimers made them (from the claims file), unclaimed ones back in
    /// their pools, then refills the pools.
    pub async fn recover(self: &Arc<Self>) -> ServerResult<(usize, usize)> {
        let records = self.provider.list().await.map_err(ServerError::Provider)?;
        let mut claims = self.pools.claims().take_found();
        // Without a journal (a first start) every running sandbox counts as ready. Replicas
        // sharing the provider keep the journal's lines on the provider's records instead.
        let journal = if self.settings.store.is_shared() {
            Some(records.iter().filter_map(|r| r.ready.as_deref().and_then(crate::journal::parse_line)).collect())
        } else {
            self.ready_journal.take_found()
        };
        let mut ready_lines = Vec::new();
        let mut live_claims = Vec::new();
        let mut orphans = Vec::new();
        let (mut live, mut dead) = (0, 0);
        let now = Instant::now();
        let now_wall = now_ms();
        for record in records {
            // The provider's own record of a claim (Kubernetes keeps it on the pod) serves when
            // this server's claims file does not have it (a new state directory).
            let claim = claims.remove(&record.spec.id).or(record.claim);
            let spec = claim.as_ref().map_or(record.spec, |c| c.spec.clone());
            let age = Duration::from_millis(now_wall.saturating_sub(spec.created_at_ms));
            let lease = Duration::from_secs(spec.server.lease_s.max(1));
            let mut timers = Timers::new(
                now,
                lease,
                spec.server.idle_timeout_s.map(Duration::from_secs),
                spec.server.ttl_s.map(Duration::from_secs),
            );
            timers.created = now.checked_sub(age).unwrap_or(now);
            let mut sb = Sandbox::new(spec.clone(), self.backend(), SandboxState::Creating, timers);
            if let Some(c) = &claim {
                sb.env_overlay = Arc::new(c.env.clone());
                sb.claimed_ms = Some(c.claimed_ms);
                sb.pool_created_ms = Some(c.pool_created_ms);
            }
            let sb = Arc::new(sb);
            // Its record, as the journal kept it: never one taken again now, from a daemon that
            // has run the sandbox's commands.
            let kept = journal.as_ref().and_then(|j| j.get(&spec.id)).cloned().flatten();
            {
                let mut inner = sb.lock();
                inner.conditions = match kept {
                    Some(signed) => Recorded::Taken(Box::new(signed)),
                    None => Recorded::Missing(
                        "it was recovered after a restart, and no record of it was kept (a server from before records \
                         were kept, or one that could take none)"
                            .into(),
                    ),
                };
                inner.endpoint = Some(record.endpoint.clone());
            }
            // Every connection to it must prove its token, as before the restart.
            self.identities.register(&record.endpoint, &spec.token);
            {
                let mut table = self.table.lock();
                if table.contains(&spec.id) {
                    continue;
                }
                table.insert(&sb);
            }
            self.metrics.moved(None, SandboxState::Creating);
            // A claimed sandbox was ready as a member of its pool.
            let was_ready = claim.is_some() || journal.as_ref().is_none_or(|j| j.contains_key(&spec.id));
            if !was_ready {
                dead += 1;
                // Its create never answered: a retry under its key makes a new one.
                sb.abandoned.store(true, Ordering::Relaxed);
                let message = "the server stopped while creating it, before it was ready; create it again".to_string();
                if let Ok(prev) = sb.transition(SandboxState::Failed, Some(Reason::CreateInterrupted), Some(message)) {
                    self.ended(&sb, prev, None);
                }
                let me = self.clone();
                self.tasks.spawn(async move {
                    if let Err(e) = me.provider.delete(sb.id()).await {
                        tracing::warn!(sandbox = sb.id(), error = %e, "cannot remove a sandbox whose create was interrupted");
                    }
                });
                continue;
            }
            match record.ended.or_else(|| unrecoverable(&spec)) {
                Some(ended) => {
                    dead += 1;
                    self.fail(&sb, ended.reason, format!("found ended after a server restart: {}", ended.message))
                        .await;
                }
                None => {
                    live += 1;
                    self.learn_image_config(&sb).await;
                    if sb.transition(SandboxState::Ready, None, Some("recovered after a server restart".into())).is_ok()
                    {
                        ready_lines.push(crate::journal::ready_line(sb.id(), sb.lock().conditions.taken()));
                        self.metrics.moved(Some(SandboxState::Creating), SandboxState::Ready);
                        self.events.emit(
                            sb.id(),
                            spec.job.as_deref(),
                            SandboxState::Ready,
                            None,
                            Some("recovered".into()),
                        );
                        // Paused before the restart, as the provider says: still paused.
                        if record.paused && sb.transition(SandboxState::Paused, None, None).is_ok() {
                            sb.lock().timers.pause(now);
                            self.metrics.moved(Some(SandboxState::Ready), SandboxState::Paused);
                            self.events.emit(sb.id(), spec.job.as_deref(), SandboxState::Paused, None, None);
                        }
                        self.schedule_check(sb.id(), sb.lock().timers.next_deadline().0);
                        // Renew the daemon's lease now: it may have been counting down while
                        // the server was away. (A paused one's is renewed when it resumes.)
                        if !record.paused {
                            self.renew_daemon_now(&sb);
                        }
                        if let Some(c) = claim {
                            live_claims.push(c);
                        } else if let Some(name) = sb.pool()
                            && !self.pools.lock().adopt(name, sb.id(), &sb.spec)
                        {
                            orphans.push(sb.id().to_string());
                        }
                    }
                }
            }
        }
        self.pools.claims().compact(&live_claims);
        self.ready_journal.compact(ready_lines.iter().map(String::as_str));
        self.release_in_background(orphans, "its pool is gone or full".into());
        self.refill_all();
        Ok((live, dead))
    }

    /// A line of progress on a create (an image pull): logged, and an event for whoever waits.
    pub(super) fn provider_progress(&self, p: Progress) {
        let Ok(sb) = self.get(&p.id) else { return };
        if sb.state() != SandboxState::Creating {
            return;
        }
        tracing::info!(sandbox = p.id, message = p.message, "creating");
        self.events.emit_progress(
            sb.id(),
            sb.spec.job.as_deref(),
            sb.spec.server.idempotency_key.as_deref(),
            p.message,
        );
    }

    pub(super) async fn provider_event(self: &Arc<Self>, ev: ProviderEvent) {
        let Ok(sb) = self.get(&ev.id) else { return };
        let state = sb.state();
        if state.is_terminal() || state == SandboxState::Releasing {
            return;
        }
        let reason = if state == SandboxState::Creating && ev.ended.reason == Reason::ProviderError {
            Reason::DaemonStartFailed
        } else {
            ev.ended.reason
        };
        tracing::warn!(sandbox = ev.id, %reason, message = ev.ended.message, "sandbox died");
        self.fail(&sb, reason, ev.ended.message).await;
    }
}

/// A record whose numbers no server could have written (an older server took any lease): it is
/// ended at start with the reason, and its remains removed, rather than served with timers that
/// cannot be computed.
fn unrecoverable(spec: &SandboxSpec) -> Option<sandman_provider::Ended> {
    let server = &spec.server;
    let daemon_lease = bounds::Bound::new(
        "daemon_lease_s",
        0,
        bounds::LEASE_S.max.saturating_add(DAEMON_LEASE_SLACK_S),
        bounds::Unit::Seconds,
    );
    // A lease of 0 is read as 1, as it always was.
    let checked = bounds::LEASE_S
        .check(server.lease_s.max(1))
        .and_then(|_| bounds::IDLE_TIMEOUT_S.check_opt(server.idle_timeout_s))
        .and_then(|()| bounds::TTL_S.check_opt(server.ttl_s))
        .and_then(|()| daemon_lease.check(spec.daemon_lease_s));
    checked.err().map(|e| sandman_provider::Ended {
        reason: Reason::ProviderError,
        message: format!("its record cannot be recovered: {e}"),
    })
}
