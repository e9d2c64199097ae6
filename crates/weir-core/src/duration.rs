//! Durations as people write them, in flows, flags and queue URLs: `200ms`, `5s`, `1.5m`,
//! `2h`, `1d`.

use std::time::Duration;

pub fn parse(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (write e.g. 500ms, 5s, 2m, 1h)"))?;
    if unit.is_empty() {
        return Err(format!("duration `{s}` needs a unit (e.g. {s}s)"));
    }
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "s" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        other => {
            return Err(format!(
                "unknown unit `{other}` in duration `{s}` (use ms, s, m, h or d)"
            ))
        }
    };
    if !(0.0..=365.0 * 86400.0).contains(&secs) {
        return Err(format!("duration `{s}` is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A duration as [`parse`] reads it, or a bare whole number of seconds: how flags and config
/// keys take them (`--grace 10` and `--grace 10s` alike).
pub fn parse_or_secs(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<u64>() {
        Ok(n) if n <= 365 * 86400 => Ok(Duration::from_secs(n)),
        Ok(_) => Err(format!("duration `{s}` is out of range")),
        Err(_) => parse(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_number_is_seconds_where_flags_take_it() {
        assert_eq!(parse_or_secs("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_or_secs("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_or_secs("1.5m"), Ok(Duration::from_secs(90)));
        assert!(parse_or_secs("ten").is_err());
        assert!(parse("10").is_err(), "flows still write the unit");
    }

    #[test]
    fn units() {
        assert_eq!(parse("200ms").unwrap(), Duration::from_millis(200));
        assert_eq!(parse("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse("1.5m").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("2h").unwrap(), Duration::from_secs(7200));
        assert!(parse("5").unwrap_err().contains("needs a unit"));
        assert!(parse("5x").unwrap_err().contains("unknown unit"));
        assert!(parse("soon").is_err());
    }
}
