//! Pausing and resuming: [`Service::pause`] freezes every process of a ready sandbox through
//! its provider and stops its lease and idle clocks (its lifetime still counts, and its job's
//! end still reclaims it); [`Service::resume`] thaws it. A proxied call that finds its sandbox
//! paused resumes it first when the create asked for `auto_resume`
//! ([`Service::call_target_resuming`]), and fails with `paused` otherwise.

use std::sync::Arc;

use sandman_provider::Provider;
use sandman_wire::server::{Sandbox as WireSandbox, SandboxState};
use tokio::time::Instant;

use super::{CallTarget, Service};
use crate::error::{ServerError, ServerResult};
use crate::sandbox::Sandbox;

impl Service {
    /// Freezes sandbox `id`: every process stops where it is and keeps its memory. Pausing a
    /// paused sandbox answers it as it is.
    pub async fn pause(self: &Arc<Self>, id: &str) -> ServerResult<WireSandbox> {
        let sb = self.get(id)?;
        let _one_at_a_time = sb.pausing.lock().await;
        match sb.state() {
            SandboxState::Ready => {}
            SandboxState::Paused => return Ok(sb.to_wire()),
            s => return Err(not_now(&sb, s, "paused")),
        }
        if sb.is_unclaimed_pool_member() {
            return Err(ServerError::Conflict(format!(
                "sandbox `{id}` waits in its warm pool; only a claimed sandbox can be paused"
            )));
        }
        let started = Instant::now();
        self.provider.pause(id).await.map_err(ServerError::Provider)?;
        match sb.transition(SandboxState::Paused, None, None) {
            Ok(prev) => {
                sb.lock().timers.pause(Instant::now());
                self.metrics.moved(Some(prev), SandboxState::Paused);
                self.metrics.pause_latency.observe(started.elapsed().as_secs_f64());
                self.events.emit(id, sb.spec.job.as_deref(), SandboxState::Paused, None, None);
                // Only its lifetime can end it now: the reaper looks again then.
                self.schedule_check(id, sb.lock().timers.next_deadline().0);
                Ok(sb.to_wire())
            }
            // Released (or failed) while it froze: the release thaws and removes it.
            Err(_) if sb.state().is_terminal() || sb.state() == SandboxState::Releasing => Err(sb.gone_error()),
            Err(e) => Err(e),
        }
    }

    /// Thaws sandbox `id`; resuming counts as a call on it (its lease and idle timeout start
    /// afresh), and its daemon's own lease is renewed at once. Resuming a ready sandbox
    /// answers it as it is.
    pub async fn resume(self: &Arc<Self>, id: &str) -> ServerResult<WireSandbox> {
        let sb = self.get(id)?;
        self.resume_sandbox(&sb).await?;
        Ok(sb.to_wire())
    }

    async fn resume_sandbox(self: &Arc<Self>, sb: &Arc<Sandbox>) -> ServerResult<()> {
        let _one_at_a_time = sb.pausing.lock().await;
        match sb.state() {
            SandboxState::Paused => {}
            SandboxState::Ready => return Ok(()),
            s => return Err(not_now(sb, s, "resumed")),
        }
        let started = Instant::now();
        self.provider.resume(sb.id()).await.map_err(ServerError::Provider)?;
        match sb.transition(SandboxState::Ready, None, None) {
            Ok(prev) => {
                sb.lock().timers.resume(Instant::now());
                self.metrics.moved(Some(prev), SandboxState::Ready);
                self.metrics.resume_latency.observe(started.elapsed().as_secs_f64());
                self.events.emit(sb.id(), sb.spec.job.as_deref(), SandboxState::Ready, None, Some("resumed".into()));
                self.renew_daemon_now(sb);
                self.schedule_check(sb.id(), sb.lock().timers.next_deadline().0);
                Ok(())
            }
            Err(_) if sb.state().is_terminal() || sb.state() == SandboxState::Releasing => Err(sb.gone_error()),
            Err(e) => Err(e),
        }
    }

    /// [`Service::call_target`], resuming the sandbox first when a call finds it paused and its
    /// create asked for `auto_resume`; without it, the call fails with `paused`.
    pub async fn call_target_resuming(self: &Arc<Self>, id: &str) -> ServerResult<CallTarget> {
        match self.call_target(id) {
            Err(ServerError::Paused(_)) => {
                let sb = self.get(id)?;
                if !sb.spec.server.auto_resume {
                    return Err(ServerError::Paused(id.to_string()));
                }
                self.resume_sandbox(&sb).await?;
                self.metrics.auto_resumes.inc();
                self.call_target(id)
            }
            other => other,
        }
    }
}

/// Why a sandbox in state `s` cannot be paused or resumed now.
fn not_now(sb: &Sandbox, s: SandboxState, what: &str) -> ServerError {
    if s.is_terminal() || s == SandboxState::Releasing {
        return sb.gone_error();
    }
    ServerError::Conflict(format!("sandbox `{}` is {s}; only a ready sandbox can be {what}", sb.id()))
}

#[cfg(test)]
#[path = "pause_tests.rs"]
mod tests;
