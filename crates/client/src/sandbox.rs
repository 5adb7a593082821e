//! The daemon's calls on one sandbox, proxied by the server under `/v1/sandboxes/{id}/…` with
//! the daemon's own request and answer types: exec, processes, sessions, files and archives.

use bytes::Bytes;
use http::Method;
use sandman_wire::daemon::{
    CreateSession, DirListing, ExecEvent, ExecRequest, ExecResult, ExtractQuery, ExtractResult, FileStat, Info,
    ListDirQuery, MkdirQuery, MoveRequest, OutputChunk, OutputEvent, OutputQuery, PathQuery, ProcessInfo, ProcessList,
    PtySize, ReadFileQuery, RemoveQuery, SessionInfo, SessionRun, SessionRunResult, SignalRequest, StartProcess,
    StdinQuery, StdinWrite, WaitRequest, WriteFileQuery,
};

use crate::body::{ByteStream, NdjsonStream, UploadBody};
use crate::client::{Client, Req, sandbox_path, segment};
use crate::error::ClientError;

/// `/v1/sandboxes/{id}/processes/{process}{rest}`.
fn process_path(id: &str, process: &str, rest: &str) -> String {
    sandbox_path(id, &format!("/processes/{}{rest}", segment(process)))
}

/// `/v1/sandboxes/{id}/sessions/{session}{rest}`.
fn session_path(id: &str, session: &str, rest: &str) -> String {
    sandbox_path(id, &format!("/sessions/{}{rest}", segment(session)))
}

/// A permission mode as the daemon reads it: octal digits.
fn octal(mode: Option<u32>) -> Option<String> {
    mode.map(|m| format!("{m:o}"))
}

impl Client {
    /// `GET /v1/info` of the sandbox's daemon: version, uptime, process counts, lease left.
    pub async fn info(&self, id: &str) -> Result<Info, ClientError> {
        self.json(Req::new(Method::GET, sandbox_path(id, "/info"))).await
    }

    // ---- exec ----

