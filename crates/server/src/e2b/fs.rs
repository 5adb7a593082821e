//! `filesystem.Filesystem`, envd's file service, on the daemon's file calls (`stat`, `dir`,
//! `move`, `files`). Directory watches (`WatchDir`, a stream, for the async SDK; the
//! `CreateWatcher`/`GetWatcherEvents` pair the sync SDK polls) compare listings of the
//! directory: the daemon has no watch of its own, so a stream lists every [`WATCH_EVERY`] while
//! it is open, and a sync watcher lists when asked for its events. Events are created, written
//! (size or modification time changed) and removed entries.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::{HeaderMap, Method};
use sandman_wire::daemon::{DirListing, FileKind, FileStat};
use serde::Deserialize;
use serde_json::{Value, json};

use super::connect::{self, Code, RpcError, decode};
use super::{E2b, MAX_WATCHERS, Sbx, rfc3339, user_of};

/// How often an open `WatchDir` stream lists its directory.
pub const WATCH_EVERY: Duration = Duration::from_millis(200);
/// Polls of a quiet watch between two keepalive messages.
const KEEPALIVE_POLLS: u32 = 50;
/// Depth of a recursive watch, the deepest listing the daemon gives.
const RECURSIVE_DEPTH: u32 = 64;

/// What a listing says of each entry, by absolute path: kind, size, modification time.
type Snapshot = BTreeMap<String, (FileKind, u64, i64)>;

