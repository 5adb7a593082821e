//! The daemon's children: one table of live child pids and the single reaper that waits for
//! every child (and, as PID 1 or subreaper, every orphan), delivering each exit to its waiter.
//!
//! Starts never wait for each other and never hold a lock while they fork or exec, and the
//! reaper never blocks the event loop waiting for a start: one daemon starts as many commands
//! at once as it has threads starting them.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

use crate::sys::{self, Reaped};

/// Every child the daemon started and has not yet reaped, by pid (each is its own process
/// group leader).
#[derive(Debug, Default)]
pub struct Children {
    /// Waiters, early exits and the starts under way. Locked only to insert or take a few
    /// entries: never across a start (fork, vfork, exec) or a `wait4`.
    table: Mutex<Table>,
    /// Keeps the reaper's sweep from running while std's `Command` forks (see [`ForkGate`]).
    gate: ForkGate,
    /// Execs between their request and their answer ([`Children::exec_running`]): whether one
    /// is alone, and so may start its command on the event loop.
    execs: AtomicUsize,
}

/// One exec under way, counted in [`Children`] until dropped.
#[derive(Debug)]
pub struct ExecRunning {
    children: Arc<Children>,
}

impl ExecRunning {
    /// No other exec is under way: this one's start holds nobody up if it blocks the event loop.
    pub fn alone(&self) -> bool {
        self.children.execs.load(Ordering::Relaxed) == 1
    }
}

impl Drop for ExecRunning {
    fn drop(&mut self) {
        self.children.execs.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
struct Table {
    /// pid → where its exit goes.
    waiters: HashMap<i32, oneshot::Sender<Reaped>>,
    /// The starts under way, by the ticket each took as it began. As many as starts run at
    /// once (the blocking pool's threads at most).
    starting: Vec<u64>,
    /// Exits reaped while a start was under way, of pids nobody waits for yet, each with the
    /// ticket of its reap: a command can exit before the start that launched it has registered
    /// it. Only a start whose ticket is older can claim one, and each is forgotten once no such
    /// start is under way (an orphan's exit, or a failed exec's).
    early: Vec<(u64, Reaped)>,
    /// Orders starts and reaps.
    next_ticket: u64,
}

impl Table {
    fn ticket(&mut self) -> u64 {
        self.next_ticket += 1;
        self.next_ticket
    }

    /// Forgets the early exits that no start under way can claim.
    fn forget_unclaimable(&mut self) {
        let oldest = self.starting.iter().copied().min();
        self.early.retain(|(reaped_at, _)| oldest.is_some_and(|t| t < *reaped_at));
    }
}

/// What std's `Command` needs from the reaper: when a command's exec fails, `spawn` reaps the
/// forked child itself with `waitpid` and panics if it finds it already reaped. So the reaper's
/// `wait4(-1)` sweep never runs while such a fork is under way. `posix_spawn` starts (every plain
/// command) do not enter the gate: glibc tolerates the reaper taking its failed child first.
///
/// The reaper only ever waits for the gate asynchronously, so a fork in progress never stalls
/// the event loop; forks that come while a sweep is wanted wait for it on their own (blocking)
/// threads, so a stream of forks cannot starve the reaper.
#[derive(Debug, Default)]
struct ForkGate {
    /// Forks in progress and whether the reaper waits to sweep. Never held across a fork or a
    /// `wait4`.
    state: Mutex<GateState>,
    /// Forks wait here while a sweep is wanted.
    reopened: Condvar,
    /// The reaper waits here for the forks in progress to end.
    drained: Notify,
}

#[derive(Debug, Default)]
struct GateState {
    forks: usize,
    sweep_wanted: bool,
    /// Forks waiting for a sweep to end: only then does its end wake anyone (a system call).
    waiting: usize,
}

/// Leave to fork with std's `Command`: no `wait4` sweep starts until it is dropped.
#[derive(Debug)]
struct ForkPass<'a> {
    gate: &'a ForkGate,
}

/// The reaper's leave to sweep: no std fork starts until it is dropped.
#[derive(Debug)]
struct SweepPass<'a> {
    gate: &'a ForkGate,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ForkGate {
    /// Blocks while a sweep is wanted or running: call it off the event loop only.
    fn enter(&self) -> ForkPass<'_> {
        let mut state = lock(&self.state);
        while state.sweep_wanted {
            state.waiting += 1;
            state = self.reopened.wait(state).unwrap_or_else(PoisonError::into_inner);
            state.waiting -= 1;
        }
        state.forks += 1;
        ForkPass { gate: self }
    }

    /// Waits, without blocking its thread, until no fork is in progress; none starts until the
    /// pass is dropped.
    async fn sweep(&self) -> SweepPass<'_> {
        loop {
            {
                let mut state = lock(&self.state);
                state.sweep_wanted = true;
                if state.forks == 0 {
                    return SweepPass { gate: self };
                }
            }
            // A fork that ends between the check and here leaves a permit: no wakeup is lost.
            self.drained.notified().await;
        }
    }
}

