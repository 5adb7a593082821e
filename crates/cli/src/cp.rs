//! `cp`: files and directories between this machine and a sandbox, like `docker cp`. Files go
//! as they are read from disk; directories as a tar built (or unpacked) on the fly, never whole.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use sandman_client::{Client, ClientError, UploadBody};
use sandman_wire::ErrorCode;
use sandman_wire::daemon::{ExtractQuery, FileKind, WriteFileQuery};
use tokio::io::AsyncWriteExt;
use tokio_util::io::{ReaderStream, SyncIoBridge};

use crate::cli::CpCmd;
use crate::format;
use crate::report;

/// Bytes in flight between the tar thread and the upload: enough to keep both busy, small
/// enough that a slow upload holds back the reading of files rather than filling memory.
const PIPE_CAPACITY: usize = 64 * 1024;

/// One side of a copy.
#[derive(Debug, PartialEq, Eq)]
enum Location {
    Local(PathBuf),
    Sandbox {
        id: String,
        path: String,
    },
    /// `-`: a tar stream on stdin or stdout.
    Stdio,
}

impl Location {
    /// `ID:/abs/path` is in a sandbox; `-` is stdio; anything else (`./a:b` included) is local.
    fn parse(text: &str) -> anyhow::Result<Location> {
        if text == "-" {
            return Ok(Location::Stdio);
        }
        match text.split_once(':') {
            Some((id, path)) if !id.is_empty() && !id.contains('/') && !id.starts_with('.') => {
                if !path.starts_with('/') {
                    bail!("`{text}`: a path in a sandbox is absolute, as in `{id}:/{path}`");
                }
                Ok(Location::Sandbox { id: id.to_owned(), path: path.to_owned() })
            }
            _ => Ok(Location::Local(PathBuf::from(text))),
        }
    }
}

pub async fn cp(client: &Client, cmd: CpCmd) -> anyhow::Result<ExitCode> {
    match (Location::parse(&cmd.src)?, Location::parse(&cmd.dst)?) {
        (Location::Local(src), Location::Sandbox { id, path }) => upload(client, &src, &id, &path, cmd.fsync).await?,
        (Location::Stdio, Location::Sandbox { id, path }) => {
            let body = UploadBody::from_stream(ReaderStream::with_capacity(tokio::io::stdin(), PIPE_CAPACITY));
            let query = ExtractQuery { path: path.clone(), user: None, fsync: cmd.fsync };
            let done = client.upload_tar_with(&id, &query, body).await?;
            report::status(&format!(
                "Extracted {} entries ({}) into {id}:{path}",
                done.entries,
                format::bytes(done.bytes)
            ));
        }
        (Location::Sandbox { id, path }, Location::Local(dst)) => download(client, &id, &path, &dst).await?,
        (Location::Sandbox { id, path }, Location::Stdio) => {
            let mut tar = client.download_tar(&id, &path).await?.into_async_read();
            let mut stdout = tokio::io::stdout();
            tokio::io::copy(&mut tar, &mut stdout).await.map_err(report::StdoutClosed::from_io)?;
            stdout.flush().await.map_err(report::StdoutClosed::from_io)?;
        }
        (Location::Sandbox { .. }, Location::Sandbox { .. }) => {
            bail!("both sides are in a sandbox: copy through this machine, in two steps")
        }
        _ => bail!("neither side is in a sandbox: one of SRC and DST is `ID:/abs/path`"),
    }
    Ok(ExitCode::SUCCESS)
}

/// What is at `path` in the sandbox, or `None` when nothing is.
async fn remote_kind(client: &Client, id: &str, path: &str) -> Result<Option<FileKind>, ClientError> {
    match client.stat(id, path).await {
        Ok(stat) => Ok(Some(stat.kind)),
        Err(err) if err.code() == Some(ErrorCode::NotFound) => Ok(None),
        Err(err) => Err(err),
    }
}

/// The last component of a path (`/a/b/` → `b`).
fn base_name(path: &str) -> &str {
    path.trim_end_matches('/').rsplit('/').next().unwrap_or_default()
}

