//! Tar archives in and out of the sandbox: streamed extraction confined to its target, streamed download.

use std::ffi::OsString;
use std::fs;
use std::io::{self, BufReader, Read};
use std::os::unix::fs::FileTypeExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Json;
use axum::body::{Body, HttpBody};
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use sandman_wire::bounds;
use sandman_wire::daemon::{ExtractQuery, ExtractResult, PathQuery};
use tokio::io::DuplexStream;
use tokio_util::io::{ReaderStream, StreamReader, SyncIoBridge};

use crate::error::{DaemonError, DaemonResult};
use crate::extract::{ApiQuery, BodyStalled, is_length_limit, is_stalled, unstalled};
use crate::files::{Durability, Fsync, absolute, blocking, shown, sorted_names};
use crate::owner::{self, Owner};
use crate::state::Daemon;

/// Bytes in flight between the tar writer thread and the response body: enough to keep both
/// sides busy, small enough that a slow client holds back the writer rather than memory.
const PIPE_CAPACITY: usize = 64 * 1024;
/// Read-ahead on the upload, so that tar's 512-byte reads do not each cross into the runtime.
const READ_AHEAD: usize = 64 * 1024;
/// The first two bytes of every gzip stream.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// `PUT /v1/archive?path=`: unpacks a tar (or gzipped tar) body into the directory `path`,
/// created if missing. Permissions and modification times are kept, existing files are
/// replaced, symlinks stay symlinks. Stops at the first entry that would land outside `path`.
/// The archive's owners are not kept: what it creates is the daemon's, or `user`'s.
pub async fn extract(
    State(daemon): State<Arc<Daemon>>,
    ApiQuery(q): ApiQuery<ExtractQuery>,
    body: Body,
) -> DaemonResult<Json<ExtractResult>> {
    let checked = absolute(&q.path).and_then(|target| Ok((target, Owner::of(&daemon, q.user.as_deref())?)));
    let (target, owner) = match checked {
        Ok(checked) => checked,
        Err(refused) => return Err(crate::files::read_rest(body, refused).await),
    };
    let limits = Unpacking {
        owner,
        sync: q.fsync.then_some(&Fsync as &'static dyn Durability),
        ..Unpacking::of(&daemon.config.limits)
    };
    extract_into(target, body, daemon.config.max_upload_bytes, limits).await.map(Json)
}

/// What an extraction may write.
#[derive(Debug, Clone, Copy, Default)]
struct Unpacking {
    /// The sandbox's disk: entries (contents plus [`ENTRY_COST`] each) past it stop the
    /// extraction (0 = no limit).
    disk: u64,
    /// A gzipped upload may unpack to this many times the compressed bytes read so far (plus
    /// [`EXPANSION_SLACK`]); 0 = no limit.
    ratio: u64,
    /// Who what the extraction creates belongs to; the daemon when `None`.
    owner: Option<Owner>,
    /// How what it wrote is made durable before the answer (`fsync=true`); not at all when `None`.
    sync: Option<&'static dyn Durability>,
}

impl Unpacking {
    fn of(limits: &crate::Limits) -> Self {
        Unpacking { disk: limits.disk_bytes, ratio: limits.expansion_ratio, owner: None, sync: None }
    }
}

/// What each entry counts against the disk limit besides its contents: its header's block, as a
/// directory or a symlink takes room too.
const ENTRY_COST: u64 = 512;
/// Unpacked bytes allowed beyond the expansion ratio, so that a small archive of a highly
/// compressible file (a megabyte of zeros) is not refused.
const EXPANSION_SLACK: u64 = 1 << 20;

/// Why a read of the archive stopped it, beyond what tar itself refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Expansion {
        ratio: u64,
    },
    /// The client went away: the request was dropped.
    Abandoned,
}

/// The extraction's counters, shared by the readers on the unpacking thread and the request.
#[derive(Debug, Default)]
struct Progress {
    /// Bytes of the upload read (compressed, for a gzipped one).
    raw: AtomicU64,
    /// Bytes of the tar stream read.
    tar: AtomicU64,
    abandoned: AtomicBool,
    stop: std::sync::Mutex<Option<Stop>>,
}

impl Progress {
    fn stop(&self, why: Stop) -> io::Error {
        *self.stop.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
        io::Error::other(format!("extraction stopped: {why:?}"))
    }

