//! The fork server's one request, between the process provider and `sandmand fork-server`: start
//! a daemon with these arguments, environment and working directory (its log, the daemon's
//! stderr, travels beside the message as a descriptor). The answer is the daemon's pid in
//! decimal, or `error: ` and why. One `SOCK_SEQPACKET` message each way, after the server's
//! [`READY`].
//!
//! A request is NUL-terminated fields: the working directory, the number of arguments, how many
//! of them after the first select the daemon in a binary that embeds it (`sandman __sandmand`),
//! the arguments, then the environment as `KEY=VALUE`. Arguments, paths and variables hold no
//! NUL, as an exec's cannot.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

/// The server's first message: it serves.
pub const READY: &[u8] = b"ready";

/// The largest request a fork server takes (a daemon's arguments and environment are a few KiB).
pub const MAX_REQUEST: usize = 64 * 1024;

/// One daemon to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForkRequest {
    pub cwd: PathBuf,
    /// The command line as an exec would have it: the binary, then `dispatch` arguments that
    /// select the daemon in a binary embedding it, then the daemon's own.
    pub argv: Vec<OsString>,
    pub dispatch: usize,
    pub env: Vec<(OsString, OsString)>,
}

impl ForkRequest {
    /// The arguments the daemon's entry point takes: the program, then its own.
    pub fn daemon_argv(&self) -> Vec<OsString> {
        self.argv.iter().take(1).chain(self.argv.iter().skip(1 + self.dispatch)).cloned().collect()
    }

    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let mut field = |bytes: &[u8], what: &str| {
            if bytes.contains(&0) {
                return Err(format!("{what} holds a NUL byte"));
            }
            out.extend_from_slice(bytes);
            out.push(0);
            Ok(())
        };
        field(self.cwd.as_os_str().as_bytes(), "the working directory")?;
        field(self.argv.len().to_string().as_bytes(), "")?;
        field(self.dispatch.to_string().as_bytes(), "")?;
        for arg in &self.argv {
            field(arg.as_bytes(), "an argument")?;
        }
        for (key, value) in &self.env {
            if key.is_empty() || key.as_bytes().contains(&b'=') {
                return Err(format!("environment variable name `{}` is empty or holds `=`", key.to_string_lossy()));
            }
            let mut var = key.as_bytes().to_vec();
            var.push(b'=');
            var.extend_from_slice(value.as_bytes());
            field(&var, "an environment variable")?;
        }
        if out.len() > MAX_REQUEST {
            return Err(format!("the request is {} bytes, over the fork server's {MAX_REQUEST}", out.len()));
        }
        Ok(out)
    }

    pub fn decode(bytes: &[u8]) -> Result<ForkRequest, String> {
        let body = bytes.strip_suffix(&[0]).ok_or("the request does not end in NUL")?;
        let mut fields = body.split(|b| *b == 0);
        let mut next = |what: &str| fields.next().ok_or_else(|| format!("the request has no {what}"));
        let cwd = PathBuf::from(OsStr::from_bytes(next("working directory")?));
        let number = |s: &[u8], what: &str| {
            std::str::from_utf8(s).ok().and_then(|s| s.parse::<usize>().ok()).ok_or_else(|| format!("bad {what}"))
        };
        let count = number(next("argument count")?, "argument count")?;
        let dispatch = number(next("dispatch count")?, "dispatch count")?;
        if count == 0 || dispatch >= count {
            return Err(format!("{count} arguments cannot hold a program and {dispatch} to select the daemon"));
        }
        let argv = (0..count)
            .map(|_| next("argument").map(|a| OsString::from_vec(a.to_vec())))
            .collect::<Result<Vec<_>, _>>()?;
        let env = fields
            .map(|var| match var.iter().position(|b| *b == b'=') {
                Some(eq) if eq > 0 => {
                    Ok((OsString::from_vec(var[..eq].to_vec()), OsString::from_vec(var[eq + 1..].to_vec())))
                }
                _ => Err(format!("`{}` is not KEY=VALUE", String::from_utf8_lossy(var))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ForkRequest { cwd, argv, dispatch, env })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> ForkRequest {
        ForkRequest {
            cwd: "/var/lib/sandman/sandboxes/sb-1".into(),
            argv: ["/usr/bin/sandman", "__sandmand", "--listen", "unix:/s/d.sock", "--isolate", ""]
                .iter()
                .map(Into::into)
                .collect(),
            dispatch: 1,
            env: vec![("PATH".into(), "/usr/bin".into()), ("EMPTY".into(), "".into()), ("EQ".into(), "a=b".into())],
        }
    }

    #[test]
    fn a_request_comes_back_as_it_went() {
        let r = request();
        let bytes = r.encode().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ForkRequest::decode(&bytes), Ok(r));
    }

    #[test]
    fn the_daemon_gets_the_program_and_its_own_arguments() {
        let argv: Vec<String> = request().daemon_argv().iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(argv, ["/usr/bin/sandman", "--listen", "unix:/s/d.sock", "--isolate", ""]);
    }

    #[test]
    fn what_an_exec_could_not_take_is_refused() {
        let mut r = request();
        r.argv.push(OsString::from_vec(b"a\0b".to_vec()));
        assert!(r.encode().is_err_and(|e| e.contains("NUL")));
        let mut r = request();
        r.env.push(("A=B".into(), "c".into()));
        assert!(r.encode().is_err_and(|e| e.contains("`A=B`")));
        let mut r = request();
        r.env.push(("BIG".into(), "x".repeat(MAX_REQUEST).into()));
        assert!(r.encode().is_err_and(|e| e.contains("over the fork server's")));
    }

    #[test]
    fn malformed_requests_are_refused_whole() {
        for bad in
            [&b""[..], b"/\0", b"/\x002", b"/\x00x\x000\0", b"/\x002\x002\0a\0b\0", b"/\x001\x000\0a\0NOEQUALS\0"]
        {
            assert!(ForkRequest::decode(bad).is_err(), "{bad:?} was taken");
        }
    }
}
