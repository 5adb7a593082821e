//! Running one process tree to its end: start it in its own group, pump its output into a sink,
//! enforce its timeout by killing the whole tree, and collect its exit and resource usage.

use std::os::fd::{AsFd, OwnedFd};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use sandman_wire::daemon::{ExitStatus, PtySize, StreamName};
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::children::Children;
use crate::error::{DaemonError, DaemonResult};
use crate::spawn::Launch;
use crate::sys::{self, Reaped};
use crate::tree;

/// How long output is still read after the leader exits, for descendants that keep the pipes
/// open (`sh -c 'sleep 100 &'`): their later output is not waited for.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);

/// Size of one read from a child's pipe, and so the largest output chunk.
const READ_CHUNK: usize = 64 * 1024;

/// Size of the first read from each of a child's pipes: most commands write little, and two
/// zeroed 64 KiB buffers per command cost more than the rest of an exec's bookkeeping (the
/// allocator grows and trims its heap for them each time). A read that fills its buffer grows
/// it to [`READ_CHUNK`].
const FIRST_READ: usize = 4 * 1024;

/// A started process tree.
#[derive(Debug)]
pub struct Started {
    pub pid: i32,
    /// Its stdin: a pipe, or the terminal's master.
    pub stdin: Option<pipe::Sender>,
    /// Its output: stdout's pipe, the one pipe of both streams, or the terminal's master.
    stdout: pipe::Receiver,
    /// Its stderr's pipe, unless stderr goes where stdout goes.
    stderr: Option<pipe::Receiver>,
    /// The terminal's master, for resizing it, when it runs on one.
    pub pty: Option<OwnedFd>,
    exit: oneshot::Receiver<Reaped>,
    started: Instant,
}

/// Where a started process's stdin, stdout and stderr go.
#[derive(Debug, Clone, Copy)]
pub enum Io {
    /// Pipes: stdin kept open for the caller when `stdin`, else closed at once so that the command
    /// reads end-of-file (not `/dev/null`: an image may have no `/dev`); stdout and stderr on one
    /// pipe when `merge`.
    Pipes { stdin: bool, merge: bool },
    /// A new pseudo-terminal of this size for all three.
    Pty(PtySize),
}

fn watch_err<T>(pid: i32, res: std::io::Result<T>) -> DaemonResult<T> {
    res.map_err(|e| DaemonError::Internal(format!("cannot watch the pipes of pid {pid}: {e}")))
        .inspect_err(|_| tree::kill_tree(pid))
}

/// Starts `launch` with its stdin, stdout and stderr as `io` says. The fork and exec run on the
/// blocking pool: the event loop serves on meanwhile, and concurrent starts fork side by side on
/// as many threads (see [`Children`]). A start whose caller went away meanwhile is killed.
///
/// With `Where::Inline`, a command that starts without a fork (a vfork-style `posix_spawn`,
/// which holds the thread only until the command has exec'd) is started on the calling thread,
/// the event loop: a start handed to the pool wakes one of its threads and then the event loop
/// again, two context switches that cost as much as the spawn itself when the machine has gone
/// idle between calls (an agent's sandbox, called between model turns). Only an exec alone in
/// the daemon asks for it, so concurrent execs still start side by side on the pool.
pub async fn start(children: &Arc<Children>, launch: Launch, io: Io, place: Where) -> DaemonResult<Started> {
    if place == Where::Inline && matches!(io, Io::Pipes { .. }) && launch.spawns_without_fork() {
        return start_here(children, &launch, io);
    }
    let children = Arc::clone(children);
    let (tx, rx) = oneshot::channel();
    tokio::task::spawn_blocking(move || {
        if let Err(Ok(orphan)) = tx.send(start_here(&children, &launch, io)) {
            tree::kill_tree(orphan.pid);
        }
    });
    rx.await.map_err(|_| DaemonError::Internal("the thread starting the command failed".into()))?
}

/// Where [`start`] starts a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    /// On the blocking pool.
    Pool,
    /// On the calling thread when it can start without a fork; else on the pool.
    Inline,
}

