//! Unpacking one layer blob into a directory for overlayfs: [`unpack`] streams the blob through
//! its digest check and the decompressor on a thread of its own, and the uncompressed stream
//! through the diff_id check and the tar reader on the caller's, which writes each entry with
//! `*at` calls relative to directories opened without following symlinks, so no entry can land
//! outside the layer. Whiteouts become overlay whiteouts; hostile entries are refused.

use std::ffi::OsStr;
use std::io::{self, BufRead, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps, XattrFlags};
use rustix::io::Errno;

use crate::error::{carry, from_io};
use crate::manifest::{Compression, Hasher};
use crate::{ImageError, Limits};

/// The largest PAX extension or GNU long name the store reads: the tar reader keeps them whole in
/// memory, so a bigger one could be a bomb (real ones are a few hundred bytes).
const MAX_TAR_METADATA: u64 = 1 << 20;
/// How much of a file is copied per write.
const COPY_BUFFER: usize = 256 << 10;
/// How much of the uncompressed stream the decompressing thread hands over at once: large enough
/// that inflating runs in its fast loop and a hand-over (a wake-up of the other thread) is rare,
/// small enough that the blocks in flight stay in the caches.
const BLOCK: usize = 256 << 10;
/// How many blocks may wait for the tar reader: a few, so that neither thread waits for the other
/// on each block; an unpack holds six at most (one being filled, one being read).
const BLOCKS_IN_FLIGHT: usize = 4;
/// How many parent directories an unpack keeps open: enough for the directories a tar visits in
/// turn (a language runtime's package directories, a tar of sorted names going down and back up),
/// few enough that unpacks at once stay well within the process's descriptors.
const OPEN_PARENTS: usize = 64;
/// The xattr that marks a directory opaque for overlayfs.
pub(crate) const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// What is known of the blob before it is read: its digest and size when a manifest gives them
/// (a `docker save` layer has only its diff_id).
#[derive(Debug, Clone)]
pub(crate) struct Expected {
    /// The layer's uncompressed digest (`rootfs.diff_ids`): it names the layer in errors.
    pub diff_id: String,
    /// The blob's digest and size.
    pub blob: Option<(String, u64)>,
}

/// What an unpack made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Unpacked {
    /// Bytes of regular files written.
    pub size: u64,
    pub entries: u64,
    /// Device nodes skipped (not made).
    pub devices: u64,
    /// The blob's digest as read.
    pub blob_digest: String,
    pub blob_size: u64,
}

/// The uncompressed bytes one image's layers have read so far, shared by its concurrent unpacks.
#[derive(Debug, Default)]
pub(crate) struct Budget(AtomicU64);

impl Budget {
    pub(crate) fn add(&self, n: u64) -> u64 {
        self.0.fetch_add(n, Ordering::Relaxed) + n
    }
}

/// Unpacks the blob `reader` gives into the existing empty directory `into`, checking its digests
/// against `expected` and its sizes against `limits`; `progress` hears the blob bytes read so far.
///
/// Two threads share the work: a scoped one reads the blob (hashing it, unless its source does)
/// and decompresses it, and hands the uncompressed stream over in blocks; the caller's hashes
/// that stream, reads the tar and writes the files. So inflating one block overlaps writing the
/// one before, and a layer of large files takes the time of the slower half rather than of both.
pub(crate) fn unpack(
    reader: impl Blob,
    into: &Path,
    expected: &Expected,
    limits: &Limits,
    budget: &Budget,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Unpacked, ImageError> {
    let layer = expected.diff_id.as_str();
    let mut blob = BlobReader {
        hasher: (!reader.hashes_itself()).then(Hasher::new),
        inner: reader,
        read: 0,
        hashed: 0,
        reported: 0,
        size: expected.blob.as_ref().map(|(_, size)| *size),
        limit: limits.max_layer_compressed,
        layer,
        progress,
    };
    let mut extract = Extract::open(into, layer, limits.max_layer_entries)?;
    let what = || format!("cannot read layer {layer}");
    let read = |blob: &mut BlobReader<'_, _>, extract: &mut Extract<'_>| -> Result<String, ImageError> {
        std::thread::scope(|scope| {
            let (blocks, received) = mpsc::sync_channel(BLOCKS_IN_FLIGHT);
            // Blocks the tar reader is done with, for the decompressor to fill again: room for all
            // there are, so that none is freed and made anew.
            let (spent, spare) = mpsc::sync_channel(BLOCKS_IN_FLIGHT + 2);
            let inflating = std::thread::Builder::new()
                .name("sandman-inflate".into())
                .spawn_scoped(scope, move || decompress(blob, &blocks, &spare))
                .map_err(|e| ImageError::io("cannot start a thread to decompress a layer", e))?;
            let mut diff = DiffReader {
                inner: Blocks { received, block: Vec::new(), at: 0, spent },
                hasher: Hasher::new(),
                guard: TarGuard::default(),
                layer,
                budget,
                limit: limits.max_image_uncompressed,
            };
            let read = (|| {
                let mut archive = tar::Archive::new(&mut diff);
                let entries = archive.entries().map_err(|e| from_io(e, what))?;
                for entry in entries {
                    let entry = entry.map_err(|e| from_io(e, what))?;
                    extract.entry(entry)?;
                }
                // The diff_id covers the whole stream, the end-of-archive blocks and any padding
                // after.
                io::copy(&mut diff, &mut io::sink()).map_err(|e| from_io(e, what))?;
                Ok(std::mem::replace(&mut diff.hasher, Hasher::new()).finish())
            })();
            // Stops the decompressor if it is still at work (the read failed).
            drop(diff);
            if let Err(panic) = inflating.join() {
                std::panic::resume_unwind(panic);
            }
            read
        })
    };
    let diff = match read(&mut blob, &mut extract) {
        Ok(diff) => diff,
        Err(e) => {
            // What the decompressor or the tar reader cannot read is most often a corrupted
            // blob: when its digest is wrong, that is the error to give (the rest is read for
            // it, never past the blob's size). A bound's refusal is not read further.
            if let Some((digest, _)) = &expected.blob
                && !matches!(e, ImageError::TooLarge { .. } | ImageError::Digest { .. })
                && blob.drain().is_ok()
                && let Some(actual) = blob.digest()
                && actual != *digest
            {
                return Err(ImageError::Digest {
                    what: format!("the digest of blob {digest} (layer {layer})"),
                    expected: digest.clone(),
                    actual,
                });
            }
            return Err(e);
        }
    };
    // As does the blob's digest, past the end of the compressed stream.
    blob.drain().map_err(|e| from_io(e, what))?;
    let blob_size = blob.read;
    let blob_digest = blob.digest().ok_or_else(|| {
        ImageError::io(what(), io::Error::new(io::ErrorKind::UnexpectedEof, "the blob ended without its digest"))
    })?;
    if let Some((digest, size)) = &expected.blob {
        if blob_size != *size {
            return Err(ImageError::Digest {
                what: format!("the size of blob {digest} (layer {layer})"),
                expected: format!("{size} bytes"),
                actual: format!("{blob_size} bytes"),
            });
        }
        if blob_digest != *digest {
            return Err(ImageError::Digest {
                what: format!("the digest of blob {digest} (layer {layer})"),
                expected: digest.clone(),
                actual: blob_digest,
            });
        }
    }
    if diff != expected.diff_id {
        return Err(ImageError::Digest {
            what: format!("the uncompressed digest of layer {layer} (its config's rootfs.diff_ids)"),
            expected: expected.diff_id.clone(),
            actual: diff,
        });
    }
    extract.finish()?;
    Ok(Unpacked { size: extract.size, entries: extract.entries, devices: extract.devices, blob_digest, blob_size })
}

/// Decompresses the blob into blocks for the tar reader, until the stream ends, the blob cannot be
/// read (the error is the last thing sent), or the tar reader has stopped. Runs on its own thread.
fn decompress<R: BufRead>(
    blob: &mut BlobReader<'_, R>,
    blocks: &mpsc::SyncSender<io::Result<Vec<u8>>>,
    spare: &mpsc::Receiver<Vec<u8>>,
) {
    let sent = (|| {
        // Enough of the blob to tell its compression, gathered when its first bytes come in pieces.
        let mut head = Vec::new();
        loop {
            let buf = blob.fill_buf()?;
            if (head.is_empty() && buf.len() >= Compression::MAGIC)
                || buf.is_empty()
                || head.len() == Compression::MAGIC
            {
                break;
            }
            let n = buf.len().min(Compression::MAGIC - head.len());
            head.extend_from_slice(&buf[..n]);
            blob.consume(n);
        }
        let compression = Compression::sniff(if head.is_empty() { blob.fill_buf()? } else { &head });
        let stream = io::Cursor::new(head).chain(blob);
        let mut decoder: Box<dyn Read + '_> = match compression {
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(stream)),
            Compression::Zstd => Box::new(zstd::Decoder::with_buffer(stream)?),
            Compression::None => Box::new(stream),
        };
        loop {
            let mut block = spare.try_recv().unwrap_or_default();
            block.resize(BLOCK, 0);
            let mut filled = 0;
            while filled < BLOCK {
                match decoder.read(&mut block[filled..]) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            if filled == 0 {
                return Ok(());
            }
            block.truncate(filled);
            if blocks.send(Ok(block)).is_err() {
                // The tar reader has stopped: what it says is what matters.
                return Ok(());
            }
        }
    })();
    if let Err(e) = sent {
        let _ = blocks.send(Err(e));
    }
}

