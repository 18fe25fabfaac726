//! The current time as Kubernetes (`metav1.Time`) and OCI (`created`) write it.

/// Now as RFC 3339 in UTC, to the second: `2026-11-28T19:00:00Z`.
pub fn now_rfc3339() -> String {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    jiff::Timestamp::from_second(seconds)
        .unwrap_or(jiff::Timestamp::UNIX_EPOCH)
        .to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn now_is_rfc3339_to_the_second_in_utc() {
        let now = super::now_rfc3339();
        assert_eq!(now.len(), 20, "{now}");
        assert!(now.ends_with('Z') && now.as_bytes()[10] == b'T', "{now}");
        assert!(now.as_str() > "2026-01-01", "{now}");
    }
}
