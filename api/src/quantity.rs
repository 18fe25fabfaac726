//! Kubernetes quantities (`80Gi`, `500m`, `1.5G`) as exact integers of nano-units, for the
//! scheduler's arithmetic on counters and capacity: sums and comparisons are exact, as the
//! API's `resource.Quantity` arithmetic is.

/// Nano-units in one unit.
const NANO: i128 = 1_000_000_000;

/// `q` in nano-units; None when it is not a quantity.
pub fn parse(q: &str) -> Option<i128> {
    let q = q.trim();
    let end = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(end);
    let (negative, number) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number.strip_prefix('+').unwrap_or(number)),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if (whole.is_empty() && fraction.is_empty())
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
        || fraction.len() > 9
    {
        return None;
    }
    // Checked throughout: a quantity from outside (a claim's consumed capacity) may be huge.
    let mut nano: i128 = if whole.is_empty() {
        0
    } else {
        whole.parse::<i128>().ok()?.checked_mul(NANO)?
    };
    if !fraction.is_empty() {
        let digits: i128 = fraction.parse().ok()?;
        nano = nano.checked_add(digits * 10i128.pow(9 - fraction.len() as u32))?;
    }
    let scaled = match suffix {
        "" => nano,
        "n" => nano / NANO,
        "u" => nano / 1_000_000,
        "m" => nano / 1_000,
        "k" => nano.checked_mul(1_000)?,
        "M" => nano.checked_mul(1_000_000)?,
        "G" => nano.checked_mul(1_000_000_000)?,
        "T" => nano.checked_mul(1_000_000_000_000)?,
        "P" => nano.checked_mul(1_000_000_000_000_000)?,
        "E" => nano.checked_mul(1_000_000_000_000_000_000)?,
        "Ki" => nano.checked_mul(1 << 10)?,
        "Mi" => nano.checked_mul(1 << 20)?,
        "Gi" => nano.checked_mul(1 << 30)?,
        "Ti" => nano.checked_mul(1 << 40)?,
        "Pi" => nano.checked_mul(1 << 50)?,
        "Ei" => nano.checked_mul(1 << 60)?,
        s if s.starts_with(['e', 'E']) => {
            nano.checked_mul(10i128.checked_pow(s[1..].parse().ok()?)?)?
        }
        _ => return None,
    };
    Some(if negative { -scaled } else { scaled })
}

/// `nano` nano-units as a quantity: the shortest of the largest binary suffix that divides it
/// (`10Gi`), the largest decimal one (`3G`) and the whole number (binary first on a tie), or a
/// decimal with up to nine fraction digits.
pub fn format(nano: i128) -> String {
    if nano % NANO == 0 {
        let units = nano / NANO;
        let binary = [
            (60, "Ei"),
            (50, "Pi"),
            (40, "Ti"),
            (30, "Gi"),
            (20, "Mi"),
            (10, "Ki"),
        ]
        .into_iter()
        .find(|(shift, _)| units != 0 && units % (1i128 << shift) == 0)
        .map(|(shift, suffix)| format!("{}{suffix}", units >> shift));
        let decimal = [
            (18, "E"),
            (15, "P"),
            (12, "T"),
            (9, "G"),
            (6, "M"),
            (3, "k"),
        ]
        .into_iter()
        .find(|(power, _)| units != 0 && units % 10i128.pow(*power) == 0)
        .map(|(power, suffix)| format!("{}{suffix}", units / 10i128.pow(power)));
        return [binary, decimal, Some(units.to_string())]
            .into_iter()
            .flatten()
            .min_by_key(String::len)
            .unwrap_or_default();
    }
    let sign = if nano < 0 { "-" } else { "" };
    let (whole, fraction) = (nano.abs() / NANO, nano.abs() % NANO);
    let fraction = format!("{fraction:09}");
    format!("{sign}{whole}.{}", fraction.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_exact_in_either_direction() {
        assert_eq!(parse("80Gi"), Some(80 * (1 << 30) * NANO));
        assert_eq!(parse("1024Mi"), parse("1Gi"));
        assert_eq!(parse("500m"), Some(NANO / 2));
        assert_eq!(parse("1.5G"), parse("1500M"));
        assert_eq!(parse("1e3"), parse("1k"));
        assert_eq!(parse("-2"), Some(-2 * NANO));
        for bad in [
            "",
            "Gi",
            "1.2.3",
            "12 GB",
            "1x",
            "1000000000000000000000000000000Ei",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        assert_eq!(format(parse("10Gi").unwrap()), "10Gi");
        assert_eq!(format(parse("1536Mi").unwrap()), "1536Mi");
        assert_eq!(format(parse("7").unwrap()), "7");
        assert_eq!(format(parse("3000M").unwrap()), "3G");
        assert_eq!(format(parse("2500M").unwrap()), "2500M");
        assert_eq!(format(parse("10G").unwrap()), "10G");
        assert_eq!(format(parse("1Gi").unwrap()), "1Gi");
        assert_eq!(format(parse("0").unwrap()), "0");
        assert_eq!(format(parse("0.25").unwrap()), "0.25");
    }
}