/// The uncompressed stream as the decompressing thread hands it over.
struct Blocks {
    received: mpsc::Receiver<io::Result<Vec<u8>>>,
    block: Vec<u8>,
    at: usize,
    /// Where a block read to its end goes back, to be filled again.
    spent: mpsc::SyncSender<Vec<u8>>,
}

impl Read for Blocks {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.block.len() {
            match self.received.recv() {
                Ok(Ok(block)) => {
                    let spent = std::mem::replace(&mut self.block, block);
                    self.at = 0;
                    if spent.capacity() > 0 {
                        let _ = self.spent.try_send(spent);
                    }
                }
                Ok(Err(e)) => return Err(e),
                // The decompressor is done: the stream has ended.
                Err(mpsc::RecvError) => return Ok(0),
            }
        }
        let n = buf.len().min(self.block.len() - self.at);
        buf[..n].copy_from_slice(&self.block[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// A layer blob as an unpack reads it.
pub(crate) trait Blob: BufRead + Send {
    /// Whether the source takes the blob's digest itself, as the bytes pass (a download hashes
    /// its chunks as they arrive, on its own thread); when not, the unpack does.
    fn hashes_itself(&self) -> bool {
        false
    }

    /// The digest of all the bytes given, once the last is, when the source takes it.
    fn digest(&mut self) -> Option<String> {
        None
    }
}

impl Blob for &[u8] {}

impl<R: Read + Send> Blob for io::BufReader<R> {}

/// The blob as read: hashed (unless its source does), counted, never read past the size its
/// descriptor gives (an endless blob is cut there and refused), nor past the per-layer limit.
struct BlobReader<'a, R> {
    inner: R,
    hasher: Option<Hasher>,
    /// Bytes consumed.
    read: u64,
    /// Bytes hashed: all that the inner reader has shown (consumed or not; the blob is read to
    /// its end before its digest is taken).
    hashed: u64,
    reported: u64,
    size: Option<u64>,
    limit: u64,
    layer: &'a str,
    progress: &'a (dyn Fn(u64) + Sync),
}

impl<R: Blob> BlobReader<'_, R> {
    /// The blob's digest, once it is read to its end.
    fn digest(&mut self) -> Option<String> {
        match self.hasher.take() {
            Some(hasher) => Some(hasher.finish()),
            None => self.inner.digest(),
        }
    }
}

impl<R: BufRead> BlobReader<'_, R> {
    /// Reads the rest of the blob, for its digest.
    fn drain(&mut self) -> io::Result<()> {
        loop {
            let n = self.fill_buf()?.len();
            if n == 0 {
                return Ok(());
            }
            self.consume(n);
        }
    }
}

impl<R: BufRead> BufRead for BlobReader<'_, R> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        let buf = self.inner.fill_buf()?;
        // A byte past the size is a longer blob, refused as soon as it is seen.
        let seen = self.read + buf.len() as u64;
        if let Some(size) = self.size
            && seen > size
        {
            return Err(carry(ImageError::Digest {
                what: format!("the size of layer {}'s blob", self.layer),
                expected: format!("{size} bytes, as its descriptor says"),
                actual: "more (the rest is not read)".into(),
            }));
        }
        if seen > self.limit {
            return Err(carry(ImageError::TooLarge {
                what: format!("the compressed blob of layer {}", self.layer),
                limit: self.limit,
                unit: "bytes",
            }));
        }
        if seen > self.hashed {
            if let Some(hasher) = &mut self.hasher {
                hasher.update(&buf[(self.hashed - self.read) as usize..]);
            }
            self.hashed = seen;
        }
        if buf.is_empty() && self.reported != self.read {
            self.reported = self.read;
            (self.progress)(self.read);
        }
        Ok(buf)
    }

    fn consume(&mut self, n: usize) {
        self.inner.consume(n);
        self.read += n as u64;
        if self.read - self.reported >= 1 << 20 {
            self.reported = self.read;
            (self.progress)(self.read);
        }
    }
}

impl<R: BufRead> Read for BlobReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let available = self.fill_buf()?;
        let n = available.len().min(buf.len());
        buf[..n].copy_from_slice(&available[..n]);
        self.consume(n);
        Ok(n)
    }
}

/// The uncompressed tar stream: hashed for the diff_id, counted against the image's bound, and
/// watched by a [`TarGuard`].
struct DiffReader<'a, R> {
    inner: R,
    hasher: Hasher,
    guard: TarGuard,
    layer: &'a str,
    budget: &'a Budget,
    limit: u64,
}

impl<R: Read> Read for DiffReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if self.budget.add(n as u64) > self.limit {
            return Err(carry(ImageError::TooLarge {
                what: "the image's uncompressed layers".into(),
                limit: self.limit,
                unit: "bytes",
            }));
        }
        self.hasher.update(&buf[..n]);
        self.guard.feed(&buf[..n]).map_err(|why| carry(ImageError::hostile(self.layer, b"(tar headers)", why)))?;
        Ok(n)
    }
}

/// Follows the tar stream's headers as the bytes pass, to refuse what the tar reader would take
/// whole into memory (a PAX extension or GNU long name bigger than [`MAX_TAR_METADATA`]) before
/// it reads it, and GNU sparse entries.
#[derive(Debug, Default)]
struct TarGuard {
    /// Bytes of the stream seen.
    pos: u64,
    /// Where the next header starts.
    next_header: u64,
    header: Vec<u8>,
    /// The content of a PAX extension header being read, and how much of it is still to come.
    pax: Option<(Vec<u8>, u64)>,
    /// The `size` a PAX extension gives the entry after it.
    pax_size: Option<u64>,
    ended: bool,
}

impl TarGuard {
    fn feed(&mut self, mut data: &[u8]) -> Result<(), String> {
        while !data.is_empty() && !self.ended {
            if self.pos < self.next_header {
                let n = (self.next_header - self.pos).min(data.len() as u64) as usize;
                if let Some((content, left)) = &mut self.pax {
                    let take = (*left).min(n as u64) as usize;
                    content.extend_from_slice(&data[..take]);
                    *left -= take as u64;
                    if *left == 0 {
                        self.pax_size = pax_value(content, b"size").and_then(|v| v.parse().ok());
                        self.pax = None;
                    }
                }
                self.pos += n as u64;
                data = &data[n..];
                continue;
            }
            let n = (512 - self.header.len()).min(data.len());
            self.header.extend_from_slice(&data[..n]);
            self.pos += n as u64;
            data = &data[n..];
            if self.header.len() < 512 {
                continue;
            }
            let header = std::mem::take(&mut self.header);
            if header.iter().all(|&b| b == 0) {
                // The tar reader stops at the first zero block; so does the guard.
                self.ended = true;
                break;
            }
            let size = numeric(&header[124..136]).ok_or("a header whose size is not a number")?;
            let size = match header[156] {
                kind @ (b'x' | b'g' | b'L' | b'K') => {
                    if size > MAX_TAR_METADATA {
                        return Err(format!(
                            "a tar metadata entry (type `{}`) of {size} bytes, over the {MAX_TAR_METADATA} bytes \
                             the store reads",
                            kind as char
                        ));
                    }
                    if kind == b'x' && size > 0 {
                        self.pax = Some((Vec::with_capacity(size as usize), size));
                    }
                    size
                }
                b'S' => return Err("a GNU sparse file, which layers do not use".into()),
                _ => self.pax_size.take().unwrap_or(size),
            };
            self.next_header = self.pos + size.div_ceil(512) * 512;
        }
        Ok(())
    }
}

/// A tar numeric field: octal text, or base-256 when its first byte's high bit is set.
fn numeric(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        if field[0] & 0x40 != 0 {
            return None;
        }
        let mut value: u64 = u64::from(field[0] & 0x3f);
        for &b in &field[1..] {
            value = value.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(value);
    }
    let text: Vec<u8> = field.iter().copied().filter(|&b| b != 0 && b != b' ').collect();
    if text.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(std::str::from_utf8(&text).ok()?, 8).ok()
}

