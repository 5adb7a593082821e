//! The server's bearer token: `SANDMAN_TOKEN` when set, else read from (or generated once into)
//! the state directory's `token` file. The check every call but `/healthz` passes is
//! `sandman_http::constant_time_eq`, shared with the daemon.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Where the token came from, for the start-up message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    Env,
    File(PathBuf),
    Generated(PathBuf),
}

/// Loads the token from the environment or `state_dir/token`, generating that file (0600) on
/// first start.
pub fn load_or_generate(env: Option<String>, state_dir: &Path) -> std::io::Result<(String, TokenSource)> {
    if let Some(t) = env.filter(|t| !t.trim().is_empty()) {
        return Ok((t.trim().to_string(), TokenSource::Env));
    }
    let path = state_dir.join("token");
    match std::fs::read_to_string(&path) {
        Ok(text) if !text.trim().is_empty() => return Ok((text.trim().to_string(), TokenSource::File(path))),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::create_dir_all(state_dir)?;
    let token = random_token()?;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&path)?;
    f.write_all(token.as_bytes())?;
    f.write_all(b"\n")?;
    Ok((token, TokenSource::Generated(path)))
}

/// 32 random bytes as hex, from the kernel (`getrandom(2)`, which needs no descriptor).
pub fn random_token() -> std::io::Result<String> {
    let mut buf = [0u8; 32];
    crate::sys::random_bytes(&mut buf)?;
    Ok(hex::encode(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_once_then_read_back() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (t1, s1) = load_or_generate(None, dir.path()).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(s1, TokenSource::Generated(_)));
        assert_eq!(t1.len(), 64);
        let mode = std::fs::metadata(dir.path().join("token"))
            .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()));
        assert_eq!(mode.ok().map(|m| m & 0o777), Some(0o600));
        let (t2, s2) = load_or_generate(None, dir.path()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t1, t2);
        assert!(matches!(s2, TokenSource::File(_)));
        let (t3, s3) = load_or_generate(Some("from-env".into()), dir.path()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((t3.as_str(), s3), ("from-env", TokenSource::Env));
    }
}
