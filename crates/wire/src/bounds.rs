//! The range of every number a caller sends: leases, timeouts, lifetimes, sizes, counts, rates.
//! Each request type has a `check_bounds` that the server or the daemon calls where it parses the
//! request, before any arithmetic is done on a caller's number; a value out of range is refused
//! with an [`OutOfRange`] that names the field and its range. Start at [`Bound`].

use crate::daemon::{ExecRequest, ReadFileQuery, SessionRun, StartProcess, WaitRequest};
use crate::server::{CreateSandbox, JobSpec, PoolSpec, PrepareRequest, Quantity, Resources};

pub const MINUTE_S: u64 = 60;
pub const HOUR_S: u64 = 60 * MINUTE_S;
pub const DAY_S: u64 = 24 * HOUR_S;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const TIB: u64 = 1 << 40;

/// A whole-number field and the values it accepts, both ends included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub field: &'static str,
    pub min: u64,
    pub max: u64,
    pub unit: Unit,
}

/// What a [`Bound`] counts, for its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Seconds,
    Milliseconds,
    Bytes,
    Count,
}

/// A real-number field (a rate, a weight, a fraction, a cpu count): above `min` (or equal to it
/// when `min_inclusive`), at most `max`, and finite.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FloatBound {
    pub field: &'static str,
    pub min: f64,
    pub min_inclusive: bool,
    pub max: f64,
}

/// A number refused because it is out of its field's range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfRange {
    /// The field as the request names it (`lease_s`, `resources.memory`).
    pub field: String,
    /// The value as it was sent.
    pub value: String,
    /// The range in words: `between 1 and 604800 (7 days)`.
    pub range: String,
}

