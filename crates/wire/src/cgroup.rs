//! The kernel's cgroup and meminfo file formats, parsed without I/O: the daemon reads its own
//! limits from inside a sandbox and the process provider reads back the ones it wrote, and both
//! must read them the same way. Start at [`parse_max`].

/// A single-value limit file (`memory.max`, `memory.swap.max`, `pids.max`): a number, or `max`
/// for none. The text is expected trimmed; anything else is `None`.
pub fn parse_max(v: &str) -> Option<u64> {
    if v == "max" { None } else { v.parse().ok() }
}

/// `cpu.max`, `QUOTA PERIOD` or `max PERIOD`, as cores (`quota / period`); `None` without a
/// quota or with a zero period.
pub fn parse_cpu_max(v: &str) -> Option<f64> {
    let mut it = v.split_whitespace();
    let quota: f64 = it.next()?.parse().ok()?;
    let period: f64 = it.next()?.parse().ok()?;
    (period > 0.0).then(|| quota / period)
}

/// `SwapTotal` of `/proc/meminfo`, in bytes.
pub fn swap_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("SwapTotal:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_value_is_a_number_or_max() {
        assert_eq!(parse_max("max"), None);
        assert_eq!(parse_max("512"), Some(512));
        assert_eq!(parse_max("0"), Some(0));
        assert_eq!(parse_max("18446744073709551615"), Some(u64::MAX));
        for bad in ["", "-1", "1k", " 5", "max\n", "maxi"] {
            assert_eq!(parse_max(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn cpu_max_is_quota_over_period() {
        assert_eq!(parse_cpu_max("150000 100000"), Some(1.5));
        assert_eq!(parse_cpu_max("50000 100000\n"), Some(0.5));
        assert_eq!(parse_cpu_max("max 100000"), None);
        assert_eq!(parse_cpu_max("100000 0"), None);
        assert_eq!(parse_cpu_max("100000"), None);
        assert_eq!(parse_cpu_max(""), None);
    }

    #[test]
    fn swap_total_is_read_in_bytes() {
        assert_eq!(swap_total("MemTotal: 1 kB\nSwapTotal:    2048 kB\n"), Some(2 << 20));
        assert_eq!(swap_total("MemTotal: 100 kB\nSwapTotal:       2048 kB\n"), Some(2 << 20));
        assert_eq!(swap_total("SwapTotal:              0 kB\n"), Some(0));
        assert_eq!(swap_total("SwapTotal:       0 kB\n"), Some(0));
        assert_eq!(swap_total("MemTotal: 100 kB\n"), None);
        assert_eq!(swap_total("SwapTotal: 12\n"), None);
        assert_eq!(swap_total(""), None);
    }
}
