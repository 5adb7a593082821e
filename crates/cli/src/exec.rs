//! `exec` and `run`: a command's output streamed to this terminal as it comes, and its exit
//! status as this process's exit code (128+signal when killed, 124 on timeout).

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use sandman_client::Client;
use sandman_wire::daemon::{ExecEvent, ExecRequest, ExitStatus};
use sandman_wire::server::{CreateSandbox, SandboxState};

use crate::cli::{ExecCmd, ExecFlags, RunCmd};
use crate::report;
use crate::sandboxes::{check_not_failed, create_request, create_showing_progress, fresh_key};

/// How long `run` waits for the release of its sandbox before leaving it to its lease.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(30);

/// The exit code `timeout(1)` uses for a command it killed.
const TIMED_OUT: u8 = 124;

pub async fn exec(client: &Client, cmd: ExecCmd) -> anyhow::Result<ExitCode> {
    if cmd.tty {
        return crate::tty::exec(client, cmd).await;
    }
    let req = exec_request(cmd.command, cmd.env.into_iter().collect(), &cmd.exec)?;
    stream(client, &cmd.id, &req).await
}

/// The request for `command`: argv as given, or one shell string with `--shell`.
pub fn exec_request(
    command: Vec<String>,
    env: BTreeMap<String, String>,
    flags: &ExecFlags,
) -> anyhow::Result<ExecRequest> {
    let stdin = if flags.stdin {
        let mut text = String::new();
        io::stdin().read_to_string(&mut text).context("could not read stdin (it is sent as UTF-8 text)")?;
        Some(text)
    } else {
        None
    };
    let (argv, command) = if flags.shell { (None, Some(command.join(" "))) } else { (Some(command), None) };
    Ok(ExecRequest {
        argv,
        command,
        env,
        cwd: flags.cwd.clone(),
        user: flags.user.clone(),
        stdin,
        timeout_ms: flags.timeout_ms,
        // Streamed output is written out as it comes, never held, so it needs no cap.
        max_output_bytes: Some(u64::MAX),
        merge_output: false,
    })
}

/// Runs `req` in sandbox `id`, writing its output to stdout and stderr as it comes.
async fn stream(client: &Client, id: &str, req: &ExecRequest) -> anyhow::Result<ExitCode> {
    let mut events = client.exec_stream(id, req).await?;
    let mut stdout = io::stdout();
    let mut stderr = io::stderr();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(err) => return Err(ended(client, id).await.unwrap_or_else(|| anyhow::Error::new(err))),
        };
        match event {
            ExecEvent::Stdout { data } => stdout
                .write_all(data.as_bytes())
                .and_then(|()| stdout.flush())
                .map_err(report::StdoutClosed::from_io)?,
            // A closed stderr loses diagnostics, not data: carry on.
            ExecEvent::Stderr { data } => drop(stderr.write_all(data.as_bytes()).and_then(|()| stderr.flush())),
            ExecEvent::Exit { status, stdout_truncated, stderr_truncated } => {
                for (name, truncated) in [("stdout", stdout_truncated), ("stderr", stderr_truncated)] {
                    if truncated {
                        report::warning(&format!("the sandbox cut the command's {name} short"));
                    }
                }
                return Ok(ExitCode::from(exit_code_of(&status)));
            }
            ExecEvent::Started { .. } | ExecEvent::Keepalive => {}
        }
    }
    Err(ended(client, id).await.unwrap_or_else(|| {
        anyhow::anyhow!("the command's output ended before it exited: the connection to the server was lost")
    }))
}

/// How long the CLI asks why an exec stream broke.
const ENDED_TIMEOUT: Duration = Duration::from_secs(5);

/// Why an exec stream stopped early, when it is that its sandbox is ending or has ended.
/// Asked briefly: the connection broke, and the server may be gone for longer than the call's
/// resends would wait.
async fn ended(client: &Client, id: &str) -> Option<anyhow::Error> {
    let asked = tokio::time::timeout(ENDED_TIMEOUT, client.get(id)).await.ok()?;
    let sandbox = asked.ok().filter(|sb| sb.state.is_terminal() || sb.state == SandboxState::Releasing)?;
    let reason = sandbox.reason.map(|r| format!(" ({r})")).unwrap_or_default();
    Some(anyhow::anyhow!("sandbox `{id}` went away while the command ran: it is {}{reason}", sandbox.state))
}

