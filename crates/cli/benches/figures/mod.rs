//! What the benchmarks share: their knobs from the environment, and quantiles and units of the
//! durations they measure.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

/// `name` from the environment as a number, else `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The `p` quantile of sorted durations; zero for none (a figure not measured).
pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// p50 and p99 of `v`, sorted in place.
pub fn p50_p99(v: &mut [Duration]) -> (Duration, Duration) {
    v.sort();
    (pct(v, 0.5), pct(v, 0.99))
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Proportional set size: shared pages (the static daemon's code, shared by all sandboxes)
/// divided among the processes that map them.
pub fn pss_kib(pid: u32) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    rollup
        .lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// With `SANDMAN_BENCH_BASELINE` (a directory holding another build's `sandman` and `sandmand`),
/// a server of that build on a state directory in `scratch`, its create rate unlimited: the
/// directory, the server, and the state's directory (removed when dropped).
pub fn baseline_server(scratch: &Path) -> Option<(PathBuf, crate::e2e::Server, tempfile::TempDir)> {
    let dir = PathBuf::from(std::env::var_os("SANDMAN_BENCH_BASELINE")?);
    let state = tempfile::tempdir_in(scratch).unwrap();
    let daemon = dir.join("sandmand").display().to_string();
    let server = crate::e2e::Server::start_bin(
        &dir.join("sandman"),
        &state.path().join("state"),
        &["--daemon", &daemon, "--create-rate", "0"],
    );
    Some((dir, server, state))
}