    /// `POST /v1/exec`: run a command to completion and answer its output and status.
    pub async fn exec(&self, id: &str, req: &ExecRequest) -> Result<ExecResult, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/exec")).json(req)?).await
    }

    /// `POST /v1/exec/stream`: run a command, its output streamed as `started`, `stdout`,
    /// `stderr` and a last `exit` event (keep-alives are consumed). Dropping the stream before
    /// `exit` kills the command's process tree. A stream that ends without `exit` means the
    /// connection or the sandbox went away.
    pub async fn exec_stream(&self, id: &str, req: &ExecRequest) -> Result<NdjsonStream<ExecEvent>, ClientError> {
        self.ndjson(Req::new(Method::POST, sandbox_path(id, "/exec/stream")).json(req)?, |line| {
            Ok(match serde_json::from_slice(line)? {
                ExecEvent::Keepalive => None,
                event => Some(event),
            })
        })
        .await
    }

    // ---- background processes (addressed by id or tag) ----

    /// `POST /v1/processes`: start a background process.
    pub async fn start_process(&self, id: &str, req: &StartProcess) -> Result<ProcessInfo, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/processes")).json(req)?).await
    }

    /// `GET /v1/processes`: every process the daemon remembers, running or exited.
    pub async fn list_processes(&self, id: &str) -> Result<Vec<ProcessInfo>, ClientError> {
        let list: ProcessList = self.json(Req::new(Method::GET, sandbox_path(id, "/processes"))).await?;
        Ok(list.processes)
    }

    /// `GET /v1/processes/{process}`: one process's status (its exit, once exited).
    pub async fn process(&self, id: &str, process: &str) -> Result<ProcessInfo, ClientError> {
        self.json(Req::new(Method::GET, process_path(id, process, ""))).await
    }

    /// `GET /v1/processes/{process}/output`: output from `query.offset` (`follow` is ignored).
    pub async fn process_output(
        &self,
        id: &str,
        process: &str,
        query: &OutputQuery,
    ) -> Result<OutputChunk, ClientError> {
        let query = OutputQuery { follow: false, ..query.clone() };
        self.json(Req::new(Method::GET, process_path(id, process, "/output")).query(&query)?).await
    }

    /// `GET /v1/processes/{process}/output?follow=true`: `data` and `dropped` events as output
    /// arrives, then `exit` (keep-alives are consumed).
    pub async fn follow_output(
        &self,
        id: &str,
        process: &str,
        query: &OutputQuery,
    ) -> Result<NdjsonStream<OutputEvent>, ClientError> {
        let query = OutputQuery { follow: true, ..query.clone() };
        self.ndjson(Req::new(Method::GET, process_path(id, process, "/output")).query(&query)?, |line| {
            Ok(match serde_json::from_slice(line)? {
                OutputEvent::Keepalive => None,
                event => Some(event),
            })
        })
        .await
    }

    /// Follows a process's output from `query.offset` as [`Client::follow_output`] does, and
    /// when the stream breaks before the process's `exit` (the connection dropped, the server
    /// restarted), opens it again where the last event ended: no byte is repeated or lost but
    /// those retention dropped meanwhile (reported as a `dropped` event). See [`OutputFollow`].
    pub fn follow_output_resuming(&self, id: &str, process: &str, query: &OutputQuery) -> OutputFollow {
        OutputFollow {
            client: self.clone(),
            id: id.to_owned(),
            process: process.to_owned(),
            query: OutputQuery { follow: true, ..query.clone() },
            stream: None,
            failures: 0,
            done: false,
        }
    }

    /// `POST /v1/processes/{process}/stdin`: write to (and maybe close) the process's stdin.
    pub async fn write_stdin(&self, id: &str, process: &str, req: &StdinWrite) -> Result<ProcessInfo, ClientError> {
        self.json(Req::new(Method::POST, process_path(id, process, "/stdin")).json(req)?).await
    }

    /// `POST /v1/processes/{process}/stdin` with raw bytes (`application/octet-stream`): any byte
    /// gets through (keystrokes for a terminal). `close` closes stdin after them; on a terminal it
    /// sends Ctrl-D.
    pub async fn write_stdin_bytes(
        &self,
        id: &str,
        process: &str,
        data: Bytes,
        close: bool,
    ) -> Result<ProcessInfo, ClientError> {
        let query = StdinQuery { close };
        self.json(Req::new(Method::POST, process_path(id, process, "/stdin")).query(&query)?.upload(data.into())).await
    }

    /// `POST /v1/processes/{process}/resize`: the new size of the process's terminal.
    pub async fn resize(&self, id: &str, process: &str, size: PtySize) -> Result<ProcessInfo, ClientError> {
        self.json(Req::new(Method::POST, process_path(id, process, "/resize")).json(&size)?.idempotent()).await
    }

    /// The URL of `127.0.0.1:{port}/{path}` inside the sandbox, through the server
    /// (`/v1/sandboxes/{id}/ports/{port}/{path}`): HTTP and WebSocket, with this client's token
    /// in `Authorization`.
    pub fn port_url(&self, id: &str, port: u16, path: &str) -> String {
        format!("{}{}", self.base_url(), sandbox_path(id, &format!("/ports/{port}/{}", path.trim_start_matches('/'))))
    }

    /// `POST /v1/processes/{process}/signal`: signal the process group.
    pub async fn signal(&self, id: &str, process: &str, req: &SignalRequest) -> Result<ProcessInfo, ClientError> {
        self.json(Req::new(Method::POST, process_path(id, process, "/signal")).json(req)?).await
    }

    /// `POST /v1/processes/{process}/wait`: the process once exited, or still running when the
    /// wait's timeout passes first.
    pub async fn wait(&self, id: &str, process: &str, req: &WaitRequest) -> Result<ProcessInfo, ClientError> {
        self.json(Req::new(Method::POST, process_path(id, process, "/wait")).json(req)?.idempotent()).await
    }

    /// `DELETE /v1/processes/{process}`: kill the process tree and forget it.
    pub async fn kill_process(&self, id: &str, process: &str) -> Result<(), ClientError> {
        self.unit(Req::new(Method::DELETE, process_path(id, process, ""))).await
    }

    // ---- sessions ----

    /// `POST /v1/sessions`: start a persistent shell.
    pub async fn create_session(&self, id: &str, req: &CreateSession) -> Result<SessionInfo, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/sessions")).json(req)?).await
    }

    /// `GET /v1/sessions`.
    pub async fn list_sessions(&self, id: &str) -> Result<Vec<SessionInfo>, ClientError> {
        let list: sandman_wire::daemon::SessionList =
            self.json(Req::new(Method::GET, sandbox_path(id, "/sessions"))).await?;
        Ok(list.sessions)
    }

    /// `POST /v1/sessions/{session}/run`: run a command in the session's shell.
    pub async fn run_session(
        &self,
        id: &str,
        session: &str,
        req: &SessionRun,
    ) -> Result<SessionRunResult, ClientError> {
        self.json(Req::new(Method::POST, session_path(id, session, "/run")).json(req)?).await
    }

    /// `POST /v1/sessions/{session}/interrupt`: SIGINT the running command.
    pub async fn interrupt_session(&self, id: &str, session: &str) -> Result<(), ClientError> {
        self.unit(Req::new(Method::POST, session_path(id, session, "/interrupt"))).await
    }

    /// `DELETE /v1/sessions/{session}`: end the session.
    pub async fn delete_session(&self, id: &str, session: &str) -> Result<(), ClientError> {
        self.unit(Req::new(Method::DELETE, session_path(id, session, ""))).await
    }

    // ---- files ----

    /// `GET /v1/files`: `length` bytes (all, when `None`) of the file at `path` from `offset`.
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> Result<Bytes, ClientError> {
        self.bytes(read_req(id, path, offset, length)?).await
    }

    /// [`Client::read_file`] as a stream of chunks, for files too large to hold.
    pub async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> Result<ByteStream, ClientError> {
        self.stream(read_req(id, path, offset, length)?).await
    }

    /// `PUT /v1/files`: write `body` to `path` atomically, creating parents; `mode` defaults to
    /// 0644. A streamed body is sent as it is read.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: impl Into<UploadBody>,
    ) -> Result<FileStat, ClientError> {
        let query = WriteFileQuery { path: path.to_owned(), mode: octal(mode), user: None, fsync: false };
        self.write_file_with(id, &query, body).await
    }

    /// `PUT /v1/files` with every option of the query: `fsync: true` makes the write durable
    /// before the answer (the file and its directory are synced).
    pub async fn write_file_with(
        &self,
        id: &str,
        query: &WriteFileQuery,
        body: impl Into<UploadBody>,
    ) -> Result<FileStat, ClientError> {
        self.json(Req::new(Method::PUT, sandbox_path(id, "/files")).query(query)?.upload(body.into())).await
    }

    /// `GET /v1/stat`: metadata of `path` (a symlink is described, not followed).
    pub async fn stat(&self, id: &str, path: &str) -> Result<FileStat, ClientError> {
        let query = PathQuery { path: path.to_owned() };
        self.json(Req::new(Method::GET, sandbox_path(id, "/stat")).query(&query)?).await
    }

    /// `GET /v1/dir`: the entries below `path`, `depth` levels deep (default 1).
    pub async fn list_dir(&self, id: &str, path: &str, depth: Option<u32>) -> Result<DirListing, ClientError> {
        let query = ListDirQuery { path: path.to_owned(), depth };
        self.json(Req::new(Method::GET, sandbox_path(id, "/dir")).query(&query)?).await
    }

    /// `POST /v1/dir`: `mkdir -p`.
    pub async fn mkdir(&self, id: &str, path: &str, mode: Option<u32>) -> Result<FileStat, ClientError> {
        let query = MkdirQuery { path: path.to_owned(), mode: octal(mode), user: None };
        self.json(Req::new(Method::POST, sandbox_path(id, "/dir")).query(&query)?.idempotent()).await
    }

    /// `DELETE /v1/files`: remove a file, or a directory (a non-empty one needs `recursive`).
    pub async fn remove(&self, id: &str, path: &str, recursive: bool) -> Result<(), ClientError> {
        let query = RemoveQuery { path: path.to_owned(), recursive };
        self.unit(Req::new(Method::DELETE, sandbox_path(id, "/files")).query(&query)?.once()).await
    }

    /// `POST /v1/move`: rename `from` to `to`.
    pub async fn move_path(&self, id: &str, req: &MoveRequest) -> Result<FileStat, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/move")).json(req)?).await
    }

    // ---- archives ----

    /// `PUT /v1/archive`: extract a tar (gzip detected) into the directory `path`, created if
    /// missing. A streamed body is sent as it is produced.
    pub async fn upload_tar(
        &self,
        id: &str,
        path: &str,
        body: impl Into<UploadBody>,
    ) -> Result<ExtractResult, ClientError> {
        let query = ExtractQuery { path: path.to_owned(), user: None, fsync: false };
        self.upload_tar_with(id, &query, body).await
    }

    /// `PUT /v1/archive` with every option of the query: `fsync: true` makes what it wrote
    /// durable before the answer.
    pub async fn upload_tar_with(
        &self,
        id: &str,
        query: &ExtractQuery,
        body: impl Into<UploadBody>,
    ) -> Result<ExtractResult, ClientError> {
        self.json(Req::new(Method::PUT, sandbox_path(id, "/archive")).query(query)?.upload_tar(body.into())).await
    }

    /// `GET /v1/archive`: the directory `path` as a tar of its contents (a file: a tar of that
    /// one file), streamed.
    pub async fn download_tar(&self, id: &str, path: &str) -> Result<ByteStream, ClientError> {
        let query = PathQuery { path: path.to_owned() };
        self.stream(Req::new(Method::GET, sandbox_path(id, "/archive")).query(&query)?.accept("application/x-tar"))
            .await
    }
}

