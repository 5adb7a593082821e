//! The one watcher of every sandbox: a single `docker events` stream, filtered to this provider's
//! containers and to `die` and `oom`, never a poll per container. A death nobody asked for is
//! written to the sandbox's `ended.json` and reported as a `ProviderEvent`; an OOM kills the
//! whole sandbox (as Kubernetes does with `memory.oom.group`), which is then reported
//! `oom_killed`. The stream is resumed from the last event seen when it breaks.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bollard::Docker;
use bollard::errors::Error as BollardError;
use bollard::models::{ContainerStateStatusEnum, EventMessage};
use bollard::query_parameters::{EventsOptions, KillContainerOptions, LogsOptions};
use futures_util::StreamExt;
use sandman_provider::{Ended, ProviderEvent, SandboxSpec};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::Shared;
use crate::container::{self, MANAGED_BY, MANAGED_BY_VALUE, OWNER_LABEL, SANDBOX_LABEL, SPEC_LABEL};
use crate::hostdir::HostDir;

/// The longest wait before the stream is opened again after it broke.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long fetching a dead daemon's last log lines may take.
const LOGS_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Watcher {
    pub docker: Docker,
    pub owner: String,
    pub base: PathBuf,
    pub shared: Arc<Shared>,
    pub events: mpsc::Sender<ProviderEvent>,
    pub cancel: CancellationToken,
    /// Events from this time on (`seconds.nanoseconds`) are watched: the provider's start, then
    /// the last event seen, so a broken stream resumes where it was.
    pub since: String,
}

/// The engine's `since` for the given time.
pub fn since(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    format!("{}.{:09}", d.as_secs(), d.subsec_nanos())
}

