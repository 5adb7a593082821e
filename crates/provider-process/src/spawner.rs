//! Starting daemons from a thread whose descriptor table stays small. A child gets a copy of
//! the descriptor table of the thread that forks it, and at exec closes the close-on-exec ones
//! one by one, so a spawn costs in proportion to the table. The server's own table grows with
//! its sandboxes (a pidfd each, connections to their daemons): at 7,000 descriptors a spawn
//! measured 2 ms more than at three, so each create cost more than the one before. The spawner
//! thread unshares its table at start (`unshare(CLONE_FILES)`) and closes the copies it got,
//! keeping stdin, stdout and stderr: whatever it opens for a spawn (the daemon's log,
//! `/dev/null`) it closes after, so every spawn copies a handful of descriptors however many
//! sandboxes the server holds. Its children are the process's children all the same: any
//! thread may wait for them, and a pidfd for one is opened from the async side as before.

use std::io;
use std::sync::mpsc;

use crate::sys;

/// The thread's name, as `/proc/<pid>/task/<tid>/comm` shows it.
pub const THREAD_NAME: &str = "sandman-spawner";

type Job = Box<dyn FnOnce() + Send>;

/// A thread with a descriptor table of its own that runs the spawns handed to it, one at a
/// time (a spawn with a small table takes a fraction of a millisecond). It ends when the
/// spawner is dropped.
#[derive(Debug)]
pub struct Spawner {
    jobs: mpsc::Sender<Job>,
}

impl Spawner {
    /// Starts the thread; fails when the table cannot be unshared.
    pub fn start() -> io::Result<Spawner> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let (started_tx, started) = mpsc::channel();
        std::thread::Builder::new().name(THREAD_NAME.into()).spawn(move || {
            let unshared = sys::unshare_files().and_then(|()| sys::close_from(3));
            let ok = unshared.is_ok();
            let _ = started_tx.send(unshared);
            if ok {
                for job in queue {
                    job();
                }
            }
        })?;
        started.recv().map_err(|_| io::Error::other("the spawner thread died as it started"))??;
        Ok(Spawner { jobs })
    }

    /// Runs `f` on the spawner thread and answers what it returns. `f` must open whatever
    /// descriptors it needs itself (the caller's are not in the thread's table) and close them
    /// before it returns.
    ///
    /// The answer comes back through a std channel to a thread of the blocking pool, never by
    /// waking a task from the spawner thread: a waker may write to the runtime's eventfd by its
    /// number, which names nothing (or something else) in the spawner's table.
    pub async fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
        let jobs = self.jobs.clone();
        let gone = || io::Error::other("the spawner thread is gone");
        tokio::task::spawn_blocking(move || {
            let (tx, rx) = mpsc::sync_channel(1);
            jobs.send(Box::new(move || {
                let _ = tx.send(f());
            }))
            .map_err(|_| gone())?;
            rx.recv().map_err(|_| gone())
        })
        .await
        .map_err(io::Error::other)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fds_of_thread(tid: i32) -> usize {
        std::fs::read_dir(format!("/proc/self/task/{tid}/fd")).map(|d| d.count()).unwrap_or(usize::MAX)
    }

    #[tokio::test]
    async fn the_spawner_thread_keeps_a_table_of_its_own() {
        let spawner = Spawner::start().unwrap_or_else(|e| panic!("{e}"));
        // Opened after the thread unshared: in the process's table, not the thread's.
        let held: Vec<std::fs::File> =
            (0..64).map(|_| std::fs::File::open("/dev/null").unwrap_or_else(|e| panic!("{e}"))).collect();
        let tid = spawner.run(sys::gettid).await.unwrap_or_else(|e| panic!("{e}"));
        let (theirs, ours) = (fds_of_thread(tid), fds_of_thread(sys::gettid()));
        assert!(ours >= held.len(), "the process holds {ours}");
        assert!(theirs <= 3, "the spawner thread holds {theirs}");
        // What a job opens is its own, and closes with it.
        let during = spawner
            .run(move || {
                let _f = std::fs::File::open("/dev/null");
                fds_of_thread(sys::gettid())
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // The file, and the directory being listed: both in the thread's own table.
        assert_eq!(during, theirs + 2);
        assert_eq!(fds_of_thread(tid), theirs);
    }
}