/// [`start`] on the calling thread, which it blocks for the fork and exec.
fn start_here(children: &Children, launch: &Launch, io: Io) -> DaemonResult<Started> {
    let spawn_err = |source| DaemonError::Spawn { program: launch.program().to_string(), source };
    match io {
        Io::Pipes { stdin: piped, merge } if launch.spawns_without_fork() => {
            let pipe_err = |e| DaemonError::Internal(format!("cannot make a pipe: {e}"));
            // The command's stdin: a pipe whose write end is kept for the caller, or dropped at
            // once so that the command reads end-of-file.
            let (stdin_w, stdin_r) = match piped {
                true => {
                    let (ours, theirs) = sys::pipe_for_child(sys::KeepEnd::Write).map_err(pipe_err)?;
                    (Some(ours), theirs)
                }
                false => (None, OwnedFd::from(std::io::pipe().map_err(pipe_err)?.0)),
            };
            let (out_r, out_w) = sys::pipe_for_child(sys::KeepEnd::Read).map_err(pipe_err)?;
            let err = if merge { None } else { Some(sys::pipe_for_child(sys::KeepEnd::Read).map_err(pipe_err)?) };
            let err_w = err.as_ref().map_or(out_w.as_fd(), |(_, w)| w.as_fd());
            let program = sys::find_program(launch.program(), launch.path(), &launch.cwd).map_err(spawn_err)?;
            let plan = sys::SpawnPlan {
                program: &program,
                argv: &launch.argv,
                env: &launch.env,
                cwd: &launch.cwd,
                stdio: [stdin_r.as_fd(), out_w.as_fd(), err_w],
                reset_signals: launch.ignored_signals,
            };
            let (pid, exit) = children.spawn_with(|| sys::posix_spawn(&plan)).map_err(spawn_err)?;
            // Only the command holds its ends now: each pipe ends when the command (and whatever
            // inherited it) is done with it.
            drop(stdin_r);
            drop(out_w);
            // The daemon's ends are pipes, made non-blocking by `pipe_for_child`.
            let stderr = match err {
                Some((r, w)) => {
                    drop(w);
                    Some(watch_err(pid, pipe::Receiver::from_owned_fd_unchecked(r))?)
                }
                None => None,
            };
            let stdin = match stdin_w {
                Some(w) => Some(watch_err(pid, pipe::Sender::from_owned_fd_unchecked(w))?),
                None => None,
            };
            let stdout = watch_err(pid, pipe::Receiver::from_owned_fd_unchecked(out_r))?;
            Ok(Started { pid, stdin, stdout, stderr, pty: None, exit, started: Instant::now() })
        }
        Io::Pipes { stdin: piped, merge } => {
            let mut cmd = launch.command(Stdio::piped());
            let merged = if merge {
                let (reader, writer) =
                    std::io::pipe().map_err(|e| DaemonError::Internal(format!("cannot make an output pipe: {e}")))?;
                let copy = writer.try_clone().map_err(|e| DaemonError::Internal(format!("cannot copy a pipe: {e}")))?;
                cmd.stdout(copy).stderr(writer);
                Some(reader)
            } else {
                None
            };
            let (mut child, exit) = children.spawn(&mut cmd).map_err(spawn_err)?;
            // The command holds the write ends of a merged pipe: drop ours, or it never ends.
            drop(cmd);
            let pid = child.id() as i32;
            // Dropping the write end of an unwanted stdin closes it: the command reads end-of-file.
            let stdin = match child.stdin.take().filter(|_| piped) {
                Some(s) => Some(watch_err(pid, pipe::Sender::from_owned_fd(OwnedFd::from(s)))?),
                None => None,
            };
            let (stdout, stderr) = match (merged, child.stdout.take(), child.stderr.take()) {
                (Some(both), _, _) => (watch_err(pid, pipe::Receiver::from_owned_fd(OwnedFd::from(both)))?, None),
                (None, Some(out), Some(err)) => (
                    watch_err(pid, pipe::Receiver::from_owned_fd(OwnedFd::from(out)))?,
                    Some(watch_err(pid, pipe::Receiver::from_owned_fd(OwnedFd::from(err)))?),
                ),
                _ => {
                    tree::kill_tree(pid);
                    return Err(DaemonError::Internal("child has no output pipes".into()));
                }
            };
            Ok(Started { pid, stdin, stdout, stderr, pty: None, exit, started: Instant::now() })
        }
        Io::Pty(size) => {
            let (master, slave) = sys::open_pty(size.rows, size.cols).map_err(|e| {
                DaemonError::Unavailable(format!(
                    "cannot open a pseudo-terminal (/dev/ptmx): {e}; the sandbox needs /dev/ptmx and /dev/pts"
                ))
            })?;
            let mut cmd = launch.command_on_pty(&slave).map_err(spawn_err)?;
            let (child, exit) = children.spawn(&mut cmd).map_err(spawn_err)?;
            // Only the command may hold the terminal's slave: the master reads end-of-file (EIO)
            // once every process on it is gone.
            drop(cmd);
            drop(slave);
            let pid = child.id() as i32;
            let writer = watch_err(pid, master.try_clone())?;
            let control = watch_err(pid, master.try_clone())?;
            // The master is a terminal, not a FIFO; it was opened non-blocking, as these need.
            let stdout = watch_err(pid, pipe::Receiver::from_owned_fd_unchecked(master))?;
            let stdin = Some(watch_err(pid, pipe::Sender::from_owned_fd_unchecked(writer))?);
            Ok(Started { pid, stdin, stdout, stderr: None, pty: Some(control), exit, started: Instant::now() })
        }
    }
}