/// `dir/name` in a sandbox.
fn remote_join(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

/// `SRC/.` copies the contents of SRC rather than SRC itself, as with `docker cp`.
fn is_contents(path: &str) -> bool {
    path.ends_with("/.")
}

async fn upload(client: &Client, src: &Path, id: &str, dst: &str, fsync: bool) -> anyhow::Result<()> {
    let shown = src.display();
    let meta = tokio::fs::metadata(src).await.with_context(|| format!("could not read `{shown}`"))?;
    let kind = remote_kind(client, id, dst).await?;
    let name = src.file_name().map(|n| n.to_string_lossy().into_owned());
    if meta.is_dir() {
        let target = match (kind, name) {
            (Some(FileKind::Dir), Some(name)) if !is_contents(&src.to_string_lossy()) => remote_join(dst, &name),
            (Some(FileKind::Dir) | None, _) => dst.to_owned(),
            (Some(_), _) => bail!("cannot copy directory `{shown}` onto `{id}:{dst}`, which is not a directory"),
        };
        let query = ExtractQuery { path: target.clone(), user: None, fsync };
        let done = client.upload_tar_with(id, &query, UploadBody::from_stream(tar_of(src.to_owned()))).await?;
        report::status(&format!("Copied {} entries ({}) to {id}:{target}", done.entries, format::bytes(done.bytes)));
    } else {
        let target = match (kind, name) {
            (Some(FileKind::Dir), Some(name)) => remote_join(dst, &name),
            (None, Some(name)) if dst.ends_with('/') => remote_join(dst, &name),
            _ => dst.to_owned(),
        };
        let file = tokio::fs::File::open(src).await.with_context(|| format!("could not open `{shown}`"))?;
        let body = UploadBody::from_stream(ReaderStream::with_capacity(file, PIPE_CAPACITY));
        let mode = Some(format!("{:o}", meta.permissions().mode() & 0o7777));
        let query = WriteFileQuery { path: target.clone(), mode, user: None, fsync };
        let stat = client.write_file_with(id, &query, body).await?;
        report::status(&format!("Copied {} to {id}:{target}", format::bytes(stat.size)));
    }
    Ok(())
}

/// The contents of the directory `dir` as a tar stream, written by a blocking thread as the
/// upload reads it. A failure midway ends the stream with the error, so the upload fails.
fn tar_of(dir: PathBuf) -> impl Stream<Item = io::Result<Bytes>> + Send + 'static {
    let (writer, reader) = tokio::io::duplex(PIPE_CAPACITY);
    let out = SyncIoBridge::new(writer);
    let writing = tokio::task::spawn_blocking(move || -> io::Result<()> {
        let mut builder = tar::Builder::new(out);
        builder.follow_symlinks(false);
        builder.append_dir_all("", &dir)?;
        builder.into_inner()?.shutdown()
    });
    let outcome = futures_util::stream::once(async move {
        match writing.await {
            Ok(Ok(())) => None,
            Ok(Err(err)) => Some(Err(err)),
            Err(join) => Some(Err(io::Error::other(join))),
        }
    })
    .filter_map(std::future::ready);
    ReaderStream::with_capacity(reader, PIPE_CAPACITY).chain(outcome)
}

async fn download(client: &Client, id: &str, src: &str, dst: &Path) -> anyhow::Result<()> {
    let stat = client.stat(id, src).await?;
    let dst_is_dir = tokio::fs::metadata(dst).await.is_ok_and(|m| m.is_dir());
    let name = base_name(src);
    let target = if dst_is_dir && !is_contents(src) && !name.is_empty() { dst.join(name) } else { dst.to_owned() };
    let shown = target.display().to_string();
    if stat.kind == FileKind::Dir {
        tokio::fs::create_dir_all(&target).await.with_context(|| format!("could not create `{shown}`"))?;
        let tar = SyncIoBridge::new(client.download_tar(id, src).await?.into_async_read());
        let into = target.clone();
        let (entries, bytes) = tokio::task::spawn_blocking(move || unpack(tar, &into))
            .await
            .context("the unpacking thread failed")?
            .with_context(|| format!("could not unpack `{id}:{src}` into `{shown}`"))?;
        report::status(&format!("Copied {entries} entries ({}) to {shown}", format::bytes(bytes)));
    } else {
        let mut body = client.read_file_stream(id, src, 0, None).await?.into_async_read();
        let mut file = tokio::fs::File::create(&target).await.with_context(|| format!("could not create `{shown}`"))?;
        let bytes =
            tokio::io::copy(&mut body, &mut file).await.with_context(|| format!("could not write `{shown}`"))?;
        file.flush().await.with_context(|| format!("could not write `{shown}`"))?;
        let mode = std::fs::Permissions::from_mode(stat.mode & 0o7777);
        tokio::fs::set_permissions(&target, mode)
            .await
            .with_context(|| format!("could not set the mode of `{shown}`"))?;
        report::status(&format!("Copied {} to {shown}", format::bytes(bytes)));
    }
    Ok(())
}

