//! Validation of the registry's identifiers. Module names become socket file names, resource
//! names, log fields and metric labels, so they are held to the strictest of those rules: an
//! RFC 1123 DNS label. Resource domains are prefixed to extended-resource names, which the kubelet
//! only accepts when the prefix is a DNS subdomain. Digests are compared with the module file's
//! digest, so they are normalised to lowercase once, here.

const LABEL_MAX: usize = 63;
const SUBDOMAIN_MAX: usize = 253;

/// A module name: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub(super) fn check_module_name(name: &str) -> Result<(), (usize, String)> {
    check_label(name).map_err(|(index, why)| {
        (
            index,
            format!(
                "invalid module name {name:?}: {why}; a name is at most 63 lowercase letters, digits \
                 and '-', starting and ending with a letter or digit, e.g. \"generic-dev\""
            ),
        )
    })
}

/// A resource domain: a lowercase DNS subdomain such as `devicelet.io`.
pub(super) fn check_resource_domain(domain: &str) -> Result<(), (usize, String)> {
    let why = if domain.len() > SUBDOMAIN_MAX {
        Err((
            0,
            format!(
                "it is {} characters long, more than {SUBDOMAIN_MAX}",
                domain.len()
            ),
        ))
    } else {
        let mut start = 0;
        domain.split('.').try_for_each(|label| {
            let checked = check_label(label).map_err(|(index, why)| (start + index, why));
            start += label.chars().count() + 1;
            checked
        })
    };
    why.map_err(|(index, why)| {
        (
            index,
            format!(
                "invalid resource domain {domain:?}: {why}; expected a lowercase DNS name, e.g. \"devicelet.io\""
            ),
        )
    })
}

/// A SHA-256 digest in hex, either case; returned in lowercase.
pub(super) fn normalize_sha256(digest: &str) -> Result<String, (usize, String)> {
    if let Some((index, c)) = digest
        .chars()
        .enumerate()
        .find(|(_, c)| !c.is_ascii_hexdigit())
    {
        return Err((
            index,
            format!("invalid sha256 {digest:?}: {c:?} is not a hexadecimal digit"),
        ));
    }
    if digest.len() != 64 {
        return Err((
            0,
            format!(
                "invalid sha256 {digest:?}: expected exactly 64 hexadecimal digits, found {}",
                digest.len()
            ),
        ));
    }
    Ok(digest.to_ascii_lowercase())
}

/// One RFC 1123 label of at most 63 characters; on failure, the character index at fault and why.
fn check_label(label: &str) -> Result<(), (usize, String)> {
    let length = label.chars().count();
    if length > LABEL_MAX {
        return Err((
            LABEL_MAX,
            format!("{length} characters is longer than {LABEL_MAX}"),
        ));
    }
    devicelet_api::names::label_error(label).map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names() {
        for good in ["a", "0", "generic-dev", "fuse2", "a-b-c", &"x".repeat(63)] {
            assert_eq!(check_module_name(good), Ok(()), "{good}");
        }
        let cases = [
            ("", 0, "it is empty"),
            ("Generic", 0, "'G' is not allowed"),
            ("gen_dev", 3, "'_' is not allowed"),
            ("gen.dev", 3, "'.' is not allowed"),
            ("-dev", 0, "must not start with '-'"),
            ("dev-", 3, "must not end with '-'"),
        ];
        for (bad, index, why) in cases {
            let (at, message) = check_module_name(bad).unwrap_err();
            assert_eq!(at, index, "{bad}");
            assert!(message.contains(why), "{bad}: {message}");
            assert!(message.contains("e.g. \"generic-dev\""), "{message}");
        }
        let (at, message) = check_module_name(&"x".repeat(64)).unwrap_err();
        assert_eq!(at, 63);
        assert!(
            message.contains("64 characters is longer than 63"),
            "{message}"
        );
    }

    #[test]
    fn resource_domains() {
        for good in ["devicelet.io", "squat.ai", "example", "a-1.b-2.c"] {
            assert_eq!(check_resource_domain(good), Ok(()), "{good}");
        }
        let cases = [
            ("Squat.ai", 0, "'S' is not allowed"),
            ("squat..ai", 6, "it is empty"),
            ("squat.ai.", 9, "it is empty"),
            ("squat.-ai", 6, "must not start with '-'"),
            ("squat.ai/x", 8, "'/' is not allowed"),
        ];
        for (bad, index, why) in cases {
            let (at, message) = check_resource_domain(bad).unwrap_err();
            assert_eq!(at, index, "{bad}");
            assert!(message.contains(why), "{bad}: {message}");
        }
        let long = vec!["a".repeat(63); 4].join(".");
        assert!(
            check_resource_domain(&long)
                .unwrap_err()
                .1
                .contains("more than 253")
        );
    }

    #[test]
    fn digests() {
        let lower = "0123456789abcdef".repeat(4);
        assert_eq!(normalize_sha256(&lower), Ok(lower.clone()));
        assert_eq!(normalize_sha256(&lower.to_uppercase()), Ok(lower.clone()));
        assert!(
            normalize_sha256(&lower[..63])
                .unwrap_err()
                .1
                .contains("found 63")
        );
        let (at, message) = normalize_sha256(&format!("{}g", &lower[..63])).unwrap_err();
        assert_eq!(at, 63);
        assert!(
            message.contains("'g' is not a hexadecimal digit"),
            "{message}"
        );
    }
}
