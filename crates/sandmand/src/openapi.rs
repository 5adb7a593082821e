//! The OpenAPI description of the daemon API, generated from the wire types. The committed copy
//! in `docs/api/daemon.openapi.json` is kept in step with it by a test, and the route table of
//! [`crate::api::ROUTES`] is checked against both.

#![allow(dead_code)]

use sandman_wire::daemon::*;
use sandman_wire::{ErrorBody, ErrorCode, ErrorDetail};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "sandmand", description = "Sandman's in-sandbox daemon API. Every call but health needs `Authorization: Bearer <token>`; every error is an ErrorBody."),
    paths(
        health, info, keepalive, conditions, exec, exec_stream,
        process_start, process_list, process_status, process_delete, process_output, process_stdin,
        process_signal, process_wait, process_resize,
        session_create, session_list, session_run, session_interrupt, session_delete,
        file_read, file_write, file_remove, stat, dir_list, dir_make, move_path, archive_put, archive_get, port,
    ),
    components(schemas(ErrorBody, ErrorDetail, ErrorCode, ExecEvent, OutputEvent)),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
#[derive(Debug)]
pub struct DaemonApi;

#[derive(Debug)]
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The description as pretty JSON, as committed.
pub fn json() -> String {
    let mut doc = DaemonApi::openapi();
    doc.info.version = crate::api::VERSION.to_string();
    doc.to_pretty_json().unwrap_or_default()
}

#[utoipa::path(get, path = "/v1/health", security(()), params(HealthQuery), responses((status = 200, body = Health), (status = 400, body = ErrorBody),
    (status = 403, description = "a challenge from a process of the sandbox itself, when the daemon is its init on a Unix socket: no proof is given inside", body = ErrorBody)))]
fn health() {}
#[utoipa::path(get, path = "/v1/info", responses((status = 200, body = Info), (status = 401, body = ErrorBody)))]
fn info() {}
#[utoipa::path(post, path = "/v1/keepalive", responses((status = 200, body = Keepalive), (status = 401, body = ErrorBody)))]
fn keepalive() {}
#[utoipa::path(get, path = "/v1/conditions", responses((status = 200, body = Observed), (status = 401, body = ErrorBody)))]
fn conditions() {}
#[utoipa::path(post, path = "/v1/exec", request_body = ExecRequest,
    responses((status = 200, body = ExecResult), (status = 400, body = ErrorBody), (status = 413, body = ErrorBody)))]
fn exec() {}
#[utoipa::path(post, path = "/v1/exec/stream", request_body = ExecRequest,
    responses((status = 200, description = "NDJSON, one ExecEvent a line", content_type = "application/x-ndjson", body = ExecEvent), (status = 400, body = ErrorBody)))]
fn exec_stream() {}
#[utoipa::path(post, path = "/v1/processes", request_body = StartProcess,
    responses((status = 201, body = ProcessInfo), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
fn process_start() {}
#[utoipa::path(get, path = "/v1/processes", responses((status = 200, body = ProcessList)))]
fn process_list() {}
#[utoipa::path(get, path = "/v1/processes/{id}", params(("id" = String, Path, description = "process id or tag")),
    responses((status = 200, body = ProcessInfo), (status = 404, body = ErrorBody)))]
fn process_status() {}
#[utoipa::path(delete, path = "/v1/processes/{id}", params(("id" = String, Path, description = "process id or tag")),
    responses((status = 204, description = "killed (the whole tree) and forgotten"), (status = 404, body = ErrorBody)))]
fn process_delete() {}
#[utoipa::path(get, path = "/v1/processes/{id}/output", params(("id" = String, Path, description = "process id or tag"), OutputQuery),
    responses((status = 200, description = "an OutputChunk, or with follow=true NDJSON OutputEvents", body = OutputChunk), (status = 404, body = ErrorBody)))]
fn process_output() {}
#[utoipa::path(post, path = "/v1/processes/{id}/stdin", params(("id" = String, Path, description = "process id or tag"), StdinQuery),
    request_body(description = "a JSON StdinWrite, or raw bytes as application/octet-stream (then `close` is a query parameter); on a terminal, `close` sends Ctrl-D",
        content((StdinWrite = "application/json"), (Vec<u8> = "application/octet-stream"))),
    responses((status = 200, body = ProcessInfo), (status = 409, body = ErrorBody)))]
fn process_stdin() {}
#[utoipa::path(post, path = "/v1/processes/{id}/resize", params(("id" = String, Path, description = "process id or tag")), request_body = PtySize,
    responses((status = 200, body = ProcessInfo), (status = 400, body = ErrorBody), (status = 409, description = "the process has no terminal, or has exited", body = ErrorBody)))]
fn process_resize() {}
#[utoipa::path(post, path = "/v1/processes/{id}/signal", params(("id" = String, Path, description = "process id or tag")), request_body = SignalRequest,
    responses((status = 200, body = ProcessInfo), (status = 409, body = ErrorBody)))]
fn process_signal() {}
#[utoipa::path(post, path = "/v1/processes/{id}/wait", params(("id" = String, Path, description = "process id or tag")), request_body = WaitRequest,
    responses((status = 200, description = "the process, exited or still running at the timeout", body = ProcessInfo)))]
