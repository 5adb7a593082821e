//! `exec -t` (`-it`): a command on a terminal of the sandbox, attached to this one. The command
//! starts as a background process with `pty`, sized as this terminal; its output is followed and
//! written here as it comes, what is typed goes to its stdin raw (this terminal in raw mode, so
//! Ctrl-C and Ctrl-D reach the command), and SIGWINCH resizes it. The CLI exits with the
//! command's code once it has exited, and the process is forgotten.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::process::ExitCode;

use bytes::Bytes;
use rustix::termios::{self, OptionalActions, Termios};
use sandman_client::Client;
use sandman_wire::daemon::{OutputEvent, OutputQuery, PtySize, StartProcess, StreamName};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::cli::ExecCmd;
use crate::exec::exit_code_of;
use crate::report;

/// Size of one read from this terminal: a burst of keystrokes (or a paste) goes as one write.
const READ_CHUNK: usize = 4096;

/// Chunks of input read but not yet sent; the reading thread waits past this (a paste faster
/// than the network).
const INPUT_CHUNKS: usize = 64;

/// The size of a terminal a command gets when this process has none.
const DEFAULT_SIZE: PtySize = PtySize { rows: 24, cols: 80 };

/// This terminal's size, from stdout, else stdin; the default when neither is a terminal.
fn local_size() -> PtySize {
    let size = termios::tcgetwinsize(io::stdout().as_fd()).or_else(|_| termios::tcgetwinsize(io::stdin().as_fd()));
    match size {
        Ok(w) if w.ws_row > 0 && w.ws_col > 0 => {
            PtySize { rows: w.ws_row.min(PtySize::MAX), cols: w.ws_col.min(PtySize::MAX) }
        }
        _ => DEFAULT_SIZE,
    }
}

/// This terminal in raw mode until dropped, then as it was: keystrokes go through unread by the
/// local line discipline (no echo, no line editing, Ctrl-C a byte rather than SIGINT here).
struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// Raw mode, when stdin is a terminal; `None` when it is not (a pipe: nothing to change).
    fn enter() -> anyhow::Result<Option<RawMode>> {
        let stdin = io::stdin();
        if !termios::isatty(stdin.as_fd()) {
            return Ok(None);
        }
        let saved = termios::tcgetattr(stdin.as_fd())?;
        let mut raw = saved.clone();
        raw.make_raw();
        termios::tcsetattr(stdin.as_fd(), OptionalActions::Now, &raw)?;
        Ok(Some(RawMode { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(io::stdin().as_fd(), OptionalActions::Now, &self.saved);
    }
}

/// Reads this process's stdin on a thread of its own (a blocking read must not hold the runtime,
/// nor keep it from ending) and hands each chunk on; `None` at end-of-file.
fn read_stdin(tx: mpsc::Sender<Option<Bytes>>) {
    std::thread::spawn(move || {
        let mut stdin = io::stdin();
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = tx.blocking_send(None);
                    return;
                }
                Ok(n) => {
                    if tx.blocking_send(Some(Bytes::copy_from_slice(&buf[..n]))).is_err() {
                        return;
                    }
                }
            }
        }
    });
}

pub async fn exec(client: &Client, cmd: ExecCmd) -> anyhow::Result<ExitCode> {
    let mut env: BTreeMap<String, String> = cmd.env.into_iter().collect();
    if let Ok(term) = std::env::var("TERM") {
        env.entry("TERM".into()).or_insert(term);
    }
    let (argv, command) = if cmd.exec.shell { (None, Some(cmd.command.join(" "))) } else { (Some(cmd.command), None) };
    let req = StartProcess {
        argv,
        command,
        env,
        cwd: cmd.exec.cwd.clone(),
        user: cmd.exec.user.clone(),
        timeout_ms: cmd.exec.timeout_ms,
        pty: Some(local_size()),
        ..StartProcess::default()
    };
    let id = cmd.id;
    let process = client.start_process(&id, &req).await?.id;
    let outcome = attach(client, &id, &process, cmd.exec.stdin).await;
    // Forget it: it has exited (or this CLI is failing, and nobody else watches it).
    let _ = client.kill_process(&id, &process).await;
    outcome
}

/// Follows the process's output to stdout, forwards stdin (with `input`; a piped stdin too, ended
/// by Ctrl-D) and resizes, until it exits; answers its exit code.
async fn attach(client: &Client, id: &str, process: &str, input: bool) -> anyhow::Result<ExitCode> {
    let query = OutputQuery { offset: 0, stream: StreamName::Stdout, follow: true, max_bytes: None };
    // A broken connection is reopened where the last event ended: nothing shown twice.
    let mut output = client.follow_output_resuming(id, process, &query);
    let _raw = if input { RawMode::enter()? } else { None };

    // Keystrokes, sent in order by one task so that none overtakes another.
    let (tx, mut rx) = mpsc::channel::<Option<Bytes>>(INPUT_CHUNKS);
    if input {
        read_stdin(tx);
    } else {
        drop(tx);
    }
    let (sender, (id_in, process_in)) = (client.clone(), (id.to_owned(), process.to_owned()));
    let forward = tokio::spawn(async move {
        while let Some(chunk) = rx.recv().await {
            let (data, close) = match chunk {
                Some(data) => (data, false),
                // End of a piped stdin: Ctrl-D, as at a terminal.
                None => (Bytes::new(), true),
            };
            if sender.write_stdin_bytes(&id_in, &process_in, data, close).await.is_err() || close {
                return;
            }
        }
    });
    let mut winch = signal(SignalKind::window_change())?;
    let mut stdout = io::stdout();
    let status = loop {
        tokio::select! {
            event = output.next() => match event {
                Some(Ok(OutputEvent::Data { data, .. })) => {
                    stdout.write_all(data.as_bytes()).and_then(|()| stdout.flush()).map_err(report::StdoutClosed::from_io)?;
                }
                Some(Ok(OutputEvent::Exit { status, .. })) => break status,
                Some(Ok(OutputEvent::Dropped { .. } | OutputEvent::Keepalive)) => {}
                Some(Err(err)) => {
                    forward.abort();
                    return Err(err.into());
                }
                None => {
                    forward.abort();
                    anyhow::bail!("the command's output ended before it exited: the connection to the server was lost");
                }
            },
            _ = winch.recv() => {
                // A resize that fails (the command just exited) changes nothing that matters.
                let _ = client.resize(id, process, local_size()).await;
            }
        }
    };
    forward.abort();
    Ok(ExitCode::from(exit_code_of(&status)))
}
