//! Rules on a module's container edits that the kit must apply as the agent does.

/// The first variable `envs` sets a second time, with both values: an answer that does so is
/// refused, since the kubelet's map would silently keep one of them (devices' own edits joined
/// for one request must not disagree either).
pub fn env_set_twice(envs: &[(String, String)]) -> Option<(&str, &str, &str)> {
    envs.iter().enumerate().find_map(|(i, (name, value))| {
        envs[..i]
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, first)| (name.as_str(), first.as_str(), value.as_str()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_set_twice_is_found_with_both_values() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(env_set_twice(&env(&[("A", "1"), ("B", "2")])), None);
        assert_eq!(
            env_set_twice(&env(&[("A", "1"), ("B", "2"), ("A", "3")])),
            Some(("A", "1", "3"))
        );
    }
}