fn process_wait() {}
#[utoipa::path(post, path = "/v1/sessions", request_body = CreateSession,
    responses((status = 201, body = SessionInfo), (status = 400, body = ErrorBody)))]
fn session_create() {}
#[utoipa::path(get, path = "/v1/sessions", responses((status = 200, body = SessionList)))]
fn session_list() {}
#[utoipa::path(post, path = "/v1/sessions/{id}/run", params(("id" = String, Path)), request_body = SessionRun,
    responses((status = 200, body = SessionRunResult), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
fn session_run() {}
#[utoipa::path(post, path = "/v1/sessions/{id}/interrupt", params(("id" = String, Path)),
    responses((status = 204, description = "SIGINT sent to the running command"), (status = 404, body = ErrorBody)))]
fn session_interrupt() {}
#[utoipa::path(delete, path = "/v1/sessions/{id}", params(("id" = String, Path)),
    responses((status = 204, description = "the shell and its children killed"), (status = 404, body = ErrorBody)))]
fn session_delete() {}
#[utoipa::path(get, path = "/v1/files", params(ReadFileQuery),
    responses((status = 200, description = "the bytes", content_type = "application/octet-stream", body = Vec<u8>), (status = 404, body = ErrorBody)))]
fn file_read() {}
#[utoipa::path(put, path = "/v1/files", params(WriteFileQuery), request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = FileStat), (status = 413, body = ErrorBody)))]
fn file_write() {}
#[utoipa::path(delete, path = "/v1/files", params(RemoveQuery),
    responses((status = 204, description = "removed"), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
fn file_remove() {}
#[utoipa::path(get, path = "/v1/stat", params(PathQuery), responses((status = 200, body = FileStat), (status = 404, body = ErrorBody)))]
fn stat() {}
#[utoipa::path(get, path = "/v1/dir", params(ListDirQuery), responses((status = 200, body = DirListing), (status = 404, body = ErrorBody)))]
fn dir_list() {}
#[utoipa::path(post, path = "/v1/dir", params(MkdirQuery), responses((status = 200, body = FileStat), (status = 409, body = ErrorBody)))]
fn dir_make() {}
#[utoipa::path(post, path = "/v1/move", request_body = MoveRequest, responses((status = 200, body = FileStat), (status = 409, body = ErrorBody)))]
fn move_path() {}
#[utoipa::path(put, path = "/v1/archive", params(ExtractQuery), request_body(content = Vec<u8>, content_type = "application/x-tar", description = "a tar, optionally gzipped"),
    responses((status = 200, body = ExtractResult), (status = 400, body = ErrorBody), (status = 413, body = ErrorBody)))]
fn archive_put() {}
#[utoipa::path(get, path = "/v1/archive", params(PathQuery),
    responses((status = 200, description = "a tar of the directory (or file)", content_type = "application/x-tar", body = Vec<u8>), (status = 404, body = ErrorBody)))]
fn archive_get() {}
#[utoipa::path(method(get, post, put, patch, delete), path = "/v1/ports/{port}/{path}",
    params(("port" = u16, Path, description = "a port inside the sandbox, 1 to 65535"), ("path" = String, Path, description = "the path on the app, with the query passed on")),
    description = "HTTP to `127.0.0.1:{port}` inside the sandbox, any method (HEAD and OPTIONS too), bodies streamed; a WebSocket or any HTTP/1.1 upgrade is spliced through after the app's 101. `Authorization` is not passed on; `Host` is `127.0.0.1:{port}`.",
    responses((status = 200, description = "the app's answer, whatever it is"), (status = 400, body = ErrorBody), (status = 503, description = "nothing answers on that port", body = ErrorBody)))]
fn port() {}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// Where the committed description lives, relative to this crate.
    const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api/daemon.openapi.json");

    #[test]
    fn description_covers_exactly_the_route_table() {
        let doc: serde_json::Value = serde_json::from_str(&super::json()).unwrap_or_default();
        let mut described = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().into_iter().flatten() {
            for method in item.as_object().into_iter().flatten().map(|(m, _)| m.to_uppercase()) {
                described.insert((method, path.clone()));
            }
        }
        let served: BTreeSet<(String, String)> =
            crate::api::ROUTES.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
        assert_eq!(described, served);
    }

    /// Regenerate with `SANDMAN_UPDATE_OPENAPI=1 cargo test -p sandmand --features openapi openapi`.
    #[test]
    fn committed_description_is_current() {
        let fresh = super::json() + "\n";
        if std::env::var_os("SANDMAN_UPDATE_OPENAPI").is_some() {
            std::fs::write(COMMITTED, &fresh).unwrap_or_else(|e| panic!("cannot write {COMMITTED}: {e}"));
        }
        let committed = std::fs::read_to_string(COMMITTED).unwrap_or_default();
        assert!(
            committed == fresh,
            "docs/api/daemon.openapi.json is out of date; run SANDMAN_UPDATE_OPENAPI=1 cargo test -p sandmand --features openapi openapi"
        );
    }
}
