//! What the benchmarks share: their knobs from the environment, and quantiles and units of the
//! durations they measure.
#![allow(dead_code)]

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
