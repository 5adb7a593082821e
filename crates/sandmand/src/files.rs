//! File calls of the daemon API: streamed reads, atomic writes, stat, listing, mkdir -p, remove, rename.

use std::ffi::{OsStr, OsString};
use std::fs::{self, Metadata, Permissions};
use std::io::{self, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Json;
use axum::body::{Body, HttpBody};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use sandman_wire::bounds;
use sandman_wire::daemon::{
    DirListing, FileKind, FileStat, ListDirQuery, MkdirQuery, MoveRequest, PathQuery, ReadFileQuery, RemoveQuery,
    WriteFileQuery,
};
use sandman_wire::mode::parse_octal_mode;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio_util::io::ReaderStream;

use crate::error::{DaemonError, DaemonResult};
use crate::extract::{ApiJson, ApiQuery, is_length_limit, is_stalled, unstalled};
use crate::owner::{self, Owner};
use crate::state::Daemon;
use crate::sys::random_hex;

/// A listing stops after this many entries and says it was truncated.
pub const MAX_LIST_ENTRIES: usize = 10_000;
/// Deepest listing accepted (`depth=1` lists the children only).
pub const MAX_LIST_DEPTH: u32 = 64;
/// Mode of a written file when the request names none.
pub const DEFAULT_FILE_MODE: u32 = 0o644;
/// Mode of created directories: parents created on the way, and `mkdir` without a mode.
pub const DEFAULT_DIR_MODE: u32 = 0o755;
/// Size of the reads that feed a streamed response body.
const READ_CHUNK: usize = 64 * 1024;
/// Files that report no size (procfs, devices) are read this far ahead, so that the usual small
/// ones are answered with an exact `content-length`; longer ones are streamed without one.
const UNSIZED_PREFETCH: u64 = 64 * 1024;
/// Bytes of the target's name kept in a temporary file's name, well below `NAME_MAX` (255).
const TEMP_NAME_KEEP: usize = 100;

/// Checks that `path` is absolute and free of NUL bytes; nothing else is normalised.
pub fn absolute(path: &str) -> DaemonResult<PathBuf> {
    if path.is_empty() {
        return Err(DaemonError::InvalidArgument("path is empty; give an absolute path".into()));
    }
    if path.contains('\0') {
        return Err(DaemonError::InvalidArgument(format!("path `{}` contains a NUL byte", path.escape_debug())));
    }
    if !path.starts_with('/') {
        return Err(DaemonError::InvalidArgument(format!("path `{path}` is not absolute")));
    }
    // Walking a path costs in proportion to its depth, at every call that names it.
    bounds::check_path_depth("path", path).map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
    Ok(PathBuf::from(path))
}

/// Describes `path` from its `lstat` metadata; a symlink's target is read, not followed.
pub fn stat_of(path: &Path, meta: &Metadata) -> FileStat {
    let ft = meta.file_type();
    let kind = if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    let link_target =
        if ft.is_symlink() { fs::read_link(path).ok().map(|t| t.to_string_lossy().into_owned()) } else { None };
    FileStat {
        path: shown(path),
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime_ms: meta.mtime().saturating_mul(1000).saturating_add(meta.mtime_nsec() / 1_000_000),
        link_target,
    }
}

/// `GET /v1/files?path=&offset=&length=`: the file's bytes, streamed.
pub async fn read_file(ApiQuery(q): ApiQuery<ReadFileQuery>) -> DaemonResult<Response> {
    q.check_bounds().map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
    let path = absolute(&q.path)?;
    let meta = tokio::fs::metadata(&path).await.map_err(|e| DaemonError::io("read", &q.path, e))?;
    let ft = meta.file_type();
    if ft.is_dir() {
        return Err(DaemonError::InvalidArgument(format!("`{}` is a directory", q.path)));
    }
    if ft.is_fifo() || ft.is_socket() {
        // Opening a FIFO would wait for a writer; neither has contents to read.
        return Err(DaemonError::InvalidArgument(format!("`{}` is not a regular file", q.path)));
    }
    let want = q.length.unwrap_or(u64::MAX);
    let sized = ft.is_file() && meta.len() > 0;
    if sized && q.offset >= meta.len() {
        return Ok(octet_stream(Body::empty(), Some(0)));
    }
    let mut file = tokio::fs::File::open(&path).await.map_err(|e| DaemonError::io("open", &q.path, e))?;
    if q.offset > 0 {
        file.seek(SeekFrom::Start(q.offset)).await.map_err(|e| DaemonError::io("seek in", &q.path, e))?;
    }
    if sized {
        // The length is fixed now; a file that shrinks meanwhile ends the response early, which
        // the client sees as a broken body rather than as silently short contents.
        let len = (meta.len() - q.offset).min(want);
        let body = Body::from_stream(ReaderStream::with_capacity(file.take(len), READ_CHUNK));
        return Ok(octet_stream(body, Some(len)));
    }
    let ahead = want.min(UNSIZED_PREFETCH);
    let mut head = Vec::new();
    (&mut file).take(ahead).read_to_end(&mut head).await.map_err(|e| DaemonError::io("read", &q.path, e))?;
    let got = head.len() as u64;
    if got < ahead || got == want {
        return Ok(octet_stream(Body::from(head), Some(got)));
    }
    let head = futures_util::stream::once(std::future::ready(Ok::<_, io::Error>(Bytes::from(head))));
    let rest = ReaderStream::with_capacity(file.take(want - got), READ_CHUNK);
    Ok(octet_stream(Body::from_stream(head.chain(rest)), None))
}

fn octet_stream(body: Body, len: Option<u64>) -> Response {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    if let Some(len) = len {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    response
}

/// `PUT /v1/files?path=&mode=`: writes the body to a temporary file beside the target and
/// renames it over the target, so readers see the old contents or the new, never a part.
/// Missing parents are created. A symlink to an existing file is written through (the file it
/// points to is replaced); a dangling one is replaced itself. With `user`, the file and the
/// parents created belong to that user. With `fsync`, the file and its directory are synced
/// before the answer. Answers the written file's stat.
pub async fn write_file(
    State(daemon): State<Arc<Daemon>>,
    ApiQuery(q): ApiQuery<WriteFileQuery>,
    body: Body,
) -> DaemonResult<Json<FileStat>> {
    let checked = absolute(&q.path).and_then(|requested| {
        Ok((requested, parse_mode(q.mode.as_deref(), DEFAULT_FILE_MODE)?, Owner::of(&daemon, q.user.as_deref())?))
    });
    let (requested, mode, owner) = match checked {
        Ok(checked) => checked,
        Err(refused) => return Err(read_rest(body, refused).await),
    };
    let limit = Upload { max: daemon.config.max_upload_bytes, disk: daemon.config.limits.disk_bytes };
    let sync = q.fsync.then_some(&Fsync as &'static dyn Durability);
    write_atomically(&requested, Written { mode, owner, sync }, body, limit).await.map(Json)
}

/// Reads what is left of an upload refused before it was read (up to
/// [`crate::archive::LINGER_BYTES`]) and answers `refused`: a client still sending the body gets
/// the answer, rather than a connection closed under its write (which a proxy in between reports
/// as the sandbox not answering).
pub(crate) async fn read_rest(body: Body, refused: DaemonError) -> DaemonError {
    let mut chunks = unstalled(body);
    let mut left = crate::archive::LINGER_BYTES;
    while left > 0
        && let Some(Ok(more)) = chunks.next().await
    {
        left = left.saturating_sub(more.len() as u64);
    }
    refused
}

/// How written data is made durable: `fsync` for real, a recorder in tests (so that a test sees
/// that `fsync=true` syncs, and what, without timing anything).
pub(crate) trait Durability: Send + Sync + std::fmt::Debug {
    /// Syncs a written file before it is renamed over its target.
    fn sync_file(&self, file: &fs::File, path: &Path) -> io::Result<()>;
    /// Syncs a directory, so that a name made or replaced in it is durable too.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Syncs the whole file system holding `dir` (an archive's many files, in one call).
    fn sync_fs(&self, dir: &Path) -> io::Result<()>;
}

/// The real [`Durability`]: `fsync(2)` and `syncfs(2)`.
#[derive(Debug)]
pub(crate) struct Fsync;

impl Durability for Fsync {
    fn sync_file(&self, file: &fs::File, _path: &Path) -> io::Result<()> {
        file.sync_all()
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        fs::File::open(dir)?.sync_all()
    }

    fn sync_fs(&self, dir: &Path) -> io::Result<()> {
        crate::sys::syncfs(&fs::File::open(dir)?)
    }
}

/// What a written file becomes: its mode, its owner, and whether (and how) it is synced.
#[derive(Debug, Clone, Copy)]
struct Written {
    mode: u32,
    owner: Option<Owner>,
    sync: Option<&'static dyn Durability>,
}

/// Bodies whose length is known and at most this are read whole, then written in one step on
/// the blocking pool: one hand-over to a thread for the whole write rather than one per system
/// call, which is most of what a small write costs.
const SMALL_WRITE: u64 = 256 * 1024;

/// How much an upload may write: the largest upload and the sandbox's disk (0 = no limit).
#[derive(Debug, Clone, Copy, Default)]
struct Upload {
    max: u64,
    disk: u64,
}

impl Upload {
    /// The refusal of an upload of `len` bytes, if it is refused.
    fn refuse(&self, len: u64) -> Option<DaemonError> {
        if self.max > 0 && len > self.max {
            Some(DaemonError::TooLarge { limit: self.max })
        } else if self.disk > 0 && len > self.disk {
            Some(DaemonError::DiskLimit { limit: self.disk, what: "the upload".into() })
        } else {
            None
        }
    }
}

/// The work of [`write_file`]: `body` into `requested` as `written` says, within `limit`.
async fn write_atomically(requested: &Path, written: Written, body: Body, limit: Upload) -> DaemonResult<FileStat> {
    let hint = body.size_hint();
    if let Some(refused) = limit.refuse(hint.lower()) {
        return Err(refused);
    }
    if hint.upper().is_some_and(|len| len <= SMALL_WRITE) {
        let data = read_small(body, limit).await?;
        if written.sync.is_none() && local_parent(requested) {
            // A symlink may lead elsewhere: its target's directory is checked too.
            let target = write_target(requested)?;
            if target.parent() == requested.parent() || local_parent(&target) {
                // The replaced file, if any, is closed here too: see `local_parent`.
                let (stat, _replaced) = write_whole_to(&target, written, &data)?;
                return Ok(stat);
            }
            return blocking_replacing(move || write_whole_to(&target, written, &data)).await;
        }
        let requested = requested.to_path_buf();
        return blocking_replacing(move || write_whole(&requested, written, &data)).await;
    }
    let requested = requested.to_path_buf();
    let (target, temp, file) = blocking(move || {
        let target = write_target(&requested)?;
        let (temp, file) = create_temp(&target, written.owner)?;
        Ok((target, temp, file))
    })
    .await?;
    // From here on every way out, an error or the request being dropped, removes the file.
    let mut guard = TempFile::new(temp.clone());
    let mut file = tokio::fs::File::from_std(file);
    copy_body(body, &mut file, limit, &temp).await?;
    let file = file.into_std().await;
    let stat = blocking_replacing(move || finish(&file, &temp, &target, written)).await?;
    guard.keep();
    Ok(stat)
}

/// Whether `target`'s directory is on a local file system whose writes into memory do not wait
/// on a device or a network (tmpfs, overlayfs, ext2/3/4, XFS, Btrfs): a small write there without
/// `fsync` is written on the daemon's own thread, and the file it replaced closed there too.
/// Handing it to the blocking pool and back cost two context switches, a quarter of a small
/// write's round trip through the server on this project's test machine (closing the replaced
/// file on the pool after the answer kept half of that). What it costs instead: a replaced file
/// whose blocks were written out, on a disk mounted with `discard`, waits for their trim in that
/// close (tens of microseconds here), and meanwhile the daemon's other calls wait too. On a
/// network or FUSE file system a write may wait without bound: it goes to the pool, as does
/// every write whose directory does not exist yet.
fn local_parent(target: &Path) -> bool {
    const LOCAL: [i64; 5] = [
        libc::TMPFS_MAGIC,
        libc::OVERLAYFS_SUPER_MAGIC,
        libc::EXT4_SUPER_MAGIC,
        libc::XFS_SUPER_MAGIC,
        libc::BTRFS_SUPER_MAGIC,
    ];
    target.parent().and_then(|dir| crate::sys::fs_type(dir).ok()).is_some_and(|t| LOCAL.contains(&t))
}

/// Runs a write's last step (`work`) as [`blocking`] does, answering its file's stat as soon as
/// there is one; the file it replaced, if any, is closed after that, by the same thread of the
/// blocking pool. Its last close frees its blocks, which on a file system mounted with
/// `discard` (ext4 without a journal does it at once) waits for the disk to trim them: the
/// answer need not wait for that, and handing the close to another thread of the pool would
/// cost two more context switches per write.
async fn blocking_replacing<F>(work: F) -> DaemonResult<FileStat>
where
    F: FnOnce() -> DaemonResult<(FileStat, Option<fs::File>)> + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    drop(tokio::task::spawn_blocking(move || {
        let (answer, replaced) = match work() {
            Ok((stat, replaced)) => (Ok(stat), replaced),
            Err(e) => (Err(e), None),
        };
        let _ = tx.send(answer);
        drop(replaced);
    }));
    rx.await.map_err(|_| DaemonError::Internal("file system task failed".into()))?
}

/// A small body, read whole (still cut when it stalls or passes `limit`).
async fn read_small(body: Body, limit: Upload) -> DaemonResult<Vec<u8>> {
    let mut chunks = unstalled(body);
    let mut data = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| body_error(&e, limit.max))?;
        if let Some(refused) = limit.refuse((data.len() + chunk.len()) as u64) {
            return Err(refused);
        }
        data.extend_from_slice(&chunk);
    }
    Ok(data)
}

