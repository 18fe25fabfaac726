//! The kubelet's checks on what a plugin sends in `Register`: the resource name and the endpoint.
//!
//! The resource-name rules are those of `v1helper.IsExtendedResourceName` (KUBELET.md, wire
//! contract): a name without a `/`, or one containing `kubernetes.io/`, is a native resource; a
//! name starting with `requests.` is refused; and `requests.` + the name must be a qualified name
//! (`IsQualifiedName`: a DNS-1123 subdomain prefix, a `/`, and a name part of at most 63
//! characters). Each check returns a sentence saying what is wrong, so that a vendor reading the
//! rejected `Register` call knows what to change.

/// The longest name part of a qualified name (`validation.qualifiedNameMaxLength`).
const NAME_MAX: usize = 63;
/// The longest DNS-1123 subdomain (`validation.DNS1123SubdomainMaxLength`).
const SUBDOMAIN_MAX: usize = 253;
/// The prefix the kubelet prepends before validating (`v1.DefaultResourceRequestsPrefix`).
const REQUESTS_PREFIX: &str = "requests.";
/// Any name containing this is a native resource (`v1.ResourceDefaultNamespacePrefix`).
const NATIVE_PREFIX: &str = "kubernetes.io/";

/// Checks that `name` is an extended resource name the kubelet accepts; `Err` says why not.
pub fn validate_resource_name(name: &str) -> Result<(), String> {
    let Some((domain, local)) = name.split_once('/') else {
        return Err(
            "an extended resource name has the form `domain/name` (e.g. `example.com/gpu`); \
             names without a domain are native resources such as cpu or memory"
                .to_owned(),
        );
    };
    if name.contains(NATIVE_PREFIX) {
        return Err(
            "names containing `kubernetes.io/` are native resources reserved by Kubernetes; \
             use your own domain"
                .to_owned(),
        );
    }
    if name.starts_with(REQUESTS_PREFIX) {
        return Err("a resource name must not start with `requests.`".to_owned());
    }
    if local.contains('/') {
        return Err("a resource name contains exactly one `/`".to_owned());
    }
    // The kubelet validates `requests.<domain>` as a DNS subdomain, so the domain itself may be
    // at most 253 - 9 characters long.
    if domain.is_empty() {
        return Err("the domain before the `/` is empty".to_owned());
    }
    if REQUESTS_PREFIX.len() + domain.len() > SUBDOMAIN_MAX {
        return Err(format!(
            "the domain is {} characters long; at most {} are allowed",
            domain.len(),
            SUBDOMAIN_MAX - REQUESTS_PREFIX.len()
        ));
    }
    if !is_dns1123_subdomain(domain) {
        return Err(format!(
            "the domain {domain:?} is not a DNS-1123 subdomain: lower-case letters, digits, `-` \
             and `.`, each dot-separated label starting and ending with a letter or digit"
        ));
    }
    if local.is_empty() {
        return Err("the name after the `/` is empty".to_owned());
    }
    if local.len() > NAME_MAX {
        return Err(format!(
            "the name after the `/` is {} characters long; at most {NAME_MAX} are allowed",
            local.len()
        ));
    }
    if !is_qualified_name_part(local) {
        return Err(format!(
            "the name {local:?} after the `/` may contain only letters, digits, `-`, `_` and \
             `.`, and must start and end with a letter or digit"
        ));
    }
    Ok(())
}

/// Checks that `endpoint` is a socket *file name*: the kubelet joins it to its own device-plugin
/// directory, so a path (the most common mistake) would point somewhere that does not exist.
pub fn validate_endpoint(endpoint: &str) -> Result<(), String> {
    if endpoint.is_empty() {
        return Err("the endpoint is empty; send the socket's file name".to_owned());
    }
    if endpoint.contains('/') {
        return Err(format!(
            "the endpoint {endpoint:?} is a path; send only the socket's file name, which the \
             kubelet joins to its device-plugin directory"
        ));
    }
    if endpoint == "." || endpoint == ".." {
        return Err(format!("the endpoint {endpoint:?} is not a file name"));
    }
    if endpoint.contains('\0') {
        return Err("the endpoint contains a NUL byte".to_owned());
    }
    Ok(())
}

