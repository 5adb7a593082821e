//! Writing a directory in overlayfs's form (a sandbox's writable layer) as an OCI layer: an
//! uncompressed tar whose whiteouts are `.wh.` names, whose owners are the sandbox's own ids,
//! and whose digest is its diff_id. Start at [`write_layer`].
//!
//! The directory belongs to a sandbox, which may have made anything in it: nothing is followed
//! (every name is opened relative to its parent's descriptor, `O_NOFOLLOW`), nothing on another
//! file system is read, and what a layer cannot carry (sockets, device nodes other than
//! whiteouts) is left out. The caller freezes the sandbox meanwhile, so the tree holds still.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{BufWriter, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use crate::ImageError;
use crate::manifest::Hasher;

/// The owner a file of the layer gets when its host id is outside the sandbox's range
/// (overflowuid, as the kernel shows such files inside a user namespace).
const OVERFLOW_ID: u64 = 65534;
/// How many ids a sandbox's range has.
const IDS: u32 = 65536;
/// How deep a layer's directories may nest before the walk refuses it.
const MAX_DEPTH: usize = 512;

/// A layer written: its digest (its diff_id, the tar being uncompressed), size and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerWritten {
    pub digest: String,
    pub size: u64,
    /// Bytes of regular files in it.
    pub file_bytes: u64,
    pub entries: u64,
}

/// Writes the tree at `dir` (an overlay upper directory) as a layer tar to `out`. Files owned by
/// host ids `ids..ids+65536` become `0..65536` (the sandbox's own ids); `ids` 0 keeps them.
/// Whiteouts (0/0 character devices) become `.wh.NAME`, opaque directories (`trusted.overlay.opaque`)
/// get a `.wh..wh..opq`. Blocking.
pub fn write_layer(dir: &Path, ids: u32, out: impl Write) -> Result<LayerWritten, ImageError> {
    let what = || format!("cannot read the layer at {}", dir.display());
    let root = rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| ImageError::io(what(), e.into()))?;
    let dev = rustix::fs::fstat(&root).map_err(|e| ImageError::io(what(), e.into()))?.st_dev;
    let counted = Counted { inner: out, hasher: Hasher::new(), size: 0 };
    let mut walk = Walk {
        tar: tar::Builder::new(BufWriter::with_capacity(1 << 20, counted)),
        dev,
        ids,
        links: HashMap::new(),
        file_bytes: 0,
        entries: 0,
        top: dir.to_path_buf(),
    };
    walk.tar.mode(tar::HeaderMode::Complete);
    walk.dir(&root, Path::new(""), 0)?;
    let (file_bytes, entries) = (walk.file_bytes, walk.entries);
    let top = walk.top.clone();
    let buffered =
        walk.tar.into_inner().map_err(|e| ImageError::io(format!("cannot write the layer of {}", top.display()), e))?;
    let counted = buffered
        .into_inner()
        .map_err(|e| ImageError::io(format!("cannot write the layer of {}", top.display()), e.into_error()))?;
    Ok(LayerWritten { digest: counted.hasher.finish(), size: counted.size, file_bytes, entries })
}

/// A writer that hashes and counts what passes.
struct Counted<W> {
    inner: W,
    hasher: Hasher,
    size: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

struct Walk<W: Write> {
    tar: tar::Builder<W>,
    /// The tree's file system: nothing on another is read.
    dev: u64,
    ids: u32,
    /// Files with more than one link, by (device, inode): the path written first.
    links: HashMap<(u64, u64), PathBuf>,
    file_bytes: u64,
    entries: u64,
    top: PathBuf,
}

impl<W: Write> Walk<W> {
    fn fail(&self, rel: &Path, e: impl Into<std::io::Error>) -> ImageError {
        ImageError::io(format!("cannot read `{}` of the layer at {}", rel.display(), self.top.display()), e.into())
    }

    fn id(&self, host: u32) -> u64 {
        match host.checked_sub(self.ids) {
            Some(inside) if inside < IDS => u64::from(inside),
            _ if self.ids == 0 => u64::from(host),
            _ => OVERFLOW_ID,
        }
    }

    fn header(&self, stat: &rustix::fs::Stat, kind: tar::EntryType) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(stat.st_mode & 0o7777);
        h.set_uid(self.id(stat.st_uid));
        h.set_gid(self.id(stat.st_gid));
        h.set_mtime(u64::try_from(stat.st_mtime).unwrap_or(0));
        h.set_size(0);
        h
    }