/// The value of `key` in PAX records (`<len> <key>=<value>\n`).
fn pax_value<'a>(records: &'a [u8], key: &[u8]) -> Option<&'a str> {
    let mut rest = records;
    while !rest.is_empty() {
        let space = rest.iter().position(|&b| b == b' ')?;
        let len: usize = std::str::from_utf8(&rest[..space]).ok()?.parse().ok()?;
        if len <= space || len > rest.len() {
            return None;
        }
        let record = &rest[space + 1..len];
        let record = record.strip_suffix(b"\n").unwrap_or(record);
        if let Some(eq) = record.iter().position(|&b| b == b'=')
            && &record[..eq] == key
        {
            return std::str::from_utf8(&record[eq + 1..]).ok();
        }
        rest = &rest[len..];
    }
    None
}

/// Where entries are written: the layer's root, opened once, and the state of one unpack.
struct Extract<'a> {
    root: Rc<OwnedFd>,
    layer: &'a str,
    max_entries: u64,
    /// The parent directories opened last, by their paths in the layer: entries come grouped by
    /// directory, so most find their parent here. Dropped whenever a directory is removed.
    parents: Parents,
    /// Directories' times, set at the end (writing into a directory changes its mtime).
    dir_times: Vec<(Vec<u8>, Timestamps)>,
    buffer: Vec<u8>,
    size: u64,
    entries: u64,
    devices: u64,
    /// Who a new file belongs to (this process's effective ids), unless its directory is
    /// setgid: a file the tar gives that owner needs no chown.
    own_ids: (u32, u32),
    /// The directories the layer made setgid (their new files take their group).
    setgid_dirs: std::collections::HashSet<Vec<u8>>,
    /// The permission bits a new file gets as asked at its creation (those the umask leaves), when
    /// nothing else decides them (no default ACL on the layer's root): a file whose mode is
    /// within them is created with it and needs no chmod. Empty when unknown.
    creation_bits: u32,
}

/// The parent directories an unpack keeps open, by path in the layer, the least recently used
/// closed first past [`OPEN_PARENTS`].
#[derive(Default)]
struct Parents {
    open: std::collections::HashMap<Vec<u8>, (Rc<OwnedFd>, u64)>,
    uses: u64,
}

impl Parents {
    fn get(&mut self, path: &[u8]) -> Option<Rc<OwnedFd>> {
        self.uses += 1;
        let (fd, used) = self.open.get_mut(path)?;
        *used = self.uses;
        Some(fd.clone())
    }

    fn insert(&mut self, path: &[u8], fd: Rc<OwnedFd>) {
        if self.open.len() >= OPEN_PARENTS
            && let Some(oldest) = self.open.iter().min_by_key(|(_, (_, used))| *used).map(|(p, _)| p.clone())
        {
            self.open.remove(&oldest);
        }
        self.uses += 1;
        self.open.insert(path.to_vec(), (fd, self.uses));
    }

    fn clear(&mut self) {
        self.open.clear();
    }
}

/// The permission bits this process's umask leaves to a new file (from `/proc/self/status`,
/// where reading it changes nothing), unless a default ACL on `dir` decides them instead; empty
/// when either is unknown.
fn creation_bits(dir: &Path) -> u32 {
    match rustix::fs::getxattr(dir, "system.posix_acl_default", &mut [0u8; 0][..]) {
        Err(Errno::NODATA | Errno::OPNOTSUPP) => {}
        _ => return 0,
    }
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    let umask =
        status.lines().find_map(|line| line.strip_prefix("Umask:")).and_then(|v| u32::from_str_radix(v.trim(), 8).ok());
    umask.map_or(0, |umask| 0o777 & !umask)
}