/// What is wrong with `label` as one RFC 1123 label, by its characters and edges
/// (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`), length aside: the character index at fault and why. The
/// one copy of the rule behind the registry's module names and resource domains, resource
/// names and annotation keys.
pub fn label_error(label: &str) -> Option<(usize, String)> {
    if label.is_empty() {
        return Some((0, "it is empty".to_string()));
    }
    if let Some((index, c)) = label
        .chars()
        .enumerate()
        .find(|(_, c)| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Some((index, format!("{c:?} is not allowed")));
    }
    if label.starts_with('-') {
        return Some((0, "it must not start with '-'".to_string()));
    }
    if label.ends_with('-') {
        return Some((label.len() - 1, "it must not end with '-'".to_string()));
    }
    None
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*`, as `IsDNS1123Subdomain`
/// (which checks only the total length, not a per-label one).
pub fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= SUBDOMAIN_MAX && s.split('.').all(|label| label_error(label).is_none())
}

/// A DRA driver name: a DNS-1123 subdomain the API keeps to 63 characters
/// (`DriverNameMaxLength`), so a longer one would be refused in every ResourceSlice.
pub fn is_dra_driver_name(s: &str) -> bool {
    s.len() <= 63 && is_dns1123_subdomain(s)
}

/// One RFC 1123 label of at most 63 characters, as `IsDNS1123Label`.
pub fn is_dns1123_label(s: &str) -> bool {
    s.len() <= 63 && label_error(s).is_none()
}

/// A Kubernetes qualified name (`IsQualifiedName`), as annotation and label keys are: an optional
/// DNS-1123 subdomain prefix and `/`, then a name part of 1 to 63 characters.
pub fn is_qualified_name(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    prefix.is_none_or(is_dns1123_subdomain)
        && name.len() <= NAME_MAX
        && is_qualified_name_part(name)
}

/// `IsValidLabelValue`: empty, or at most 63 bytes of `[A-Za-z0-9._-]` beginning and ending with
/// a letter or digit.
pub fn is_label_value(v: &str) -> bool {
    v.is_empty() || (v.len() <= NAME_MAX && is_qualified_name_part(v))
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`, the name part of `IsQualifiedName`.
fn is_qualified_name_part(s: &str) -> bool {
    let bytes = s.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qualified_names_need_clean_label_edges_in_the_prefix() {
        assert!(is_qualified_name("devicelet.io/key"));
        assert!(is_qualified_name("key_1.x"));
        // The sandbox's own copy of this rule once skipped the label-edge check.
        for bad in [
            "-x.io/key",
            "x-.io/key",
            "x..io/key",
            "/key",
            "x.io/",
            "a/b/c",
            "X.io/key",
        ] {
            assert!(!is_qualified_name(bad), "{bad}");
        }
        assert!(!is_qualified_name(&format!("x.io/{}", "k".repeat(64))));
    }

    #[test]
    fn accepts_extended_resource_names() {
        for name in [
            "devicelet.io/fuse",
            "nvidia.com/gpu",
            "nvidia.com/mig-1g.10gb",
            "amd.com/gpu",
            "example.com/My_Device.v2",
            "a/b",
            "123.example-x.com/123-abc",
            &format!("example.com/{}", "x".repeat(63)),
            &format!("{}/x", "a".repeat(244)),
        ] {
            assert_eq!(validate_resource_name(name), Ok(()), "{name}");
        }
    }

    #[test]
    fn refuses_what_the_kubelet_refuses() {
        for (name, why) in [
            ("gpu", "form `domain/name`"),
            ("cpu", "form `domain/name`"),
            ("kubernetes.io/gpu", "kubernetes.io/"),
            ("nvidia.kubernetes.io/gpu", "kubernetes.io/"),
            ("requests.example.com/gpu", "requests."),
            ("example.com/a/b", "exactly one"),
            ("/gpu", "empty"),
            ("example.com/", "empty"),
            ("Example.com/gpu", "DNS-1123"),
            ("example..com/gpu", "DNS-1123"),
            ("-example.com/gpu", "DNS-1123"),
            ("example_com/gpu", "DNS-1123"),
            ("example.com/-gpu", "letter or digit"),
            ("example.com/gpu.", "letter or digit"),
            ("example.com/g p u", "letter or digit"),
            (&format!("example.com/{}", "x".repeat(64)), "at most 63"),
            (&format!("{}/x", "a".repeat(245)), "at most 244"),
        ] {
            let err = validate_resource_name(name).expect_err(name);
            assert!(err.contains(why), "{name}: {err}");
        }
    }

    #[test]
    fn endpoint_is_a_file_name() {
        assert_eq!(validate_endpoint("devicelet-fuse-1700000000.sock"), Ok(()));
        for endpoint in [
            "",
            "/var/lib/kubelet/device-plugins/x.sock",
            "sub/x.sock",
            ".",
            "..",
        ] {
            assert!(validate_endpoint(endpoint).is_err(), "{endpoint:?}");
        }
    }
}
