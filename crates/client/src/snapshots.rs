//! Snapshots and forks: `POST /v1/sandboxes/{id}/snapshots`, `/v1/snapshots`,
//! `POST /v1/sandboxes/{id}/fork`.

use http::Method;
use sandman_wire::snapshots::{
    CreateSnapshot, ExportSnapshot, Exported, ForkRequest, Forked, Snapshot, SnapshotList, SnapshotQuery,
};

use crate::client::{Client, Req, sandbox_path, segment};
use crate::error::ClientError;

impl Client {
    /// `POST /v1/sandboxes/{id}/snapshots`: records the sandbox's files (not its processes).
    pub async fn snapshot(&self, id: &str, req: &CreateSnapshot) -> Result<Snapshot, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/snapshots")).json(req)?).await
    }

    /// `GET /v1/snapshots?job=`: the snapshots the server holds, oldest first.
    pub async fn snapshots(&self, query: &SnapshotQuery) -> Result<Vec<Snapshot>, ClientError> {
        let list: SnapshotList = self.json(Req::new(Method::GET, "/v1/snapshots".into()).query(query)?).await?;
        Ok(list.snapshots)
    }

    /// `GET /v1/snapshots/{id}`.
    pub async fn get_snapshot(&self, id: &str) -> Result<Snapshot, ClientError> {
        self.json(Req::new(Method::GET, snapshot_path(id, ""))).await
    }

    /// `DELETE /v1/snapshots/{id}`: sandboxes started from it keep running.
    pub async fn delete_snapshot(&self, id: &str) -> Result<Snapshot, ClientError> {
        self.json(Req::new(Method::DELETE, snapshot_path(id, ""))).await
    }

    /// `POST /v1/snapshots/{id}/export`: pushes the snapshot as an image to `reference`.
    pub async fn export_snapshot(&self, id: &str, reference: &str) -> Result<Exported, ClientError> {
        let body = ExportSnapshot { reference: reference.to_string() };
        self.json(Req::new(Method::POST, snapshot_path(id, "/export")).json(&body)?.idempotent()).await
    }

    /// `POST /v1/sandboxes/{id}/fork`: a snapshot and `count` new sandboxes from it.
    pub async fn fork(&self, id: &str, req: &ForkRequest) -> Result<Forked, ClientError> {
        self.json(Req::new(Method::POST, sandbox_path(id, "/fork")).json(req)?).await
    }
}

fn snapshot_path(id: &str, rest: &str) -> String {
    format!("/v1/snapshots/{}{rest}", segment(id))
}
