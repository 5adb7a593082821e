//! The daemon API (`sandmand`, port 7778): exec, background processes, shell sessions, files and
//! archives. Request types refuse unknown fields; the daemon parses them into typed actions.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Default TCP port of the daemon.
pub const DEFAULT_PORT: u16 = 7778;

/// What marks the temporary file of a write in progress: the daemon writes `.{name}.sandman-{32
/// hex digits}` beside the target and renames it over the target once written, so that nobody
/// sees a file half-written. A listing taken meanwhile shows it; [`is_write_in_progress`] tells.
pub const TEMP_MARK: &str = ".sandman-";

/// Whether a file name is the temporary file of a write in progress (see [`TEMP_MARK`]).
pub fn is_write_in_progress(name: &str) -> bool {
    name.starts_with('.')
        && name
            .rsplit_once(TEMP_MARK)
            .is_some_and(|(_, suffix)| suffix.len() == 32 && suffix.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// Always `"ok"` when the daemon answers.
    pub status: String,
    pub version: String,
    /// The answer to the query's `challenge`: lowercase hex of HMAC-SHA256 keyed with the
    /// daemon's token over [`health_proof_input`]. Only the daemon holding the sandbox's token can
    /// give it, so a caller that knows the token tells its own daemon from another one answering
    /// at the same address (a reused pod IP), without sending the token there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<String>,
}

/// Query of `GET /v1/health`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct HealthQuery {
    /// A fresh random string (at most [`MAX_HEALTH_CHALLENGE`] bytes) for the daemon to prove
    /// its token with: the answer carries `proof`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub challenge: Option<String>,
}

/// The longest `challenge` the daemon answers.
pub const MAX_HEALTH_CHALLENGE: usize = 128;

/// What the health proof signs: a fixed context, a zero byte, then the challenge. The context
/// keeps the proof from being usable as a MAC of anything else made with the token.
pub fn health_proof_input(challenge: &str) -> Vec<u8> {
    const CONTEXT: &[u8] = b"sandmand health proof v1";
    let mut input = Vec::with_capacity(CONTEXT.len() + 1 + challenge.len());
    input.extend_from_slice(CONTEXT);
    input.push(0);
    input.extend_from_slice(challenge.as_bytes());
    input
}

/// `GET /v1/info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Info {
    pub version: String,
    pub uptime_ms: u64,
    /// The daemon's own pid (1 when it is the sandbox's init).
    pub pid: u32,
    /// Background processes still running.
    pub processes_running: usize,
    /// Background processes the daemon still remembers (running or exited).
    pub processes: usize,
    pub sessions: usize,
    /// The lease period, when a lease is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// Time left before the lease lapses and the daemon kills everything and exits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_remaining_ms: Option<u64>,
    /// Summed CPU of every command the daemon has run and reaped so far (with what they waited
    /// for), and the largest peak RSS among them: `getrusage(RUSAGE_CHILDREN)`. Commands still
    /// running are not in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub children_usage: Option<Usage>,
}

/// `POST /v1/keepalive`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Keepalive {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_remaining_ms: Option<u64>,
}

/// What to run: exactly one of `argv` (run directly, no shell) or `command` (a shell string run
/// by the daemon's shell, `/bin/sh -c` unless configured otherwise).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Added to (and overriding) the sandbox's default environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Absolute working directory; the daemon's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// A user name (looked up in the image's `/etc/passwd`) or `uid[:gid]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Text written to the command's stdin, which is then closed. Without it stdin is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Kill the whole process tree after this long; the partial output is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Keep at most this many bytes of each of stdout and stderr.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
    /// Give stdout and stderr one pipe, so that they interleave as a terminal shows them, in the
    /// order written: all of it is reported as stdout, and stderr is empty.
    #[serde(default, skip_serializing_if = "is_false")]
    pub merge_output: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The size of a pseudo-terminal, in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    /// 1 to 1000.
    pub rows: u16,
    /// 1 to 1000.
    pub cols: u16,
}

impl PtySize {
    /// Largest rows or cols accepted.
    pub const MAX: u16 = 1000;

