//! Snapshots and forks of the server API (`POST /v1/sandboxes/{id}/snapshots`, `/v1/snapshots`,
//! `POST /v1/sandboxes/{id}/fork`): a snapshot is a sandbox's files as they were when it was
//! taken (its changes over its image, as one more layer of it), which a create names as
//! `image: "snapshot:<id>"`; a fork is a snapshot and creates from it in one call. Processes are
//! not kept, only files.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::bounds::{Bound, IDLE_TIMEOUT_S, LEASE_S, OutOfRange, TTL_S, Unit, WAIT_TIMEOUT_S};
use crate::server::{Resources, Sandbox};

/// What a create names to start from snapshot `id`: `snapshot:<id>`.
pub const IMAGE_PREFIX: &str = "snapshot:";

/// The snapshot id a create's image names, when it names one (`snapshot:<id>`).
pub fn snapshot_of_image(image: &str) -> Option<&str> {
    image.strip_prefix(IMAGE_PREFIX)
}

/// The descriptor at which an isolated sandbox's daemon (the process provider's) keeps its
/// writable layer's directory open for its whole life: the host reads a snapshot's files through
/// `/proc/<daemon>/fd/<LAYER_FD>`, the layer being in no mount the host can see.
pub const LAYER_FD: i32 = 999;

/// The most sandboxes one fork makes.
pub const FORK_COUNT: Bound = Bound::new("count", 1, 256, Unit::Count);
/// The longest name a snapshot may have, in bytes.
pub const MAX_NAME_BYTES: usize = 128;
/// The most directories one snapshot may name (`paths`).
pub const MAX_PATHS: usize = 16;
/// The longest directory a snapshot may name, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;

/// `POST /v1/sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// A name of the caller's, shown beside the id (not unique).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The directories to record (absolute, such as `/workspace`), for a provider that records
    /// named directories rather than the whole file system (kubernetes); the others refuse it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
}

impl CreateSnapshot {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        check_name(self.name.as_deref())?;
        check_paths(&self.paths)
    }
}

/// At most [`MAX_PATHS`] directories, each absolute, of at most [`MAX_PATH_BYTES`], with no
/// `.` or `..` part, not `/` itself, and none named twice or inside another.
pub fn check_paths(paths: &[String]) -> Result<(), OutOfRange> {
    let out = |value: String, range: &str| Err(OutOfRange { field: "paths".into(), value, range: range.into() });
    if paths.len() > MAX_PATHS {
        return out(format!("{} directories", paths.len()), &format!("at most {MAX_PATHS} directories"));
    }
    for (i, p) in paths.iter().enumerate() {
        let parts: Vec<&str> = p.split('/').skip(1).filter(|c| !c.is_empty()).collect();
        let bad = !p.starts_with('/')
            || p.len() > MAX_PATH_BYTES
            || parts.is_empty()
            || parts.iter().any(|c| *c == "." || *c == "..")
            || p.contains('\0');
        if bad {
            return out(
                format!("`{p}`"),
                &format!("absolute directories below `/`, at most {MAX_PATH_BYTES} bytes, without `.` or `..`"),
            );
        }
        let inside = |outer: &str, inner: &str| inner == outer || inner.starts_with(&format!("{outer}/"));
        if let Some(q) = paths[..i].iter().find(|q| inside(&normal(q), &normal(p)) || inside(&normal(p), &normal(q))) {
            return out(format!("`{p}` and `{q}`"), "each directory once, none inside another");
        }
    }
    Ok(())
}

/// A checked path without repeated or trailing slashes: `/a//b/` is `/a/b`.
pub fn normal(path: &str) -> String {
    path.split('/').filter(|c| !c.is_empty()).fold(String::new(), |mut s, c| {
        s.push('/');
        s.push_str(c);
        s
    })
}

fn check_name(name: Option<&str>) -> Result<(), OutOfRange> {
    match name {
        Some(n) if n.len() > MAX_NAME_BYTES => Err(OutOfRange {
            field: "name".into(),
            value: format!("{} bytes long", n.len()),
            range: format!("at most {MAX_NAME_BYTES} bytes long"),
        }),
        _ => Ok(()),
    }
}