/// A whole write of `data` into `requested`, on the calling (blocking) thread; with the file it
/// replaced, as [`finish`] answers.
fn write_whole(requested: &Path, written: Written, data: &[u8]) -> DaemonResult<(FileStat, Option<fs::File>)> {
    write_whole_to(&write_target(requested)?, written, data)
}

/// [`write_whole`] once the target is known ([`write_target`]).
fn write_whole_to(target: &Path, written: Written, data: &[u8]) -> DaemonResult<(FileStat, Option<fs::File>)> {
    let (temp, mut file) = create_temp(target, written.owner)?;
    let mut guard = TempFile::new(temp.clone());
    io::Write::write_all(&mut file, data).map_err(|e| DaemonError::io("write", shown(&temp), e))?;
    let done = finish(&file, &temp, target, written)?;
    guard.keep();
    Ok(done)
}

/// Makes the missing parents of `target` and a new temporary file beside it (0600 until
/// [`finish`] sets its mode), returning its path and the open file.
fn create_temp(target: &Path, owner: Option<Owner>) -> DaemonResult<(PathBuf, fs::File)> {
    let (dir, name) = split(target)?;
    owner::create_dirs(dir, owner)?;
    let temp = dir.join(temp_name(name));
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temp)
        .map_err(|e| DaemonError::io("create temporary file", shown(&temp), e))?;
    Ok((temp, file))
}