fn read_req(id: &str, path: &str, offset: u64, length: Option<u64>) -> Result<Req, ClientError> {
    let query = ReadFileQuery { path: path.to_owned(), offset, length };
    Ok(Req::new(Method::GET, sandbox_path(id, "/files")).query(&query)?.accept("application/octet-stream"))
}

/// How many times in a row a followed output is opened again without an event coming, before
/// the failure is the caller's.
const FOLLOW_ATTEMPTS: u32 = 5;
/// The wait before the first reopening; it doubles with each failure in a row.
const FOLLOW_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);

/// A process's followed output that survives a broken connection ([`Client::follow_output_resuming`]):
/// it keeps the byte offset where the last event ended (a `data` event's `next_offset`, the end
/// of a `dropped` gap) and, when the stream breaks or ends before `exit`, opens a new one there.
/// After [`FOLLOW_ATTEMPTS`] failures in a row with no event between, the last error is
/// answered; an error answer of the server (the process is not found, the sandbox is gone) is
/// answered at once.
#[derive(Debug)]
pub struct OutputFollow {
    client: Client,
    id: String,
    process: String,
    /// What the next opening asks for; its `offset` is where the last event ended.
    query: OutputQuery,
    stream: Option<NdjsonStream<OutputEvent>>,
    /// Openings in a row that ended with no event.
    failures: u32,
    /// The `exit` event came, or an error was answered.
    done: bool,
}