impl Drop for ForkPass<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.gate.state);
        state.forks -= 1;
        if state.forks == 0 && state.sweep_wanted {
            self.gate.drained.notify_one();
        }
    }
}

impl Drop for SweepPass<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.gate.state);
        state.sweep_wanted = false;
        if state.waiting > 0 {
            self.gate.reopened.notify_all();
        }
    }
}

impl Children {
    pub fn new() -> Arc<Self> {
        Arc::new(Children::default())
    }

    /// Spawns `cmd` (std's fork and exec) and registers it; the receiver resolves when the
    /// reaper reaps it. Blocks for the fork and exec, and while the reaper sweeps: call it off the
    /// event loop ([`crate::run::start`], `spawn_blocking`).
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, oneshot::Receiver<Reaped>)> {
        let mut child = None;
        let (_, rx) = self.spawn_with(|| {
            let _pass = self.gate.enter();
            let c = cmd.spawn()?;
            let pid = c.id() as i32;
            child = Some(c);
            Ok(pid)
        })?;
        child.map(|c| (c, rx)).ok_or_else(|| io::Error::other("spawned no child"))
    }

    /// Runs `start`, which starts one child and answers its pid (`sys::posix_spawn`, say), and
    /// registers that child; the receiver resolves when the reaper reaps it, even if it exited
    /// before `start` returned. Holds no lock while `start` runs.
    pub fn spawn_with(&self, start: impl FnOnce() -> io::Result<i32>) -> io::Result<(i32, oneshot::Receiver<Reaped>)> {
        let ticket = {
            let mut table = lock(&self.table);
            let ticket = table.ticket();
            table.starting.push(ticket);
            ticket
        };
        let started = start();
        let mut table = lock(&self.table);
        if let Some(i) = table.starting.iter().position(|&t| t == ticket) {
            table.starting.swap_remove(i);
        }
        let registered = started.map(|pid| {
            let (tx, rx) = oneshot::channel();
            let early = table.early.iter().position(|(reaped_at, r)| r.pid == pid && *reaped_at > ticket);
            match early {
                Some(i) => {
                    let (_, reaped) = table.early.swap_remove(i);
                    let _ = tx.send(reaped);
                }
                None => {
                    table.waiters.insert(pid, tx);
                }
            }
            (pid, rx)
        });
        table.forget_unclaimable();
        registered
    }

    /// Reaps every child that has exited, once no std fork is in progress (waiting for that
    /// without blocking the thread). Orphans the daemon inherited are reaped and dropped.
    pub async fn reap(&self) {
        self.reap_with(sys::reap_any).await;
    }

    /// [`Children::reap`] with `reap_one` for `wait4`.
    async fn reap_with(&self, mut reap_one: impl FnMut() -> io::Result<Option<Reaped>>) {
        let _sweep = self.gate.sweep().await;
        loop {
            match reap_one() {
                Ok(Some(reaped)) => self.deliver(reaped),
                Ok(None) => return,
                Err(err) => {
                    tracing::warn!(%err, "wait4 failed");
                    return;
                }
            }
        }
    }

    /// Hands one exit to its waiter, or keeps it for a start under way that may claim it.
    fn deliver(&self, reaped: Reaped) {
        let mut table = lock(&self.table);
        if let Some(waiter) = table.waiters.remove(&reaped.pid) {
            drop(table);
            // The waiter may have given up (its request was cancelled); fine.
            let _ = waiter.send(reaped);
        } else if !table.starting.is_empty() {
            let ticket = table.ticket();
            table.early.push((ticket, reaped));
        }
    }

    /// The pids of the children still running.
    pub fn live(&self) -> Vec<i32> {
        lock(&self.table).waiters.keys().copied().collect()
    }

    pub fn count(&self) -> usize {
        lock(&self.table).waiters.len()
    }

    /// Counts an exec as under way until the guard is dropped.
    pub fn exec_running(self: &Arc<Self>) -> ExecRunning {
        self.execs.fetch_add(1, Ordering::Relaxed);
        ExecRunning { children: Arc::clone(self) }
    }
}