/// Gives the written temporary file its owner and mode, syncs it when asked, puts it in
/// `target`'s place ([`replace`]: the one moment the new contents become visible, whole), then
/// syncs the directory when asked. Answers the target's stat, and the file it replaced, if any,
/// still open (`O_PATH`): its blocks are freed when that is closed, which
/// [`blocking_replacing`] does after the answer.
fn finish(file: &fs::File, temp: &Path, target: &Path, written: Written) -> DaemonResult<(FileStat, Option<fs::File>)> {
    // Before the mode: a change of owner clears the setuid and setgid bits.
    if let Some(owner) = written.owner {
        owner.give_file(file, temp)?;
    }
    // chmod rather than the create mode, so that the umask does not apply.
    file.set_permissions(Permissions::from_mode(written.mode))
        .map_err(|e| DaemonError::io("set the mode of", shown(temp), e))?;
    if let Some(sync) = written.sync {
        sync.sync_file(file, temp).map_err(|e| DaemonError::io("sync", shown(temp), e))?;
    }
    let meta = file.metadata().map_err(|e| DaemonError::io("stat", shown(temp), e))?;
    // Whatever is there (a file, a dangling symlink itself): nothing there is nothing to hold.
    let replaced = fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_NOFOLLOW).open(target).ok();
    // Nothing there to exchange with: a rename, without a failed exchange first.
    let put = if replaced.is_some() { replace(temp, target) } else { fs::rename(temp, target) };
    put.map_err(|e| DaemonError::io("replace", shown(target), e))?;
    if let Some(sync) = written.sync {
        let (dir, _) = split(target)?;
        sync.sync_dir(dir).map_err(|e| DaemonError::io("sync the directory", shown(dir), e))?;
    }
    Ok((stat_of(target, &meta), replaced))
}

/// Puts the file at `temp` in `target`'s place. Where `target` exists, the two are exchanged
/// (`renameat2(RENAME_EXCHANGE)`) and the old one, now at `temp`, is unlinked; otherwise (or where
/// the file system cannot exchange) `temp` is renamed. Why not always rename: ext4 (with its
/// default `auto_da_alloc`) allocates the delayed blocks of a file renamed over another and starts
/// writing them out, in the rename, and every allocated block is freed again when the next write
/// replaces the file, which on a file system mounted `discard` waits for the device to trim it.
/// An exchange leaves a new file's blocks delayed, so that a file rewritten before the kernel
/// writes it back (30 s by default) never has any: on this project's test machine (root ext4,
/// `discard`) a write-and-replace of 1 KiB in a loop took 10–13 µs against 74–105 µs with the
/// rename, counting the freeing of the replaced file. A directory found at `target` (put there
/// since [`write_target`] looked) is exchanged back and refused.
fn replace(temp: &Path, target: &Path) -> io::Result<()> {
    match crate::sys::exchange(temp, target) {
        Ok(()) => match fs::remove_file(temp) {
            Ok(()) => Ok(()),
            Err(e) => {
                // The old entry could not go: a directory, most likely. Put it back.
                let _ = crate::sys::exchange(temp, target);
                Err(e)
            }
        },
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP | libc::EXDEV)
            ) =>
        {
            fs::rename(temp, target)
        }
        Err(e) => Err(e),
    }
}

/// The file a write replaces: `path`, or the file an existing symlink there points to.
fn write_target(path: &Path) -> DaemonResult<PathBuf> {
    let is_dir = |p: &Path| DaemonError::InvalidArgument(format!("`{}` is a directory", shown(p)));
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Err(is_dir(path)),
        Ok(meta) if meta.file_type().is_symlink() => match fs::canonicalize(path) {
            Ok(real) => match fs::metadata(&real) {
                Ok(meta) if meta.is_dir() => Err(is_dir(path)),
                _ => Ok(real),
            },
            Err(_) => Ok(path.to_path_buf()),
        },
        Ok(_) => Ok(path.to_path_buf()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(path.to_path_buf()),
        Err(e) => Err(DaemonError::io("stat", shown(path), e)),
    }
}

/// Streams the request body into `file`, refusing it past `limit`.
async fn copy_body(body: Body, file: &mut tokio::fs::File, limit: Upload, temp: &Path) -> DaemonResult<u64> {
    let mut chunks = unstalled(body);
    let mut written = 0u64;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| body_error(&e, limit.max))?;
        written = written.saturating_add(chunk.len() as u64);
        if let Some(refused) = limit.refuse(written) {
            // The rest of the body, up to a cap, so that the client gets the answer.
            let mut left = crate::archive::LINGER_BYTES;
            while left > 0
                && let Some(Ok(more)) = chunks.next().await
            {
                left = left.saturating_sub(more.len() as u64);
            }
            return Err(refused);
        }
        file.write_all(&chunk).await.map_err(|e| DaemonError::io("write", shown(temp), e))?;
    }
    file.flush().await.map_err(|e| DaemonError::io("write", shown(temp), e))?;
    Ok(written)
}

/// The answer to a failure reading a request body: `too_large` when a length limit cut it.
pub(crate) fn body_error(err: &axum::Error, limit: u64) -> DaemonError {
    if is_length_limit(err) {
        DaemonError::TooLarge { limit }
    } else if is_stalled(err) {
        DaemonError::Stalled(err.to_string())
    } else {
        DaemonError::InvalidArgument(format!("cannot read request body: {err}"))
    }
}

/// A temporary file that is removed when dropped unless [`TempFile::keep`] was called.
#[derive(Debug)]
struct TempFile {
    path: Option<PathBuf>,
}

impl TempFile {
    fn new(path: PathBuf) -> Self {
        TempFile { path: Some(path) }
    }

    fn keep(&mut self) {
        self.path = None;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.path.take() {
            // One unlink; it may already be gone, which is what we want anyway.
            let _ = fs::remove_file(path);
        }
    }
}

