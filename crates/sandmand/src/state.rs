//! `Daemon`, the state every handler shares: configuration, children, processes, sessions and
//! the lease. Start here to see what the daemon owns.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::budget::OutputBudget;
use crate::children::Children;
use crate::lease::Lease;
use crate::processes::Processes;
use crate::sessions::Sessions;
use crate::spawn::Defaults;
use crate::{sys, tree};

/// Settings fixed at start.
#[derive(Debug, Clone)]
pub struct Config {
    /// The bearer token every call but health must carry.
    pub token: String,
    /// Largest file or archive upload, in bytes (0 = no limit).
    pub max_upload_bytes: u64,
    /// What the daemon holds and writes on a caller's behalf.
    pub limits: crate::Limits,
    /// How long children get between SIGTERM and SIGKILL when the daemon is asked to stop.
    pub shutdown_grace: Duration,
    /// Where the daemon listens, for `info`.
    pub listen: String,
    pub workdir: Option<PathBuf>,
}

#[derive(Debug)]
pub struct Daemon {
    pub config: Config,
    pub defaults: Defaults,
    pub children: Arc<Children>,
    pub processes: Processes,
    /// Command output held in memory at once, over every exec, background process and session run.
    pub output_budget: Arc<OutputBudget>,
    pub sessions: Sessions,
    pub lease: Arc<Lease>,
    /// Tasks that outlive the request that started them (streamed execs, process drivers).
    pub tasks: TaskTracker,
    pub started: Instant,
    /// True when the daemon is PID 1 of its pid namespace.
    pub pid1: bool,
}

impl Daemon {
    pub fn new(config: Config, defaults: Defaults, children: Arc<Children>, lease: Option<Duration>) -> Arc<Self> {
        let output_budget = Arc::new(OutputBudget::new(config.limits.max_buffered_output));
        let sessions = Sessions::new(Arc::clone(&output_budget));
        Arc::new(Daemon {
            config,
            defaults,
            children,
            output_budget,
            processes: Processes::default(),
            sessions,
            lease: Arc::new(Lease::new(lease)),
            tasks: TaskTracker::new(),
            started: Instant::now(),
            pid1: std::process::id() == 1,
        })
    }

    /// Sends `signal` to every process group the daemon started.
    pub fn signal_all(&self, signal: i32) {
        for pid in self.children.live() {
            let _ = sys::kill_group(pid, signal);
        }
    }

    /// SIGKILLs every process the daemon started and everything below them.
    pub fn kill_everything(&self) {
        self.sessions.kill_all();
        for pid in self.children.live() {
            tree::kill_tree(pid);
        }
        tree::kill_all_descendants();
        if self.pid1 {
            let _ = sys::kill_all_others(sys::SIGKILL);
        }
    }
}