/// What an entry's header and PAX records say about it.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    times: Timestamps,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl<'a> Extract<'a> {
    fn open(into: &Path, layer: &'a str, max_entries: u64) -> Result<Extract<'a>, ImageError> {
        let root = rustix::fs::open(into, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| ImageError::io(format!("cannot open {}", into.display()), e.into()))?;
        Ok(Extract {
            root: Rc::new(root),
            layer,
            max_entries,
            parents: Parents::default(),
            dir_times: Vec::new(),
            buffer: vec![0; COPY_BUFFER],
            size: 0,
            entries: 0,
            devices: 0,
            own_ids: (rustix::process::geteuid().as_raw(), rustix::process::getegid().as_raw()),
            setgid_dirs: std::collections::HashSet::new(),
            creation_bits: creation_bits(into),
        })
    }

    fn hostile(&self, entry: &[u8], why: impl Into<String>) -> ImageError {
        ImageError::hostile(self.layer, entry, why)
    }

    fn io(&self, entry: &[u8], doing: &str, e: Errno) -> ImageError {
        let entry = String::from_utf8_lossy(entry);
        ImageError::io(format!("layer {}: cannot {doing} `{entry}`", self.layer), e.into())
    }

    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), ImageError> {
        self.entries += 1;
        if self.entries > self.max_entries {
            return Err(ImageError::TooLarge {
                what: format!("layer {}", self.layer),
                limit: self.max_entries,
                unit: "entries",
            });
        }
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() {
            return Ok(());
        }
        let raw = entry.path_bytes().into_owned();
        let components = clean(&raw).map_err(|why| self.hostile(&raw, why))?;
        let meta = self.meta(&mut entry, &raw)?;
        let (name, parent) = match components.split_last() {
            Some((name, parent)) => (*name, parent.join(&b'/')),
            None => {
                if !kind.is_dir() {
                    return Err(self.hostile(&raw, "it names the layer's root, which only a directory can"));
                }
                return self.root_dir(&raw, meta);
            }
        };
        if let Some(hidden) = name.strip_prefix(b".wh.") {
            return self.whiteout(&raw, &parent, hidden, &meta);
        }
        if kind.is_block_special() || kind.is_character_special() {
            // Not made: a sandbox gets its own /dev, and a layer's device would be a way in.
            self.devices += 1;
            return Ok(());
        }
        if kind.is_hard_link() {
            let target = entry.link_name_bytes().ok_or_else(|| self.hostile(&raw, "a hard link without a target"))?;
            return self.hard_link(&raw, &parent, name, &target);
        }
        let parent_fd = self.parent(&raw, &parent, true)?;
        let parent_fd = parent_fd.as_fd();
        // What this process makes is its own, unless its directory is setgid.
        let owned = !self.setgid_dirs.contains(&parent) && (meta.uid, meta.gid) == self.own_ids;
        if kind.is_file() || kind.is_contiguous() {
            self.file(parent_fd, &raw, name, &meta, owned, &mut entry)
        } else if kind.is_dir() {
            self.dir(parent_fd, &raw, &parent, name, meta)
        } else if kind.is_symlink() {
            let target = entry.link_name_bytes().ok_or_else(|| self.hostile(&raw, "a symlink without a target"))?;
            let make = || rustix::fs::symlinkat(OsStr::from_bytes(&target), parent_fd, OsStr::from_bytes(name));
            // Most names are new: made first, and what is there cleared only when something is.
            match make() {
                Err(Errno::EXIST) => {
                    self.clear(parent_fd, &raw, name, false)?;
                    make()
                }
                made => made,
            }
            .map_err(|e| self.io(&raw, "make the symlink", e))?;
            self.owner_and_times_at(parent_fd, &raw, name, &meta, !owned, false)
        } else if kind.is_fifo() {
            self.clear(parent_fd, &raw, name, false)?;
            rustix::fs::mknodat(parent_fd, OsStr::from_bytes(name), FileType::Fifo, Mode::from_raw_mode(0o600), 0)
                .map_err(|e| self.io(&raw, "make the fifo", e))?;
            self.owner_and_times_at(parent_fd, &raw, name, &meta, true, true)
        } else {
            Err(self.hostile(&raw, format!("entry type `{}` is not a file system object", kind.as_byte() as char)))
        }
    }

    /// The mode, owner, times and kept xattrs of an entry.
    fn meta<R: Read>(&self, entry: &mut tar::Entry<'_, R>, raw: &[u8]) -> Result<Meta, ImageError> {
        // The numeric fields as GNU tar reads them: all NULs is 0 (Docker keeps such fields of an
        // imported tar, where the tar crate's own accessors refuse them). A PAX uid or gid is
        // already written into the header by the tar reader.
        let header = entry.header().as_bytes();
        let field = |range: std::ops::Range<usize>, name: &str| {
            numeric(&header[range]).ok_or_else(|| self.hostile(raw, format!("its {name} is not a number")))
        };
        let mode = field(100..108, "mode")? as u32 & 0o7777;
        let id = |v: u64, name: &str| {
            u32::try_from(v)
                .ok()
                .filter(|&v| v != u32::MAX)
                .ok_or_else(|| self.hostile(raw, format!("its {name} {v} is not an id")))
        };
        let uid = id(field(108..116, "uid")?, "uid")?;
        let gid = id(field(116..124, "gid")?, "gid")?;
        let mtime = field(136..148, "mtime")?;
        let mut mtime = Timespec { tv_sec: i64::try_from(mtime).unwrap_or(i64::MAX), tv_nsec: 0 };
        let mut xattrs = Vec::new();
        let pax =
            entry.pax_extensions().map_err(|e| from_io(e, || format!("layer {}: bad PAX records", self.layer)))?;
        for record in pax.into_iter().flatten() {
            let record = record.map_err(|e| from_io(e, || format!("layer {}: bad PAX records", self.layer)))?;
            let key = record.key_bytes();
            if key == b"mtime" {
                if let Some(t) = std::str::from_utf8(record.value_bytes()).ok().and_then(pax_time) {
                    mtime = t;
                }
            } else if let Some(name) = key.strip_prefix(b"SCHILY.xattr.")
                && keep_xattr(name)
            {
                xattrs.push((name.to_vec(), record.value_bytes().to_vec()));
            }
        }
        Ok(Meta { mode, uid, gid, times: Timestamps { last_access: mtime, last_modification: mtime }, xattrs })
    }

    /// The directory `parent` (a path in the layer), opened without following any symlink; made
    /// (0755, root's) with its missing ancestors when `create`.
    fn parent(&mut self, raw: &[u8], parent: &[u8], create: bool) -> Result<Rc<OwnedFd>, ImageError> {
        if parent.is_empty() {
            return Ok(self.root.clone());
        }
        if let Some(fd) = self.parents.get(parent) {
            return Ok(fd);
        }
        let fd = Rc::new(self.open_dir(raw, parent, create)?);
        self.parents.insert(parent, fd.clone());
        Ok(fd)
    }

    fn open_dir(&self, raw: &[u8], path: &[u8], create: bool) -> Result<OwnedFd, ImageError> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        if path.is_empty() {
            return rustix::fs::openat(&*self.root, c".", flags, Mode::empty())
                .map_err(|e| self.io(raw, "open the layer's root for", e));
        }
        let resolve = ResolveFlags::IN_ROOT | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV;
        loop {
            match rustix::fs::openat2(&*self.root, OsStr::from_bytes(path), flags, Mode::empty(), resolve) {
                Ok(fd) => return Ok(fd),
                // openat2 asks for a retry when a rename raced the lookup.
                Err(Errno::AGAIN) => continue,
                Err(Errno::LOOP) => return Err(self.through_symlink(raw, path)),
                Err(Errno::NOTDIR) => return Err(self.not_a_dir(raw, path)),
                Err(Errno::NOENT) if create => return self.walk(raw, path),
                Err(Errno::NOENT) => {
                    return Err(self.hostile(raw, format!("`{}` is not in the layer", String::from_utf8_lossy(path))));
                }
                // A kernel without openat2 (before 5.6): the same, a component at a time.
                Err(Errno::NOSYS) => return self.walk(raw, path),
                Err(e) => return Err(self.io(raw, "open the directory of", e)),
            }
        }
    }

    /// Opens `path` a component at a time, never following a symlink, making what is missing.
    fn walk(&self, raw: &[u8], path: &[u8]) -> Result<OwnedFd, ImageError> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let mut dir = rustix::fs::openat(&*self.root, c".", flags, Mode::empty())
            .map_err(|e| self.io(raw, "open the layer's root for", e))?;
        let mut walked = Vec::new();
        for component in path.split(|&b| b == b'/') {
            if !walked.is_empty() {
                walked.push(b'/');
            }
            walked.extend_from_slice(component);
            let name = OsStr::from_bytes(component);
            dir = match rustix::fs::openat(&dir, name, flags, Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    match rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(self.io(raw, "make a parent directory of", e)),
                    }
                    rustix::fs::openat(&dir, name, flags, Mode::empty())
                        .map_err(|e| self.io(raw, "open a parent directory of", e))?
                }
                // O_NOFOLLOW on a symlink with O_PATH opens the link itself: not a directory.
                Err(Errno::LOOP | Errno::NOTDIR) => {
                    return Err(match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => {
                            self.through_symlink(raw, &walked)
                        }
                        _ => self.not_a_dir(raw, &walked),
                    });
                }
                Err(e) => return Err(self.io(raw, "open a parent directory of", e)),
            };
        }
        Ok(dir)
    }

    fn through_symlink(&self, raw: &[u8], path: &[u8]) -> ImageError {
        self.hostile(
            raw,
            format!(
                "its parent `{}` is or passes through a symlink, which an entry is never unpacked through",
                String::from_utf8_lossy(path)
            ),
        )
    }

    fn not_a_dir(&self, raw: &[u8], path: &[u8]) -> ImageError {
        self.hostile(raw, format!("its parent `{}` is not a directory", String::from_utf8_lossy(path)))
    }

    /// Removes whatever is at `name` in `parent` (a directory with everything in it) unless it is
    /// a directory and `keep_dir`; whether a directory was kept.
    fn clear(&mut self, parent: BorrowedFd<'_>, raw: &[u8], name: &[u8], keep_dir: bool) -> Result<bool, ImageError> {
        let name = OsStr::from_bytes(name);
        let st = match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(false),
            Err(e) => return Err(self.io(raw, "look at what is already at", e)),
        };
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            if keep_dir {
                return Ok(true);
            }
            // Cached parents may be in it.
            self.parents.clear();
            remove_tree(parent, name).map_err(|e| self.io(raw, "remove the directory already at", e))?;
        } else {
            rustix::fs::unlinkat(parent, name, AtFlags::empty()).map_err(|e| self.io(raw, "replace", e))?;
        }
        Ok(false)
    }

    fn file<R: Read>(
        &mut self,
        parent: BorrowedFd<'_>,
        raw: &[u8],
        name: &[u8],
        meta: &Meta,
        owned: bool,
        data: &mut tar::Entry<'_, R>,
    ) -> Result<(), ImageError> {
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        // Made with its mode when the umask leaves it whole (no chmod then), unless it has
        // setuid, setgid or sticky bits: a chown clears the first two, and the umask never has them.
        let mode_at_creation = meta.mode & !self.creation_bits == 0;
        let mode = Mode::from_raw_mode(if mode_at_creation { meta.mode } else { 0o600 });
        let create = || rustix::fs::openat(parent, OsStr::from_bytes(name), flags, mode);
        // Most names are new: create first, and clear what is there only when something is.
        let fd = match create() {
            Err(Errno::EXIST) => {
                self.clear(parent, raw, name, false)?;
                create()
            }
            created => created,
        };
        let fd = fd.map_err(|e| self.io(raw, "create", e))?;
        let mut file = std::fs::File::from(fd);
        loop {
            let n =
                data.read(&mut self.buffer).map_err(|e| from_io(e, || format!("cannot read layer {}", self.layer)))?;
            if n == 0 {
                break;
            }
            file.write_all(&self.buffer[..n])
                .map_err(|e| ImageError::io(format!("layer {}: cannot write `{}`", self.layer, lossy(raw)), e))?;
            self.size += n as u64;
        }
        self.finish_fd(file.as_fd(), raw, meta, !owned, !mode_at_creation, true)
    }

    /// Owner (when `chown`: a new file may have it already), then mode (when `chmod`: a new file
    /// may have it already; after the owner, since a chown clears setuid bits), xattrs and times
    /// of an open file or directory; times only when `times` (a directory's are set at the end).
    fn finish_fd(
        &self,
        fd: BorrowedFd<'_>,
        raw: &[u8],
        meta: &Meta,
        chown: bool,
        chmod: bool,
        times: bool,
    ) -> Result<(), ImageError> {
        if chown {
            let (uid, gid) = ids(meta);
            rustix::fs::fchown(fd, Some(uid), Some(gid)).map_err(|e| self.io(raw, "set the owner of", e))?;
        }
        if chmod {
            rustix::fs::fchmod(fd, Mode::from_raw_mode(meta.mode)).map_err(|e| self.io(raw, "set the mode of", e))?;
        }
        for (name, value) in &meta.xattrs {
            rustix::fs::fsetxattr(fd, OsStr::from_bytes(name), value, XattrFlags::empty())
                .map_err(|e| self.io(raw, &format!("set the xattr `{}` of", lossy(name)), e))?;
        }
        if times {
            rustix::fs::futimens(fd, &meta.times).map_err(|e| self.io(raw, "set the times of", e))?;
        }
        Ok(())
    }

    /// Owner (when `chown`: a new symlink may have it already), mode (unless a symlink's) and
    /// times of `name` in `parent`, not following it.
    fn owner_and_times_at(
        &self,
        parent: BorrowedFd<'_>,
        raw: &[u8],
        name: &[u8],
        meta: &Meta,
        chown: bool,
        mode: bool,
    ) -> Result<(), ImageError> {
        let name = OsStr::from_bytes(name);
        if chown {
            let (uid, gid) = ids(meta);
            rustix::fs::chownat(parent, name, Some(uid), Some(gid), AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| self.io(raw, "set the owner of", e))?;
        }
        if mode {
            // Only a fifo gets here with `mode`: chmodat follows symlinks, and this is none.
            rustix::fs::chmodat(parent, name, Mode::from_raw_mode(meta.mode), AtFlags::empty())
                .map_err(|e| self.io(raw, "set the mode of", e))?;
        }
        rustix::fs::utimensat(parent, name, &meta.times, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| self.io(raw, "set the times of", e))
    }

    fn dir(
        &mut self,
        parent_fd: BorrowedFd<'_>,
        raw: &[u8],
        parent: &[u8],
        name: &[u8],
        meta: Meta,
    ) -> Result<(), ImageError> {
        if !self.clear(parent_fd, raw, name, true)? {
            rustix::fs::mkdirat(parent_fd, OsStr::from_bytes(name), Mode::from_raw_mode(0o700))
                .map_err(|e| self.io(raw, "make the directory", e))?;
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(parent_fd, OsStr::from_bytes(name), flags, Mode::empty())
            .map_err(|e| self.io(raw, "open the directory", e))?;
        self.finish_fd(fd.as_fd(), raw, &meta, true, true, false)?;
        let mut path = parent.to_vec();
        if !path.is_empty() {
            path.push(b'/');
        }
        path.extend_from_slice(name);
        if meta.mode & 0o2000 != 0 {
            self.setgid_dirs.insert(path.clone());
        } else {
            self.setgid_dirs.remove(&path);
        }
        self.dir_times.push((path, meta.times));
        Ok(())
    }

    fn root_dir(&mut self, raw: &[u8], meta: Meta) -> Result<(), ImageError> {
        let fd =
            rustix::fs::openat(&*self.root, c".", OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| self.io(raw, "open the layer's root for", e))?;
        self.finish_fd(fd.as_fd(), raw, &meta, true, true, false)?;
        if meta.mode & 0o2000 != 0 {
            self.setgid_dirs.insert(Vec::new());
        } else {
            self.setgid_dirs.remove(&Vec::new());
        }
        self.dir_times.push((Vec::new(), meta.times));
        Ok(())
    }

    fn hard_link(&mut self, raw: &[u8], parent: &[u8], name: &[u8], target: &[u8]) -> Result<(), ImageError> {
        let components = clean(target).map_err(|why| self.hostile(raw, format!("its link target: {why}")))?;
        let Some((target_name, target_parent)) = components.split_last() else {
            return Err(self.hostile(raw, "a hard link to the layer's root"));
        };
        let target_parent = target_parent.join(&b'/');
        let mut here = parent.to_vec();
        if !here.is_empty() {
            here.push(b'/');
        }
        here.extend_from_slice(name);
        if components.join(&b'/') == here {
            return Ok(());
        }
        let target_dir = match self.open_dir(raw, &target_parent, false) {
            Ok(fd) => fd,
            Err(ImageError::HostileLayer { why, .. }) if why.ends_with("is not in the layer") => {
                return Err(self.not_yet(raw, target));
            }
            Err(e) => return Err(e),
        };
        let parent_fd = self.parent(raw, parent, true)?;
        match rustix::fs::statat(&target_dir, OsStr::from_bytes(target_name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                return Err(self.hostile(raw, "a hard link to a directory"));
            }
            Ok(_) => {}
            Err(Errno::NOENT) => return Err(self.not_yet(raw, target)),
            Err(e) => return Err(self.io(raw, "look at the target of", e)),
        }
        self.clear(parent_fd.as_fd(), raw, name, false)?;
        // Without AT_SYMLINK_FOLLOW: a link to a symlink is to the symlink itself.
        rustix::fs::linkat(
            &target_dir,
            OsStr::from_bytes(target_name),
            &parent_fd,
            OsStr::from_bytes(name),
            AtFlags::empty(),
        )
        .map_err(|e| self.io(raw, "make the hard link", e))
    }

    fn not_yet(&self, raw: &[u8], target: &[u8]) -> ImageError {
        self.hostile(
            raw,
            format!("a hard link to `{}`, which the layer has not unpacked before it", String::from_utf8_lossy(target)),
        )
    }

    /// `.wh.NAME` hides NAME of the layers below: an overlay whiteout, a 0/0 character device;
    /// `.wh..wh..opq` hides all of its directory below: the opaque xattr.
    fn whiteout(&mut self, raw: &[u8], parent: &[u8], hidden: &[u8], meta: &Meta) -> Result<(), ImageError> {
        if hidden == b".wh..opq" {
            let dir = self.open_dir(raw, parent, true)?;
            let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
            let dir = rustix::fs::openat(&dir, c".", flags, Mode::empty())
                .map_err(|e| self.io(raw, "open the opaque directory of", e))?;
            return rustix::fs::fsetxattr(&dir, OPAQUE_XATTR, b"y", XattrFlags::empty())
                .map_err(|e| self.io(raw, "mark opaque the directory of", e));
        }
        if hidden.starts_with(b".wh.") {
            // Other `.wh..wh.` names are AUFS's own bookkeeping (`.wh..wh.plnk`): nothing to do.
            return Ok(());
        }
        if hidden.is_empty() || hidden == b"." || hidden == b".." {
            return Err(self.hostile(raw, "a whiteout of no name"));
        }
        let parent_fd = self.parent(raw, parent, true)?;
        self.clear(parent_fd.as_fd(), raw, hidden, false)?;
        let dev = rustix::fs::makedev(0, 0);
        rustix::fs::mknodat(&parent_fd, OsStr::from_bytes(hidden), FileType::CharacterDevice, Mode::empty(), dev)
            .map_err(|e| self.io(raw, "make the whiteout", e))?;
        let (uid, gid) = ids(meta);
        rustix::fs::chownat(&parent_fd, OsStr::from_bytes(hidden), Some(uid), Some(gid), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| self.io(raw, "set the owner of the whiteout", e))
    }

    /// Sets the directories' times. The layer is not durable yet: the store syncs it before it
    /// renames it into place ([`crate::store::Disk::commit_layer`]).
    fn finish(&mut self) -> Result<(), ImageError> {
        let dir_times = std::mem::take(&mut self.dir_times);
        for (path, times) in dir_times {
            let raw = path.clone();
            let (parent, name) = match path.iter().rposition(|&b| b == b'/') {
                Some(i) => (path[..i].to_vec(), path[i + 1..].to_vec()),
                None => (Vec::new(), path.clone()),
            };
            if path.is_empty() {
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
                let fd = rustix::fs::openat(&*self.root, c".", flags, Mode::empty())
                    .map_err(|e| self.io(&raw, "open the layer's root for", e))?;
                rustix::fs::futimens(&fd, &times).map_err(|e| self.io(&raw, "set the times of", e))?;
                continue;
            }
            // A directory an entry after it replaced is no longer there: nothing to set.
            let Ok(dir) = self.open_dir(&raw, &parent, false) else { continue };
            match rustix::fs::utimensat(&dir, OsStr::from_bytes(&name), &times, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(self.io(&raw, "set the times of", e)),
            }
        }
        Ok(())
    }
}