impl std::fmt::Display for OutOfRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` is {}; it must be {}", self.field, self.value, self.range)
    }
}

impl std::error::Error for OutOfRange {}

impl Bound {
    pub const fn new(field: &'static str, min: u64, max: u64, unit: Unit) -> Self {
        Bound { field, min, max, unit }
    }

    /// The same range under another field name.
    pub const fn named(self, field: &'static str) -> Self {
        Bound { field, ..self }
    }

    /// The same field with another upper end (a server's or a daemon's configured ceiling).
    pub const fn up_to(self, max: u64) -> Self {
        Bound { max, ..self }
    }

    /// `between 1 and 604800 (7 days)`.
    pub fn range(&self) -> String {
        format!("between {} and {}{}", self.min, self.max, human(self.max, self.unit))
    }

    pub fn check(&self, value: u64) -> Result<u64, OutOfRange> {
        if (self.min..=self.max).contains(&value) {
            return Ok(value);
        }
        Err(OutOfRange { field: self.field.to_string(), value: value.to_string(), range: self.range() })
    }

    /// Checks a value when one was sent.
    pub fn check_opt(&self, value: Option<u64>) -> Result<(), OutOfRange> {
        value.map_or(Ok(()), |v| self.check(v).map(drop))
    }
}

impl FloatBound {
    pub fn range(&self) -> String {
        let low = if self.min_inclusive { "at least" } else { "above" };
        format!("{low} {} and at most {}", self.min, self.max)
    }

    pub fn check(&self, value: f64) -> Result<f64, OutOfRange> {
        let above = if self.min_inclusive { value >= self.min } else { value > self.min };
        if value.is_finite() && above && value <= self.max {
            return Ok(value);
        }
        Err(OutOfRange { field: self.field.to_string(), value: value.to_string(), range: self.range() })
    }

    pub fn check_opt(&self, value: Option<f64>) -> Result<(), OutOfRange> {
        value.map_or(Ok(()), |v| self.check(v).map(drop))
    }
}

/// ` (7 days)`, ` (64 MiB)`: the upper end in the unit people think in, when it helps.
fn human(value: u64, unit: Unit) -> String {
    let plural = |n: u64, what: &str| if n == 1 { format!(" (1 {what})") } else { format!(" ({n} {what}s)") };
    match unit {
        Unit::Seconds if value >= DAY_S && value.is_multiple_of(DAY_S) => plural(value / DAY_S, "day"),
        Unit::Seconds if value >= HOUR_S && value.is_multiple_of(HOUR_S) => plural(value / HOUR_S, "hour"),
        Unit::Milliseconds if value >= DAY_S * 1000 && value.is_multiple_of(DAY_S * 1000) => {
            plural(value / (DAY_S * 1000), "day")
        }
        Unit::Bytes if value >= TIB && value.is_multiple_of(TIB) => format!(" ({} TiB)", value / TIB),
        Unit::Bytes if value >= GIB && value.is_multiple_of(GIB) => format!(" ({} GiB)", value / GIB),
        Unit::Bytes if value >= MIB && value.is_multiple_of(MIB) => format!(" ({} MiB)", value / MIB),
        _ => String::new(),
    }
}

// ---- the server API ----

/// A sandbox's lease, and the default lease of a job or the longest of a pool.
pub const LEASE_S: Bound = Bound::new("lease_s", 1, 7 * DAY_S, Unit::Seconds);
pub const IDLE_TIMEOUT_S: Bound = Bound::new("idle_timeout_s", 1, 7 * DAY_S, Unit::Seconds);
/// A sandbox's lifetime (a server's `--max-ttl-s` may lower it).
pub const TTL_S: Bound = Bound::new("ttl_s", 1, 30 * DAY_S, Unit::Seconds);
/// How long a create waits for its sandbox, queue included.
pub const WAIT_TIMEOUT_S: Bound = Bound::new("wait_timeout_s", 0, DAY_S, Unit::Seconds);
/// Most sandboxes of one job alive at once.
pub const MAX_SANDBOXES: Bound = Bound::new("max_sandboxes", 0, 1_000_000, Unit::Count);
pub const CREATE_RATE: FloatBound = FloatBound { field: "create_rate", min: 0.0, min_inclusive: false, max: 100_000.0 };
pub const WEIGHT: FloatBound = FloatBound { field: "weight", min: 0.001, min_inclusive: true, max: 1000.0 };
/// Sandboxes one pool keeps (ready and being created).
pub const POOL_SIZE: Bound = Bound::new("max", 0, 10_000, Unit::Count);
pub const HOLD_UNTIL: FloatBound = FloatBound { field: "hold_until", min: 0.0, min_inclusive: false, max: 1.0 };
/// Cores.
pub const CPU: FloatBound = FloatBound { field: "resources.cpu", min: 0.0, min_inclusive: false, max: 1024.0 };
pub const MEMORY: Bound = Bound::new("resources.memory", 1, 64 * TIB, Unit::Bytes);
pub const DISK: Bound = Bound::new("resources.disk", 1, 1024 * TIB, Unit::Bytes);
/// The kernel's own most (`pid_max` is at most 2^22).
pub const PIDS: Bound = Bound::new("resources.pids", 1, 1 << 22, Unit::Count);

// ---- the daemon API ----

/// A command's `timeout_ms` (exec, background processes, session runs).
pub const TIMEOUT_MS: Bound = Bound::new("timeout_ms", 0, 7 * DAY_S * 1000, Unit::Milliseconds);
/// How long `/wait` waits.
pub const WAIT_MS: Bound = Bound::new("timeout_ms", 0, 7 * DAY_S * 1000, Unit::Milliseconds);
/// Output held for one answer, per stream (`/v1/exec`, session runs); a daemon or a server may
/// set a lower ceiling. A streamed exec holds nothing and takes any `max_output_bytes`.
pub const MAX_OUTPUT_BYTES: Bound = Bound::new("max_output_bytes", 0, 64 * MIB, Unit::Bytes);
/// Output a background process keeps, per stream.
pub const RETAIN_BYTES: Bound = Bound::new("retain_bytes", 0, 64 * MIB, Unit::Bytes);
/// A byte offset in a file: what `lseek` takes.
pub const FILE_OFFSET: Bound = Bound::new("offset", 0, i64::MAX as u64, Unit::Bytes);
/// Components of a path (`/a/b` has 2): the file calls and archive entries.
pub const PATH_DEPTH: Bound = Bound::new("path depth", 0, 256, Unit::Count);

impl Resources {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        let value = |field: &'static str, q: &Quantity| {
            q.value().map_err(|e| OutOfRange { field: field.into(), value: quantity_text(q), range: e })
        };
        if let Some(q) = &self.cpu {
            CPU.check(value("resources.cpu", q)?).map_err(|e| OutOfRange { value: quantity_text(q), ..e })?;
        }
        for (bound, q) in [(MEMORY, &self.memory), (DISK, &self.disk)] {
            if let Some(q) = q {
                let bytes = value(bound.field, q)?;
                // A value past u64 saturates and so is refused as over the range.
                bound.check(bytes.ceil() as u64).map_err(|e| OutOfRange { value: quantity_text(q), ..e })?;
            }
        }
        PIDS.check_opt(self.pids)
    }
}

fn quantity_text(q: &Quantity) -> String {
    match q {
        Quantity::Number(n) => n.to_string(),
        Quantity::Text(t) => format!("`{t}`"),
    }
}

impl CreateSandbox {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        self.resources.check_bounds()?;
        LEASE_S.check_opt(self.lease_s)?;
        IDLE_TIMEOUT_S.check_opt(self.idle_timeout_s)?;
        TTL_S.check_opt(self.ttl_s)?;
        WAIT_TIMEOUT_S.check_opt(self.wait_timeout_s)
    }
}

impl JobSpec {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        MAX_SANDBOXES.check_opt(self.max_sandboxes)?;
        CREATE_RATE.check_opt(self.create_rate)?;
        WEIGHT.check_opt(self.weight)?;
        LEASE_S.check_opt(self.lease_s)
    }
}

impl PoolSpec {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        self.resources.check_bounds()?;
        POOL_SIZE.named("min_ready").check(self.min_ready)?;
        POOL_SIZE.check_opt(self.max)?;
        LEASE_S.check_opt(self.lease_s)
    }
}

impl PrepareRequest {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        HOLD_UNTIL.check_opt(self.hold_until)
    }
}

impl ExecRequest {
    /// For `/v1/exec`, which holds the output: `max_output_bytes` up to `output_ceiling`. A
    /// streamed exec holds none and is checked with `None`.
    pub fn check_bounds(&self, output_ceiling: Option<u64>) -> Result<(), OutOfRange> {
        TIMEOUT_MS.check_opt(self.timeout_ms)?;
        match output_ceiling {
            Some(max) => MAX_OUTPUT_BYTES.up_to(max).check_opt(self.max_output_bytes),
            None => Ok(()),
        }
    }
}

impl StartProcess {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        TIMEOUT_MS.check_opt(self.timeout_ms)?;
        RETAIN_BYTES.check_opt(self.retain_bytes)
    }
}

impl SessionRun {
    pub fn check_bounds(&self, output_ceiling: u64) -> Result<(), OutOfRange> {
        TIMEOUT_MS.check_opt(self.timeout_ms)?;
        MAX_OUTPUT_BYTES.up_to(output_ceiling).check_opt(self.max_output_bytes)
    }
}

impl WaitRequest {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        WAIT_MS.check_opt(self.timeout_ms)
    }
}

impl ReadFileQuery {
    pub fn check_bounds(&self) -> Result<(), OutOfRange> {
        FILE_OFFSET.check(self.offset).map(drop)
    }
}

/// Refuses a path deeper than [`PATH_DEPTH`]: walking and creating its components costs time
/// in proportion to their number, for every entry that names it.
pub fn check_path_depth(what: &str, path: &str) -> Result<(), OutOfRange> {
    let depth = path.split('/').filter(|c| !c.is_empty() && *c != ".").count() as u64;
    if depth <= PATH_DEPTH.max {
        return Ok(());
    }
    Err(OutOfRange {
        field: what.to_string(),
        value: format!("{depth} levels deep"),
        range: format!("at most {} levels deep", PATH_DEPTH.max),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_range_value_names_its_field_and_range() {
        let err = LEASE_S.check(u64::MAX).err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "`lease_s` is 18446744073709551615; it must be between 1 and 604800 (7 days)");
        assert!(LEASE_S.check(0).is_err());
        assert_eq!(LEASE_S.check(600), Ok(600));
        let err = MAX_OUTPUT_BYTES.up_to(8 * MIB).check(9 * MIB).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.ends_with("between 0 and 8388608 (8 MiB)"), "{err}");
        assert!(WEIGHT.check(f64::INFINITY).is_err() && WEIGHT.check(0.0).is_err() && WEIGHT.check(2.0).is_ok());
    }

    #[test]
    fn a_create_with_a_lease_of_u64_max_is_refused() {
        let c = CreateSandbox { lease_s: Some(u64::MAX), ..CreateSandbox::default() };
        assert_eq!(c.check_bounds().map_err(|e| e.field), Err("lease_s".to_string()));
        let c = CreateSandbox { wait_timeout_s: Some(u64::MAX), ..CreateSandbox::default() };
        assert_eq!(c.check_bounds().map_err(|e| e.field), Err("wait_timeout_s".to_string()));
        assert!(CreateSandbox::default().check_bounds().is_ok());
    }

    #[test]
    fn quantities_past_their_range_are_refused_with_the_text_sent() {
        let r = Resources { memory: Some(Quantity::Text("1e30".into())), ..Resources::default() };
        let err = r.check_bounds().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.starts_with("`resources.memory` is `1e30`; it must be between 1 and"), "{err}");
        let r = Resources { cpu: Some(Quantity::Number(1e9)), ..Resources::default() };
        assert!(r.check_bounds().is_err());
        let r = Resources {
            cpu: Some(Quantity::Text("500m".into())),
            memory: Some(Quantity::Text("512Mi".into())),
            ..Default::default()
        };
        assert!(r.check_bounds().is_ok());
    }

    #[test]
    fn paths_deeper_than_the_bound_are_refused() {
        let deep = "/a".repeat(257);
        assert!(check_path_depth("path", &deep).is_err());
        assert!(check_path_depth("path", &"/a".repeat(256)).is_ok());
        assert!(check_path_depth("path", "/").is_ok());
    }
}
