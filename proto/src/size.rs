//! Byte sizes for people: read from flags (`10GiB`, `512MiB`) and written
//! in messages (`312.4 MiB`). One rule for every binary, so that a limit
//! set with cairnctl reads back the same way in the runner's warnings.

/// Parses a size for people: `10GiB`, `512MiB`, `1.5G`, `2000000`. `K`,
/// `M`, `G`, `T` (alone or with `iB`) are powers of 1024; `KB`, `MB`, `GB`,
/// `TB` powers of 1000; `B` or nothing are bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit = unit.trim();
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
            ));
        }
    };
    if number.is_empty() {
        return Err(format!("{text:?} is not a size (e.g. 10GiB, 512MiB)"));
    }
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(multiplier)
            .ok_or_else(|| format!("{text:?} is too large"));
    }
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 10GiB, 512MiB)"))?;
    let bytes = value * multiplier as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{text:?} is too large"));
    }
    Ok(bytes.round() as u64)
}

/// Binary-prefixed byte count: `12 B`, `1.5 KiB`, `312.4 MiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_people_write_them() {
        assert_eq!(parse_size("10GiB").unwrap(), 10 << 30);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("3MB").unwrap(), 3_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("0").unwrap(), 0);
        assert!(parse_size("ten").is_err());
        assert!(
            parse_size("5 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn sizes_are_written_with_binary_prefixes() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(900 << 10), "900.0 KiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(parse_size(&human_bytes(100 << 10)).unwrap(), 100 << 10);
    }
}
