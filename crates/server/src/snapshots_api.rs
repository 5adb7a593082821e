//! The HTTP handlers of snapshots and forks (`crate::service` has their logic): merged into
//! the control routes by [`crate::api::router`].

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use sandman_http::extract::{ApiJson, ApiQuery};
use sandman_wire::snapshots::{
    CreateSnapshot, ExportSnapshot, Exported, ForkRequest, Forked, Snapshot, SnapshotList, SnapshotQuery,
};

use crate::error::ServerResult;
use crate::service::Service;

pub fn routes() -> Router<Arc<Service>> {
    Router::new()
        .route("/v1/sandboxes/{id}/snapshots", post(take).get(of_sandbox))
        .route("/v1/sandboxes/{id}/fork", post(fork))
        .route("/v1/snapshots", get(list))
        .route("/v1/snapshots/{snapshot}", get(get_one).delete(delete))
        .route("/v1/snapshots/{snapshot}/export", post(export))
}

/// The body is optional: an empty one takes an unnamed snapshot.
async fn take(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> ServerResult<Json<Snapshot>> {
    let req = if body.iter().all(u8::is_ascii_whitespace) {
        CreateSnapshot::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| crate::error::ServerError::InvalidArgument(format!("{e}")))?
    };
    let snapshot = service.take_snapshot(&id, req).await?;
    service.settings.store.saved().await?;
    Ok(Json(snapshot))
}

async fn of_sandbox(State(service): State<Arc<Service>>, Path(id): Path<String>) -> Json<SnapshotList> {
    Json(SnapshotList { snapshots: service.snapshot_list(None, Some(&id)) })
}

async fn fork(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ForkRequest>,
) -> ServerResult<Json<Forked>> {
    service.fork(&id, req).await.map(Json)
}

async fn list(State(service): State<Arc<Service>>, ApiQuery(q): ApiQuery<SnapshotQuery>) -> Json<SnapshotList> {
    Json(SnapshotList { snapshots: service.snapshot_list(q.job.as_deref(), None) })
}

async fn get_one(State(service): State<Arc<Service>>, Path(id): Path<String>) -> ServerResult<Json<Snapshot>> {
    service.snapshot_info(&id).map(Json)
}

async fn delete(State(service): State<Arc<Service>>, Path(id): Path<String>) -> ServerResult<Json<Snapshot>> {
    let snapshot = service.delete_snapshot(&id).await?;
    service.settings.store.saved().await?;
    Ok(Json(snapshot))
}

async fn export(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExportSnapshot>,
) -> ServerResult<Json<Exported>> {
    let digest = service.export_snapshot(&id, &req.reference).await?;
    Ok(Json(Exported { reference: req.reference, digest }))
}
