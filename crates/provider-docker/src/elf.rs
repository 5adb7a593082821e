//! Whether the daemon binary is static: an ELF executable with no interpreter (`PT_INTERP`) and no
//! shared library (`DT_NEEDED`), so that it runs in any image, even one with no libc at all.

use std::path::{Path, PathBuf};

/// Why a daemon binary cannot be bind-mounted into an arbitrary image.
#[derive(Debug, thiserror::Error)]
pub enum DaemonBinaryError {
    #[error("cannot read the daemon binary `{}`", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{}` is not a 64-bit little-endian ELF executable: {why}", path.display())]
    NotElf { path: PathBuf, why: &'static str },
    #[error(
        "`{}` is dynamically linked ({what}), so it cannot run in an image without that libc; \
         the docker provider needs the static daemon: build it with ./scripts/build-daemon and pass \
         --daemon target/static/x86_64-unknown-linux-gnu/daemon/sandmand (or set SANDMAN_DAEMON)",
        path.display()
    )]
    Dynamic { path: PathBuf, what: String },
}

const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;

/// Checks that `path` is a static ELF executable (a static-pie has a dynamic section, but no
/// interpreter and no `DT_NEEDED`).
pub fn check_static(path: &Path) -> Result<(), DaemonBinaryError> {
    let bytes = std::fs::read(path).map_err(|source| DaemonBinaryError::Read { path: path.to_path_buf(), source })?;
    match linkage(&bytes) {
        Ok(Linkage::Static) => Ok(()),
        Ok(Linkage::Dynamic(what)) => Err(DaemonBinaryError::Dynamic { path: path.to_path_buf(), what }),
        Err(why) => Err(DaemonBinaryError::NotElf { path: path.to_path_buf(), why }),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Linkage {
    Static,
    /// What makes it dynamic: its interpreter, its shared libraries.
    Dynamic(String),
}

fn linkage(b: &[u8]) -> Result<Linkage, &'static str> {
    if b.get(..4) != Some(b"\x7fELF") {
        return Err("no ELF magic");
    }
    if b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err("not ELF64 little-endian");
    }
    let phoff = u64_at(b, 0x20).ok_or("truncated header")?;
    let phentsize = u64::from(u16_at(b, 0x36).ok_or("truncated header")?);
    let phnum = u64::from(u16_at(b, 0x38).ok_or("truncated header")?);
    let mut interp = None;
    let mut dynamic = None;
    for i in 0..phnum {
        let at = usize::try_from(phoff + i * phentsize).map_err(|_| "program header out of range")?;
        let kind = u32_at(b, at).ok_or("truncated program header")?;
        let offset = u64_at(b, at + 8).ok_or("truncated program header")?;
        let size = u64_at(b, at + 32).ok_or("truncated program header")?;
        match kind {
            PT_INTERP => interp = Some((offset, size)),
            PT_DYNAMIC => dynamic = Some((offset, size)),
            _ => {}
        }
    }
    let mut why = Vec::new();
    if let Some((offset, size)) = interp {
        let text = slice(b, offset, size).ok_or("interpreter out of range")?;
        let name = String::from_utf8_lossy(text.split(|c| *c == 0).next().unwrap_or_default()).into_owned();
        why.push(format!("interpreter {name}"));
    }
    if let Some((offset, size)) = dynamic {
        let table = slice(b, offset, size).ok_or("dynamic section out of range")?;
        let needed = table
            .chunks_exact(16)
            .map(|e| u64_at(e, 0).unwrap_or(DT_NULL))
            .take_while(|tag| *tag != DT_NULL)
            .filter(|tag| *tag == DT_NEEDED)
            .count();
        if needed > 0 {
            why.push(format!("{needed} shared librar{}", if needed == 1 { "y" } else { "ies" }));
        }
    }
    if why.is_empty() { Ok(Linkage::Static) } else { Ok(Linkage::Dynamic(why.join(", "))) }
}

fn slice(b: &[u8], offset: u64, size: u64) -> Option<&[u8]> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(usize::try_from(size).ok()?)?;
    b.get(start..end)
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 image: a header, program headers of the given kinds, and their contents.
    fn elf(segments: &[(u32, Vec<u8>)]) -> Vec<u8> {
        let phoff = 64u64;
        let mut data_at = phoff + 56 * segments.len() as u64;
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[0x20..0x28].copy_from_slice(&phoff.to_le_bytes());
        b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        b[0x38..0x3a].copy_from_slice(&(segments.len() as u16).to_le_bytes());
        let mut data = Vec::new();
        for (kind, content) in segments {
            let mut ph = vec![0u8; 56];
            ph[..4].copy_from_slice(&kind.to_le_bytes());
            ph[8..16].copy_from_slice(&data_at.to_le_bytes());
            ph[32..40].copy_from_slice(&(content.len() as u64).to_le_bytes());
            b.extend_from_slice(&ph);
            data.extend_from_slice(content);
            data_at += content.len() as u64;
        }
        b.extend_from_slice(&data);
        b
    }

    fn dynamic(tags: &[u64]) -> Vec<u8> {
        tags.iter().flat_map(|t| t.to_le_bytes().into_iter().chain(0u64.to_le_bytes())).collect()
    }

    #[test]
    fn a_static_pie_is_static_and_an_interpreter_or_needed_library_is_not() {
        assert_eq!(linkage(&elf(&[(1, vec![0; 8])])), Ok(Linkage::Static));
        // static-pie: a dynamic section with relocations (DT_RELA = 7) but nothing needed.
        assert_eq!(linkage(&elf(&[(PT_DYNAMIC, dynamic(&[7, DT_NULL, DT_NEEDED]))])), Ok(Linkage::Static));
        let interp = elf(&[(PT_INTERP, b"/lib64/ld-linux-x86-64.so.2\0".to_vec())]);
        assert_eq!(linkage(&interp), Ok(Linkage::Dynamic("interpreter /lib64/ld-linux-x86-64.so.2".into())));
        let needed = elf(&[(PT_DYNAMIC, dynamic(&[DT_NEEDED, DT_NEEDED, DT_NULL]))]);
        assert_eq!(linkage(&needed), Ok(Linkage::Dynamic("2 shared libraries".into())));
        assert!(linkage(b"#!/bin/sh\n").is_err());
        assert!(linkage(&elf(&[(PT_INTERP, vec![])])[..70]).is_err());
    }

    #[test]
    fn this_test_binary_is_dynamic() {
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
        match check_static(&exe) {
            Err(e @ DaemonBinaryError::Dynamic { .. }) => assert!(e.to_string().contains("build-daemon"), "{e}"),
            other => panic!("expected a dynamic binary, got {other:?}"),
        }
    }
}