/// `.{name}.sandman-{random}` in the same directory, so that the final rename stays on one
/// filesystem and is atomic.
fn temp_name(name: &OsStr) -> OsString {
    let bytes = name.as_bytes();
    let kept = OsStr::from_bytes(&bytes[..bytes.len().min(TEMP_NAME_KEEP)]);
    let mut temp = OsString::from(".");
    temp.push(kept);
    temp.push(sandman_wire::daemon::TEMP_MARK);
    temp.push(random_hex());
    temp
}

/// The directory and the name of a path that names a file (not `/`, not ending in `..`).
fn split(path: &Path) -> DaemonResult<(&Path, &OsStr)> {
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => Ok((dir, name)),
        _ => Err(DaemonError::InvalidArgument(format!("`{}` does not name a file", shown(path)))),
    }
}

fn parse_mode(text: Option<&str>, default: u32) -> DaemonResult<u32> {
    text.map_or(Ok(default), |t| parse_octal_mode(t).map_err(DaemonError::InvalidArgument))
}

/// `GET /v1/stat?path=`: metadata of the path itself (symlinks are described, not followed).
pub async fn stat(ApiQuery(q): ApiQuery<PathQuery>) -> DaemonResult<Json<FileStat>> {
    let path = absolute(&q.path)?;
    blocking(move || {
        let meta = fs::symlink_metadata(&path).map_err(|e| DaemonError::io("stat", shown(&path), e))?;
        Ok(Json(stat_of(&path, &meta)))
    })
    .await
}

/// `GET /v1/dir?path=&depth=`: the entries below a directory, by name, depth first.
pub async fn list_dir(ApiQuery(q): ApiQuery<ListDirQuery>) -> DaemonResult<Json<DirListing>> {
    let root = absolute(&q.path)?;
    let depth = q.depth.unwrap_or(1);
    if depth == 0 || depth > MAX_LIST_DEPTH {
        return Err(DaemonError::InvalidArgument(format!(
            "depth {depth} is out of range: 1 lists the children only, at most {MAX_LIST_DEPTH}"
        )));
    }
    blocking(move || list(&root, depth, MAX_LIST_ENTRIES).map(Json)).await
}

/// Lists `root` (which may be a symlink to a directory) down to `depth` levels without following
/// symlinks below it, stopping after `max` entries.
fn list(root: &Path, depth: u32, max: usize) -> DaemonResult<DirListing> {
    let meta = fs::metadata(root).map_err(|e| DaemonError::io("list", shown(root), e))?;
    if !meta.is_dir() {
        return Err(DaemonError::InvalidArgument(format!("`{}` is not a directory", shown(root))));
    }
    let children = sorted_names(root).map_err(|e| DaemonError::io("list", shown(root), e))?;
    let mut entries = Vec::new();
    let truncated = walk(root, children, depth, max, &mut entries);
    Ok(DirListing { path: shown(root), entries, truncated })
}

/// Appends `children` of `dir` and, while `depth` allows, what is below them. True when it
/// stopped because `out` already held `max` entries and another one followed.
fn walk(dir: &Path, children: Vec<OsString>, depth: u32, max: usize, out: &mut Vec<FileStat>) -> bool {
    for name in children {
        let path = dir.join(name);
        let Ok(meta) = fs::symlink_metadata(&path) else {
            continue; // removed since the directory was read
        };
        if out.len() >= max {
            return true;
        }
        out.push(stat_of(&path, &meta));
        if depth > 1 && meta.is_dir() {
            // A subdirectory that cannot be read is listed, but not entered.
            if let Ok(grandchildren) = sorted_names(&path)
                && walk(&path, grandchildren, depth - 1, max, out)
            {
                return true;
            }
        }
    }
    false
}

/// The names in `dir`, sorted bytewise.
pub(crate) fn sorted_names(dir: &Path) -> io::Result<Vec<OsString>> {
    let mut names = fs::read_dir(dir)?.map(|e| e.map(|e| e.file_name())).collect::<io::Result<Vec<_>>>()?;
    names.sort();
    Ok(names)
}

/// `POST /v1/dir?path=&mode=&user=`: mkdir -p. Parents are created 0755 and the directory itself
/// with `mode` (default 0755), those created given to `user`; an existing directory is left as
/// it is.
pub async fn mkdir(
    State(daemon): State<Arc<Daemon>>,
    ApiQuery(q): ApiQuery<MkdirQuery>,
) -> DaemonResult<Json<FileStat>> {
    let path = absolute(&q.path)?;
    let mode = parse_mode(q.mode.as_deref(), DEFAULT_DIR_MODE)?;
    let owner = Owner::of(&daemon, q.user.as_deref())?;
    blocking(move || make_dir(&path, mode, owner).map(Json)).await
}

fn make_dir(path: &Path, mode: u32, owner: Option<Owner>) -> DaemonResult<FileStat> {
    match fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(DaemonError::Conflict(format!("`{}` exists and is not a directory", shown(path))));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            owner::create_dirs(path, owner)?;
            // chmod rather than the create mode, so that the umask does not apply.
            fs::set_permissions(path, Permissions::from_mode(mode))
                .map_err(|e| DaemonError::io("set the mode of", shown(path), e))?;
        }
        Err(e) => return Err(DaemonError::io("create directory", shown(path), e)),
    }
    let meta = fs::symlink_metadata(path).map_err(|e| DaemonError::io("stat", shown(path), e))?;
    Ok(stat_of(path, &meta))
}

/// `DELETE /v1/files?path=&recursive=`: removes a file, a symlink (never what it points to), an
/// empty directory, or with `recursive` a whole tree.
pub async fn remove(ApiQuery(q): ApiQuery<RemoveQuery>) -> DaemonResult<StatusCode> {
    let path = absolute(&q.path)?;
    if path.file_name().is_none() {
        return Err(DaemonError::InvalidArgument(format!("refusing to remove `{}`", q.path)));
    }
    blocking(move || remove_path(&path, q.recursive)).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn remove_path(path: &Path, recursive: bool) -> DaemonResult<()> {
    let failed = |e| DaemonError::io("remove", shown(path), e);
    let meta = fs::symlink_metadata(path).map_err(failed)?;
    if !meta.is_dir() {
        return fs::remove_file(path).map_err(failed);
    }
    if recursive {
        return fs::remove_dir_all(path).map_err(failed);
    }
    fs::remove_dir(path).map_err(|e| {
        if e.kind() == io::ErrorKind::DirectoryNotEmpty {
            DaemonError::Conflict(format!(
                "directory `{}` is not empty; pass recursive=true to remove it and everything in it",
                shown(path)
            ))
        } else {
            failed(e)
        }
    })
}

/// `POST /v1/move`: renames `from` to `to`, creating `to`'s missing parents. Across
/// filesystems a file or symlink is copied and then removed; a directory is refused.
pub async fn move_path(ApiJson(req): ApiJson<MoveRequest>) -> DaemonResult<Json<FileStat>> {
    let from = absolute(&req.from)?;
    let to = absolute(&req.to)?;
    if from.file_name().is_none() {
        return Err(DaemonError::InvalidArgument(format!("refusing to move `{}`", req.from)));
    }
    if to.file_name().is_none() {
        return Err(DaemonError::InvalidArgument(format!("cannot move anything onto `{}`", req.to)));
    }
    blocking(move || rename(&from, &to, req.overwrite).map(Json)).await
}

fn rename(from: &Path, to: &Path, overwrite: bool) -> DaemonResult<FileStat> {
    let meta = fs::symlink_metadata(from).map_err(|e| DaemonError::io("move", shown(from), e))?;
    if from != to {
        match fs::symlink_metadata(to) {
            Ok(_) if !overwrite => {
                return Err(DaemonError::Conflict(format!(
                    "`{}` already exists; pass overwrite=true to replace it",
                    shown(to)
                )));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(DaemonError::io("move to", shown(to), e)),
        }
    }
    if let Some(parent) = to.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(DEFAULT_DIR_MODE)
            .create(parent)
            .map_err(|e| DaemonError::io("create directory", shown(parent), e))?;
    }
    match fs::rename(from, to) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::CrossesDevices => move_across_filesystems(from, to, &meta)?,
        Err(e) => return Err(DaemonError::io("move", shown(from), e)),
    }
    let meta = fs::symlink_metadata(to).map_err(|e| DaemonError::io("stat", shown(to), e))?;
    Ok(stat_of(to, &meta))
}