    fn stopped(&self) -> Option<Stop> {
        *self.stop.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Counts what passes through a reader of the upload (`raw`) or of the tar stream, and stops the
/// tar stream past the expansion ratio or once the request is dropped.
struct Counting<R> {
    inner: R,
    progress: Arc<Progress>,
    tar: bool,
    /// The expansion ratio, for the tar stream of a gzipped upload.
    ratio: Option<u64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let p = &self.progress;
        if p.abandoned.load(Ordering::Relaxed) {
            return Err(p.stop(Stop::Abandoned));
        }
        let n = self.inner.read(buf)?;
        if !self.tar {
            p.raw.fetch_add(n as u64, Ordering::Relaxed);
            return Ok(n);
        }
        let unpacked = p.tar.fetch_add(n as u64, Ordering::Relaxed).saturating_add(n as u64);
        if let Some(ratio) = self.ratio {
            let allowed = p.raw.load(Ordering::Relaxed).saturating_mul(ratio).saturating_add(EXPANSION_SLACK);
            if unpacked > allowed {
                return Err(p.stop(Stop::Expansion { ratio }));
            }
        }
        Ok(n)
    }
}

/// Marks the extraction abandoned when the request's future is dropped before it ends: the
/// unpacking thread stops at its next read instead of working on for nobody.
struct AbandonOnDrop(Arc<Progress>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        self.0.abandoned.store(true, Ordering::Relaxed);
    }
}

/// The work of [`extract`]: `body` unpacked into `target`, at most `limit` bytes read from it
/// (0 = no limit), within `limits`.
async fn extract_into(target: PathBuf, body: Body, limit: u64, limits: Unpacking) -> DaemonResult<ExtractResult> {
    if limit > 0 && body.size_hint().lower() > limit {
        return Err(DaemonError::TooLarge { limit });
    }
    let made = target.clone();
    blocking(move || owner::create_dirs(&made, limits.owner)).await?;
    // Set by the body stream when the upload passes the limit; read after the unpacking thread
    // has been joined, which orders it.
    let over_limit = Arc::new(AtomicBool::new(false));
    let upload = SyncIoBridge::new(StreamReader::new(counted(body, limit, Arc::clone(&over_limit))));
    let dst = target.clone();
    let progress = Arc::new(Progress::default());
    let _abandon = AbandonOnDrop(Arc::clone(&progress));
    let shared = Arc::clone(&progress);
    let unpacked = blocking(move || {
        let mut raw = Counting { inner: upload, progress: Arc::clone(&shared), tar: false, ratio: None };
        let mut unpacked = unpack(BufReader::with_capacity(READ_AHEAD, &mut raw), &dst, limits, &shared);
        if let (Ok(_), Some(sync)) = (&unpacked, limits.sync)
            && let Err(source) = sync.sync_fs(&dst)
        {
            unpacked = Err(Refusal::Unpack { entry: dst.clone(), source });
        }
        // What follows the archive's end (a refused one's rest, or the padding of a whole one:
        // tar writers pad to a record of 10 KiB) is read before the answer, so that the client
        // is not cut off while it still sends it.
        linger(&mut raw);
        Ok(unpacked)
    })
    .await?;
    match unpacked {
        Ok(counts) => Ok(ExtractResult { path: shown(&target), entries: counts.entries, bytes: counts.bytes }),
        Err(_) if over_limit.load(Ordering::Relaxed) => Err(DaemonError::TooLarge { limit }),
        Err(refused) if refused.is_stall() => {
            Err(DaemonError::Stalled(format!("{}; the extraction into `{}` was stopped", BodyStalled, shown(&target))))
        }
        Err(refused) => Err(refused.into_error(&target)),
    }
}

/// The most of an upload read and thrown away after the archive (refused, or ended before the
/// body did) and before the answer: a client still sending its body gets the answer, rather
/// than a connection closed under its write, when what is left is no more than this.
pub const LINGER_BYTES: u64 = 16 << 20;

/// Reads what is left of an upload, up to [`LINGER_BYTES`], and throws it away; stops at its
/// end, at an error (a stall, the client gone) or at the cap.
fn linger(upload: impl Read) {
    let _ = io::copy(&mut upload.take(LINGER_BYTES), &mut io::sink());
}

/// The body as a byte stream for [`StreamReader`], cut with an error past `limit` bytes
/// (0 = no limit); `over_limit` records why, since tar wraps the error it gets.
fn counted(body: Body, limit: u64, over_limit: Arc<AtomicBool>) -> impl Stream<Item = io::Result<Bytes>> {
    let mut seen = 0u64;
    unstalled(body).map(move |chunk| match chunk {
        Ok(bytes) => {
            seen = seen.saturating_add(bytes.len() as u64);
            if limit > 0 && seen > limit {
                over_limit.store(true, Ordering::Relaxed);
                Err(io::Error::other(DaemonError::TooLarge { limit }))
            } else {
                Ok(bytes)
            }
        }
        Err(err) => {
            if is_length_limit(&err) {
                over_limit.store(true, Ordering::Relaxed);
            }
            // A stall is kept whole so that it can be told apart from a bad archive.
            if is_stalled(&err) {
                return Err(io::Error::new(io::ErrorKind::TimedOut, err));
            }
            Err(io::Error::other(err))
        }
    })
}