fn ids(meta: &Meta) -> (rustix::fs::Uid, rustix::fs::Gid) {
    (rustix::fs::Uid::from_raw(meta.uid), rustix::fs::Gid::from_raw(meta.gid))
}

fn lossy(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(bytes)
}

/// The components of an entry's path in the layer: a leading `/` is dropped (the path is the
/// layer's, as Docker reads it), `.` and empty components skipped, `..` refused.
fn clean(path: &[u8]) -> Result<Vec<&[u8]>, &'static str> {
    let mut components = Vec::new();
    for component in path.split(|&b| b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => return Err("a `..` component, which could reach out of the layer"),
            c => components.push(c),
        }
    }
    Ok(components)
}

/// Which xattrs of a tar are written: `user.*` only. `trusted.*` (a `trusted.overlay.*` would
/// steer overlayfs: an opaque or redirect of the layer's choosing) and `security.*` are the
/// host's business, and `user.overlay.*` is what overlayfs reads instead when mounted with
/// `userxattr` in a user namespace.
fn keep_xattr(name: &[u8]) -> bool {
    name.starts_with(b"user.") && !name.starts_with(b"user.overlay.")
}

/// A PAX time: `<seconds>[.<fraction>]`.
fn pax_time(text: &str) -> Option<Timespec> {
    let (secs, fraction) = text.split_once('.').unwrap_or((text, ""));
    let tv_sec: i64 = secs.parse().ok()?;
    let digits: String = fraction.chars().take(9).collect();
    let tv_nsec = if digits.is_empty() { 0 } else { digits.parse::<i64>().ok()? * 10i64.pow(9 - digits.len() as u32) };
    Some(Timespec { tv_sec, tv_nsec: if tv_sec < 0 { -tv_nsec } else { tv_nsec } })
}

