//! The server's only `unsafe`: raising its open files limit, which std does not expose.
#![allow(unsafe_code)]

/// Raises the soft limit on open files to the hard limit (as Go's runtime and most servers
/// do: the default soft limit, 1024, is a relic of `select`) and answers the soft limit now in
/// force. Processes started later inherit it.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `getrlimit` writes one plain C struct that lives on this stack frame.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: `setrlimit` reads one plain C struct that lives on this stack frame.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    Ok(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit() {
        let now = super::raise_open_files_limit().unwrap_or(0);
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        assert_eq!((now, limit.rlim_cur), (limit.rlim_max, limit.rlim_max));
    }
}
