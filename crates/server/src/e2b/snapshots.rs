//! E2B's snapshots and forks mapped onto Sandman's (`docs/snapshots.md`): a filesystem
//! snapshot (`create_snapshot()`, `POST /sandboxes/{id}/snapshots`) is a Sandman snapshot, whose
//! id is the template a create names (`Sandbox.create(snapshot_id)`); `list_snapshots()` is
//! `GET /snapshots`, `delete_snapshot()` `DELETE /templates/{id}`, and `fork()` `POST
//! /sandboxes/{id}/fork`, each child answered on its own. Memory is never kept: a snapshot that
//! asks for it (`memory: true`) is refused, and a fork's children start with the files only.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use http::StatusCode;
use sandman_wire::snapshots::{CreateSnapshot, ForkRequest, Snapshot};
use serde::Deserialize;

use super::E2b;
use super::control::{ControlError, MAX_TIMEOUT_S, created, live, template_of};

/// E2B's most forks in one call.
const MAX_FORKS: u64 = 20;

pub fn routes() -> Router<Arc<E2b>> {
    Router::new()
        .route("/sandboxes/{id}/snapshots", post(take))
        .route("/snapshots", get(list))
        .route("/templates/{id}", delete(remove).fallback(super::control::unsupported))
        .route("/sandboxes/{id}/fork", post(fork))
}

#[derive(Debug, Default, Deserialize)]
struct SnapshotBody {
    name: Option<String>,
    memory: Option<bool>,
}

fn info(s: &Snapshot) -> serde_json::Value {
    let mut names = vec![s.id.clone()];
    names.extend(s.name.clone());
    serde_json::json!({"snapshotID": s.id, "names": names})
}

fn body_of<T: Default + for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ControlError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ControlError::invalid(format!("bad request: {e}")))
}

async fn take(State(e2b): State<Arc<E2b>>, Path(id): Path<String>, body: bytes::Bytes) -> Response {
    let result = async {
        let body: SnapshotBody = body_of(&body)?;
        if body.memory == Some(true) {
            return Err(ControlError::invalid(
                "memory snapshots are not supported by Sandman: a snapshot holds the sandbox's files only (mode=\"filesystem\")",
            ));
        }
        live(&e2b, &id)?;
        let snapshot = e2b.service.take_snapshot(&id, CreateSnapshot { name: body.name, paths: Vec::new() }).await?;
        Ok::<_, ControlError>(info(&snapshot))
    };
    match result.await {
        Ok(v) => (StatusCode::CREATED, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListParams {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<usize>,
    #[allow(dead_code)]
    next_token: Option<String>,
}

async fn list(State(e2b): State<Arc<E2b>>, Query(q): Query<ListParams>) -> Json<Vec<serde_json::Value>> {
    let limit = q.limit.unwrap_or(super::control::MAX_PAGE).clamp(1, super::control::MAX_PAGE);
    let found = e2b
        .service
        .snapshot_list(None, q.sandbox_id.as_deref())
        .into_iter()
        .filter(|s| q.name.as_deref().is_none_or(|n| s.id == n || s.name.as_deref() == Some(n)))
        .take(limit)
        .map(|s| info(&s))
        .collect();
    Json(found)
}

/// Only snapshots are templates here: another id is not found.
async fn remove(State(e2b): State<Arc<E2b>>, Path(id): Path<String>) -> Result<StatusCode, ControlError> {
    e2b.service.delete_snapshot(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u64>,
}

async fn fork(State(e2b): State<Arc<E2b>>, Path(id): Path<String>, body: bytes::Bytes) -> Response {
    let result = async {
        let body: ForkBody = body_of(&body)?;
        let count = body.count.unwrap_or(1);
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(ControlError::invalid(format!("`count` is {count}; it must be between 1 and {MAX_FORKS}")));
        }
        let ttl = match body.timeout {
            Some(t) if (1..=MAX_TIMEOUT_S).contains(&t) => Some(t),
            Some(t) => {
                return Err(ControlError::invalid(format!(
                    "`timeout` is {t}; it must be between 1 and {MAX_TIMEOUT_S} seconds (a day)"
                )));
            }
            None => Some(super::control::DEFAULT_TIMEOUT_S),
        };
        let source = live(&e2b, &id)?;
        let template = template_of(&source);
        let forked =
            e2b.service.fork(&id, ForkRequest { count, ttl_s: ttl, wait: true, ..ForkRequest::default() }).await?;
        let token = &e2b.service.token;
        let children: Vec<serde_json::Value> =
            forked.sandboxes.iter().map(|sb| serde_json::json!({"sandbox": created(token, sb, &template)})).collect();
        Ok::<_, ControlError>(children)
    };
    match result.await {
        Ok(v) => (StatusCode::CREATED, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}