impl Watcher {
    pub async fn run(mut self) {
        let mut backoff = Duration::from_secs(1);
        loop {
            let filters = HashMap::from([
                ("type".to_string(), vec!["container".to_string()]),
                ("event".to_string(), vec!["die".to_string(), "oom".to_string()]),
                (
                    "label".to_string(),
                    vec![format!("{MANAGED_BY}={MANAGED_BY_VALUE}"), format!("{OWNER_LABEL}={}", self.owner)],
                ),
            ]);
            let options = EventsOptions { since: Some(self.since.clone()), until: None, filters: Some(filters) };
            let mut stream = self.docker.events(Some(options));
            loop {
                let item = tokio::select! {
                    _ = self.cancel.cancelled() => return,
                    item = stream.next() => item,
                };
                match item {
                    Some(Ok(ev)) => {
                        backoff = Duration::from_secs(1);
                        if let Some(nanos) = ev.time_nano {
                            self.since = format!("{}.{:09}", nanos / 1_000_000_000, nanos % 1_000_000_000);
                        }
                        self.handle(ev).await;
                    }
                    Some(Err(err)) => {
                        tracing::warn!(%err, "docker events stream broke; resuming");
                        break;
                    }
                    None => {
                        tracing::warn!("docker events stream ended; resuming");
                        break;
                    }
                }
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn handle(&self, ev: EventMessage) {
        let attrs = ev.actor.and_then(|a| a.attributes).unwrap_or_default();
        let Some(id) = attrs.get(SANDBOX_LABEL).cloned() else { return };
        if crate::check_id(&id).is_err() {
            return;
        }
        let spec: Option<SandboxSpec> = attrs.get(SPEC_LABEL).and_then(|s| serde_json::from_str(s).ok());
        let dir = HostDir::new(&self.base, &id);
        if self.asked_for(&id, &dir).await {
            return;
        }
        match ev.action.as_deref() {
            Some("oom") => self.oom(&id, &dir, spec.as_ref()).await,
            Some("die") => self.died(&id, &dir, spec.as_ref()).await,
            _ => {}
        }
    }

    /// Whether the death was a delete: this instance's, or another's (its marker, or the sandbox
    /// directory already removed).
    async fn asked_for(&self, id: &str, dir: &HostDir) -> bool {
        if self.shared.is_deleting(id) {
            return true;
        }
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || dir.being_deleted()).await.unwrap_or(true)
    }

    /// A process in the sandbox went over the memory limit. The limit is the sandbox's, so the
    /// sandbox ends: its report is written first, then the container is killed, and its `die`
    /// reports it.
    async fn oom(&self, id: &str, dir: &HostDir, spec: Option<&SandboxSpec>) {
        if !self.shared.first_oom(id) {
            return;
        }
        tracing::warn!(sandbox = id, "a process went over the sandbox's memory limit; the sandbox is killed");
        let ended = container::oom_killed(spec);
        self.write_ended(dir, &ended).await;
        let kill = KillContainerOptions { signal: "SIGKILL".into() };
        match self.docker.kill_container(&container::container_name(id), Some(kill)).await {
            Ok(()) => {}
            // Gone or stopped already: its die event (or the delete) follows.
            Err(BollardError::DockerResponseServerError { status_code: 404 | 409, .. }) => {}
            Err(err) => tracing::warn!(sandbox = id, %err, "cannot kill a sandbox that ran out of memory"),
        }
    }

    async fn died(&self, id: &str, dir: &HostDir, spec: Option<&SandboxSpec>) {
        if self.shared.was_reported(id) {
            return;
        }
        let name = container::container_name(id);
        let removed = Ended {
            reason: sandman_wire::server::Reason::ProviderError,
            message: "the container was removed outside sandman".into(),
        };
        // Deletes are known (`asked_for`): a container being removed or gone was removed by
        // someone else.
        let ended = match self.docker.inspect_container(&name, None).await {
            Ok(c) => {
                let state = c.state.unwrap_or_default();
                match self.recorded(dir).await {
                    Some(ended) => ended,
                    None if state.status == Some(ContainerStateStatusEnum::REMOVING) => removed,
                    None => {
                        let words = last_words(&self.docker, &name, state.exit_code).await;
                        container::ended_of(&state, spec, words)
                    }
                }
            }
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => removed,
            Err(err) => {
                tracing::warn!(sandbox = id, %err, "cannot inspect a container that died");
                Ended { reason: sandman_wire::server::Reason::ProviderError, message: format!("daemon died ({err})") }
            }
        };
        self.write_ended(dir, &ended).await;
        // A delete may have begun meanwhile.
        if self.asked_for(id, dir).await || !self.shared.mark_reported(id) {
            return;
        }
        tracing::warn!(sandbox = id, reason = %ended.reason, message = %ended.message, "sandbox died");
        let event = ProviderEvent { id: id.to_string(), ended };
        tokio::select! {
            _ = self.cancel.cancelled() => {}
            _ = self.events.send(event) => {}
        }
    }

    async fn recorded(&self, dir: &HostDir) -> Option<Ended> {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || dir.read_ended()).await.ok().flatten()
    }

    async fn write_ended(&self, dir: &HostDir, ended: &Ended) {
        let (d, e) = (dir.clone(), ended.clone());
        let written = tokio::task::spawn_blocking(move || {
            // Never recreates a removed directory: the write fails instead.
            if d.read_ended().is_some() { Ok(()) } else { d.write_ended(&e) }
        })
        .await;
        if !matches!(written, Ok(Ok(()))) && dir.root.exists() {
            tracing::warn!(path = %dir.ended().display(), "cannot record how the sandbox ended");
        }
    }
}

/// The daemon's last log lines, for an exit that is not a signal's.
pub async fn last_words(docker: &Docker, name: &str, exit_code: Option<i64>) -> Option<String> {
    if exit_code.is_none_or(|c| c > 128 || c == container::EXIT_LEASE_EXPIRED) {
        return None;
    }
    let options = LogsOptions { stdout: true, stderr: true, tail: "20".into(), ..Default::default() };
    let collect = async {
        let mut text = String::new();
        let mut logs = docker.logs(name, Some(options));
        while let Some(Ok(chunk)) = logs.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk.into_bytes()));
        }
        text
    };
    let text = tokio::time::timeout(LOGS_TIMEOUT, collect).await.ok()?;
    sandman_provider::records::last_paragraph(&strip_ansi(&text))
}

/// The daemon's log lines without terminal colours.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_has_nanoseconds_and_colours_are_stripped() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 5);
        assert_eq!(since(t), "1700000000.000000005");
        assert_eq!(strip_ansi("\u{1b}[2mINFO\u{1b}[0m listening"), "INFO listening");
    }
}