    fn dir(&mut self, fd: &OwnedFd, rel: &Path, depth: usize) -> Result<(), ImageError> {
        if depth > MAX_DEPTH {
            return Err(ImageError::Unsupported {
                what: format!("the layer at {}", self.top.display()),
                why: format!("its directories nest deeper than {MAX_DEPTH}"),
            });
        }
        let mut names: Vec<Vec<u8>> = Vec::new();
        let dir = rustix::fs::Dir::read_from(fd).map_err(|e| self.fail(rel, e))?;
        for entry in dir {
            let entry = entry.map_err(|e| self.fail(rel, e))?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
        names.sort();
        for name in names {
            let path = rel.join(OsStr::from_bytes(&name));
            self.entry(fd, &name, &path, depth)?;
        }
        Ok(())
    }

    fn entry(&mut self, parent: &OwnedFd, name: &[u8], path: &Path, depth: usize) -> Result<(), ImageError> {
        let stat = match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(s) => s,
            // Gone meanwhile (a sandbox that was not frozen): nothing to write.
            Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(self.fail(path, e)),
        };
        if stat.st_dev != self.dev {
            return Ok(());
        }
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::CharacterDevice if stat.st_rdev == 0 => {
                let mut whiteout = path.to_path_buf();
                let mut wh = b".wh.".to_vec();
                wh.extend_from_slice(name);
                whiteout.set_file_name(OsStr::from_bytes(&wh));
                let mut h = self.header(&stat, tar::EntryType::Regular);
                self.append(&mut h, &whiteout, std::io::empty())
            }
            FileType::Directory => {
                let fd = rustix::fs::openat(
                    parent,
                    name,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| self.fail(path, e))?;
                let mut h = self.header(&stat, tar::EntryType::Directory);
                self.append(&mut h, path, std::io::empty())?;
                let mut opaque = [0u8; 2];
                if let Ok(n) = rustix::fs::fgetxattr(&fd, crate::unpack::OPAQUE_XATTR, &mut opaque)
                    && opaque[..n] == *b"y"
                {
                    let mut h = self.header(&stat, tar::EntryType::Regular);
                    h.set_mode(0o644);
                    self.append(&mut h, &path.join(".wh..wh..opq"), std::io::empty())?;
                }
                self.dir(&fd, path, depth + 1)
            }
            FileType::RegularFile => {
                if stat.st_nlink > 1 {
                    if let Some(first) = self.links.get(&(stat.st_dev, stat.st_ino)).cloned() {
                        let mut h = self.header(&stat, tar::EntryType::Link);
                        return self.link(&mut h, path, &first);
                    }
                    self.links.insert((stat.st_dev, stat.st_ino), path.to_path_buf());
                }
                let fd = rustix::fs::openat(
                    parent,
                    name,
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
                    Mode::empty(),
                )
                .map_err(|e| self.fail(path, e))?;
                let opened = rustix::fs::fstat(&fd).map_err(|e| self.fail(path, e))?;
                if opened.st_ino != stat.st_ino || FileType::from_raw_mode(opened.st_mode) != FileType::RegularFile {
                    return Err(self.fail(path, std::io::Error::other("it changed while it was read")));
                }
                let size = u64::try_from(opened.st_size).unwrap_or(0);
                let mut h = self.header(&opened, tar::EntryType::Regular);
                h.set_size(size);
                self.file_bytes += size;
                let file = std::fs::File::from(fd);
                // Exactly `size` bytes, whatever the file does meanwhile: short is padded.
                let body = file.take(size).chain(std::io::repeat(0)).take(size);
                self.append(&mut h, path, body)
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(parent, name, Vec::new()).map_err(|e| self.fail(path, e))?;
                let mut h = self.header(&stat, tar::EntryType::Symlink);
                h.set_mode(0o777);
                let target = PathBuf::from(OsStr::from_bytes(target.to_bytes()));
                self.link(&mut h, path, &target)
            }
            FileType::Fifo => {
                let mut h = self.header(&stat, tar::EntryType::Fifo);
                self.append(&mut h, path, std::io::empty())
            }
            // Sockets and device nodes: nothing a layer carries (a sandbox cannot make devices).
            _ => Ok(()),
        }
    }

    fn append(&mut self, h: &mut tar::Header, path: &Path, body: impl Read) -> Result<(), ImageError> {
        self.entries += 1;
        let top = self.top.clone();
        self.tar.append_data(h, path, body).map_err(|e| {
            ImageError::io(format!("cannot write `{}` of the layer of {}", path.display(), top.display()), e)
        })
    }

    fn link(&mut self, h: &mut tar::Header, path: &Path, target: &Path) -> Result<(), ImageError> {
        self.entries += 1;
        let top = self.top.clone();
        self.tar.append_link(h, path, target).map_err(|e| {
            ImageError::io(format!("cannot write `{}` of the layer of {}", path.display(), top.display()), e)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;
    use crate::unpack::{OPAQUE_XATTR, unpack_plain};

    /// A sandbox's upper layer (host ids from `BASE`), written and unpacked again: whiteouts,
    /// an opaque directory, a hard link, a symbolic link and owners come through as the layer
    /// form says; a socket is left out.
    #[test]
    fn an_upper_layer_round_trips_through_its_tar() {
        sandman_testkit::require_root();
        const BASE: u32 = 1_000_000;
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let upper = tmp.path().join("upper");
        let p = |rel: &str| upper.join(rel);
        std::fs::create_dir_all(p("etc/opq")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(p("etc/app.conf"), b"x=1\n").unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(p("etc/app.conf"), std::fs::Permissions::from_mode(0o640))
            .unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::lchown(p("etc/app.conf"), Some(BASE + 1000), Some(BASE + 1000))
            .unwrap_or_else(|e| panic!("{e}"));
        std::fs::hard_link(p("etc/app.conf"), p("etc/app.link")).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink("app.conf", p("etc/app.sym")).unwrap_or_else(|e| panic!("{e}"));
        rustix::fs::mknodat(
            rustix::fs::CWD,
            p("etc/gone"),
            FileType::CharacterDevice,
            Mode::from_raw_mode(0o000),
            rustix::fs::makedev(0, 0),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        rustix::fs::setxattr(p("etc/opq"), OPAQUE_XATTR, b"y", rustix::fs::XattrFlags::empty())
            .unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(p("etc/opq/new"), b"n").unwrap_or_else(|e| panic!("{e}"));
        let _socket = std::os::unix::net::UnixListener::bind(p("etc/sock")).unwrap_or_else(|e| panic!("{e}"));

        let mut tar = Vec::new();
        let written = write_layer(&upper, BASE, &mut tar).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(written.size, tar.len() as u64);
        let mut names: Vec<String> = tar::Archive::new(&tar[..])
            .entries()
            .unwrap_or_else(|e| panic!("{e}"))
            .map(|e| e.unwrap_or_else(|e| panic!("{e}")).path().unwrap_or_else(|e| panic!("{e}")).display().to_string())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "etc",
                "etc/.wh.gone",
                "etc/app.conf",
                "etc/app.link",
                "etc/app.sym",
                "etc/opq",
                "etc/opq/.wh..wh..opq",
                "etc/opq/new"
            ]
        );

        let back = tmp.path().join("back");
        std::fs::create_dir(&back).unwrap_or_else(|e| panic!("{e}"));
        unpack_plain(&tar, &back, &written.digest, &crate::Limits::default()).unwrap_or_else(|e| panic!("{e}"));
        let conf = std::fs::metadata(back.join("etc/app.conf")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((conf.uid(), conf.gid(), conf.mode() & 0o7777, conf.nlink()), (1000, 1000, 0o640, 2));
        assert_eq!(
            std::fs::read_link(back.join("etc/app.sym")).unwrap_or_else(|e| panic!("{e}")).to_str(),
            Some("app.conf")
        );
        let gone = std::fs::symlink_metadata(back.join("etc/gone")).unwrap_or_else(|e| panic!("{e}"));
        assert!(FileType::from_raw_mode(gone.mode()) == FileType::CharacterDevice && gone.rdev() == 0);
        let mut opaque = [0u8; 2];
        let n = rustix::fs::getxattr(back.join("etc/opq"), OPAQUE_XATTR, &mut opaque).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&opaque[..n], b"y");
        assert!(!back.join("etc/sock").exists());
    }
}