/// Where a running tree's output goes.
pub trait OutputSink {
    /// Takes one chunk; `false` means nobody wants more (the client left) and the tree is killed.
    fn output(&mut self, stream: StreamName, data: &[u8]) -> impl Future<Output = bool> + Send;

    /// Resolves when nobody wants the output any more even though none is coming (a silent
    /// command whose client left); the tree is then killed. Never, by default.
    fn abandoned(&self) -> impl Future<Output = ()> + Send + 'static {
        std::future::pending()
    }
}

/// Kills the tree if the future driving it is dropped before the tree has exited (the call that
/// started it went away): nothing runs on that nobody can see or stop.
struct KillOnDrop {
    pid: i32,
    armed: bool,
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.armed {
            tree::kill_tree(self.pid);
        }
    }
}

/// Pumps output into `sink` until the leader has exited and its pipes are drained; kills the
/// whole tree at `timeout`, or as soon as the sink stops wanting output.
pub async fn drive<S: OutputSink>(mut started: Started, timeout: Option<Duration>, sink: &mut S) -> ExitStatus {
    let pid = started.pid;
    // Timeouts are bounded where they are parsed; one too long to add never fires.
    let deadline = timeout.and_then(|t| started.started.checked_add(t));
    let mut timed_out = false;
    let mut abandoned = false;
    let (mut out_open, mut err_open) = (true, started.stderr.is_some());
    let mut out_buf = vec![0u8; FIRST_READ];
    let mut err_buf = vec![0u8; FIRST_READ];
    let mut reaped: Option<Reaped> = None;
    let mut drain_until: Option<Instant> = None;
    let far = Instant::now() + Duration::from_secs(86400 * 365);
    let mut guard = KillOnDrop { pid, armed: true };
    let abandon = sink.abandoned();
    tokio::pin!(abandon);
    loop {
        if reaped.is_some() && !out_open && !err_open {
            break;
        }
        tokio::select! {
            _ = &mut abandon, if !abandoned && reaped.is_none() => {
                abandoned = true;
                tree::kill_tree(pid);
            },
            r = started.stdout.read(&mut out_buf), if out_open => match r {
                Ok(n) if n > 0 => {
                    if !abandoned && !sink.output(StreamName::Stdout, &out_buf[..n]).await {
                        abandoned = true;
                        tree::kill_tree(pid);
                    }
                    grow_when_full(&mut out_buf, n);
                }
                _ => out_open = false,
            },
            r = read_some(started.stderr.as_mut(), &mut err_buf), if err_open => match r {
                Ok(n) if n > 0 => {
                    if !abandoned && !sink.output(StreamName::Stderr, &err_buf[..n]).await {
                        abandoned = true;
                        tree::kill_tree(pid);
                    }
                    grow_when_full(&mut err_buf, n);
                }
                _ => err_open = false,
            },
            r = &mut started.exit, if reaped.is_none() => {
                match r {
                    Ok(r) => reaped = Some(r),
                    // The table was dropped: the daemon is shutting down.
                    Err(_) => reaped = Some(Reaped { pid, status: 0, usage: Default::default() }),
                }
                drain_until = Some(Instant::now() + DRAIN_AFTER_EXIT);
            },
            _ = tokio::time::sleep_until(deadline.unwrap_or(far)), if deadline.is_some() && !timed_out && reaped.is_none() => {
                timed_out = true;
                tree::kill_tree(pid);
            },
            _ = tokio::time::sleep_until(drain_until.unwrap_or(far)), if drain_until.is_some() => break,
        }
    }
    // The leader has been reaped: what is left of its group was not waited for on purpose.
    guard.armed = false;
    let reaped = reaped.unwrap_or(Reaped { pid, status: 0, usage: Default::default() });
    ExitStatus {
        exit_code: reaped.exit_code(),
        signal: reaped.signal(),
        timed_out,
        duration_ms: started.started.elapsed().as_millis() as u64,
        usage: reaped.usage,
    }
}