/// A snapshot as the server reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// `snap-…`.
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The sandbox it was taken of (which may be gone since: the snapshot does not need it).
    pub source: String,
    /// The source's job: the snapshot is deleted when the job is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// The provider that holds it; only its sandboxes can start from it.
    pub provider: String,
    /// What a create names to start from it: `snapshot:<id>`.
    pub image: String,
    /// The image the source ran, which the snapshot is a layer over.
    pub base_image: String,
    /// Bytes of its layer (the source's changes), where the provider knows them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The directories it recorded, when it recorded named ones only (kubernetes); empty: the
    /// whole file system.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    /// Where the provider pushed it as an image, when it did (kubernetes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pushed: Option<String>,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
}

/// `GET /v1/snapshots`, `GET /v1/sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotList {
    pub snapshots: Vec<Snapshot>,
}

/// `GET /v1/snapshots?job=`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotQuery {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
}

/// `POST /v1/snapshots/{id}/export`: push the snapshot, as an image, to a registry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportSnapshot {
    /// Where to push it: `registry/repository:tag`.
    pub reference: String,
}

/// What an export pushed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exported {
    pub reference: String,
    /// The digest of the manifest pushed.
    pub digest: String,
}

/// `POST /v1/sandboxes/{id}/fork`: a snapshot of the sandbox and `count` creates from it. What
/// is left out is the source's (job, labels, resources, environment, profile, network, lease,
/// user).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    pub count: u64,
    /// The snapshot's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The snapshot's directories ([`CreateSnapshot::paths`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    /// Merged over the source's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// Answer once every child is ready (default) or at once.
    #[serde(default = "yes")]
    pub wait: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_timeout_s: Option<u64>,
}

fn yes() -> bool {
    true
}

impl ForkRequest {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        FORK_COUNT.check(self.count)?;
        check_name(self.name.as_deref())?;
        check_paths(&self.paths)?;
        if let Some(r) = &self.resources {
            r.check_bounds()?;
        }
        LEASE_S.check_opt(self.lease_s)?;
        TTL_S.check_opt(self.ttl_s)?;
        IDLE_TIMEOUT_S.check_opt(self.idle_timeout_s)?;
        WAIT_TIMEOUT_S.check_opt(self.wait_timeout_s)
    }
}

/// What a fork made: its snapshot and the new sandboxes, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Forked {
    pub snapshot: Snapshot,
    pub sandboxes: Vec<Sandbox>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_asks_for_one_to_256_children_and_names_the_field_otherwise() {
        let ok = ForkRequest { count: 8, wait: true, ..Default::default() };
        assert!(ok.check_bounds().is_ok());
        for count in [0, 257, u64::MAX] {
            let e = ForkRequest { count, ..ok.clone() }.check_bounds().err().map(|e| e.field);
            assert_eq!(e.as_deref(), Some("count"));
        }
    }

    #[test]
    fn a_fork_request_takes_only_known_fields_and_waits_by_default() {
        let r: ForkRequest = serde_json::from_str(r#"{"count": 2}"#).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.wait);
        assert!(serde_json::from_str::<ForkRequest>(r#"{"count": 2, "cnt": 1}"#).is_err());
    }

    #[test]
    fn a_snapshots_paths_are_absolute_directories_named_once() {
        let ok = |p: &[&str]| check_paths(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(ok(&["/workspace", "/root/.cache", "/work"]).is_ok());
        assert!(ok(&[]).is_ok());
        for bad in [
            &["workspace"][..],
            &["/"],
            &["/a/../etc"],
            &["/a/./b"],
            &["/a", "/a/"],
            &["//"],
            &["/a", "/a/b"],
            &["/a/b/c", "/a"],
        ] {
            assert_eq!(ok(bad).err().map(|e| e.field).as_deref(), Some("paths"), "{bad:?}");
        }
        let many: Vec<String> = (0..=MAX_PATHS).map(|i| format!("/d{i}")).collect();
        assert!(check_paths(&many).is_err());
        assert_eq!(normal("/a//b/"), "/a/b");
    }

    #[test]
    fn an_image_names_a_snapshot_by_its_prefix() {
        assert_eq!(snapshot_of_image("snapshot:snap-1"), Some("snap-1"));
        assert_eq!(snapshot_of_image("python:3.12"), None);
    }
}