/// What an extraction unpacked.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    entries: u64,
    /// Bytes of regular file contents.
    bytes: u64,
}

/// Why an extraction stopped.
#[derive(Debug)]
enum Refusal {
    /// The entry's path, or a hard link's target, leaves the target directory.
    Escapes { entry: String, link: Option<String> },
    /// The archive itself could not be read (bad header, bad gzip, truncated, body failed).
    Read(io::Error),
    /// One entry could not be written.
    Unpack { entry: PathBuf, source: io::Error },
    /// An entry's path, or its link's, is deeper than the bound.
    TooDeep { entry: String, depth: usize },
    /// The entries would write past the sandbox's disk limit.
    Disk { entry: String, limit: u64 },
    /// A read of the archive stopped it.
    Stopped(Stop),
}

impl Refusal {
    /// Whether the upload stalled (see [`unstalled`]): tar wraps the error it read.
    fn is_stall(&self) -> bool {
        let err = match self {
            Refusal::Read(err) | Refusal::Unpack { source: err, .. } => err,
            _ => return false,
        };
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = cur {
            if is_stalled(e) {
                return true;
            }
            cur = e.source();
        }
        err.kind() == io::ErrorKind::TimedOut
    }

    fn into_error(self, target: &Path) -> DaemonError {
        let target = shown(target);
        match self {
            Refusal::Escapes { entry, link: None } => {
                DaemonError::InvalidArgument(format!("tar entry `{entry}` would land outside `{target}`"))
            }
            Refusal::Escapes { entry, link: Some(link) } => DaemonError::InvalidArgument(format!(
                "tar entry `{entry}` is a hard link to `{link}`, which would land outside `{target}`"
            )),
            Refusal::Read(err) => DaemonError::InvalidArgument(format!("cannot read the tar archive: {err}")),
            Refusal::TooDeep { entry, depth } => DaemonError::InvalidArgument(format!(
                "tar entry `{}` is {depth} levels deep, over the limit of {} levels",
                short(&entry),
                bounds::PATH_DEPTH.max
            )),
            Refusal::Disk { entry, limit } => {
                DaemonError::DiskLimit { limit, what: format!("the archive, at entry `{}`,", short(&entry)) }
            }
            Refusal::Stopped(Stop::Expansion { ratio }) => DaemonError::Expansion { ratio },
            Refusal::Stopped(Stop::Abandoned) => {
                DaemonError::InvalidArgument("the client went away; the extraction was stopped".into())
            }
            // What tar refuses itself (a write through a symlink leading outside the target, a
            // link without a name) comes as `Other`; a truncated archive as `UnexpectedEof`.
            Refusal::Unpack { entry, source } => match source.kind() {
                io::ErrorKind::Other
                | io::ErrorKind::InvalidData
                | io::ErrorKind::InvalidInput
                | io::ErrorKind::UnexpectedEof => DaemonError::InvalidArgument(format!(
                    "tar entry `{}` cannot be unpacked in `{target}`: {source}",
                    shown(&entry)
                )),
                _ => DaemonError::io("unpack tar entry into", target, source),
            },
        }
    }
}

/// Unpacks a tar stream into `dst`, gunzipping it first when it starts with the gzip magic,
/// within `limits`; `progress` counts and can stop it.
fn unpack(mut upload: impl Read, dst: &Path, limits: Unpacking, progress: &Arc<Progress>) -> Result<Counts, Refusal> {
    let mut magic = [0u8; 2];
    let mut seen = 0;
    while seen < magic.len() {
        match upload.read(&mut magic[seen..]) {
            Ok(0) => break,
            Ok(n) => seen += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Refusal::Read(e)),
        }
    }
    let whole = (&magic[..seen]).chain(upload);
    let counted = |inner, ratio| Counting { inner, progress: Arc::clone(progress), tar: true, ratio };
    let unpacked = if magic == GZIP_MAGIC {
        let ratio = (limits.ratio > 0).then_some(limits.ratio);
        unpack_tar(counted(Box::new(flate2::read::MultiGzDecoder::new(whole)) as Box<dyn Read>, ratio), dst, limits)
    } else {
        unpack_tar(counted(Box::new(whole) as Box<dyn Read>, None), dst, limits)
    };
    // tar wraps the error of a read that stopped the extraction; the progress says why.
    unpacked.map_err(|refused| progress.stopped().map_or(refused, Refusal::Stopped))
}

