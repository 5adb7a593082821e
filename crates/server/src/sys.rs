//! The server's only `unsafe`: raising its open files limit, `getrandom(2)` and `geteuid(2)`,
//! which std does not expose.
#![allow(unsafe_code)]

/// Where the kernel's ceiling for any process's open files limit is read.
const NR_OPEN: &str = "/proc/sys/fs/nr_open";

/// Raises the limit on open files as far as this process may, and answers the soft limit now
/// in force: the soft limit to the hard one (as Go's runtime and most servers do: the default
/// soft limit, 1024, is a relic of `select`), and, where the process may (as root, with
/// `CAP_SYS_RESOURCE`), both to the kernel's ceiling `fs.nr_open`, so that one server can hold
/// tens of thousands of sandboxes whatever `ulimit -n` it was started under. Processes started
/// later inherit it.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let mut limit = open_files_rlimit()?;
    let ceiling = std::fs::read_to_string(NR_OPEN).ok().and_then(|t| t.trim().parse::<libc::rlim_t>().ok());
    let mut tries = Vec::with_capacity(2);
    if let Some(ceiling) = ceiling.filter(|&c| c > limit.rlim_max) {
        tries.push(ceiling);
    }
    tries.push(limit.rlim_max);
    for to in tries {
        if limit.rlim_cur >= to {
            break;
        }
        let raised = libc::rlimit { rlim_cur: to, rlim_max: to };
        // SAFETY: `setrlimit` reads one plain C struct that lives on this stack frame.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
            break;
        }
    }
    Ok(limit.rlim_cur)
}

/// The soft limit on open files now in force (0 when it cannot be read).
pub fn open_files_limit() -> u64 {
    open_files_rlimit().map_or(0, |l| l.rlim_cur)
}

fn open_files_rlimit() -> std::io::Result<libc::rlimit> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `getrlimit` writes one plain C struct that lives on this stack frame.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(limit)
}

/// Fills `buf` from the kernel's random pool with the `getrandom` system call, which needs no
/// file descriptor (a server at its open files limit still gets random ids and tokens) and
/// blocks only until the pool is first seeded at boot.
pub fn random_bytes(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the pointer and length describe the live, writable slice `rest`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        filled += n as usize;
    }
    Ok(())
}

/// 128 random bits as hex, from the `getrandom` system call: no descriptor to run out of, and
/// no fallback (to a clock, say) that could hand two sandboxes the same id or a guessable token.
/// The server checks at start that the call works (`run`); it cannot fail after.
pub fn random_hex() -> String {
    let mut buf = [0u8; 16];
    if let Err(e) = random_bytes(&mut buf) {
        // Unreachable past the start-up check: getrandom(2) fails only where it does not exist.
        panic!("getrandom(2) failed after working at start: {e}");
    }
    hex::encode(buf)
}

/// Whether this process holds capability `cap` (its bit in `CapEff` of `/proc/self/status`).
#[cfg(test)]
fn has_capability(cap: u32) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

/// The server's effective uid.
pub fn euid() -> u32 {
    // SAFETY: `geteuid` takes nothing and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    /// `CAP_SYS_RESOURCE`, which raising a hard rlimit takes.
    const CAP_SYS_RESOURCE: u32 = 24;

    #[test]
    fn random_bytes_come_from_getrandom_even_with_no_descriptor_left() {
        // Regression (issue 16): at its open files limit the server read /dev/urandom, failed,
        // and fell back to the clock, handing every new sandbox the same id.
        let mut a = [0u8; 16];
        let mut b = [0u8; 16];
        super::random_bytes(&mut a).unwrap_or_else(|e| panic!("{e}"));
        super::random_bytes(&mut b).unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(a, b);
        assert_ne!(a, [0u8; 16]);
    }

    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit_and_with_cap_sys_resource_to_nr_open() {
        let now = super::raise_open_files_limit().unwrap_or(0);
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        assert_eq!((now, limit.rlim_cur), (limit.rlim_max, limit.rlim_max));
        // Raising the hard limit takes CAP_SYS_RESOURCE (root in a container may lack it).
        if super::has_capability(CAP_SYS_RESOURCE) {
            let nr_open: u64 = std::fs::read_to_string(super::NR_OPEN)
                .ok()
                .and_then(|t| t.trim().parse().ok())
                .unwrap_or_else(|| panic!("cannot read {}", super::NR_OPEN));
            assert!(now >= nr_open, "with CAP_SYS_RESOURCE the limit went to {now}, not to fs.nr_open ({nr_open})");
        }
    }
}
