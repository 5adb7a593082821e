//! How data reads for people: aligned tables, ages, UTC timestamps, byte sizes.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Columns padded to their widest cell, two spaces apart; the last column is not padded.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let pad = widths[i] - cell.chars().count();
                line.push_str(cell);
                line.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A duration in its largest whole unit: `42s`, `5m`, `3h`, `2d`.
pub fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// How long ago `at_ms` was (0s for a time in the future: clocks differ).
pub fn age(at_ms: u64, now_ms: u64) -> String {
    duration(now_ms.saturating_sub(at_ms))
}

/// `at_ms` as an RFC 3339 UTC time to the second: `2023-11-14T22:13:20Z`.
pub fn timestamp(at_ms: u64) -> String {
    let secs = at_ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A byte count for people: `512 B`, `1.5 KiB`, `3.0 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `value` as indented JSON.
pub fn json<T: serde::Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(value)?)
}

/// A unit enum as its wire name (`eval`, `none`).
pub fn json_word<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_value(value).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// `key: value` lines, the values aligned; no trailing newline.
pub fn fields(fields: &[(&str, String)]) -> String {
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let lines: Vec<String> = fields.iter().map(|(k, v)| format!("{:<width$} {v}", format!("{k}:"))).collect();
    lines.join("\n")
}

/// A figure to at most `places` decimals, without trailing zeros: `0.4`, `12`, `0.33`.
pub fn decimal(value: f64, places: usize) -> String {
    let text = format!("{value:.places$}");
    if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.').to_owned() } else { text }
}

/// `-` for nothing.
pub fn or_dash(text: Option<&str>) -> String {
    text.filter(|t| !t.is_empty()).unwrap_or("-").to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_trim() {
        let rows = vec![vec!["sb-1".to_owned(), "ready".to_owned(), "x".to_owned()]];
        assert_eq!(table(&["ID", "STATE", "AGE"], &rows), "ID    STATE  AGE\nsb-1  ready  x\n");
        assert_eq!(table(&["ID", "NOTE"], &[vec!["a".into(), "".into()]]), "ID  NOTE\na\n");
    }

    #[test]
    fn durations_and_ages() {
        assert_eq!(duration(999), "0s");
        assert_eq!(duration(59_999), "59s");
        assert_eq!(duration(60_000), "1m");
        assert_eq!(duration(3_600_000), "1h");
        assert_eq!(duration(47 * 3_600_000), "47h");
        assert_eq!(duration(49 * 3_600_000), "2d");
        assert_eq!(age(10_000, 5_000), "0s");
    }

    #[test]
    fn timestamps_are_utc() {
        assert_eq!(timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(timestamp(1_700_000_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(timestamp(951_782_400_000), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn fields_align_and_decimals_trim() {
        assert_eq!(fields(&[("a", "1".into()), ("long", "2".into())]), "a:    1\nlong: 2");
        assert_eq!(decimal(0.4, 2), "0.4");
        assert_eq!(decimal(12.0, 1), "12");
        assert_eq!(decimal(1.0 / 3.0, 2), "0.33");
        assert_eq!(decimal(100.0, 0), "100");
    }

    #[test]
    fn byte_counts() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 * 1024 * 1024), "3.0 MiB");
    }
}
