//! File modes on the wire: numbers in JSON bodies, octal text (`0644`, `644`, `0o644`) in queries.

/// Parses a permission mode written in octal. Only the permission, setuid, setgid and sticky bits
/// are accepted.
pub fn parse_octal_mode(text: &str) -> Result<u32, String> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    if digits.is_empty() || digits.len() > 5 {
        return Err(format!("mode `{text}` is not an octal permission mode like 0644"));
    }
    let mode = u32::from_str_radix(digits, 8)
        .map_err(|_| format!("mode `{text}` is not an octal permission mode like 0644"))?;
    if mode > 0o7777 {
        return Err(format!("mode `{text}` has bits beyond 07777"));
    }
    Ok(mode)
}

#[cfg(test)]
mod tests {
    use super::parse_octal_mode;

    #[test]
    fn accepts_the_usual_spellings() {
        assert_eq!(parse_octal_mode("0644"), Ok(0o644));
        assert_eq!(parse_octal_mode("755"), Ok(0o755));
        assert_eq!(parse_octal_mode("0o600"), Ok(0o600));
        assert_eq!(parse_octal_mode("4755"), Ok(0o4755));
    }

    #[test]
    fn refuses_what_is_not_a_mode() {
        assert!(parse_octal_mode("").is_err());
        assert!(parse_octal_mode("rwx").is_err());
        assert!(parse_octal_mode("0899").is_err());
        assert!(parse_octal_mode("17777").is_err());
    }
}