/// Grows a read buffer to [`READ_CHUNK`] once a read of `n` bytes has filled it: more is coming.
fn grow_when_full(buf: &mut Vec<u8>, n: usize) {
    if n == buf.len() && buf.len() < READ_CHUNK {
        buf.resize(READ_CHUNK, 0);
    }
}

/// Reads from `pipe`, or never when there is none.
async fn read_some(pipe: Option<&mut pipe::Receiver>, buf: &mut [u8]) -> std::io::Result<usize> {
    match pipe {
        Some(p) => p.read(buf).await,
        None => std::future::pending().await,
    }
}

/// Decodes a byte stream as UTF-8 chunk by chunk, carrying a sequence split across chunks to the
/// next one instead of mangling it; invalid bytes become U+FFFD.
#[derive(Debug, Default)]
pub struct Utf8Chunks {
    carry: Vec<u8>,
}

impl Utf8Chunks {
    pub fn push(&mut self, data: &[u8]) -> String {
        let mut bytes = std::mem::take(&mut self.carry);
        bytes.extend_from_slice(data);
        // Keep back an incomplete sequence at the end (at most 3 bytes).
        let keep = incomplete_tail(&bytes);
        self.carry = bytes.split_off(bytes.len() - keep);
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Bytes held back: the start of a character whose end has not come yet (at most 3).
    pub fn carried(&self) -> usize {
        self.carry.len()
    }

    /// Whatever is left at the end of the stream.
    pub fn finish(&mut self) -> String {
        String::from_utf8_lossy(&std::mem::take(&mut self.carry)).into_owned()
    }
}

/// Length of a trailing, possibly valid but unfinished UTF-8 sequence.
pub(crate) fn incomplete_tail(bytes: &[u8]) -> usize {
    for back in 1..=3.min(bytes.len()) {
        let b = bytes[bytes.len() - back];
        if b & 0b1100_0000 == 0b1000_0000 {
            continue; // continuation byte: look further back for the lead
        }
        let need = match b {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => return 0,
        };
        return if need > back { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_multibyte_sequences_are_carried() {
        let text = "héllo €";
        let bytes = text.as_bytes();
        let mut dec = Utf8Chunks::default();
        let mut out = String::new();
        for b in bytes {
            out.push_str(&dec.push(std::slice::from_ref(b)));
        }
        out.push_str(&dec.finish());
        assert_eq!(out, text);
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut dec = Utf8Chunks::default();
        let s = dec.push(&[b'a', 0xFF, b'b']);
        assert_eq!(s, "a\u{FFFD}b");
    }
}