/// Runs the reaper until cancelled: one `wait4` sweep per SIGCHLD. Must be started (the signal
/// handler installed) before the first child is spawned; `install` does that part.
pub fn install_reaper(children: Arc<Children>, cancel: CancellationToken) -> io::Result<tokio::task::JoinHandle<()>> {
    let mut sigchld = signal(SignalKind::child())?;
    Ok(tokio::spawn(async move {
        // Children started before the handler (none in practice) are swept once up front.
        children.reap().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                got = sigchld.recv() => {
                    if got.is_none() { return; }
                    children.reap().await;
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit_of(pid: i32) -> Reaped {
        Reaped { pid, status: 0, usage: Default::default() }
    }

    /// Runs `f` on a thread of its own and answers what it returns; fails, rather than hangs,
    /// when it deadlocks. The time is no measure of speed: only a lock that is never released
    /// takes a minute here.
    fn or_deadlock<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(60)).unwrap_or_else(|_| panic!("deadlock: {what}"))
    }

    /// Issue 34: an exec starts its command on the event loop only while no other exec is under
    /// way; concurrent ones start theirs side by side on the pool. The count follows the guards.
    #[test]
    fn an_exec_is_alone_only_while_no_other_is_under_way() {
        let children = Children::new();
        let first = children.exec_running();
        assert!(first.alone());
        let second = children.exec_running();
        assert!(!first.alone() && !second.alone());
        drop(first);
        assert!(second.alone());
        drop(second);
        assert!(children.exec_running().alone());
    }

    /// Regression (issue 16, and the daemon's throughput with concurrent execs): starts took
    /// one lock around their fork, then a read lock that the reaper took exclusively on the
    /// event loop, so every exec waited for the forks of the others. A start now holds nothing
    /// while it starts its child: another start, a whole sweep of the reaper and every query of
    /// the table all go through, from another thread, while one is in the middle of its `start`.
    /// A lock taken around `start` that any of those also takes makes this fail.
    #[test]
    fn nothing_waits_for_a_start_in_progress() {
        let children = Arc::new(Children::default());
        let outer = Arc::clone(&children);
        let started = or_deadlock("a start waited for another start in progress", move || {
            outer.spawn_with(|| {
                let children = Arc::clone(&outer);
                let (inner, count) = or_deadlock("a start, the reaper or a query waited for a start", move || {
                    let inner = children.spawn_with(|| Ok(4242));
                    let mut exits = vec![exit_of(4242)];
                    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap_or_else(|e| panic!("{e}"));
                    rt.block_on(children.reap_with(|| Ok(exits.pop())));
                    (inner, (children.live().len(), children.count()))
                });
                let (pid, mut rx) = inner?;
                assert_eq!((pid, count), (4242, (0, 0)));
                assert_eq!(rx.try_recv().map(|r| r.pid).ok(), Some(4242), "the exit did not reach its waiter");
                Ok(4343)
            })
        });
        assert!(started.is_ok());
        assert_eq!(children.live(), [4343]);
    }

    /// The reaper's sweep waits for a std fork in progress without blocking its thread (the
    /// event loop: this test's runtime has one thread), and a fork that comes while a sweep is
    /// wanted waits for it.
    #[test]
    fn the_reaper_waits_for_std_forks_without_blocking_the_event_loop() {
        or_deadlock("the reaper blocked the event loop", || {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap_or_else(|e| panic!("{e}"));
            rt.block_on(async {
                let children = Arc::new(Children::default());
                let pass = children.gate.enter();
                let sweep = {
                    let children = Arc::clone(&children);
                    tokio::spawn(async move {
                        let _sweep = children.gate.sweep().await;
                    })
                };
                // The one thread still runs other tasks meanwhile.
                tokio::task::yield_now().await;
                assert!(!sweep.is_finished(), "the sweep ran during a fork");
                assert!(lock(&children.gate.state).sweep_wanted, "a stream of forks could starve the reaper");
                drop(pass);
                sweep.await.unwrap_or_else(|e| panic!("{e}"));
                assert!(!lock(&children.gate.state).sweep_wanted);
                let _again = children.gate.enter();
            });
        });
    }

    /// An exit reaped before its start registered the pid reaches that start's waiter; one no
    /// start can claim (an orphan's) is forgotten.
    #[test]
    fn an_exit_before_registration_is_kept_for_its_start_only() {
        let children = Children::default();
        let (pid, mut rx) = children
            .spawn_with(|| {
                children.deliver(exit_of(77));
                children.deliver(exit_of(78));
                Ok(77)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pid, 77);
        assert_eq!(rx.try_recv().map(|r| r.pid).ok(), Some(77));
        assert_eq!(children.count(), 0);
        assert!(lock(&children.table).early.is_empty(), "an orphan's exit was kept");
        // With no start under way, an unknown pid's exit is an orphan's: nothing keeps it, and a
        // later child with that pid is not taken for exited.
        children.deliver(exit_of(79));
        let (_, mut rx) = children.spawn_with(|| Ok(79)).unwrap_or_else(|e| panic!("{e}"));
        assert!(rx.try_recv().is_err());
        assert_eq!(children.live(), [79]);
    }
}