    /// Refuses a size outside `1..=MAX`, naming it.
    pub fn check(&self) -> Result<(), String> {
        if (1..=Self::MAX).contains(&self.rows) && (1..=Self::MAX).contains(&self.cols) {
            Ok(())
        } else {
            Err(format!("a terminal of {} rows and {} cols is out of range (1 to {})", self.rows, self.cols, Self::MAX))
        }
    }
}

/// `POST /v1/processes/{id}/resize`: the new size of a process's terminal.
pub type ResizeRequest = PtySize;

/// Query of `POST /v1/processes/{id}/stdin` when its body is raw bytes
/// (`Content-Type: application/octet-stream`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct StdinQuery {
    /// Close stdin after writing (for a terminal: send end-of-file, Ctrl-D).
    #[serde(default)]
    pub close: bool,
}

/// Resource usage of a finished process tree, from `wait4`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Usage {
    pub cpu_user_ms: u64,
    pub cpu_system_ms: u64,
    /// Peak resident set of the largest process waited for, in KiB.
    pub max_rss_kib: u64,
}

/// How a process ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExitStatus {
    /// The exit code, when the process exited by itself.
    pub exit_code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    /// True when the daemon killed it for exceeding `timeout_ms`.
    pub timed_out: bool,
    pub duration_ms: u64,
    pub usage: Usage,
}

/// `POST /v1/exec`: the result of a command run to completion.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExecResult {
    #[serde(flatten)]
    pub status: ExitStatus,
    /// Output as UTF-8; invalid sequences are replaced with U+FFFD.
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

/// One line of `POST /v1/exec/stream` (NDJSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ExecEvent {
    Started {
        pid: u32,
    },
    Stdout {
        data: String,
    },
    Stderr {
        data: String,
    },
    /// Sent while nothing else is, so that idle connections stay open through proxies.
    Keepalive,
    Exit {
        #[serde(flatten)]
        status: ExitStatus,
        stdout_truncated: bool,
        stderr_truncated: bool,
    },
}

/// `POST /v1/processes`: start a background process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StartProcess {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// A client-chosen name, unique among the daemon's processes, usable wherever an id is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Give the process a stdin pipe (written with `/stdin`); otherwise stdin is `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
    /// Bytes of each output stream kept for reading; older bytes are dropped and counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retain_bytes: Option<u64>,
    /// Kill the process tree after this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// One pipe for stdout and stderr, reported as stdout, in the order written.
    #[serde(default, skip_serializing_if = "is_false")]
    pub merge_output: bool,
    /// Run the process on a new pseudo-terminal of this size, as its controlling terminal and
    /// its stdin, stdout and stderr: its output is one stream (`stdout`), its input is written
    /// with `/stdin` (always open), and `/resize` changes the size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    Running,
    Exited,
}

/// A background process, running or exited (its exit status is kept until it is deleted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessInfo {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    pub pid: u32,
    pub argv: Vec<String>,
    pub state: ProcessState,
    /// Milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// Present once the process has exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitStatus>,
    /// Total bytes written to each stream so far (including dropped ones).
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub stdin_open: bool,
    /// The terminal's size, for a process started with `pty`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

/// `GET /v1/processes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// Which output stream of a process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum StreamName {
    #[default]
    Stdout,
    Stderr,
}

/// Query of `GET /v1/processes/{id}/output`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    /// Byte offset in the stream to start from (0 = the first byte ever written).
    #[serde(default)]
    pub offset: u64,
    #[serde(default)]
    pub stream: StreamName,
    /// Stream NDJSON [`OutputEvent`]s as output arrives, until the process exits.
    #[serde(default)]
    pub follow: bool,
    /// At most this many bytes in one answer (not following).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

/// `GET /v1/processes/{id}/output` without `follow`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutputChunk {
    pub stream: StreamName,
    /// Where `data` starts: the requested offset, or later when bytes there were dropped.
    pub offset: u64,
    /// The offset to ask for next.
    pub next_offset: u64,
    /// Bytes between the requested offset and `offset` that retention dropped.
    pub dropped: u64,
    pub data: String,
    /// True when the process has exited and no byte follows `next_offset`.
    pub eof: bool,
}