impl OutputFollow {
    /// Where the output read so far ends: the offset a new follow would start at.
    pub fn offset(&self) -> u64 {
        self.query.offset
    }

    /// The next `data`, `dropped` or `exit` event; `None` after `exit` (or after an error).
    pub async fn next(&mut self) -> Option<Result<OutputEvent, ClientError>> {
        use futures_util::StreamExt;
        while !self.done {
            let stream = match &mut self.stream {
                Some(stream) => stream,
                None => match self.client.follow_output(&self.id, &self.process, &self.query).await {
                    Ok(stream) => self.stream.insert(stream),
                    Err(err) => match self.retry(err).await {
                        Some(err) => return Some(Err(err)),
                        None => continue,
                    },
                },
            };
            let err = match stream.next().await {
                Some(Ok(event)) => {
                    self.failures = 0;
                    match &event {
                        OutputEvent::Data { next_offset, .. } => self.query.offset = *next_offset,
                        OutputEvent::Dropped { offset, bytes } => self.query.offset = offset.saturating_add(*bytes),
                        OutputEvent::Exit { next_offset, .. } => {
                            self.query.offset = *next_offset;
                            self.done = true;
                        }
                        OutputEvent::Keepalive => {}
                    }
                    return Some(Ok(event));
                }
                Some(Err(err)) => err,
                None => ClientError::StreamEnded {
                    call: format!("GET /v1/sandboxes/{}/processes/{}/output", self.id, self.process),
                },
            };
            self.stream = None;
            if let Some(err) = self.retry(err).await {
                return Some(Err(err));
            }
        }
        None
    }

    /// After a failed opening or a broken stream: waits before the next attempt and answers
    /// `None`, or answers the error when it is not worth another attempt.
    async fn retry(&mut self, err: ClientError) -> Option<ClientError> {
        self.failures += 1;
        if !err.is_broken_connection() || self.failures >= FOLLOW_ATTEMPTS {
            self.done = true;
            return Some(err);
        }
        tokio::time::sleep(FOLLOW_BACKOFF * 2u32.pow(self.failures - 1)).await;
        None
    }
}