/// Unpacks a tar into `dst`, keeping modes and times; an entry that would land outside `dst`
/// is refused. Answers the entries and file bytes written.
fn unpack(tar: impl io::Read, dst: &Path) -> io::Result<(u64, u64)> {
    let mut archive = tar::Archive::new(tar);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    let (mut entries, mut bytes) = (0, 0);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let size = entry.size();
        if !entry.unpack_in(dst)? {
            let path = entry.path().map(|p| p.display().to_string()).unwrap_or_default();
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("entry `{path}` would land outside")));
        }
        entries += 1;
        bytes += size;
    }
    Ok((entries, bytes))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn locations() {
        let sandbox = |id: &str, path: &str| Location::Sandbox { id: id.into(), path: path.into() };
        assert_eq!(Location::parse("sb-1:/a/b").unwrap(), sandbox("sb-1", "/a/b"));
        assert_eq!(Location::parse("./sb-1:/a").unwrap(), Location::Local("./sb-1:/a".into()));
        assert_eq!(Location::parse("dir/x:y").unwrap(), Location::Local("dir/x:y".into()));
        assert_eq!(Location::parse("file").unwrap(), Location::Local("file".into()));
        assert_eq!(Location::parse("-").unwrap(), Location::Stdio);
        let err = Location::parse("sb-1:rel").unwrap_err().to_string();
        assert!(err.contains("`sb-1:/rel`"), "{err}");
    }

    #[test]
    fn names() {
        assert_eq!(base_name("/a/b/"), "b");
        assert_eq!(base_name("/"), "");
        assert_eq!(remote_join("/w/", "x"), "/w/x");
        assert!(is_contents("/w/."));
    }

    #[tokio::test]
    async fn a_directory_round_trips_through_tar() {
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("d/e")).unwrap();
        std::fs::write(src.path().join("d/e/f.txt"), "hello").unwrap();
        std::fs::write(src.path().join("top"), vec![1u8; 200_000]).unwrap();
        std::os::unix::fs::symlink("top", src.path().join("link")).unwrap();
        std::fs::set_permissions(src.path().join("top"), std::fs::Permissions::from_mode(0o750)).unwrap();

        let mut stream = std::pin::pin!(tar_of(src.path().to_owned()));
        let mut tar = Vec::new();
        while let Some(chunk) = stream.next().await {
            tar.extend_from_slice(&chunk.unwrap());
        }
        let dst = tempfile::tempdir().unwrap();
        let into = dst.path().to_owned();
        let (entries, bytes) = tokio::task::spawn_blocking(move || unpack(&tar[..], &into)).await.unwrap().unwrap();
        assert_eq!(entries, 5);
        assert_eq!(bytes, 200_005);
        assert_eq!(std::fs::read_to_string(dst.path().join("d/e/f.txt")).unwrap(), "hello");
        assert_eq!(std::fs::metadata(dst.path().join("top")).unwrap().permissions().mode() & 0o777, 0o750);
        assert_eq!(std::fs::read_link(dst.path().join("link")).unwrap(), Path::new("top"));
    }

    #[test]
    fn unpack_refuses_escapes() {
        let mut tar = Vec::new();
        let mut header = tar::Header::new_old();
        header.as_old_mut().name[..6].copy_from_slice(b"../out");
        header.set_size(1);
        header.set_mode(0o644);
        header.set_cksum();
        tar.extend_from_slice(header.as_bytes());
        tar.extend_from_slice(&[b'x'; 512]);
        tar.extend_from_slice(&[0; 1024]);
        let dst = tempfile::tempdir().unwrap();
        std::fs::create_dir(dst.path().join("in")).unwrap();
        assert!(unpack(&tar[..], &dst.path().join("in")).is_err());
        assert!(!dst.path().join("out").exists());
    }
}