/// A sync watcher: its directory and what it last saw there.
#[derive(Debug)]
pub struct Watcher {
    sandbox: String,
    path: String,
    depth: u32,
    seen: Snapshot,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PathReq {
    path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MoveReq {
    source: String,
    destination: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ListReq {
    path: String,
    depth: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct WatchReq {
    path: String,
    recursive: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct WatcherReq {
    #[serde(alias = "watcher_id")]
    watcher_id: String,
}

/// One call of `filesystem.Filesystem/<method>`.
pub async fn call(
    e2b: &Arc<E2b>,
    sbx: Sbx,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, RpcError> {
    match method {
        "Stat" => {
            let req: PathReq = decode(body, false)?;
            Ok(connect::unary(&json!({"entry": entry(&stat(&sbx, &req.path).await?)})))
        }
        "MakeDir" => make_dir(&sbx, headers, body).await,
        "Move" => {
            let req: MoveReq = decode(body, false)?;
            let mv = json!({"from": req.source, "to": req.destination, "overwrite": true});
            sbx.json::<Value>(Method::POST, "move", None, Some(mv)).await?;
            Ok(connect::unary(&json!({"entry": entry(&stat(&sbx, &req.destination).await?)})))
        }
        "ListDir" => {
            let req: ListReq = decode(body, false)?;
            let listing = listing(&sbx, &req.path, req.depth.max(1)).await?;
            let entries: Vec<Value> = listing.entries.iter().map(entry).collect();
            Ok(connect::unary(&json!({"entries": entries})))
        }
        "Remove" => {
            let req: PathReq = decode(body, false)?;
            let q = query(&[("path", &req.path), ("recursive", "true")]);
            sbx.call(Method::DELETE, "files", Some(q), Body::empty(), None).await?;
            Ok(connect::unary(&json!({})))
        }
        "WatchDir" => watch_dir(sbx, body).await,
        "CreateWatcher" => create_watcher(e2b, sbx, body).await,
        "GetWatcherEvents" => watcher_events(e2b, sbx, body).await,
        "RemoveWatcher" => {
            let req: WatcherReq = decode(body, false)?;
            let removed = {
                let mut watchers = e2b.watchers();
                match watchers.get(&req.watcher_id) {
                    Some(w) if w.sandbox == sbx.id => watchers.remove(&req.watcher_id).is_some(),
                    _ => false,
                }
            };
            if !removed {
                return Err(RpcError::not_found(format!("watcher `{}` not found", req.watcher_id)));
            }
            Ok(connect::unary(&json!({})))
        }
        other => Err(RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} is not supported by Sandman"),
        )),
    }
}

/// Whether a method answers with a stream.
pub fn streams(method: &str) -> bool {
    method == "WatchDir"
}

pub fn query(pairs: &[(&str, &str)]) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        q.append_pair(k, v);
    }
    q.finish()
}

pub async fn stat(sbx: &Sbx, path: &str) -> Result<FileStat, RpcError> {
    sbx.json(Method::GET, "stat", Some(query(&[("path", path)])), None).await
}

async fn listing(sbx: &Sbx, path: &str, depth: u32) -> Result<DirListing, RpcError> {
    let depth = depth.min(RECURSIVE_DEPTH).to_string();
    sbx.json(Method::GET, "dir", Some(query(&[("path", path), ("depth", &depth)])), None).await
}

async fn make_dir(sbx: &Sbx, headers: &HeaderMap, body: &[u8]) -> Result<Response, RpcError> {
    let req: PathReq = decode(body, false)?;
    match stat(sbx, &req.path).await {
        Ok(_) => return Err(RpcError::new(Code::AlreadyExists, format!("`{}` already exists", req.path))),
        Err(e) if e.code == Code::NotFound => {}
        Err(e) => return Err(e),
    }
    let user = user_of(headers)?;
    let mut pairs = vec![("path", req.path.as_str())];
    if let Some(u) = &user {
        pairs.push(("user", u));
    }
    sbx.call(Method::POST, "dir", Some(query(&pairs)), Body::empty(), None).await?;
    Ok(connect::unary(&json!({"entry": entry(&stat(sbx, &req.path).await?)})))
}

/// envd's `EntryInfo` of one of the daemon's stats.
pub fn entry(st: &FileStat) -> Value {
    let name = st.path.rsplit('/').find(|s| !s.is_empty()).unwrap_or("/");
    let kind = match st.kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let owner = |id: u32| if id == 0 { "root".to_string() } else { id.to_string() };
    let mut v = json!({
        "name": name,
        "type": kind,
        "path": st.path,
        "size": st.size,
        "mode": st.mode,
        "permissions": permissions(st.kind, st.mode),
        "owner": owner(st.uid),
        "group": owner(st.gid),
        "modifiedTime": rfc3339(u64::try_from(st.mtime_ms).unwrap_or(0)),
        "isSymlink": st.kind == FileKind::Symlink,
    });
    if let Some(t) = &st.link_target {
        v["symlinkTarget"] = json!(t);
    }
    v
}

/// `ls -l`'s permission string.
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

async fn snapshot(sbx: &Sbx, path: &str, depth: u32) -> Result<Snapshot, RpcError> {
    let listing = listing(sbx, path, depth).await?;
    // A write in progress is not an event: its rename over the target is, at the next look.
    let done = |path: &str| !sandman_wire::daemon::is_write_in_progress(path.rsplit('/').next().unwrap_or(path));
    Ok(listing.entries.into_iter().filter(|e| done(&e.path)).map(|e| (e.path, (e.kind, e.size, e.mtime_ms))).collect())
}

/// The events between two listings of `root`, named relative to it.
fn diff(root: &str, old: &Snapshot, new: &Snapshot) -> Vec<Value> {
    let name = |p: &str| {
        p.strip_prefix(root.trim_end_matches('/')).map(|r| r.trim_start_matches('/')).unwrap_or(p).to_string()
    };
    let mut events = Vec::new();
    for (path, now) in new {
        match old.get(path) {
            None => events.push(json!({"name": name(path), "type": "EVENT_TYPE_CREATE"})),
            Some(then) if then != now && now.0 != FileKind::Dir => {
                events.push(json!({"name": name(path), "type": "EVENT_TYPE_WRITE"}))
            }
            Some(_) => {}
        }
    }
    for path in old.keys().filter(|p| !new.contains_key(*p)) {
        events.push(json!({"name": name(path), "type": "EVENT_TYPE_REMOVE"}));
    }
    events
}

fn watch_depth(recursive: bool) -> u32 {
    if recursive { RECURSIVE_DEPTH } else { 1 }
}

async fn watch_dir(sbx: Sbx, body: &[u8]) -> Result<Response, RpcError> {
    let req: WatchReq = decode(body, true)?;
    let depth = watch_depth(req.recursive);
    // A directory that is not there fails the call, before the stream starts.
    let mut seen = snapshot(&sbx, &req.path, depth).await?;
    let (tx, resp) = connect::stream();
    let tasks = sbx.service.tasks.clone();
    tasks.spawn(async move {
        if !tx.send(&json!({"start": {}})).await {
            return;
        }
        let mut quiet = 0u32;
        let mut tick = tokio::time::interval(WATCH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                _ = tick.tick() => {}
            }
            let now = match snapshot(&sbx, &req.path, depth).await {
                Ok(s) => s,
                Err(e) => return tx.end(Some(e)).await,
            };
            let events = diff(&req.path, &seen, &now);
            seen = now;
            quiet = if events.is_empty() { quiet.saturating_add(1) } else { 0 };
            for ev in events {
                if !tx.send(&json!({"filesystem": ev})).await {
                    return;
                }
            }
            if quiet >= KEEPALIVE_POLLS {
                quiet = 0;
                if !tx.send(&json!({"keepalive": {}})).await {
                    return;
                }
            }
        }
    });
    Ok(resp)
}

async fn create_watcher(e2b: &Arc<E2b>, sbx: Sbx, body: &[u8]) -> Result<Response, RpcError> {
    let req: WatchReq = decode(body, false)?;
    let depth = watch_depth(req.recursive);
    let seen = snapshot(&sbx, &req.path, depth).await?;
    let id = crate::sys::random_hex();
    {
        let mut watchers = e2b.watchers();
        if watchers.len() >= MAX_WATCHERS {
            // Room first from watchers of sandboxes that are gone.
            let service = &e2b.service;
            watchers.retain(|_, w| service.get(&w.sandbox).is_ok_and(|s| !s.state().is_terminal()));
        }
        if watchers.len() >= MAX_WATCHERS {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("the server holds {MAX_WATCHERS} directory watchers already; remove some"),
            ));
        }
        watchers.insert(id.clone(), Watcher { sandbox: sbx.id.clone(), path: req.path, depth, seen });
    }
    Ok(connect::unary(&json!({"watcherId": id})))
}