/// Copies a file or symlink next to `to`, renames the copy over `to`, then removes `from`.
fn move_across_filesystems(from: &Path, to: &Path, meta: &Metadata) -> DaemonResult<()> {
    let ft = meta.file_type();
    if ft.is_dir() {
        return Err(DaemonError::InvalidArgument(format!(
            "cannot move directory `{}` to `{}`: they are on different filesystems; \
             download it as an archive and extract it there instead",
            shown(from),
            shown(to)
        )));
    }
    if !ft.is_file() && !ft.is_symlink() {
        return Err(DaemonError::InvalidArgument(format!(
            "cannot move `{}` to another filesystem: only files and symlinks can be copied",
            shown(from)
        )));
    }
    let (dir, name) = split(to)?;
    let temp = dir.join(temp_name(name));
    let mut guard = TempFile::new(temp.clone());
    let copy_failed = |e| DaemonError::io("copy", shown(from), e);
    if ft.is_symlink() {
        let target = fs::read_link(from).map_err(copy_failed)?;
        std::os::unix::fs::symlink(target, &temp).map_err(copy_failed)?;
    } else {
        // `fs::copy` keeps the permission bits; keep the modification time as well.
        fs::copy(from, &temp).map_err(copy_failed)?;
        let copy = fs::OpenOptions::new().write(true).open(&temp).map_err(copy_failed)?;
        if let Ok(mtime) = meta.modified() {
            copy.set_modified(mtime).map_err(copy_failed)?;
        }
        copy.sync_all().map_err(copy_failed)?;
    }
    fs::rename(&temp, to).map_err(|e| DaemonError::io("replace", shown(to), e))?;
    guard.keep();
    fs::remove_file(from).map_err(|e| DaemonError::io("remove after copying", shown(from), e))
}

/// Runs blocking file system work (several system calls in a row) off the async threads.
pub(crate) async fn blocking<T, F>(work: F) -> DaemonResult<T>
where
    T: Send + 'static,
    F: FnOnce() -> DaemonResult<T> + Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| DaemonError::Internal(format!("file system task failed: {e}")))?
}

