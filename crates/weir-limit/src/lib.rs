//! Rate limits (to come: governor quotas per node and per key, hold/flush decisions).
//!
//! For now this crate only reads the quota notation flows use, so that it is checked the same
//! way everywhere once the `rate-limit` node lands.

use std::time::Duration;

/// `N/s`, `N/min`, `N/h`: how many per period.
pub fn parse_rate(s: &str) -> Result<(u32, Duration), String> {
    let (n, per) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}` is not a rate (write e.g. 10/s, 1/min, 100/h)"))?;
    let n: u32 = n
        .trim()
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("`{s}`: the count is a whole number above 0"))?;
    let per = match per.trim() {
        "s" | "sec" => Duration::from_secs(1),
        "min" | "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        other => return Err(format!("`{s}`: unknown period `{other}` (s, min or h)")),
    };
    Ok((n, per))
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates() {
        assert_eq!(super::parse_rate("10/s").unwrap().0, 10);
        assert_eq!(super::parse_rate("1/min").unwrap().1.as_secs(), 60);
        assert!(super::parse_rate("0/s").is_err());
        assert!(super::parse_rate("5/day").is_err());
    }
}
