//! The daemon's children: one table of live child pids and the single reaper that waits for
//! every child (and, as PID 1 or subreaper, every orphan), delivering each exit to its waiter.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::sys::{self, Reaped};

/// Every child the daemon started and has not yet reaped, by pid (each is its own process
/// group leader).
#[derive(Debug, Default)]
pub struct Children {
    /// pid → where its exit goes. Locked only to insert or take one entry, never across a fork
    /// or a `wait4`.
    table: Mutex<HashMap<i32, oneshot::Sender<Reaped>>>,
    /// Orders forks against the reaper: every spawn holds it shared from its fork until its
    /// waiter is in `table`, and the reaper holds it exclusively around its `wait4` sweep. So
    /// forks run side by side (on as many threads as spawn at once, never two under one
    /// exclusive lock), while an exit can never be reaped before its waiter exists, and std's
    /// own `waitpid` after a failed `exec` never finds its child already reaped by us.
    forking: RwLock<()>,
}

/// Proof that a fork may run now: no `wait4` sweep runs until it is dropped. Any number exist
/// at once.
#[derive(Debug)]
pub struct ForkGuard<'a> {
    _shared: RwLockReadGuard<'a, ()>,
}

impl Children {
    pub fn new() -> Arc<Self> {
        Arc::new(Children::default())
    }

    /// Leave to fork: shared with every other fork, exclusive of the reaper's sweep.
    pub fn fork_guard(&self) -> ForkGuard<'_> {
        ForkGuard { _shared: self.forking.read().unwrap_or_else(PoisonError::into_inner) }
    }

    /// Spawns `cmd` and registers it; the receiver resolves when the reaper reaps it. Blocks for
    /// the fork and exec: commands are started off the event loop ([`crate::run::start`]).
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, oneshot::Receiver<Reaped>)> {
        let mut child = None;
        let (_, rx) = self.spawn_with(|| {
            let c = cmd.spawn()?;
            let pid = c.id() as i32;
            child = Some(c);
            Ok(pid)
        })?;
        child.map(|c| (c, rx)).ok_or_else(|| io::Error::other("spawned no child"))
    }

    /// Runs `start`, which starts one child and answers its pid (`sys::posix_spawn`, say), and
    /// registers that child as [`Children::spawn`] does.
    pub fn spawn_with(&self, start: impl FnOnce() -> io::Result<i32>) -> io::Result<(i32, oneshot::Receiver<Reaped>)> {
        let _fork = self.fork_guard();
        let pid = start()?;
        let (tx, rx) = oneshot::channel();
        self.table.lock().unwrap_or_else(PoisonError::into_inner).insert(pid, tx);
        Ok((pid, rx))
    }

    /// Reaps every child that has exited. Orphans the daemon inherited are reaped and dropped.
    pub fn reap(&self) {
        let _sweep = self.forking.write().unwrap_or_else(PoisonError::into_inner);
        loop {
            match sys::reap_any() {
                Ok(Some(reaped)) => {
                    let waiter = self.table.lock().unwrap_or_else(PoisonError::into_inner).remove(&reaped.pid);
                    if let Some(waiter) = waiter {
                        // The waiter may have given up (its request was cancelled); fine.
                        let _ = waiter.send(reaped);
                    }
                }
                Ok(None) => return,
                Err(err) => {
                    tracing::warn!(%err, "wait4 failed");
                    return;
                }
            }
        }
    }

    /// The pids of the children still running.
    pub fn live(&self) -> Vec<i32> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner).keys().copied().collect()
    }

    pub fn count(&self) -> usize {
        self.table.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// Runs the reaper until cancelled: one `wait4` sweep per SIGCHLD. Must be started (the signal
/// handler installed) before the first child is spawned; `install` does that part.
pub fn install_reaper(children: Arc<Children>, cancel: CancellationToken) -> io::Result<tokio::task::JoinHandle<()>> {
    let mut sigchld = signal(SignalKind::child())?;
    Ok(tokio::spawn(async move {
        // Children started before the handler (none in practice) are swept once up front.
        children.reap();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                got = sigchld.recv() => {
                    if got.is_none() { return; }
                    children.reap();
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 16): every fork took one mutex, so one daemon's execs forked one at a
    /// time. Forks now share their guard: a second fork gets leave while the first holds it,
    /// and only the reaper's sweep waits for both.
    #[test]
    fn forks_never_wait_for_each_other_only_the_reaper_waits_for_forks() {
        let children = Children::default();
        let first = children.fork_guard();
        // A second fork, on another thread, gets leave while the first holds its guard.
        let got_second =
            std::thread::scope(|s| s.spawn(|| children.forking.try_read().is_ok()).join().unwrap_or(false));
        assert!(got_second, "a fork waited for another fork");
        // The reaper's sweep does wait for a fork in progress.
        assert!(children.forking.try_write().is_err(), "the reaper could sweep during a fork");
        drop(first);
        assert!(children.forking.try_write().is_ok());
    }
}