fn unpack_tar(source: impl Read, dst: &Path, limits: Unpacking) -> Result<Counts, Refusal> {
    let mut archive = tar::Archive::new(source);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    archive.set_unpack_xattrs(false);
    let mut counts = Counts::default();
    // Contents plus a header's block for each entry: what the disk limit is held against.
    let mut cost = 0u64;
    for entry in archive.entries().map_err(Refusal::Read)? {
        let mut entry = entry.map_err(Refusal::Read)?;
        let name = entry.path().map_err(Refusal::Read)?.into_owned();
        let escapes = |link: Option<&Path>| Refusal::Escapes { entry: shown(&name), link: link.map(shown) };
        let too_deep = |path: &Path| {
            let depth = path.components().count();
            (depth as u64 > bounds::PATH_DEPTH.max).then(|| Refusal::TooDeep { entry: shown(&name), depth })
        };
        if let Some(refusal) = too_deep(&name) {
            return Err(refusal);
        }
        if !stays_inside(&name) {
            return Err(escapes(None));
        }
        let kind = entry.header().entry_type();
        if let Some(link) = entry.link_name().map_err(Refusal::Read)?
            && let Some(refusal) = too_deep(&link)
        {
            return Err(refusal);
        }
        if kind.is_hard_link()
            && let Some(link) = entry.link_name().map_err(Refusal::Read)?
            && !stays_inside(&link)
        {
            return Err(escapes(Some(&link)));
        }
        cost = cost.saturating_add(entry.size()).saturating_add(ENTRY_COST);
        if limits.disk > 0 && cost > limits.disk {
            return Err(Refusal::Disk { entry: shown(&name), limit: limits.disk });
        }
        // What this entry creates, to give to the owner once it is unpacked: the directories
        // `unpack_in` makes on the way, and the entry itself unless it is a directory that
        // was there.
        let created = limits.owner.filter(|_| !kind.is_pax_global_extensions()).map(|_| {
            let path = dst.join(name.components().filter(|c| matches!(c, Component::Normal(_))).collect::<PathBuf>());
            let mut created = owner::missing_ancestors(&path, dst);
            if !kind.is_dir() && path != dst && created.first() != Some(&path) {
                created.insert(0, path);
            }
            created
        });
        // `unpack_in` also refuses to write through a symlink that leads outside `dst`.
        match entry.unpack_in(dst) {
            Ok(true) => {}
            Ok(false) => return Err(escapes(None)),
            Err(source) => return Err(Refusal::Unpack { entry: name, source }),
        }
        if let (Some(owner), Some(created)) = (limits.owner, created) {
            let mode = entry.header().mode().ok();
            for (i, path) in created.iter().enumerate() {
                // The entry itself (first) keeps its setuid and setgid bits.
                let kept = if i == 0 && !kind.is_symlink() { mode } else { None };
                match owner::give_keeping_mode(owner, path, kept) {
                    // An entry of a kind that is not unpacked (a device) made nothing.
                    Err(source) if source.kind() != io::ErrorKind::NotFound => {
                        return Err(Refusal::Unpack { entry: name.clone(), source });
                    }
                    _ => {}
                }
            }
        }
        if kind.is_pax_global_extensions() {
            continue;
        }
        counts.entries += 1;
        if matches!(kind, tar::EntryType::Regular | tar::EntryType::Continuous) {
            counts.bytes += entry.size();
        }
    }
    Ok(counts)
}

/// A name for a message: at most 200 characters of it.
fn short(name: &str) -> String {
    match name.char_indices().nth(200) {
        Some((at, _)) => format!("{}…", &name[..at]),
        None => name.to_string(),
    }
}