/// One line of a followed output stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum OutputEvent {
    /// Output: `data` is the bytes from `offset` up to `next_offset`, as UTF-8 (bytes that are
    /// not UTF-8 become U+FFFD, so the text's length says nothing of theirs). A follow resumed
    /// at `next_offset` goes on with the next byte; a character is never split between events.
    Data {
        offset: u64,
        next_offset: u64,
        data: String,
    },
    /// Bytes dropped by retention before the client could read them.
    Dropped {
        offset: u64,
        bytes: u64,
    },
    Keepalive,
    Exit {
        #[serde(flatten)]
        status: ExitStatus,
        next_offset: u64,
    },
}

/// `POST /v1/processes/{id}/stdin`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StdinWrite {
    #[serde(default)]
    pub data: String,
    /// Close stdin after writing.
    #[serde(default)]
    pub close: bool,
}

/// `POST /v1/processes/{id}/signal`: a name (`TERM`, `SIGTERM`) or a number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub signal: SignalSpec,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum SignalSpec {
    Number(i32),
    Name(String),
}

/// `POST /v1/processes/{id}/wait`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WaitRequest {
    /// Give up after this long and answer with the process still running (default 30 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// `POST /v1/sessions`: start a persistent shell.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// The shell to run (default: the daemon's shell, `/bin/sh`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionInfo {
    pub id: String,
    pub shell: String,
    pub pid: u32,
    /// False once the shell has died (it exited, or a run was killed).
    pub alive: bool,
}

/// `GET /v1/sessions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
}

/// `POST /v1/sessions/{id}/run`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SessionRun {
    pub command: String,
    /// Interrupt the command after this long (SIGINT, then SIGKILL to what it started); the
    /// shell stays, with its cwd and environment, and the run answers `timed_out`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
    /// The command's stderr goes to its stdout (one pipe, order kept); `stderr` is empty.
    #[serde(default, skip_serializing_if = "is_false")]
    pub merge_output: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionRunResult {
    /// The command's status (`$?`); absent when the session died before it finished.
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub timed_out: bool,
    pub duration_ms: u64,
}

/// Query of `GET /v1/files`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct ReadFileQuery {
    pub path: String,
    #[serde(default)]
    pub offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
}

/// Query of `PUT /v1/files`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct WriteFileQuery {
    pub path: String,
    /// Octal permission mode (default 0644); missing parents are created 0755.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Who owns the file and the parents created for it (`name`, `uid`, `uid:gid` or
    /// `name:group`, as a command's `user`): that user's uid and gid (the daemon's by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Make the write durable before answering: the file and its directory are `fsync`ed. Off by
    /// default: a write is atomic either way (readers see the old contents or the new, never a
    /// part), and an ephemeral sandbox seldom needs its files to outlive a crash of the host.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fsync: bool,
}

/// Query naming one path (`GET /v1/stat`, `GET /v1/archive`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    pub path: String,
}

/// Query of `GET /v1/dir`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct ListDirQuery {
    pub path: String,
    /// How deep to descend: 1 lists the directory itself (default 1, at most 64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
}

/// Query of `POST /v1/dir` (mkdir -p).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct MkdirQuery {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Who owns the directories created, as `PUT /v1/files`'s `user`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// Query of `PUT /v1/archive`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct ExtractQuery {
    /// The directory to unpack into, created if missing.
    pub path: String,
    /// Who owns what the extraction creates (the tar's own owners are not kept), as
    /// `PUT /v1/files`'s `user`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Make what the extraction wrote durable before answering (one `syncfs` of the file system
    /// it wrote to). Off by default, as for `PUT /v1/files`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fsync: bool,
}

/// Query of `DELETE /v1/files`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
}

/// `POST /v1/move`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    pub from: String,
    pub to: String,
    /// Replace `to` when it exists (default: refuse with `conflict`).
    #[serde(default)]
    pub overwrite: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// Metadata of one path (symlinks are described, not followed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileStat {
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`0o7777` mask).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Milliseconds since the Unix epoch.
    pub mtime_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