/// A path as the wire shows it (lossy for names that are not UTF-8).
pub(crate) fn shown(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn code(err: &DaemonError) -> sandman_wire::ErrorCode {
        err.code()
    }

    #[test]
    fn absolute_refuses_relative_empty_and_nul() {
        assert_eq!(absolute("/tmp/x").ok(), Some(PathBuf::from("/tmp/x")));
        for bad in ["", "tmp/x", "./x", "/tmp/\0x"] {
            let err = absolute(bad).err();
            assert!(matches!(err, Some(DaemonError::InvalidArgument(_))), "{bad:?}: {err:?}");
        }
        let msg = absolute("a/b").err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(msg, "path `a/b` is not absolute");
    }

    #[test]
    fn only_writes_into_an_existing_directory_of_a_local_file_system_stay_on_the_daemons_thread() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let local = crate::sys::fs_type(dir.path())?;
        let known = [libc::TMPFS_MAGIC, libc::EXT4_SUPER_MAGIC, libc::XFS_SUPER_MAGIC, libc::BTRFS_SUPER_MAGIC];
        assert_eq!(local_parent(&dir.path().join("f")), known.contains(&local), "file system {local:#x}");
        // Not where writes may wait on something else, nor where the parents are still to make.
        assert!(!local_parent(Path::new("/proc/self/f")));
        assert!(!local_parent(&dir.path().join("missing/f")));
        let tmpfs = Path::new("/dev/shm");
        if crate::sys::fs_type(tmpfs).ok() == Some(libc::TMPFS_MAGIC) {
            assert!(local_parent(&tmpfs.join("f")));
        }
        Ok(())
    }

    #[test]
    fn a_small_write_to_a_local_file_system_needs_no_blocking_thread() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("f");
        assert!(local_parent(&target), "the tests' scratch directory is not on a local file system");
        // The blocking pool's one thread is taken for the whole write: a write that needed it
        // would wait (bounded only so that it fails rather than hangs).
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().max_blocking_threads(1).build()?;
        rt.block_on(async {
            let (release, held) = std::sync::mpsc::channel::<()>();
            let blocker = tokio::task::spawn_blocking(move || held.recv());
            let written = Written { mode: 0o644, owner: None, sync: None };
            let mut sizes = Vec::new();
            // The second write replaces the first's file, and closes it, on this thread too.
            for len in [1024, 2048] {
                let write = write_atomically(&target, written, Body::from(vec![b'x'; len]), Upload::default());
                let done = tokio::time::timeout(std::time::Duration::from_secs(60), write).await;
                sizes.push(done.map_err(|_| "a small local write waited for the blocking pool")??.size);
            }
            let _ = release.send(());
            let _ = blocker.await;
            assert_eq!(sizes, [1024, 2048]);
            assert_eq!(fs::read(&target)?.len(), 2048);
            Ok(())
        })
    }

    #[test]
    fn absolute_normalises_nothing() {
        assert_eq!(absolute("/a/../b/").ok(), Some(PathBuf::from("/a/../b/")));
    }

    #[test]
    fn stat_of_describes_symlinks_without_following() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("f");
        fs::write(&file, b"hello")?;
        fs::set_permissions(&file, Permissions::from_mode(0o640))?;
        let link = dir.path().join("l");
        symlink("f", &link)?;
        let s = stat_of(&file, &fs::symlink_metadata(&file)?);
        assert_eq!((s.kind, s.size, s.mode, s.link_target), (FileKind::File, 5, 0o640, None));
        assert!(s.mtime_ms > 0);
        let s = stat_of(&link, &fs::symlink_metadata(&link)?);
        assert_eq!((s.kind, s.link_target.as_deref()), (FileKind::Symlink, Some("f")));
        Ok(())
    }

    #[test]
    fn a_write_hands_back_the_file_it_replaced_still_open() -> Result<(), Box<dyn std::error::Error>> {
        // Its last close frees its blocks (a disk trim, with `discard`): the write hands it back
        // for `blocking_replacing` to close after the answer, rather than closing it on the way.
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("f");
        fs::write(&target, b"old")?;
        let old = fs::metadata(&target)?.ino();
        let written = Written { mode: 0o644, owner: None, sync: None };
        let (stat, replaced) = write_whole(&target, written, b"new")?;
        assert_eq!((stat.size, fs::read(&target)?), (3, b"new".to_vec()));
        let replaced = replaced.ok_or("the replaced file was not handed back")?;
        let held = replaced.metadata()?;
        assert_eq!((held.ino(), held.nlink()), (old, 0), "not the replaced file, or still linked");
        // A new file replaces nothing.
        let (_, replaced) = write_whole(&dir.path().join("g"), written, b"g")?;
        assert!(replaced.is_none());
        // Neither the temporary files nor the old file (exchanged to a temporary name) are left.
        let mut left: Vec<_> = fs::read_dir(dir.path())?.map(|e| e.map(|e| e.file_name())).collect::<Result<_, _>>()?;
        left.sort();
        assert_eq!(left, ["f", "g"]);
        Ok(())
    }

    #[tokio::test]
    async fn the_replaced_file_is_closed_after_the_answer() -> Result<(), Box<dyn std::error::Error>> {
        // The write end of a pipe stands for the replaced file: its reader sees the end of the
        // pipe once it is closed, and only then.
        let (mut reader, writer) = io::pipe()?;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("f");
        fs::write(&path, b"x")?;
        let meta = fs::metadata(&path)?;
        let stat = stat_of(&path, &meta);
        let answered =
            blocking_replacing(move || Ok((stat, Some(fs::File::from(std::os::fd::OwnedFd::from(writer)))))).await?;
        assert_eq!(answered.size, 1);
        let (closed, seen) = std::sync::mpsc::channel();
        std::thread::spawn(move || closed.send(io::Read::read_to_end(&mut reader, &mut Vec::new()).map(|_| ())));
        // Bounded only so that a leak fails rather than hangs.
        seen.recv_timeout(std::time::Duration::from_secs(60)).map_err(|_| "the replaced file was never closed")??;
        // A failed write answers its error.
        let failed = blocking_replacing(|| Err(DaemonError::InvalidArgument("no".into()))).await;
        assert!(matches!(failed, Err(DaemonError::InvalidArgument(_))), "{failed:?}");
        Ok(())
    }

    #[test]
    fn a_directory_found_in_the_targets_place_is_put_back_and_refused() -> Result<(), Box<dyn std::error::Error>> {
        // As when one appears there after `write_target` looked: the exchange swaps the file and
        // the directory, the old entry cannot be unlinked, and the two go back.
        let dir = tempfile::tempdir()?;
        let (temp, target) = (dir.path().join(".t.tmp"), dir.path().join("t"));
        fs::write(&temp, b"new")?;
        fs::create_dir(&target)?;
        fs::write(target.join("inside"), b"kept")?;
        let err = replace(&temp, &target).err().ok_or("a directory was replaced")?;
        assert_eq!(err.raw_os_error(), Some(libc::EISDIR), "{err}");
        assert_eq!(fs::read(target.join("inside"))?, b"kept");
        assert_eq!(fs::read(&temp)?, b"new");
        Ok(())
    }

    fn tree() -> io::Result<tempfile::TempDir> {
        let dir = tempfile::tempdir()?;
        let root = dir.path();
        fs::create_dir_all(root.join("b/d"))?;
        fs::write(root.join("c"), b"c")?;
        fs::write(root.join("a"), b"a")?;
        fs::write(root.join("b/e"), b"e")?;
        fs::write(root.join("b/d/f"), b"f")?;
        symlink("/", root.join("b/link"))?;
        Ok(dir)
    }

    fn names(listing: &DirListing, root: &Path) -> Vec<String> {
        let prefix = format!("{}/", shown(root));
        listing.entries.iter().map(|e| e.path.strip_prefix(&prefix).unwrap_or(&e.path).to_owned()).collect()
    }

    #[test]
    fn list_is_sorted_depth_first_and_absolute() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tree()?;
        let root = dir.path();
        let one = list(root, 1, 100)?;
        assert_eq!(names(&one, root), ["a", "b", "c"]);
        assert!(!one.truncated);
        assert!(one.entries.iter().all(|e| e.path.starts_with('/')));
        let all = list(root, 64, 100)?;
        assert_eq!(names(&all, root), ["a", "b", "b/d", "b/d/f", "b/e", "b/link", "c"]);
        let two = list(root, 2, 100)?;
        assert_eq!(names(&two, root), ["a", "b", "b/d", "b/e", "b/link", "c"]);
        Ok(())
    }

    #[test]
    fn list_does_not_follow_symlinks() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tree()?;
        let all = list(dir.path(), 64, 100)?;
        let link = all.entries.iter().find(|e| e.path.ends_with("/b/link"));
        assert_eq!(link.map(|e| e.kind), Some(FileKind::Symlink));
        assert!(!all.entries.iter().any(|e| e.path.contains("/b/link/")));
        Ok(())
    }

    #[test]
    fn list_truncates_only_when_more_entries_follow() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tree()?;
        let root = dir.path();
        let cut = list(root, 64, 3)?;
        assert_eq!(names(&cut, root), ["a", "b", "b/d"]);
        assert!(cut.truncated);
        let exact = list(root, 64, 7)?;
        assert_eq!(exact.entries.len(), 7);
        assert!(!exact.truncated);
        Ok(())
    }

    #[test]
    fn list_of_a_file_is_invalid() -> io::Result<()> {
        let dir = tree()?;
        let err = list(&dir.path().join("a"), 1, 10).err();
        assert!(matches!(err, Some(DaemonError::InvalidArgument(_))), "{err:?}");
        let err = list(&dir.path().join("missing"), 1, 10).err();
        assert_eq!(err.as_ref().map(code), Some(sandman_wire::ErrorCode::NotFound));
        Ok(())
    }

    #[test]
    fn temp_names_are_hidden_and_short() {
        let long = OsString::from("x".repeat(255));
        let name = temp_name(&long);
        assert!(name.len() < 255);
        assert!(name.as_bytes().starts_with(b".xxx"));
        assert_ne!(temp_name(OsStr::new("a")), temp_name(OsStr::new("a")));
    }

    #[test]
    fn remove_refuses_non_empty_dir_without_recursive() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tree()?;
        let b = dir.path().join("b");
        let err = remove_path(&b, false).err();
        assert!(matches!(&err, Some(DaemonError::Conflict(m)) if m.contains("recursive=true")), "{err:?}");
        remove_path(&b.join("link"), false)?;
        assert!(dir.path().join("a").exists(), "the link's target must survive");
        remove_path(&b, true)?;
        assert!(!b.exists());
        Ok(())
    }

    #[test]
    fn make_dir_is_mkdir_p_and_conflicts_with_files() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tree()?;
        let deep = dir.path().join("x/y/z");
        let s = make_dir(&deep, 0o700, None)?;
        assert_eq!((s.kind, s.mode), (FileKind::Dir, 0o700));
        make_dir(&deep, 0o755, None)?;
        let err = make_dir(&dir.path().join("a"), 0o755, None).err();
        assert!(matches!(err, Some(DaemonError::Conflict(_))), "{err:?}");
        Ok(())
    }

    #[test]
    fn rename_refuses_to_overwrite_unless_asked() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tree()?;
        let (a, c) = (dir.path().join("a"), dir.path().join("c"));
        let err = rename(&a, &c, false).err();
        assert!(matches!(err, Some(DaemonError::Conflict(_))), "{err:?}");
        let s = rename(&a, &c, true)?;
        assert_eq!(s.size, 1);
        assert_eq!(fs::read(&c)?, b"a");
        let moved = rename(&c, &dir.path().join("new/parent/c"), false)?;
        assert_eq!(moved.kind, FileKind::File);
        Ok(())
    }

    async fn body_of(response: Response) -> Result<(Option<u64>, Bytes), Box<dyn std::error::Error>> {
        let len = match response.headers().get(header::CONTENT_LENGTH) {
            Some(v) => Some(v.to_str()?.parse()?),
            None => None,
        };
        Ok((len, axum::body::to_bytes(response.into_body(), usize::MAX).await?))
    }

    fn read_query(path: &Path, offset: u64, length: Option<u64>) -> ApiQuery<ReadFileQuery> {
        ApiQuery(ReadFileQuery { path: shown(path), offset, length })
    }

    #[tokio::test]
    async fn read_file_answers_the_exact_range_with_its_length() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("f");
        fs::write(&file, b"0123456789")?;
        let whole = read_file(read_query(&file, 0, None)).await?;
        assert_eq!(
            whole.headers().get(header::CONTENT_TYPE).map(|v| v.as_bytes()),
            Some(&b"application/octet-stream"[..])
        );
        assert_eq!(body_of(whole).await?, (Some(10), Bytes::from_static(b"0123456789")));
        let part = read_file(read_query(&file, 3, Some(4))).await?;
        assert_eq!(body_of(part).await?, (Some(4), Bytes::from_static(b"3456")));
        let tail = read_file(read_query(&file, 8, Some(100))).await?;
        assert_eq!(body_of(tail).await?, (Some(2), Bytes::from_static(b"89")));
        let past = read_file(read_query(&file, 50, None)).await?;
        assert_eq!(body_of(past).await?, (Some(0), Bytes::new()));
        Ok(())
    }

    #[tokio::test]
    async fn read_file_refuses_directories_and_reports_missing_files() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let err = read_file(read_query(dir.path(), 0, None)).await.err();
        let expected = format!("`{}` is a directory", shown(dir.path()));
        assert!(matches!(&err, Some(DaemonError::InvalidArgument(m)) if *m == expected), "{err:?}");
        let err = read_file(read_query(&dir.path().join("nope"), 0, None)).await.err();
        assert_eq!(err.as_ref().map(code), Some(sandman_wire::ErrorCode::NotFound));
        Ok(())
    }

    #[tokio::test]
    async fn read_file_of_a_file_without_a_size_still_has_a_length() -> Result<(), Box<dyn std::error::Error>> {
        // procfs reports size 0 for files that do have contents.
        let status = Path::new("/proc/self/status");
        let (len, bytes) = body_of(read_file(read_query(status, 0, None)).await?).await?;
        assert!(!bytes.is_empty());
        assert_eq!(len, Some(bytes.len() as u64));
        let (len, bytes) = body_of(read_file(read_query(status, 0, Some(5))).await?).await?;
        assert_eq!((len, bytes.len()), (Some(5), 5));
        Ok(())
    }

    fn leftovers(dir: &Path) -> io::Result<Vec<OsString>> {
        Ok(sorted_names(dir)?.into_iter().filter(|n| n.as_bytes().starts_with(b".")).collect())
    }

    fn plain(mode: u32) -> Written {
        Written { mode, owner: None, sync: None }
    }

    /// One sync a [`Recorder`] saw: what was synced, what the target held then, and the length
    /// of the synced file.
    type Synced = (&'static str, Option<Vec<u8>>, u64);

    /// A [`Durability`] that records each sync, with what the target held at that moment.
    #[derive(Debug, Default)]
    struct Recorder {
        target: PathBuf,
        calls: std::sync::Mutex<Vec<Synced>>,
    }

    impl Recorder {
        fn leaked(target: &Path) -> &'static Recorder {
            Box::leak(Box::new(Recorder { target: target.to_path_buf(), ..Recorder::default() }))
        }

        fn record(&self, what: &'static str, synced_len: u64) {
            let now = fs::read(&self.target).ok();
            self.calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((what, now, synced_len));
        }

        fn calls(&self) -> Vec<Synced> {
            self.calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
        }
    }

    impl Durability for Recorder {
        fn sync_file(&self, file: &fs::File, _path: &Path) -> io::Result<()> {
            self.record("file", file.metadata()?.len());
            Ok(())
        }

        fn sync_dir(&self, _dir: &Path) -> io::Result<()> {
            self.record("dir", 0);
            Ok(())
        }

        fn sync_fs(&self, _dir: &Path) -> io::Result<()> {
            self.record("fs", 0);
            Ok(())
        }
    }

    /// `fsync=true` syncs the whole new file while the target still holds its old contents, then
    /// the directory once the rename made the new contents visible; without it nothing is synced.
    /// Both ways in: a small body read whole, and a body of unknown length streamed.
    #[tokio::test]
    async fn fsync_syncs_the_whole_file_before_the_rename_and_the_directory_after()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("f");
        for streamed in [false, true] {
            fs::write(&target, b"old")?;
            let recorder = Recorder::leaked(&target);
            let body = if streamed {
                Body::from_stream(futures_util::stream::iter(
                    ["new ", "contents"].map(|c| Ok::<_, io::Error>(Bytes::from(c))),
                ))
            } else {
                Body::from("new contents")
            };
            let written = Written { sync: Some(recorder), ..plain(0o644) };
            write_atomically(&target, written, body, Upload::default()).await?;
            assert_eq!(
                recorder.calls(),
                [("file", Some(b"old".to_vec()), 12), ("dir", Some(b"new contents".to_vec()), 0)],
                "streamed: {streamed}"
            );
            let quiet = Recorder::leaked(&target);
            write_atomically(&target, plain(0o644), Body::from("again"), Upload::default()).await?;
            assert!(quiet.calls().is_empty());
        }
        assert!(leftovers(dir.path())?.is_empty());
        Ok(())
    }

    /// Regression (issue 16): a write is visible under the target's name only whole. While a
    /// streamed body is half written, the target still holds the old contents and the half
    /// lives only in a temporary file of another name.
    #[tokio::test]
    async fn a_half_written_file_is_never_visible_under_the_target_name() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("f");
        fs::write(&target, b"old")?;
        let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(1);
        let (asked_tx, asked_rx) = tokio::sync::oneshot::channel::<()>();
        let body = Body::from_stream(AsksAfterFirst { rx, yielded: 0, asked: Some(asked_tx) });
        let write = tokio::spawn({
            let target = target.clone();
            async move { write_atomically(&target, plain(0o644), body, Upload::default()).await }
        });
        tx.send(Ok(Bytes::from_static(b"first half, "))).await?;
        // The writer has written the first chunk and waits for the second.
        asked_rx.await?;
        assert_eq!(fs::read(&target)?, b"old");
        let temps = leftovers(dir.path())?;
        assert_eq!(temps.len(), 1, "{temps:?}");
        assert!(temps[0].as_bytes().starts_with(b".f.sandman-"), "{temps:?}");
        tx.send(Ok(Bytes::from_static(b"second half"))).await?;
        drop(tx);
        write.await??;
        assert_eq!(fs::read(&target)?, b"first half, second half");
        assert!(leftovers(dir.path())?.is_empty());
        Ok(())
    }

    /// A body fed from a channel that says when it is asked for its second chunk: by then the
    /// first has been taken and written.
    struct AsksAfterFirst {
        rx: tokio::sync::mpsc::Receiver<io::Result<Bytes>>,
        yielded: usize,
        asked: Option<tokio::sync::oneshot::Sender<()>>,
    }

    impl futures_util::Stream for AsksAfterFirst {
        type Item = io::Result<Bytes>;

        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            if self.yielded == 1
                && let Some(asked) = self.asked.take()
            {
                let _ = asked.send(());
            }
            let next = self.rx.poll_recv(cx);
            if let std::task::Poll::Ready(Some(_)) = &next {
                self.yielded += 1;
            }
            next
        }
    }

    #[tokio::test]
    async fn write_creates_parents_and_sets_the_mode() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("a/b/c.txt");
        let s = write_atomically(&target, plain(0o600), Body::from("hello"), Upload { max: 0, disk: 0 }).await?;
        assert_eq!((s.kind, s.size, s.mode), (FileKind::File, 5, 0o600));
        assert_eq!(fs::read(&target)?, b"hello");
        assert!(fs::metadata(dir.path().join("a/b"))?.is_dir());
        let s =
            write_atomically(&target, plain(DEFAULT_FILE_MODE), Body::from("bye"), Upload { max: 0, disk: 0 }).await?;
        assert_eq!((s.size, s.mode), (3, 0o644));
        assert!(leftovers(&dir.path().join("a/b"))?.is_empty());
        Ok(())
    }

    #[tokio::test]
    async fn write_over_the_limit_is_too_large_and_leaves_nothing() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("big");
        // A body of unknown length, so that the limit is found while streaming it.
        let chunks =
            futures_util::stream::iter(["12345", "67890", "abcde"].map(|c| Ok::<_, io::Error>(Bytes::from(c))));
        let err =
            write_atomically(&target, plain(0o644), Body::from_stream(chunks), Upload { max: 8, disk: 0 }).await.err();
        assert!(matches!(err, Some(DaemonError::TooLarge { limit: 8 })), "{err:?}");
        assert!(!target.exists());
        assert!(leftovers(dir.path())?.is_empty());
        // A body whose length is known is refused before anything is created.
        let err =
            write_atomically(&target, plain(0o644), Body::from("123456789"), Upload { max: 8, disk: 0 }).await.err();
        assert!(matches!(err, Some(DaemonError::TooLarge { limit: 8 })), "{err:?}");
        assert!(sorted_names(dir.path())?.is_empty());
        Ok(())
    }

    #[tokio::test]
    async fn an_upload_past_the_disk_limit_is_stopped_and_leaves_nothing() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("big");
        let chunks = futures_util::stream::iter(["12345", "67890"].map(|c| Ok::<_, io::Error>(Bytes::from(c))));
        let err =
            write_atomically(&target, plain(0o644), Body::from_stream(chunks), Upload { max: 0, disk: 8 }).await.err();
        assert!(matches!(err, Some(DaemonError::DiskLimit { limit: 8, .. })), "{err:?}");
        assert_eq!(err.map(|e| e.code().http_status()), Some(413));
        assert!(leftovers(dir.path())?.is_empty());
        Ok(())
    }

    /// A client that sends half a body and then nothing is cut at the stall timeout, rather than
    /// holding its connection and a temporary file for as long as it likes.
    #[tokio::test(start_paused = true)]
    async fn an_upload_that_stalls_is_cut_and_leaves_nothing() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("slow");
        let first = futures_util::stream::once(async { Ok::<_, io::Error>(Bytes::from_static(b"half")) });
        let body = Body::from_stream(first.chain(futures_util::stream::pending()));
        let err = write_atomically(&target, plain(0o644), body, Upload::default()).await.err();
        assert_eq!(err.map(|e| e.code()), Some(sandman_wire::ErrorCode::Timeout));
        assert!(!target.exists());
        assert!(leftovers(dir.path())?.is_empty());
        Ok(())
    }

    #[tokio::test]
    async fn write_refuses_a_directory_and_writes_through_a_symlink() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tree()?;
        let err = write_atomically(&dir.path().join("b"), plain(0o644), Body::from("x"), Upload { max: 0, disk: 0 })
            .await
            .err();
        assert!(matches!(err, Some(DaemonError::InvalidArgument(_))), "{err:?}");
        symlink("a", dir.path().join("to-a"))?;
        let s = write_atomically(&dir.path().join("to-a"), plain(0o644), Body::from("new"), Upload { max: 0, disk: 0 })
            .await?;
        assert_eq!(s.path, shown(&dir.path().join("a")));
        assert_eq!(fs::read(dir.path().join("a"))?, b"new");
        assert!(fs::symlink_metadata(dir.path().join("to-a"))?.file_type().is_symlink());
        Ok(())
    }

    #[tokio::test]
    async fn remove_refuses_the_root() {
        for root in ["/", "//", "/tmp/.."] {
            let err = remove(ApiQuery(RemoveQuery { path: root.into(), recursive: true })).await.err();
            assert!(matches!(err, Some(DaemonError::InvalidArgument(_))), "{root}: {err:?}");
        }
    }

    #[test]
    fn the_cross_filesystem_fallback_copies_files_and_symlinks_and_refuses_directories()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tree()?;
        let (a, moved) = (dir.path().join("a"), dir.path().join("moved"));
        fs::set_permissions(&a, Permissions::from_mode(0o751))?;
        let before = fs::metadata(&a)?;
        move_across_filesystems(&a, &moved, &before)?;
        assert!(!a.exists());
        assert_eq!(fs::read(&moved)?, b"a");
        let after = fs::metadata(&moved)?;
        assert_eq!(after.permissions().mode() & 0o7777, 0o751);
        assert_eq!(after.modified()?, before.modified()?);
        let link = dir.path().join("b/link");
        move_across_filesystems(&link, &dir.path().join("link2"), &fs::symlink_metadata(&link)?)?;
        assert_eq!(fs::read_link(dir.path().join("link2"))?, Path::new("/"));
        let b = dir.path().join("b");
        let err = move_across_filesystems(&b, &dir.path().join("b2"), &fs::symlink_metadata(&b)?).err();
        assert!(matches!(err, Some(DaemonError::InvalidArgument(_))), "{err:?}");
        assert!(leftovers(dir.path())?.is_empty());
        Ok(())
    }
}