/// Removes `name` in `parent` and, when it is a directory, everything in it, following no
/// symlink.
pub(crate) fn remove_tree(parent: BorrowedFd<'_>, name: &OsStr) -> Result<(), Errno> {
    match rustix::fs::unlinkat(parent, name, AtFlags::empty()) {
        Ok(()) => return Ok(()),
        Err(Errno::ISDIR | Errno::PERM) => {}
        Err(e) => return Err(e),
    }
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let dir = rustix::fs::openat(parent, name, flags, Mode::empty())?;
    let children: Vec<std::ffi::CString> = rustix::fs::Dir::read_from(&dir)?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_owned())
        .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
        .collect();
    for child in children {
        remove_tree(dir.as_fd(), OsStr::from_bytes(child.as_bytes()))?;
    }
    rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
}

/// Unpacks an uncompressed layer held in memory, with no blob digest to check.
#[cfg(test)]
pub(crate) fn unpack_plain(tar: &[u8], into: &Path, diff_id: &str, limits: &Limits) -> Result<Unpacked, ImageError> {
    let expected = Expected { diff_id: diff_id.to_string(), blob: None };
    unpack(tar, into, &expected, limits, &Budget::default(), &|_| {})
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    use std::path::PathBuf;
    use std::process::Command;

    use tar::{EntryType, Header};

    use super::*;
    use crate::manifest::sha256;

    /// A layer tar built entry by entry, with raw paths (so hostile ones can be written).
    struct Layer(tar::Builder<Vec<u8>>);

    impl Layer {
        fn new() -> Layer {
            Layer(tar::Builder::new(Vec::new()))
        }

        fn raw(&mut self, kind: EntryType, path: &str, link: Option<&str>, data: &[u8], mode: u32) -> &mut Layer {
            let mut header = Header::new_gnu();
            header.set_entry_type(kind);
            header.set_size(data.len() as u64);
            header.set_mode(mode);
            header.set_uid(1000);
            header.set_gid(1001);
            header.set_mtime(1_600_000_000);
            let old = header.as_old_mut();
            old.name[..path.len()].copy_from_slice(path.as_bytes());
            if let Some(link) = link {
                old.linkname[..link.len()].copy_from_slice(link.as_bytes());
            }
            header.set_cksum();
            self.0.append(&header, data).unwrap_or_else(|e| panic!("{e}"));
            self
        }

        fn file(&mut self, path: &str, data: &[u8]) -> &mut Layer {
            self.raw(EntryType::Regular, path, None, data, 0o644)
        }

        fn dir(&mut self, path: &str) -> &mut Layer {
            self.raw(EntryType::Directory, path, None, b"", 0o755)
        }

        fn symlink(&mut self, path: &str, target: &str) -> &mut Layer {
            self.raw(EntryType::Symlink, path, Some(target), b"", 0o777)
        }

        fn hard_link(&mut self, path: &str, target: &str) -> &mut Layer {
            self.raw(EntryType::Link, path, Some(target), b"", 0o644)
        }

        fn pax(&mut self, records: &[(&str, &[u8])]) -> &mut Layer {
            self.0.append_pax_extensions(records.iter().map(|(k, v)| (*k, *v))).unwrap_or_else(|e| panic!("{e}"));
            self
        }

        fn bytes(&mut self) -> Vec<u8> {
            let builder = std::mem::replace(&mut self.0, tar::Builder::new(Vec::new()));
            builder.into_inner().unwrap_or_else(|e| panic!("{e}"))
        }
    }

    fn root_dir() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let fs = dir.path().join("fs");
        std::fs::create_dir(&fs).unwrap_or_else(|e| panic!("{e}"));
        (dir, fs)
    }

    fn unpacked(tar: &[u8]) -> (tempfile::TempDir, PathBuf, Unpacked) {
        let (dir, fs) = root_dir();
        let done = unpack_plain(tar, &fs, &sha256(tar), &Limits::default()).unwrap_or_else(|e| panic!("{e}"));
        (dir, fs, done)
    }

    fn refused(tar: &[u8]) -> (ImageError, tempfile::TempDir) {
        let (dir, fs) = root_dir();
        let err = unpack_plain(tar, &fs, &sha256(tar), &Limits::default()).err().unwrap_or_else(|| panic!("unpacked"));
        (err, dir)
    }

    fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let n = rustix::fs::lgetxattr(path, name, &mut buf[..]).ok()?;
        buf.truncate(n);
        Some(buf)
    }

    #[test]
    fn files_keep_owners_modes_times_links_and_user_xattrs() {
        sandman_testkit::require_root();
        let mut layer = Layer::new();
        layer
            .dir("usr/")
            .dir("usr/bin/")
            .raw(EntryType::Regular, "usr/bin/su", None, b"setuid", 0o4755)
            .hard_link("usr/bin/su2", "usr/bin/su")
            .symlink("usr/bin/sh", "/bin/dash")
            .pax(&[
                ("SCHILY.xattr.user.note", b"kept"),
                ("SCHILY.xattr.trusted.overlay.opaque", b"y"),
                ("SCHILY.xattr.security.capability", b"\x01\x00\x00\x02"),
                ("SCHILY.xattr.user.overlay.redirect", b"/x"),
                ("mtime", b"1600000000.5"),
            ])
            .file("usr/bin/noted", b"x")
            .file("/abs/file", b"absolute")
            .file("top", b"t")
            .hard_link("top2", "/top")
            .raw(EntryType::Char, "dev/null", None, b"", 0o666)
            .raw(EntryType::Block, "dev/sda", None, b"", 0o660)
            .raw(EntryType::Fifo, "run/fifo", None, b"", 0o600);
        let (_dir, fs, done) = unpacked(&layer.bytes());
        let su = std::fs::symlink_metadata(fs.join("usr/bin/su")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(su.mode() & 0o7777, 0o4755, "setuid kept (the mode is set after the owner)");
        assert_eq!((su.uid(), su.gid()), (1000, 1001), "numeric ids as in the tar");
        assert_eq!(su.mtime(), 1_600_000_000);
        let su2 = std::fs::symlink_metadata(fs.join("usr/bin/su2")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(su2.ino(), su.ino(), "a hard link is one inode");
        let sh = std::fs::read_link(fs.join("usr/bin/sh")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sh, Path::new("/bin/dash"), "symlinks as written");
        let noted = fs.join("usr/bin/noted");
        assert_eq!(xattr(&noted, "user.note").as_deref(), Some(&b"kept"[..]));
        assert_eq!(xattr(&noted, "trusted.overlay.opaque"), None, "trusted.* dropped");
        assert_eq!(xattr(&noted, "security.capability"), None, "security.* dropped");
        assert_eq!(xattr(&noted, "user.overlay.redirect"), None, "user.overlay.* dropped");
        let noted = std::fs::metadata(&noted).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((noted.mtime(), noted.mtime_nsec()), (1_600_000_000, 500_000_000), "PAX mtimes");
        assert_eq!(
            std::fs::read(fs.join("abs/file")).unwrap_or_default(),
            b"absolute",
            "an absolute path is the layer's"
        );
        let usr = std::fs::metadata(fs.join("usr")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(usr.mtime(), 1_600_000_000, "a directory's time is set after what is made in it");
        assert!(!fs.join("dev/null").exists() && !fs.join("dev/sda").exists(), "device nodes are not made");
        assert_eq!(done.devices, 2);
        let fifo = std::fs::metadata(fs.join("run/fifo")).unwrap_or_else(|e| panic!("{e}"));
        assert!(fifo.file_type().is_fifo());
        assert_eq!(std::fs::read(fs.join("top2")).unwrap_or_default(), b"t", "a link to the layer's top");
        assert_eq!(done.size, 6 + 1 + 8 + 1);
    }

    /// Unmounts when dropped.
    struct Mounted(PathBuf);

    impl Drop for Mounted {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }

    #[test]
    fn whiteouts_and_opaque_directories_are_honoured_by_a_real_overlay() {
        sandman_testkit::require_root();
        let lower = Layer::new()
            .dir("a/")
            .file("a/keep", b"1")
            .file("a/gone", b"2")
            .dir("opq/")
            .file("opq/old", b"3")
            .dir("dir/")
            .file("dir/inside", b"4")
            .bytes();
        let upper = Layer::new()
            .file("a/.wh.gone", b"")
            .file("opq/.wh..wh..opq", b"")
            .file("opq/new", b"5")
            .file(".wh.dir", b"")
            .bytes();
        let (_l, lower_fs, _) = unpacked(&lower);
        let (_u, upper_fs, _) = unpacked(&upper);
        let whiteout = std::fs::symlink_metadata(upper_fs.join("a/gone")).unwrap_or_else(|e| panic!("{e}"));
        assert!(whiteout.file_type().is_char_device() && whiteout.rdev() == 0, "a 0/0 character device");
        assert_eq!(xattr(&upper_fs.join("opq"), OPAQUE_XATTR).as_deref(), Some(&b"y"[..]));
        let mnt = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let options = format!("lowerdir={}:{}", upper_fs.display(), lower_fs.display());
        let status = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &options])
            .arg(mnt.path())
            .status()
            .unwrap_or_else(|e| panic!("mount: {e}"));
        assert!(status.success(), "mount -t overlay -o {options}");
        let _mounted = Mounted(mnt.path().to_path_buf());
        let root = mnt.path();
        assert!(root.join("a/keep").exists());
        assert!(!root.join("a/gone").exists(), "the whiteout hides the lower file");
        assert!(!root.join("opq/old").exists(), "the opaque directory hides the lower one's contents");
        assert!(root.join("opq/new").exists(), "but not its own");
        assert!(!root.join("dir").exists(), "a whited-out directory is gone with its contents");
    }

    #[test]
    fn dot_dot_is_refused() {
        let (err, _dir) = refused(&Layer::new().file("a/../../escape", b"x").bytes());
        assert!(matches!(&err, ImageError::HostileLayer { entry, .. } if entry == "a/../../escape"), "{err}");
        assert!(err.to_string().contains(".."), "{err}");
    }

    #[test]
    fn an_entry_under_a_symlink_is_refused_and_nothing_lands_outside() {
        let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let target = outside.path().to_string_lossy().into_owned();
        let (err, _dir) = refused(&Layer::new().symlink("a", &target).file("a/passwd", b"root::0:0").bytes());
        assert!(matches!(&err, ImageError::HostileLayer { entry, .. } if entry == "a/passwd"), "{err}");
        assert!(err.to_string().contains("symlink"), "{err}");
        assert_eq!(std::fs::read_dir(outside.path()).map(|d| d.count()).unwrap_or(1), 0);
        // Through a relative symlink deeper in the path, and one made over a directory.
        let (err, _dir) = refused(&Layer::new().dir("d/").symlink("d/up", "..").file("d/up/x", b"").bytes());
        assert!(matches!(err, ImageError::HostileLayer { .. }), "{err}");
        let (err, _dir) = refused(&Layer::new().dir("x/").symlink("x", &target).file("x/file", b"").bytes());
        assert!(matches!(err, ImageError::HostileLayer { .. }), "{err}");
        assert_eq!(std::fs::read_dir(outside.path()).map(|d| d.count()).unwrap_or(1), 0);
    }

    #[test]
    fn hard_links_out_of_the_layer_or_forward_are_refused() {
        let (err, _dir) = refused(&Layer::new().hard_link("l", "../../etc/passwd").bytes());
        assert!(matches!(&err, ImageError::HostileLayer { why, .. } if why.contains("..")), "{err}");
        // An absolute target is the layer's own path, which it does not have.
        let (err, _dir) = refused(&Layer::new().hard_link("l", "/etc/passwd").bytes());
        assert!(matches!(&err, ImageError::HostileLayer { why, .. } if why.contains("not unpacked")), "{err}");
        let (err, _dir) = refused(&Layer::new().hard_link("early", "later").file("later", b"x").bytes());
        assert!(matches!(&err, ImageError::HostileLayer { why, .. } if why.contains("not unpacked")), "{err}");
        let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(outside.path().join("secret"), "s").unwrap_or_else(|e| panic!("{e}"));
        let target = outside.path().to_string_lossy().into_owned();
        let (err, _dir) = refused(&Layer::new().symlink("out", &target).hard_link("l", "out/secret").bytes());
        assert!(matches!(&err, ImageError::HostileLayer { why, .. } if why.contains("symlink")), "{err}");
    }

    #[test]
    fn a_trusted_overlay_xattr_in_the_tar_does_not_make_a_directory_opaque() {
        sandman_testkit::require_root();
        let layer = Layer::new().pax(&[("SCHILY.xattr.trusted.overlay.opaque", b"y")]).dir("d/").bytes();
        let (_dir, fs, _) = unpacked(&layer);
        assert_eq!(xattr(&fs.join("d"), OPAQUE_XATTR), None);
    }

    #[test]
    fn bounds_refuse_oversized_layers() {
        let layer = Layer::new().file("a", b"1").file("b", b"2").file("c", b"3").bytes();
        let (_d, fs) = root_dir();
        let limits = Limits { max_layer_entries: 2, ..Limits::default() };
        let err = unpack_plain(&layer, &fs, &sha256(&layer), &limits).err();
        assert!(matches!(err, Some(ImageError::TooLarge { unit: "entries", .. })), "{err:?}");
        let (_d, fs) = root_dir();
        let limits = Limits { max_image_uncompressed: 1024, ..Limits::default() };
        let err = unpack_plain(&layer, &fs, &sha256(&layer), &limits).err();
        assert!(matches!(err, Some(ImageError::TooLarge { unit: "bytes", .. })), "{err:?}");
        let (_d, fs) = root_dir();
        let limits = Limits { max_layer_compressed: 1024, ..Limits::default() };
        let err = unpack_plain(&layer, &fs, &sha256(&layer), &limits).err();
        assert!(matches!(err, Some(ImageError::TooLarge { .. })), "{err:?}");
        // The image's budget is shared by its layers.
        let (_d, fs) = root_dir();
        let budget = Budget::default();
        budget.add(Limits::default().max_image_uncompressed);
        let expected = Expected { diff_id: sha256(&layer), blob: None };
        let err = unpack(&layer[..], &fs, &expected, &Limits::default(), &budget, &|_| {}).err();
        assert!(matches!(err, Some(ImageError::TooLarge { .. })), "{err:?}");
    }

    #[test]
    fn an_endless_blob_is_cut_at_its_size_and_refused() {
        let (_d, fs) = root_dir();
        let expected = Expected { diff_id: sha256(b""), blob: Some((sha256(b""), 4096)) };
        let endless = io::BufReader::new(io::repeat(0));
        let err = unpack(endless, &fs, &expected, &Limits::default(), &Budget::default(), &|_| {}).err();
        assert!(matches!(&err, Some(ImageError::Digest { what, .. }) if what.contains("size")), "{err:?}");
    }

    #[test]
    fn a_tar_metadata_bomb_is_refused_before_it_is_read() {
        let mut header = Header::new_gnu();
        header.set_entry_type(EntryType::GNULongName);
        header.set_size(1 << 40);
        header.set_cksum();
        let mut bytes = header.as_bytes().to_vec();
        bytes.extend(std::iter::repeat_n(b'a', 4096));
        let (_d, fs) = root_dir();
        let err = unpack_plain(&bytes, &fs, &sha256(&bytes), &Limits::default()).err();
        assert!(matches!(&err, Some(ImageError::HostileLayer { why, .. }) if why.contains("metadata")), "{err:?}");
    }

    #[test]
    fn digests_that_do_not_match_are_refused() {
        let layer = Layer::new().file("a", b"1").bytes();
        let (_d, fs) = root_dir();
        let err = unpack_plain(&layer, &fs, &sha256(b"other"), &Limits::default()).err();
        assert!(matches!(&err, Some(ImageError::Digest { what, .. }) if what.contains("diff_ids")), "{err:?}");
        let (_d, fs) = root_dir();
        let expected = Expected { diff_id: sha256(&layer), blob: Some((sha256(b"other"), layer.len() as u64)) };
        let err = unpack(&layer[..], &fs, &expected, &Limits::default(), &Budget::default(), &|_| {}).err();
        assert!(matches!(&err, Some(ImageError::Digest { what, .. }) if what.contains("digest of blob")), "{err:?}");
    }

    #[test]
    fn a_corrupted_blob_is_a_digest_error_whatever_fails_first() {
        let layer = Layer::new().file("a", &vec![b'x'; 200_000]).file("b", b"after").bytes();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&layer).unwrap_or_else(|e| panic!("{e}"));
        let good = gz.finish().unwrap_or_else(|e| panic!("{e}"));
        // Overwritten in the middle: the inflate fails there, before any digest is known.
        let mut bad = good.clone();
        let middle = bad.len() / 2;
        bad[middle..middle + 16].fill(0xff);
        let (_d, fs) = root_dir();
        let expected = Expected { diff_id: sha256(&layer), blob: Some((sha256(&good), good.len() as u64)) };
        let err = unpack(&bad[..], &fs, &expected, &Limits::default(), &Budget::default(), &|_| {}).err();
        assert!(matches!(&err, Some(ImageError::Digest { what, .. }) if what.contains("digest of blob")), "{err:?}");
    }

    #[test]
    fn gzip_and_zstd_layers_unpack() {
        sandman_testkit::require_root();
        let layer = Layer::new().file("f", &vec![7u8; 100_000]).bytes();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&layer).unwrap_or_else(|e| panic!("{e}"));
        let gz = gz.finish().unwrap_or_else(|e| panic!("{e}"));
        let zst = zstd::encode_all(&layer[..], 3).unwrap_or_else(|e| panic!("{e}"));
        for blob in [gz, zst] {
            let (_d, fs) = root_dir();
            let expected = Expected { diff_id: sha256(&layer), blob: Some((sha256(&blob), blob.len() as u64)) };
            let done = unpack(&blob[..], &fs, &expected, &Limits::default(), &Budget::default(), &|_| {})
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(done.blob_size, blob.len() as u64);
            assert_eq!(std::fs::read(fs.join("f")).map(|b| b.len()).unwrap_or(0), 100_000);
            assert_eq!(std::fs::metadata(fs.join("f")).map(|m| m.permissions().mode() & 0o777).unwrap_or(0), 0o644);
        }
    }

    #[test]
    fn later_entries_replace_earlier_ones() {
        sandman_testkit::require_root();
        let layer = Layer::new()
            .dir("x/")
            .file("x/in", b"1")
            .file("x", b"now a file")
            .symlink("y", "t")
            .file("y", b"f")
            .bytes();
        let (_d, fs, _) = unpacked(&layer);
        assert_eq!(std::fs::read(fs.join("x")).unwrap_or_default(), b"now a file");
        assert!(std::fs::symlink_metadata(fs.join("y")).is_ok_and(|m| m.is_file()));
    }

    #[test]
    fn a_symlink_replaces_a_file_or_a_directory_already_there() {
        sandman_testkit::require_root();
        let layer =
            Layer::new().file("f", b"1").dir("d/").file("d/in", b"2").symlink("f", "t1").symlink("d", "t2").bytes();
        let (_d, fs, _) = unpacked(&layer);
        assert_eq!(std::fs::read_link(fs.join("f")).ok(), Some(PathBuf::from("t1")));
        assert_eq!(std::fs::read_link(fs.join("d")).ok(), Some(PathBuf::from("t2")));
    }

    #[test]
    fn a_directory_made_again_is_the_one_its_entries_land_in() {
        sandman_testkit::require_root();
        // `d` is opened for `d/a`, then removed: `d/b` must go into the new `d`, not the old one.
        let layer = Layer::new().dir("d/").file("d/a", b"1").file("d", b"a file").dir("d/").file("d/b", b"2").bytes();
        let (_d, fs, _) = unpacked(&layer);
        assert_eq!(std::fs::read(fs.join("d/b")).unwrap_or_default(), b"2");
        assert!(!fs.join("d/a").exists());
    }

    #[test]
    fn entries_in_more_directories_than_are_kept_open_land_in_theirs() {
        sandman_testkit::require_root();
        let dirs = OPEN_PARENTS * 2 + 1;
        let mut layer = Layer::new();
        for round in 0..3 {
            for d in 0..dirs {
                layer.file(&format!("d{d}/f{round}"), format!("{d}.{round}").as_bytes());
            }
        }
        let (_d, fs, _) = unpacked(&layer.bytes());
        for round in 0..3 {
            for d in 0..dirs {
                let found = std::fs::read(fs.join(format!("d{d}/f{round}"))).unwrap_or_default();
                assert_eq!(found, format!("{d}.{round}").as_bytes(), "d{d}/f{round}");
            }
        }
    }

    #[test]
    fn files_get_their_modes_exactly_whatever_the_umask_leaves() {
        sandman_testkit::require_root();
        let modes = [0o644, 0o755, 0o777, 0o666, 0o600, 0o000, 0o444, 0o4755, 0o2711, 0o1777];
        let mut layer = Layer::new();
        for (i, mode) in modes.iter().enumerate() {
            // Both the tar's owner and this process's (which takes no chown).
            for uid in [0, 1000] {
                let mut header = Header::new_gnu();
                header.set_entry_type(EntryType::Regular);
                header.set_size(1);
                header.set_mode(*mode);
                header.set_uid(uid);
                header.set_gid(uid);
                header.set_path(format!("m{i}-{uid}")).unwrap_or_else(|e| panic!("{e}"));
                header.set_cksum();
                layer.0.append(&header, &b"x"[..]).unwrap_or_else(|e| panic!("{e}"));
            }
        }
        let (_d, fs, _) = unpacked(&layer.bytes());
        for (i, mode) in modes.iter().enumerate() {
            for uid in [0, 1000] {
                let meta = std::fs::metadata(fs.join(format!("m{i}-{uid}"))).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(meta.mode() & 0o7777, *mode, "m{i}-{uid}: {mode:o}");
                assert_eq!((meta.uid(), meta.gid()), (uid as u32, uid as u32));
            }
        }
    }

    #[test]
    fn a_blob_whose_first_bytes_come_one_at_a_time_is_still_read_as_gzip() {
        sandman_testkit::require_root();
        let layer = Layer::new().file("f", b"x").bytes();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&layer).unwrap_or_else(|e| panic!("{e}"));
        let gz = gz.finish().unwrap_or_else(|e| panic!("{e}"));
        let (_d, fs) = root_dir();
        let expected = Expected { diff_id: sha256(&layer), blob: Some((sha256(&gz), gz.len() as u64)) };
        let trickle = io::BufReader::with_capacity(1, &gz[..]);
        let done = unpack(trickle, &fs, &expected, &Limits::default(), &Budget::default(), &|_| {})
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(done.blob_size, gz.len() as u64);
        assert_eq!(std::fs::read(fs.join("f")).unwrap_or_default(), b"x");
    }

    #[test]
    fn a_refusal_early_in_a_large_layer_stops_its_decompressor() {
        // Refused at its first entry, with megabytes still to inflate: the unpack ends with the
        // refusal, its decompressor stopped rather than left waiting to hand over more.
        let layer = Layer::new().file("../escape", b"x").file("big", &vec![7; 16 << 20]).bytes();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&layer).unwrap_or_else(|e| panic!("{e}"));
        let gz = gz.finish().unwrap_or_else(|e| panic!("{e}"));
        let (_d, fs) = root_dir();
        let expected = Expected { diff_id: sha256(&layer), blob: Some((sha256(&gz), gz.len() as u64)) };
        let err = unpack(&gz[..], &fs, &expected, &Limits::default(), &Budget::default(), &|_| {}).err();
        assert!(matches!(&err, Some(ImageError::HostileLayer { why, .. }) if why.contains("..")), "{err:?}");
    }

    #[test]
    fn a_root_file_in_a_setgid_directory_still_gets_its_group() {
        sandman_testkit::require_root();
        let mut layer = Layer::new();
        // The directory is group 1001 and setgid: a new file in it would take group 1001.
        layer.raw(EntryType::Directory, "shared/", None, b"", 0o2775);
        let mut header = Header::new_gnu();
        header.set_entry_type(EntryType::Regular);
        header.set_size(1);
        header.set_mode(0o644);
        header.set_uid(0);
        header.set_gid(0);
        header.as_old_mut().name[..8].copy_from_slice(b"shared/f");
        header.set_cksum();
        layer.0.append(&header, &b"x"[..]).unwrap_or_else(|e| panic!("{e}"));
        let mut header = Header::new_gnu();
        header.set_entry_type(EntryType::Symlink);
        header.set_size(0);
        header.set_mode(0o777);
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        header.set_path("shared/l").unwrap_or_else(|e| panic!("{e}"));
        header.set_link_name("f").unwrap_or_else(|e| panic!("{e}"));
        header.set_cksum();
        layer.0.append(&header, &b""[..]).unwrap_or_else(|e| panic!("{e}"));
        let (_d, fs, _) = unpacked(&layer.bytes());
        let shared = std::fs::metadata(fs.join("shared")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((shared.gid(), shared.mode() & 0o7777), (1001, 0o2775));
        let file = std::fs::metadata(fs.join("shared/f")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((file.uid(), file.gid()), (0, 0), "the tar's group, not the directory's");
        let link = std::fs::symlink_metadata(fs.join("shared/l")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((link.uid(), link.gid()), (0, 0), "a symlink's too");
    }

    #[test]
    fn numeric_fields_of_nuls_are_zero_as_docker_keeps_them() {
        sandman_testkit::require_root();
        let mut header = Header::new_gnu();
        header.set_entry_type(EntryType::Regular);
        header.set_size(2);
        header.as_old_mut().name[..4].copy_from_slice(b"file");
        header.as_old_mut().mode.copy_from_slice(b"0000644\0");
        header.set_cksum();
        let mut layer = Layer::new();
        layer.0.append(&header, &b"hi"[..]).unwrap_or_else(|e| panic!("{e}"));
        let (_d, fs, _) = unpacked(&layer.bytes());
        let meta = std::fs::metadata(fs.join("file")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((meta.uid(), meta.gid(), meta.mtime()), (0, 0, 0));
    }

    #[test]
    fn numeric_fields_and_pax_records_are_read() {
        assert_eq!(numeric(b"0000644\0"), Some(0o644));
        assert_eq!(numeric(b"        "), Some(0));
        assert_eq!(numeric(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]), Some(256));
        assert_eq!(pax_value(b"11 size=42\n8 a=bcd\n", b"a"), Some("bcd"));
        assert_eq!(pax_value(b"11 size=42\n", b"size"), Some("42"));
        assert_eq!(pax_time("12.5").map(|t| (t.tv_sec, t.tv_nsec)), Some((12, 500_000_000)));
    }
}