async fn watcher_events(e2b: &Arc<E2b>, sbx: Sbx, body: &[u8]) -> Result<Response, RpcError> {
    let req: WatcherReq = decode(body, false)?;
    let (path, depth) = {
        let watchers = e2b.watchers();
        match watchers.get(&req.watcher_id) {
            Some(w) if w.sandbox == sbx.id => (w.path.clone(), w.depth),
            _ => return Err(RpcError::not_found(format!("watcher `{}` not found", req.watcher_id))),
        }
    };
    let now = snapshot(&sbx, &path, depth).await?;
    let events = {
        let mut watchers = e2b.watchers();
        let w = watchers
            .get_mut(&req.watcher_id)
            .ok_or_else(|| RpcError::not_found(format!("watcher `{}` not found", req.watcher_id)))?;
        let events = diff(&path, &w.seen, &now);
        w.seen = now;
        events
    };
    Ok(connect::unary(&json!({"events": events})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_differ_by_created_written_and_removed_entries() {
        let old: Snapshot = [
            ("/w/a".to_string(), (FileKind::File, 1, 10)),
            ("/w/b".to_string(), (FileKind::File, 1, 10)),
            ("/w/d".to_string(), (FileKind::Dir, 0, 10)),
        ]
        .into();
        let new: Snapshot = [
            ("/w/a".to_string(), (FileKind::File, 2, 11)),
            ("/w/c".to_string(), (FileKind::File, 0, 12)),
            ("/w/d".to_string(), (FileKind::Dir, 0, 13)),
        ]
        .into();
        let events = diff("/w/", &old, &new);
        assert_eq!(
            events,
            vec![
                json!({"name": "a", "type": "EVENT_TYPE_WRITE"}),
                json!({"name": "c", "type": "EVENT_TYPE_CREATE"}),
                json!({"name": "b", "type": "EVENT_TYPE_REMOVE"}),
            ]
        );
    }

    #[test]
    fn permissions_read_as_ls_shows_them() {
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::File, 0o640), "-rw-r-----");
    }
}