/// Whether an archive path stays below the directory it is unpacked in: relative, and with no
/// `..` anywhere.
fn stays_inside(path: &Path) -> bool {
    path.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// `GET /v1/archive?path=`: a directory as a tar of its contents (names relative to it, like
/// `a/b`), or a file as a tar holding it under its base name. Symlinks stay symlinks, modes and
/// times are kept. A failure after the first byte aborts the body, so a client never takes a cut
/// archive for a whole one.
pub async fn download(ApiQuery(q): ApiQuery<PathQuery>) -> DaemonResult<Response> {
    let root = absolute(&q.path)?;
    // Everything that can be refused is checked before the answer starts.
    let source = blocking(move || Source::open(root)).await?;
    let (writer, reader) = tokio::io::duplex(PIPE_CAPACITY);
    let out = SyncIoBridge::new(writer);
    let path = q.path;
    let writing = tokio::task::spawn_blocking(move || write_tar(source, out));
    let outcome = futures_util::stream::once(async move {
        let err = match writing.await {
            Ok(Ok(())) => return None,
            Ok(Err(err)) => err,
            Err(join) => io::Error::other(join),
        };
        tracing::warn!(path = %path, error = %err, "archive download failed midway");
        Some(Err(err))
    })
    .filter_map(std::future::ready);
    let body = Body::from_stream(ReaderStream::with_capacity(reader, PIPE_CAPACITY).chain(outcome));
    let mut response = Response::new(body);
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-tar"));
    Ok(response)
}

/// What a download archives.
#[derive(Debug)]
enum Source {
    Dir(PathBuf),
    File { name: OsString, file: fs::File },
}

impl Source {
    /// Follows `root` if it is a symlink; refuses what is neither a directory nor a file.
    fn open(root: PathBuf) -> DaemonResult<Self> {
        let meta = fs::metadata(&root).map_err(|e| DaemonError::io("archive", shown(&root), e))?;
        if meta.is_dir() {
            fs::read_dir(&root).map_err(|e| DaemonError::io("list", shown(&root), e))?;
            return Ok(Source::Dir(root));
        }
        let name = root.file_name().map(ToOwned::to_owned);
        match name {
            Some(name) if meta.is_file() => {
                let file = fs::File::open(&root).map_err(|e| DaemonError::io("open", shown(&root), e))?;
                Ok(Source::File { name, file })
            }
            _ => Err(DaemonError::InvalidArgument(format!(
                "`{}` is neither a directory nor a regular file",
                shown(&root)
            ))),
        }
    }
}

fn write_tar(source: Source, out: SyncIoBridge<DuplexStream>) -> io::Result<()> {
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    match source {
        Source::Dir(root) => append_tree(&mut builder, &root)?,
        Source::File { name, mut file } => builder.append_file(Path::new(&name), &mut file)?,
    }
    builder.into_inner()?.shutdown()
}

/// Appends everything below `root`, by name, depth first, each directory before its contents.
/// Sockets cannot be archived and are left out, as are entries removed while this runs.
fn append_tree<W: io::Write>(builder: &mut tar::Builder<W>, root: &Path) -> io::Result<()> {
    let named = |path: &Path, e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    // Paths relative to `root`, next one last; a stack rather than recursion, so a deep tree
    // cannot exhaust the thread's stack.
    let mut pending: Vec<PathBuf> =
        sorted_names(root).map_err(|e| named(root, e))?.into_iter().rev().map(PathBuf::from).collect();
    while let Some(rel) = pending.pop() {
        let path = root.join(&rel);
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(named(&path, e)),
        };
        if meta.file_type().is_socket() {
            continue;
        }
        match builder.append_path_with_name(&path, &rel) {
            Ok(()) => {}
            // The file was opened before its header is written, so nothing went out.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(named(&path, e)),
        }
        if meta.is_dir() {
            let children = sorted_names(&path).map_err(|e| named(&path, e))?;
            pending.extend(children.into_iter().rev().map(|name| rel.join(name)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{PermissionsExt, symlink};

    use super::*;

    #[test]
    fn entry_paths_must_stay_inside() {
        for good in ["a", "a/b", "./a/b", "a/./b", ".", "dir/"] {
            assert!(stays_inside(Path::new(good)), "{good}");
        }
        for bad in ["../x", "a/../../x", "a/..", "/etc/passwd", "/"] {
            assert!(!stays_inside(Path::new(bad)), "{bad}");
        }
    }

    /// A tar header whose name is written raw, since `tar::Builder` refuses bad names.
    fn raw_entry(out: &mut Vec<u8>, name: &str, kind: tar::EntryType, link: Option<&str>, data: &[u8]) {
        let mut header = tar::Header::new_old();
        let slot = &mut header.as_old_mut().name;
        slot[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(link) = link {
            let slot = &mut header.as_old_mut().linkname;
            slot[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_entry_type(kind);
        header.set_mode(0o644);
        header.set_size(data.len() as u64);
        header.set_cksum();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }

    fn finish(mut out: Vec<u8>) -> Vec<u8> {
        out.resize(out.len() + 1024, 0);
        out
    }

    fn refusal_message(archive: &[u8], dst: &Path) -> String {
        match unpack(archive, dst, Unpacking::default(), &Arc::default()) {
            Ok(counts) => format!("unpacked {counts:?}"),
            Err(refusal) => refusal.into_error(dst).to_string(),
        }
    }

    #[test]
    fn parent_dir_entries_are_refused_and_nothing_lands_outside() -> io::Result<()> {
        let scratch = tempfile::tempdir()?;
        let dst = scratch.path().join("target");
        fs::create_dir(&dst)?;
        let mut tar = Vec::new();
        raw_entry(&mut tar, "ok", tar::EntryType::Regular, None, b"fine");
        raw_entry(&mut tar, "../evil", tar::EntryType::Regular, None, b"evil");
        let msg = refusal_message(&finish(tar), &dst);
        assert_eq!(msg, format!("tar entry `../evil` would land outside `{}`", dst.display()));
        assert!(!scratch.path().join("evil").exists());
        assert_eq!(fs::read(dst.join("ok"))?, b"fine");
        Ok(())
    }

    #[test]
    fn absolute_entries_and_escaping_hard_links_are_refused() -> io::Result<()> {
        let scratch = tempfile::tempdir()?;
        let dst = scratch.path().join("target");
        fs::create_dir(&dst)?;
        let mut tar = Vec::new();
        raw_entry(&mut tar, "/abs", tar::EntryType::Regular, None, b"x");
        assert!(refusal_message(&finish(tar), &dst).contains("tar entry `/abs` would land outside"));
        let mut tar = Vec::new();
        raw_entry(&mut tar, "h", tar::EntryType::Link, Some("../secret"), b"");
        let msg = refusal_message(&finish(tar), &dst);
        assert!(msg.contains("hard link to `../secret`"), "{msg}");
        assert!(!dst.join("h").exists());
        Ok(())
    }

    #[test]
    fn writing_through_a_symlink_that_leads_outside_is_refused() -> io::Result<()> {
        let scratch = tempfile::tempdir()?;
        let dst = scratch.path().join("target");
        let outside = scratch.path().join("outside");
        fs::create_dir(&dst)?;
        fs::create_dir(&outside)?;
        let mut tar = Vec::new();
        raw_entry(&mut tar, "link", tar::EntryType::Symlink, Some(&outside.to_string_lossy()), b"");
        raw_entry(&mut tar, "link/planted", tar::EntryType::Regular, None, b"x");
        let msg = refusal_message(&finish(tar), &dst);
        assert!(msg.contains("tar entry `link/planted` cannot be unpacked"), "{msg}");
        assert!(!outside.join("planted").exists());
        // The symlink itself is kept as a symlink.
        assert!(fs::symlink_metadata(dst.join("link"))?.file_type().is_symlink());
        Ok(())
    }

    fn sample_tree() -> io::Result<tempfile::TempDir> {
        let src = tempfile::tempdir()?;
        fs::create_dir_all(src.path().join("d/e"))?;
        fs::write(src.path().join("d/e/f"), b"deep")?;
        fs::write(src.path().join("x"), b"exec")?;
        fs::set_permissions(src.path().join("x"), fs::Permissions::from_mode(0o755))?;
        symlink("d/e/f", src.path().join("l"))?;
        Ok(src)
    }

    fn archive_of(root: &Path) -> io::Result<Vec<u8>> {
        let mut builder = tar::Builder::new(Vec::new());
        builder.follow_symlinks(false);
        append_tree(&mut builder, root)?;
        builder.into_inner()
    }

    #[test]
    fn a_tree_round_trips_with_modes_and_symlinks() -> io::Result<()> {
        let src = sample_tree()?;
        let tar = archive_of(src.path())?;
        let names: Vec<String> = tar::Archive::new(&tar[..])
            .entries()?
            .map(|e| e.and_then(|e| Ok(shown(&e.path()?))))
            .collect::<io::Result<_>>()?;
        assert_eq!(names, ["d", "d/e", "d/e/f", "l", "x"]);
        let dst = tempfile::tempdir()?;
        let counts = unpack(&tar[..], dst.path(), Unpacking::default(), &Arc::default())
            .map_err(|r| io::Error::other(format!("{r:?}")))?;
        assert_eq!(counts, Counts { entries: 5, bytes: 8 });
        assert_eq!(fs::read(dst.path().join("d/e/f"))?, b"deep");
        assert_eq!(fs::metadata(dst.path().join("x"))?.permissions().mode() & 0o777, 0o755);
        assert_eq!(fs::read_link(dst.path().join("l"))?, Path::new("d/e/f"));
        Ok(())
    }

    /// Counts `syncfs` calls and checks every file is in place when it comes.
    #[derive(Debug, Default)]
    struct SyncsAfterAll {
        expect: PathBuf,
        syncs: AtomicU64,
    }

    impl Durability for SyncsAfterAll {
        fn sync_file(&self, _file: &fs::File, _path: &Path) -> io::Result<()> {
            Err(io::Error::other("an extraction syncs its file system, not each file"))
        }

        fn sync_dir(&self, _dir: &Path) -> io::Result<()> {
            Err(io::Error::other("an extraction syncs its file system, not each directory"))
        }

        fn sync_fs(&self, _dir: &Path) -> io::Result<()> {
            assert!(self.expect.exists(), "synced before the last entry was written");
            self.syncs.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    /// `fsync=true` on an upload syncs the file system once, after the last entry; without it,
    /// never.
    #[tokio::test]
    async fn an_extraction_with_fsync_syncs_once_at_the_end() -> Result<(), Box<dyn std::error::Error>> {
        let src = sample_tree()?;
        let tar = archive_of(src.path())?;
        for fsync in [true, false] {
            let dst = tempfile::tempdir()?;
            let recorder: &'static SyncsAfterAll =
                Box::leak(Box::new(SyncsAfterAll { expect: dst.path().join("x"), ..Default::default() }));
            let limits =
                Unpacking { sync: fsync.then_some(recorder as &'static dyn Durability), ..Unpacking::default() };
            let done = extract_into(dst.path().to_path_buf(), Body::from(tar.clone()), 0, limits).await?;
            assert_eq!(done.entries, 5);
            assert_eq!(recorder.syncs.load(Ordering::Relaxed), u64::from(fsync));
        }
        Ok(())
    }

    #[test]
    fn gzip_is_detected_by_its_magic() -> io::Result<()> {
        let src = sample_tree()?;
        let tar = archive_of(src.path())?;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        io::Write::write_all(&mut gz, &tar)?;
        let gz = gz.finish()?;
        assert_eq!(gz[..2], GZIP_MAGIC);
        let dst = tempfile::tempdir()?;
        let counts = unpack(&gz[..], dst.path(), Unpacking::default(), &Arc::default())
            .map_err(|r| io::Error::other(format!("{r:?}")))?;
        assert_eq!(counts.entries, 5);
        assert_eq!(fs::read(dst.path().join("x"))?, b"exec");
        Ok(())
    }

    /// A tar of one file of `len` zero bytes, gzipped.
    fn zeros_gz(len: usize) -> io::Result<Vec<u8>> {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(len as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append_data(&mut header, "zeros", io::repeat(0).take(len as u64))?;
        let tar = builder.into_inner()?;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        io::Write::write_all(&mut gz, &tar)?;
        gz.finish()
    }

    #[test]
    fn a_gzip_bomb_stops_at_the_disk_limit() -> io::Result<()> {
        let bomb = zeros_gz(16 << 20)?;
        assert!(bomb.len() < 64 << 10, "{}", bomb.len());
        let dst = tempfile::tempdir()?;
        let limits = Unpacking { disk: 1 << 20, ratio: 0, owner: None, sync: None };
        let refused = unpack(&bomb[..], dst.path(), limits, &Arc::default()).err();
        let msg = refused.map(|r| r.into_error(dst.path()).to_string()).unwrap_or_default();
        assert!(msg.contains("disk limit of 1048576 bytes") && msg.contains("`zeros`"), "{msg}");
        // Refused before a byte of it was written.
        assert!(!dst.path().join("zeros").exists());
        Ok(())
    }

    #[test]
    fn a_gzip_bomb_stops_at_the_expansion_ratio() -> io::Result<()> {
        let bomb = zeros_gz(32 << 20)?;
        let dst = tempfile::tempdir()?;
        let limits = Unpacking { disk: 0, ratio: 100, owner: None, sync: None };
        let refused = unpack(&bomb[..], dst.path(), limits, &Arc::default()).err();
        let err = refused.map(|r| r.into_error(dst.path()));
        assert!(matches!(err, Some(DaemonError::Expansion { ratio: 100 })), "{err:?}");
        assert_eq!(err.map(|e| e.code()), Some(sandman_wire::ErrorCode::TooLarge));
        let written = fs::metadata(dst.path().join("zeros")).map(|m| m.len()).unwrap_or(0);
        assert!(written <= 100 * bomb.len() as u64 + EXPANSION_SLACK, "{written} bytes written");
        // Within the ratio, the same archive unpacks whole.
        let dst = tempfile::tempdir()?;
        let small = zeros_gz(64 << 10)?;
        assert!(unpack(&small[..], dst.path(), limits, &Arc::default()).is_ok());
        Ok(())
    }

    #[test]
    fn a_2000_deep_path_is_refused_before_anything_is_made() -> io::Result<()> {
        let deep = "d/".repeat(2000) + "f";
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(1);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append_data(&mut header, &deep, &b"x"[..])?;
        let tar = builder.into_inner()?;
        assert!(tar.len() < 16 << 10);
        let dst = tempfile::tempdir()?;
        let msg = refusal_message(&tar, dst.path());
        assert!(msg.contains("is 2001 levels deep, over the limit of 256 levels"), "{msg}");
        assert!(msg.len() < 400, "the whole name was put in the message: {}", msg.len());
        assert!(!dst.path().join("d").exists());
        Ok(())
    }

    #[test]
    fn an_abandoned_extraction_stops_at_its_next_read() -> io::Result<()> {
        let src = sample_tree()?;
        let tar = archive_of(src.path())?;
        let progress = Arc::new(Progress::default());
        drop(AbandonOnDrop(Arc::clone(&progress)));
        let dst = tempfile::tempdir()?;
        let refused = unpack(&tar[..], dst.path(), Unpacking::default(), &progress).err();
        assert_eq!(progress.stopped(), Some(Stop::Abandoned), "{refused:?}");
        assert!(fs::read_dir(dst.path())?.next().is_none(), "something was unpacked for nobody");
        Ok(())
    }

    #[test]
    fn an_empty_upload_unpacks_nothing() {
        let dst = Path::new("/nonexistent-sandman-test");
        assert_eq!(unpack(&[][..], dst, Unpacking::default(), &Arc::default()).ok(), Some(Counts::default()));
    }

    #[test]
    fn garbage_is_an_unreadable_archive() -> io::Result<()> {
        let dst = tempfile::tempdir()?;
        let msg = refusal_message(&[7u8; 1024], dst.path());
        assert!(msg.starts_with("cannot read the tar archive"), "{msg}");
        Ok(())
    }

    #[tokio::test]
    async fn download_then_extract_round_trips_through_the_handlers() -> Result<(), Box<dyn std::error::Error>> {
        let src = sample_tree()?;
        let response = download(ApiQuery(PathQuery { path: shown(src.path()) })).await?;
        let content_type = response.headers().get(header::CONTENT_TYPE).map(|v| v.as_bytes().to_vec());
        assert_eq!(content_type.as_deref(), Some(&b"application/x-tar"[..]));
        let tar = axum::body::to_bytes(response.into_body(), usize::MAX).await?;
        let dst = tempfile::tempdir()?;
        let target = dst.path().join("new/dir");
        let result = extract_into(target.clone(), Body::from(tar), 0, Unpacking::default()).await?;
        assert_eq!((result.path, result.entries, result.bytes), (shown(&target), 5, 8));
        assert_eq!(fs::read(target.join("d/e/f"))?, b"deep");
        Ok(())
    }

    #[tokio::test]
    async fn download_of_a_file_holds_it_by_its_base_name() -> Result<(), Box<dyn std::error::Error>> {
        let src = sample_tree()?;
        let response = download(ApiQuery(PathQuery { path: shown(&src.path().join("d/e/f")) })).await?;
        let tar = axum::body::to_bytes(response.into_body(), usize::MAX).await?;
        let mut archive = tar::Archive::new(&tar[..]);
        let names: Vec<String> =
            archive.entries()?.map(|e| e.and_then(|e| Ok(shown(&e.path()?)))).collect::<io::Result<_>>()?;
        assert_eq!(names, ["f"]);
        Ok(())
    }

    #[tokio::test]
    async fn download_of_a_missing_path_is_not_found_before_any_byte() {
        let err = download(ApiQuery(PathQuery { path: "/nonexistent-sandman-test/x".into() })).await.err();
        assert_eq!(err.map(|e| e.code()), Some(sandman_wire::ErrorCode::NotFound));
    }

    #[test]
    fn a_stalled_upload_is_told_apart_from_a_bad_archive() {
        let stalled = io::Error::new(io::ErrorKind::TimedOut, axum::Error::new(BodyStalled));
        // tar wraps what it read in an error of its own.
        let wrapped = io::Error::other(stalled);
        assert!(Refusal::Read(wrapped).is_stall());
        assert!(!Refusal::Read(io::Error::other("bad header")).is_stall());
    }

    /// Before, the answer went out once tar read the archive's end, and the padding after it
    /// (Python's tarfile and GNU tar pad to 10 KiB) was left unread: the daemon closed the
    /// connection while the client (the server's proxy) was still writing it, and the call
    /// failed with a broken pipe about one time in five.
    #[tokio::test]
    async fn what_follows_the_archives_end_is_read_before_the_answer() -> Result<(), Box<dyn std::error::Error>> {
        let src = sample_tree()?;
        let tar = archive_of(src.path())?;
        let pulled = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&pulled);
        let chunks = [Bytes::from(tar), Bytes::from(vec![0u8; 8192]), Bytes::from(vec![0u8; 8192])];
        let body = Body::from_stream(futures_util::stream::iter(chunks).map(move |c| {
            counter.fetch_add(1, Ordering::Relaxed);
            Ok::<_, io::Error>(c)
        }));
        let dst = tempfile::tempdir()?;
        let done = extract_into(dst.path().to_path_buf(), body, 0, Unpacking::default()).await?;
        assert_eq!(done.entries, 5);
        assert_eq!(pulled.load(Ordering::Relaxed), 3, "the padding after the archive was not read");
        Ok(())
    }

    #[tokio::test]
    async fn extract_over_the_limit_is_too_large() -> Result<(), Box<dyn std::error::Error>> {
        let src = sample_tree()?;
        let tar = archive_of(src.path())?;
        let chunks: Vec<io::Result<Bytes>> = tar.chunks(512).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        let dst = tempfile::tempdir()?;
        let body = Body::from_stream(futures_util::stream::iter(chunks));
        let err = extract_into(dst.path().to_path_buf(), body, 1024, Unpacking::default()).await.err();
        assert!(matches!(err, Some(DaemonError::TooLarge { limit: 1024 })), "{err:?}");
        Ok(())
    }
}
