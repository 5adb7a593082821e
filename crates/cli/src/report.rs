//! Diagnostics in uv's style (`error:`, `  Caused by:`, `hint:`, `warning:`) on stderr, and the
//! exit codes: 0 ok, 1 a clean "no", 2 an error.

use std::io::{self, Write};
use std::process::ExitCode;

use sandman_client::{ClientError, env};
use sandman_wire::ErrorCode;

/// A clean "no": the answer is negative but nothing went wrong (rm of a sandbox already gone).
pub const NO: u8 = 1;
/// Something went wrong.
pub const ERROR: u8 = 2;

/// Writes a line of data to stdout; a closed stdout (`| head`) ends the command quietly.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*).map_err($crate::report::StdoutClosed::from_io)
    }};
}
pub(crate) use outln;

/// Writing to stdout failed: usually the reader went away. Stops the command; see [`exit_code`].
#[derive(Debug, thiserror::Error)]
#[error("could not write to stdout")]
pub struct StdoutClosed(#[source] pub io::Error);

impl StdoutClosed {
    pub fn from_io(err: io::Error) -> anyhow::Error {
        anyhow::Error::new(StdoutClosed(err))
    }
}

/// The exit code of a command's outcome, printing its error (with a hint where one exists).
pub fn exit_code(outcome: anyhow::Result<ExitCode>) -> ExitCode {
    match outcome {
        Ok(code) => code,
        Err(err) if stdout_closed(&err) => ExitCode::SUCCESS,
        Err(err) => {
            error(&err);
            ExitCode::from(ERROR)
        }
    }
}

fn stdout_closed(err: &anyhow::Error) -> bool {
    err.chain()
        .filter_map(|e| e.downcast_ref::<StdoutClosed>())
        .any(|StdoutClosed(io)| io.kind() == io::ErrorKind::BrokenPipe)
}

/// `error: ...`, every cause, then the hint.
pub fn error(err: &anyhow::Error) {
    let mut text = format!("error: {err}\n");
    for cause in err.chain().skip(1) {
        text.push_str(&format!("  Caused by: {cause}\n"));
    }
    if let Some(hint) = hint(err) {
        text.push_str(&format!("hint: {hint}\n"));
    }
    // Nothing is left to tell when stderr itself is gone.
    let _ = io::stderr().lock().write_all(text.as_bytes());
}

/// `warning: ...` on stderr.
pub fn warning(text: &str) {
    let _ = writeln!(io::stderr().lock(), "warning: {text}");
}

/// A status line for people (`Copied ...`) on stderr.
pub fn status(text: &str) {
    let _ = writeln!(io::stderr().lock(), "{text}");
}

/// The client error in `err`'s chain, if any.
pub fn client_error(err: &anyhow::Error) -> Option<&ClientError> {
    err.chain().find_map(|e| e.downcast_ref::<ClientError>())
}

/// The next step, where one exists.
fn hint(err: &anyhow::Error) -> Option<String> {
    let client = client_error(err)?;
    if client.is_connection_refused() {
        return Some(
            "no server is listening there: start one with `sandman serve`, or point SANDMAN_URL (or `--url`) at it"
                .to_owned(),
        );
    }
    if matches!(client, ClientError::NoToken { .. }) || client.code() == Some(ErrorCode::Unauthorized) {
        return Some(format!(
            "set SANDMAN_TOKEN (or `--token`) to the server's token, or point SANDMAN_STATE_DIR at the server's \
             state directory, where it writes its token (read from `{}`)",
            env::default_token_file().display()
        ));
    }
    match (client.code(), client.reason()) {
        (Some(ErrorCode::Gone), Some("lease_expired")) => Some(
            "a sandbox is reclaimed when its lease lapses: renew it with `sandman keepalive` or `sandman job \
             heartbeat`, or create it with a longer `--lease`"
                .to_owned(),
        ),
        (Some(ErrorCode::Gone), Some("idle_expired")) => {
            Some("a sandbox is reclaimed after its idle timeout: create it with a longer `--idle-timeout`".to_owned())
        }
        (Some(ErrorCode::Gone), Some("ttl_expired")) => {
            Some("a sandbox lives at most its TTL: create it with a longer `--ttl`".to_owned())
        }
        (Some(ErrorCode::Paused), _) => Some(
            "resume it with `sandman resume ID`, or create it with `--auto-resume` so that calls resume it".to_owned(),
        ),
        (Some(ErrorCode::QuotaExceeded), _) => {
            Some("see the job's quota with `sandman job get JOB`, and raise it with `sandman job put`".to_owned())
        }
        _ => None,
    }
}

/// Whether `err` says the sandbox (or what was named) no longer exists: a clean "no".
pub fn is_gone(err: &anyhow::Error) -> bool {
    client_error(err).and_then(ClientError::code).is_some_and(|c| matches!(c, ErrorCode::Gone | ErrorCode::NotFound))
}
