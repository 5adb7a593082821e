//! Watching daemons die: one task per daemon, awaiting its pidfd becoming readable (and reaping it
//! when it is our child), and reporting a death nobody asked for as a `ProviderEvent`, after
//! writing it to the sandbox's `ended.json`.

use std::os::fd::OwnedFd;
use std::process::ExitStatus;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sandman_provider::{Ended, ProviderEvent};
use sandman_wire::server::Reason;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::layout::SandboxDir;

/// Exit code with which `sandmand` reports that its lease lapsed.
const EXIT_LEASE_EXPIRED: i32 = 3;

/// What a watcher needs to report one sandbox's death.
#[derive(Debug)]
pub struct Watch {
    pub id: String,
    pub dir: SandboxDir,
    pub daemon_lease_s: u64,
    /// Set by `delete` before it kills the daemon: that death is not news.
    pub deleting: Arc<AtomicBool>,
    pub events: mpsc::Sender<ProviderEvent>,
    pub cancel: CancellationToken,
}

/// How the daemon's exit was learnt.
#[derive(Debug)]
enum Exit {
    /// Our child: its status is known.
    Status(ExitStatus),
    /// Started by an earlier server: only the fact of the exit is known.
    Unknown,
}

impl Watch {
    /// Awaits our own child's exit through its pidfd, reaps it, then reports.
    pub async fn child(self, pid: i32, pidfd: Arc<AsyncFd<OwnedFd>>) {
        if !self.exited(&pidfd).await {
            return;
        }
        match crate::sys::reap(pid) {
            Ok(Some(status)) => self.report(Exit::Status(status)).await,
            outcome => {
                tracing::warn!(sandbox = %self.id, pid, ?outcome, "cannot reap the daemon");
                self.report(Exit::Unknown).await;
            }
        }
    }

    /// Awaits the exit of a daemon this server did not start, through its pidfd (no polling).
    pub async fn pidfd(self, pidfd: Arc<AsyncFd<OwnedFd>>) {
        if self.exited(&pidfd).await {
            self.report(Exit::Unknown).await;
        }
    }

    /// Waits for the pidfd to become readable (the process exited); false when the provider
    /// stops first.
    async fn exited(&self, pidfd: &AsyncFd<OwnedFd>) -> bool {
        tokio::select! {
            _ = self.cancel.cancelled() => false,
            ready = pidfd.readable() => {
                if let Err(err) = ready {
                    tracing::warn!(sandbox = %self.id, %err, "cannot watch the daemon's pidfd");
                }
                true
            }
        }
    }

    async fn report(self, exit: Exit) {
        if self.asked_for() {
            return;
        }
        // A daemon this server did not start cannot be waited for, but it left its exit code.
        let exit = match exit {
            Exit::Unknown => self.dir.exit_code().map_or(Exit::Unknown, |code| {
                use std::os::unix::process::ExitStatusExt;
                Exit::Status(ExitStatus::from_raw((code & 0xff) << 8))
            }),
            known => known,
        };
        let ended = ended(&exit, self.daemon_lease_s, self.dir.last_words());
        tracing::warn!(sandbox = %self.id, reason = ?ended.reason, message = %ended.message, "sandbox daemon ended");
        let dir = self.dir.clone();
        let record = ended.clone();
        let written = tokio::task::spawn_blocking(move || dir.write_ended(&record)).await;
        if !matches!(written, Ok(Ok(()))) && !self.asked_for() {
            tracing::warn!(sandbox = %self.id, "cannot record how the daemon ended in ended.json");
        }
        let event = ProviderEvent { id: self.id.clone(), ended };
        tokio::select! {
            _ = self.cancel.cancelled() => {}
            _ = self.events.send(event) => {}
        }
    }

    /// Whether the death was a delete: ours, or another provider instance's (its marker file, or
    /// the record already removed).
    fn asked_for(&self) -> bool {
        self.deleting.load(Ordering::SeqCst) || self.dir.being_deleted() || !self.dir.record().exists()
    }
}

/// How a daemon that is no longer running ended, from what it left in its directory (its exit
/// code, its last log line): for one found dead at start.
pub fn ended_of(dir: &SandboxDir, lease_s: u64) -> Ended {
    use std::os::unix::process::ExitStatusExt;
    let exit = dir.exit_code().map_or(Exit::Unknown, |code| Exit::Status(ExitStatus::from_raw((code & 0xff) << 8)));
    let mut ended = ended(&exit, lease_s, dir.last_words());
    if matches!(exit, Exit::Unknown) {
        ended.message = format!("daemon is not running{}", ended.message.strip_prefix("daemon exited").unwrap_or(""));
    }
    ended
}

fn ended(exit: &Exit, lease_s: u64, last_words: Option<String>) -> Ended {
    use std::os::unix::process::ExitStatusExt;
    let tail = last_words.map(|w| format!(": {w}")).unwrap_or_default();
    match exit {
        Exit::Status(s) if s.code() == Some(EXIT_LEASE_EXPIRED) => Ended {
            reason: Reason::LeaseExpired,
            message: format!("the daemon's lease lapsed: no call reached it for {lease_s} s"),
        },
        Exit::Status(s) => match (s.code(), s.signal()) {
            (Some(code), _) => {
                Ended { reason: Reason::ProviderError, message: format!("daemon exited with status {code}{tail}") }
            }
            (None, Some(sig)) => {
                Ended { reason: Reason::ProviderError, message: format!("daemon was killed by signal {sig}{tail}") }
            }
            (None, None) => Ended { reason: Reason::ProviderError, message: format!("daemon exited{tail}") },
        },
        Exit::Unknown => Ended { reason: Reason::ProviderError, message: format!("daemon exited{tail}") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn exit_3_is_the_lease_and_the_rest_are_provider_errors() {
        let lease = ended(&Exit::Status(ExitStatus::from_raw(3 << 8)), 60, Some("lease lapsed".into()));
        assert_eq!(lease.reason, Reason::LeaseExpired);
        let failed = ended(&Exit::Status(ExitStatus::from_raw(2 << 8)), 60, Some("error: no token".into()));
        assert_eq!(failed.reason, Reason::ProviderError);
        assert_eq!(failed.message, "daemon exited with status 2: error: no token");
        let killed = ended(&Exit::Status(ExitStatus::from_raw(9)), 60, None);
        assert_eq!(killed.message, "daemon was killed by signal 9");
    }
}