/// The command's exit code as a shell reports it: its own code, 128+signal when a signal killed
/// it, 124 when it was killed for its timeout.
pub fn exit_code_of(status: &ExitStatus) -> u8 {
    if status.timed_out {
        TIMED_OUT
    } else if let Some(code) = status.exit_code {
        (code & 0xff) as u8
    } else if let Some(signal) = status.signal {
        (128 + signal).clamp(0, 255) as u8
    } else {
        report::NO
    }
}

/// Creates a sandbox, runs the command, and releases the sandbox whatever happens: an error, a
/// failed exec, or SIGINT/SIGTERM (then the exit code is 128+signal).
pub async fn run(client: &Client, cmd: RunCmd) -> anyhow::Result<ExitCode> {
    let exec_req = exec_request(cmd.command, BTreeMap::new(), &cmd.exec)?;
    let mut create = create_request(&cmd.image, &cmd.sandbox, true);
    // A key unique to this run: a create retried after an interruption finds its sandbox, and the
    // create's progress is followed by it.
    create.idempotency_key.get_or_insert_with(|| fresh_key("run"));
    let sandbox = tokio::select! {
        created = create_showing_progress(client, &create) => created?,
        signal = shutdown_signal() => {
            release_interrupted_create(client, create).await;
            return Ok(ExitCode::from(128 + signal));
        }
    };
    let outcome = match check_not_failed(&sandbox) {
        Err(err) => Err(err),
        Ok(()) => tokio::select! {
            code = stream(client, &sandbox.id, &exec_req) => code,
            // Dropping the stream closes the connection, and the daemon kills the command.
            signal = shutdown_signal() => Ok(ExitCode::from(128 + signal)),
        },
    };
    release(client, &sandbox.id).await;
    outcome
}

/// A create cut short may still have made the sandbox: the same idempotency key answers it (or
/// makes it) at once, and it is released.
async fn release_interrupted_create(client: &Client, create: CreateSandbox) {
    let again = CreateSandbox { wait: false, ..create };
    if let Ok(Ok(sandbox)) = tokio::time::timeout(RELEASE_TIMEOUT, client.create(&again)).await {
        release(client, &sandbox.id).await;
    }
}

pub async fn release(client: &Client, id: &str) {
    let released = tokio::select! {
        released = tokio::time::timeout(RELEASE_TIMEOUT, client.release(id)) => released,
        _ = shutdown_signal() => {
            report::warning(&format!("left sandbox `{id}` to be reclaimed when its lease lapses"));
            return;
        }
    };
    match released {
        Ok(Ok(_)) => {}
        Ok(Err(err)) => {
            let err = anyhow::Error::new(err);
            if !report::is_gone(&err) {
                report::warning(&format!(
                    "could not release sandbox `{id}` ({err}); it is reclaimed when its lease lapses"
                ));
            }
        }
        Err(_) => report::warning(&format!(
            "releasing sandbox `{id}` took over {}s; it is reclaimed when its lease lapses",
            RELEASE_TIMEOUT.as_secs()
        )),
    }
}

/// The number of the first SIGINT or SIGTERM received from now on.
async fn shutdown_signal() -> u8 {
    use tokio::signal::unix::{SignalKind, signal};
    let interrupt = async {
        match signal(SignalKind::interrupt()) {
            Ok(mut s) => s.recv().await,
            Err(_) => std::future::pending().await,
        }
    };
    let terminate = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => s.recv().await,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = interrupt => 2,
        _ = terminate => 15,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        let status =
            |exit_code, signal, timed_out| ExitStatus { exit_code, signal, timed_out, ..ExitStatus::default() };
        assert_eq!(exit_code_of(&status(Some(3), None, false)), 3);
        assert_eq!(exit_code_of(&status(Some(0), None, false)), 0);
        assert_eq!(exit_code_of(&status(None, Some(9), false)), 137);
        assert_eq!(exit_code_of(&status(None, Some(9), true)), 124);
        assert_eq!(exit_code_of(&status(Some(256 + 4), None, false)), 4);
    }

    #[test]
    fn shell_mode_sends_one_string() {
        let flags = ExecFlags { cwd: None, user: None, timeout_ms: Some(5), shell: true, stdin: false };
        let req = exec_request(vec!["echo".into(), "$HOME".into()], BTreeMap::new(), &flags).unwrap_or_default();
        assert_eq!((req.argv, req.command.as_deref()), (None, Some("echo $HOME")));
        let flags = ExecFlags { shell: false, ..flags };
        let req = exec_request(vec!["a b".into()], BTreeMap::new(), &flags).unwrap_or_default();
        assert_eq!(req.argv, Some(vec!["a b".to_owned()]));
        assert_eq!(req.timeout_ms, Some(5));
    }
}
