//! Where a client finds its server and token: `SANDMAN_URL`, `SANDMAN_TOKEN`, and the Unix
//! socket and token file the server keeps in its state directory ([`default_state_dir`]).

use std::io;
use std::path::PathBuf;

pub use sandman_wire::state_dir::default_state_dir;

use crate::error::ClientError;

/// The server's URL when `SANDMAN_URL` is unset.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7777";

/// The name of the file, in the state directory, holding the server's token.
pub const TOKEN_FILE: &str = "token";

/// The path of the token file the server writes: `<default_state_dir>/token`.
pub fn default_token_file() -> PathBuf {
    default_state_dir().join(TOKEN_FILE)
}

/// The name of the Unix socket, in the state directory, the server serves on too.
pub const SOCKET_FILE: &str = "sandman.sock";

/// The server's URL: `$SANDMAN_URL`; else its Unix socket in the default state directory, where
/// a server on this machine serves (`unix:<state dir>/sandman.sock`: a directory only the
/// server's user may enter, so nobody else can stand in for it there); else [`DEFAULT_URL`].
pub fn url_from_env() -> String {
    if let Some(url) = std::env::var("SANDMAN_URL").ok().filter(|u| !u.is_empty()) {
        return url;
    }
    let socket = default_state_dir().join(SOCKET_FILE);
    if is_socket(&socket) {
        return format!("unix:{}", socket.display());
    }
    DEFAULT_URL.to_owned()
}

fn is_socket(path: &std::path::Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// The token: `$SANDMAN_TOKEN`, else the contents of [`default_token_file`] (trimmed).
pub fn token_from_env() -> Result<String, ClientError> {
    if let Some(token) = std::env::var("SANDMAN_TOKEN").ok().filter(|t| !t.is_empty()) {
        return Ok(token);
    }
    read_token_file(default_token_file())
}

fn read_token_file(path: PathBuf) -> Result<String, ClientError> {
    match std::fs::read_to_string(&path) {
        Ok(text) if !text.trim().is_empty() => Ok(text.trim().to_owned()),
        Ok(_) => Err(ClientError::NoToken { path }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(ClientError::NoToken { path }),
        Err(source) => Err(ClientError::TokenFile { path, source }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn token_files_are_trimmed_and_missing_ones_say_where_they_were_looked_for() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(TOKEN_FILE);
        std::fs::write(&file, "s3cret\n").unwrap();
        assert_eq!(read_token_file(file.clone()).unwrap(), "s3cret");
        std::fs::write(&file, "\n").unwrap();
        assert!(matches!(read_token_file(file.clone()), Err(ClientError::NoToken { .. })));
        std::fs::remove_file(&file).unwrap();
        match read_token_file(file.clone()) {
            Err(ClientError::NoToken { path }) => assert_eq!(path, file),
            other => panic!("{other:?}"),
        }
    }
}
