//! Durations ("500ms", "2s") and sizes ("64MiB") as operators write them. The grammar is kept
//! strict, a whole number immediately followed by one unit, so that a value means exactly one
//! thing: "2 s", "1.5s", "1h30m" and bare numbers are refused with an example of what works.

use std::time::Duration;

const DURATION_HELP: &str =
    "expected a whole number followed by a unit (ms, s, m or h), e.g. 500ms, 2s, 1m";
const SIZE_HELP: &str =
    "expected a whole number followed by a unit (B, KiB, MiB, GiB, or KB, MB, GB), e.g. 64MiB";

/// Parses `"<digits><unit>"` with unit `ms`, `s`, `m` or `h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || format!("invalid duration {text:?}: {DURATION_HELP}");
    let (number, unit) = split_number(text).ok_or_else(invalid)?;
    let millis_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(invalid()),
    };
    let millis = number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(millis_per_unit))
        .ok_or_else(|| format!("duration {text:?} is too large"))?;
    Ok(Duration::from_millis(millis))
}

/// Parses `"<digits><unit>"` with binary units `B`, `KiB`, `MiB`, `GiB` or decimal `KB`, `MB`,
/// `GB`, into bytes.
pub(super) fn parse_size(text: &str) -> Result<u64, String> {
    let invalid = || format!("invalid size {text:?}: {SIZE_HELP}");
    let (number, unit) = split_number(text).ok_or_else(invalid)?;
    let bytes_per_unit: u64 = match unit {
        "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return Err(invalid()),
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(bytes_per_unit))
        .ok_or_else(|| format!("size {text:?} is too large"))
}

/// Splits leading ASCII digits from the rest; `None` when there are no digits or no unit.
fn split_number(text: &str) -> Option<(&str, &str)> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0 && digits < text.len()).then(|| text.split_at(digits))
}

/// The shortest exact spelling in the registry's own grammar, for messages ("25s", "100ms").
pub(super) fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if !duration.subsec_nanos().is_multiple_of(1_000_000) {
        return format!("{duration:?}");
    }
    for (unit, per) in [("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if millis >= per && millis.is_multiple_of(per) {
            return format!("{}{unit}", millis / per);
        }
    }
    format!("{millis}ms")
}

/// The shortest exact binary spelling, for messages ("1MiB", "4GiB").
pub(super) fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        let per = 1u64 << shift;
        if bytes >= per && bytes.is_multiple_of(per) {
            return format!("{}{unit}", bytes / per);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in [
            "", "2", "s", "2 s", " 2s", "2s ", "1.5s", "-1s", "+1s", "1h30m", "2S", "2sec", "2us",
        ] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.contains("e.g. 500ms, 2s, 1m"), "{bad:?}: {err}");
        }
        assert!(
            parse_duration("99999999999999999999h")
                .unwrap_err()
                .contains("too large")
        );
        assert!(
            parse_duration("18446744073709551615h")
                .unwrap_err()
                .contains("too large")
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("100B"), Ok(100));
        assert_eq!(parse_size("2KB"), Ok(2_000));
        assert_eq!(parse_size("64MB"), Ok(64_000_000));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        for bad in [
            "", "64", "MiB", "64 MiB", "64mib", "64M", "64TiB", "1.5GiB", "-1MiB",
        ] {
            let err = parse_size(bad).unwrap_err();
            assert!(err.contains("e.g. 64MiB"), "{bad:?}: {err}");
        }
        assert!(
            parse_size("99999999999GiB")
                .unwrap_err()
                .contains("too large")
        );
    }

    #[test]
    fn formatting_round_trips() {
        for text in ["100ms", "1500ms", "25s", "1m", "90s", "1h", "0ms"] {
            assert_eq!(format_duration(parse_duration(text).unwrap()), text);
        }
        for text in ["1MiB", "4GiB", "1536KiB", "100B", "0B"] {
            assert_eq!(format_size(parse_size(text).unwrap()), text);
        }
        assert_eq!(format_duration(Duration::from_micros(1500)), "1.5ms");
    }
}
