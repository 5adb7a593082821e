//! The daemon's children: one table of live child pids and the single reaper that waits for
//! every child (and, as PID 1 or subreaper, every orphan), delivering each exit to its waiter.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::sys::{self, Reaped};

/// Every child the daemon started and has not yet reaped, by pid (each is its own process
/// group leader).
#[derive(Debug, Default)]
pub struct Children {
    /// pid → where its exit goes. The lock also serialises `wait4` with `spawn`: a child's exit
    /// can never be reaped before its waiter is registered, and std's own `waitpid` after a
    /// failed `exec` never finds its child already reaped by us.
    table: Mutex<HashMap<i32, oneshot::Sender<Reaped>>>,
}

impl Children {
    pub fn new() -> Arc<Self> {
        Arc::new(Children::default())
    }

    /// Spawns `cmd` and registers it; the receiver resolves when the reaper reaps it.
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, oneshot::Receiver<Reaped>)> {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let child = cmd.spawn()?;
        let (tx, rx) = oneshot::channel();
        table.insert(child.id() as i32, tx);
        Ok((child, rx))
    }

    /// Reaps every child that has exited. Orphans the daemon inherited are reaped and dropped.
    pub fn reap(&self) {
        loop {
            let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
            match sys::reap_any() {
                Ok(Some(reaped)) => {
                    if let Some(waiter) = table.remove(&reaped.pid) {
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