/// `GET /v1/dir`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DirListing {
    pub path: String,
    /// Entries in depth-first order, `path` absolute.
    pub entries: Vec<FileStat>,
    /// True when the listing stopped at the entry limit.
    pub truncated: bool,
}

/// `PUT /v1/archive`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExtractResult {
    pub path: String,
    pub entries: u64,
    /// Bytes of file content written.
    pub bytes: u64,
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_writes_temporary_file_is_told_from_other_names() {
        assert!(is_write_in_progress(".new.txt.sandman-11b1a7542c3e6bc3c0083e1241c804e7"));
        assert!(!is_write_in_progress("new.txt"));
        assert!(!is_write_in_progress(".new.txt.sandman-notes"));
        assert!(!is_write_in_progress("x.sandman-11b1a7542c3e6bc3c0083e1241c804e7"));
    }

    use super::*;

    #[test]
    fn exec_request_refuses_unknown_fields_naming_them() {
        let err = serde_json::from_str::<ExecRequest>(r#"{"argv":["true"],"timeout":5}"#)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("unknown field `timeout`"), "{err}");
    }

    #[test]
    fn exec_events_are_tagged_by_event() {
        let exit = ExecEvent::Exit {
            status: ExitStatus { exit_code: Some(0), ..ExitStatus::default() },
            stdout_truncated: false,
            stderr_truncated: false,
        };
        let v = serde_json::to_value(&exit).unwrap_or_default();
        assert_eq!(v["event"], "exit");
        assert_eq!(v["exit_code"], 0);
        let v = serde_json::to_value(ExecEvent::Stdout { data: "hi".into() }).unwrap_or_default();
        assert_eq!(v, serde_json::json!({"event": "stdout", "data": "hi"}));
    }

    #[test]
    fn exec_result_flattens_its_status() {
        let r = ExecResult { stdout: "x".into(), ..ExecResult::default() };
        let v = serde_json::to_value(&r).unwrap_or_default();
        assert!(v.get("exit_code").is_some() && v.get("usage").is_some() && v.get("status").is_none());
        let back: ExecResult = serde_json::from_value(v).unwrap_or_default();
        assert_eq!(back, r);
    }

    #[test]
    fn signals_are_names_or_numbers() {
        let n: SignalRequest =
            serde_json::from_str(r#"{"signal":15}"#).unwrap_or(SignalRequest { signal: SignalSpec::Number(0) });
        assert_eq!(n.signal, SignalSpec::Number(15));
        let s: SignalRequest =
            serde_json::from_str(r#"{"signal":"TERM"}"#).unwrap_or(SignalRequest { signal: SignalSpec::Number(0) });
        assert_eq!(s.signal, SignalSpec::Name("TERM".into()));
    }
}

/// `GET /v1/conditions`: what the daemon observes from inside the sandbox. Limits are `None`
/// when none is set (or none could be read).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Observed {
    pub daemon_version: String,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel: String,
    /// The first `model name` of `/proc/cpuinfo`.
    pub cpu_model: String,
    /// CPUs this process may run on.
    pub cpus_available: usize,
    /// cgroup cpu quota in cores (`cpu.max`, or `cpu.cfs_quota_us / cpu.cfs_period_us`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_cpu_limit: Option<f64>,
    /// cgroup memory limit in bytes (`memory.max` or `memory.limit_in_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_memory_limit: Option<u64>,
    /// cgroup swap limit in bytes beyond memory (`memory.swap.max`, or v1's
    /// `memory.memsw.limit_in_bytes - memory.limit_in_bytes`); 0 when the host has no swap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_swap_limit: Option<u64>,
    /// cgroup process limit (`pids.max`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_pids_limit: Option<u64>,
    /// Limits the daemon sets on every process it starts (`--rlimit-*`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimit_as: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimit_fsize: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimit_nofile: Option<u64>,
    /// Network interfaces from `/proc/net/dev`, sorted.
    pub network_interfaces: Vec<String>,
    /// `TZ` of the commands' environment, else the target of `/etc/localtime`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// `LC_ALL`, else `LANG`, of the commands' environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locale: Option<String>,
    pub hostname: String,
    /// True when the daemon is PID 1 of its pid namespace.
    pub pid1: bool,
}
