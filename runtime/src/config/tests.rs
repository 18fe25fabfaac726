//! Registry-level tests: a full valid registry, then one test per kind of bad input, each checking
//! the line, the key and the gist of the message.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use super::{Registry, RegistryError};

const FILE: &str = "/etc/devicelet/registry.toml";

fn parse(text: &str) -> Result<Registry, RegistryError> {
    Registry::parse(text, Path::new(FILE))
}

/// Parses `text`, expecting an error, and returns (line, column, key, message) for assertions.
#[track_caller]
fn invalid(text: &str) -> (usize, usize, Option<String>, String) {
    match parse(text) {
        Ok(registry) => panic!("expected an error, got {registry:#?}"),
        Err(RegistryError::Invalid {
            file,
            line,
            column,
            key,
            message,
        }) => {
            assert_eq!(file, Path::new(FILE));
            (line, column, key, message)
        }
        Err(other) => panic!("expected Invalid, got {other:?}"),
    }
}

/// Asserts the error is at `line`, names `key`, and its message contains `needle`; also that the
/// rendered error carries file, line and key. Returns the rendered error.
#[track_caller]
fn assert_invalid(text: &str, line: usize, key: Option<&str>, needle: &str) -> String {
    let (got_line, column, got_key, message) = invalid(text);
    assert_eq!(got_line, line, "line of {message:?}");
    assert_eq!(got_key.as_deref(), key, "key of {message:?}");
    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    let rendered = parse(text).unwrap_err().to_string();
    assert!(
        rendered.starts_with(&format!("{FILE}:{line}:{column}: ")),
        "{rendered}"
    );
    if let Some(key) = key {
        assert!(rendered.contains(&format!("key `{key}`: ")), "{rendered}");
    }
    rendered
}

const MINIMAL: &str = "[[module]]\nname = \"a\"\npath = \"a.wasm\"\n";

#[test]
fn full_registry() {
    let text = r#"
# A node with two modules.
host-root = "/var/lib/devicelet/fixture"
resource-domain = "example.com"

[[module]]
name = "generic-dev"
path = "modules/generic_dev.wasm"
resource-domain = "squat.ai"
health-interval = "500ms"
call-deadline = "3s"
memory-limit = "128MiB"
sha256 = "0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789ABCDEF"
allocate-ahead = false
allocation-policy = "distributed"

[module.grants]
sysfs = ["/sys/bus/pci/devices/*"]
dev = ["/dev/fuse", "/dev/ttyUSB*"]

[module.config]
groups = [{ name = "fuse", paths = ["/dev/fuse"], permissions = "r" }]
ratio = 0.5
enabled = true
since = 1979-05-27T07:32:00Z
"odd key" = { nested = [1, [2, "three"]] }

[[module]]
name = "usb"
path = "/opt/devicelet/usb.wasm"
"#;
    let registry = parse(text).unwrap();
    assert_eq!(registry.file, PathBuf::from(FILE));
    assert_eq!(
        registry.host_root,
        PathBuf::from("/var/lib/devicelet/fixture")
    );
    assert_eq!(registry.modules.len(), 2);

    let generic = &registry.modules[0];
    assert_eq!(generic.name, "generic-dev");
    assert_eq!(
        generic.path,
        PathBuf::from("/etc/devicelet/modules/generic_dev.wasm")
    );
    assert_eq!(generic.resource_domain, "squat.ai");
    assert_eq!(generic.health_interval, Duration::from_millis(500));
    assert_eq!(generic.call_deadline, Duration::from_secs(3));
    assert_eq!(generic.memory_limit, 128 * 1024 * 1024);
    assert_eq!(
        generic.sha256.as_deref(),
        Some(&*"0123456789abcdef".repeat(4))
    );
    assert!(!generic.allocate_ahead);
    assert_eq!(
        generic.allocation_policy,
        crate::policy::AllocationPolicy::Distributed
    );
    let patterns = |ps: &[devicelet_rules::grants::Pattern]| {
        ps.iter()
            .map(|p| p.as_str().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(patterns(&generic.grants.sysfs), ["/sys/bus/pci/devices/*"]);
    assert_eq!(patterns(&generic.grants.dev), ["/dev/fuse", "/dev/ttyUSB*"]);
    assert!(devicelet_rules::grants::granted(
        &generic.grants.dev,
        "/dev/ttyUSB3"
    ));
    assert!(!devicelet_rules::grants::granted(
        &generic.grants.dev,
        "/dev/ttyS0"
    ));
    assert_eq!(
        generic.config,
        json!({
            "groups": [{ "name": "fuse", "paths": ["/dev/fuse"], "permissions": "r" }],
            "ratio": 0.5,
            "enabled": true,
            "since": "1979-05-27T07:32:00Z",
            "odd key": { "nested": [1, [2, "three"]] },
        })
    );

    // Defaults: the registry's domain, and the documented limits; nothing granted; config {}.
    let usb = registry.module("usb").unwrap();
    assert_eq!(usb.path, PathBuf::from("/opt/devicelet/usb.wasm"));
    assert_eq!(usb.resource_domain, "example.com");
    assert_eq!(usb.health_interval, super::DEFAULT_HEALTH_INTERVAL);
    assert_eq!(usb.call_deadline, super::DEFAULT_CALL_DEADLINE);
    assert_eq!(usb.memory_limit, super::DEFAULT_MEMORY_LIMIT);
    assert_eq!(usb.sha256, None);
    assert!(
        usb.allocate_ahead,
        "answers are prepared unless the registry says not"
    );
    assert!(usb.grants.is_empty());
    assert_eq!(usb.config, json!({}));
    assert!(registry.module("nope").is_none());
}

#[test]
fn minimal_registry_takes_every_default() {
    let registry = Registry::parse(MINIMAL, Path::new("registry.toml")).unwrap();
    assert_eq!(registry.host_root, PathBuf::from("/"));
    let module = &registry.modules[0];
    // A registry named without a directory resolves modules against the current directory.
    assert_eq!(module.path, PathBuf::from("a.wasm"));
    assert_eq!(module.resource_domain, "devicelet.io");
    assert_eq!(module.health_interval, Duration::from_secs(5));
    assert_eq!(module.call_deadline, Duration::from_secs(2));
    assert_eq!(module.memory_limit, 64 << 20);
}

#[test]
fn inline_module_tables_are_accepted() {
    let text =
        "module = [{ name = \"a\", path = \"a.wasm\", grants = { dev = [\"/dev/fuse\"] } }]\n";
    let registry = parse(text).unwrap();
    assert!(devicelet_rules::grants::granted(
        &registry.modules[0].grants.dev,
        "/dev/fuse"
    ));
}

#[test]
fn load_reads_the_file_and_resolves_against_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("registry.toml");
    std::fs::write(&file, MINIMAL).unwrap();
    let registry = Registry::load(&file).unwrap();
    assert_eq!(registry.file, file);
    assert_eq!(registry.modules[0].path, dir.path().join("a.wasm"));
}

#[test]
fn load_reports_unreadable_files() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("missing.toml");
    let error = Registry::load(&file).unwrap_err();
    assert!(
        matches!(&error, RegistryError::Read { error, .. } if error.kind() == std::io::ErrorKind::NotFound)
    );
    assert_eq!(error.file(), file);
    let rendered = error.to_string();
    assert!(
        rendered.starts_with(&format!(
            "{}: cannot read the module registry: ",
            file.display()
        )),
        "{rendered}"
    );
}

#[test]
fn load_reports_invalid_utf8_with_its_position() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("registry.toml");
    std::fs::write(&file, b"[[module]]\nname = \"a\xffb\"\n").unwrap();
    match Registry::load(&file).unwrap_err() {
        RegistryError::Invalid {
            line,
            column,
            message,
            ..
        } => {
            assert_eq!((line, column), (2, 10));
            assert!(message.contains("not valid UTF-8"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn toml_syntax_error() {
    let rendered = assert_invalid(
        "[[module]]\nname = \"a\npath = \"a.wasm\"\n",
        2,
        None,
        "invalid TOML",
    );
    assert!(!rendered.contains("key `"), "{rendered}");
}

#[test]
fn toml_duplicate_key() {
    assert_invalid(
        "[[module]]\nname = \"a\"\nname = \"b\"\npath = \"a.wasm\"\n",
        3,
        None,
        "duplicate key `name`",
    );
}

#[test]
fn unknown_top_level_key() {
    assert_invalid(
        "host-roots = \"/\"\n[[module]]\nname = \"a\"\npath = \"a.wasm\"\n",
        1,
        Some("host-roots"),
        "unknown key; did you mean `host-root`?",
    );
    // `[modules]` instead of `[[module]]`.
    assert_invalid(
        "[[modules]]\nname = \"a\"\npath = \"a.wasm\"\n",
        1,
        Some("modules"),
        "unknown key; did you mean `module`? (allowed here: host-root, resource-domain, module)",
    );
}

#[test]
fn unknown_module_key() {
    let text = "[[module]]\nname = \"a\"\npath = \"a.wasm\"\n\n[[module]]\nname = \"b\"\npath = \"b.wasm\"\nhealth_interval = \"1s\"\n";
    let (_, column, _, _) = invalid(text);
    assert_eq!(column, 1);
    assert_invalid(
        text,
        8,
        Some("module[1].health_interval"),
        "did you mean `health-interval`?",
    );
}

#[test]
fn an_unknown_allocation_policy_names_the_choices() {
    let text = format!("{MINIMAL}allocation-policy = \"spread\"\n");
    assert_invalid(
        &text,
        4,
        Some("module[0].allocation-policy"),
        "expected \"module\", \"packed\", \"distributed\" or \"none\"",
    );
}

#[test]
fn the_device_list_strategy_is_one_name_or_several() {
    let registry = parse(MINIMAL).unwrap();
    assert!(!registry.modules[0].device_list_strategy.uses_cdi());
    let text = format!("{MINIMAL}device-list-strategy = \"cdi-cri\"\n");
    let s = parse(&text).unwrap().modules[0].device_list_strategy;
    assert!(s.cdi_cri && !s.devices && !s.cdi_annotations);
    let text = format!("{MINIMAL}device-list-strategy = [\"devices\", \"cdi-annotations\"]\n");
    let s = parse(&text).unwrap().modules[0].device_list_strategy;
    assert!(s.devices && s.cdi_annotations && !s.cdi_cri);
}

#[test]
fn an_unknown_or_empty_device_list_strategy_is_refused() {
    let text = format!("{MINIMAL}device-list-strategy = [\"devices\", \"cdi\"]\n");
    assert_invalid(
        &text,
        4,
        Some("module[0].device-list-strategy"),
        "unknown device-list strategy \"cdi\"",
    );
    let text = format!("{MINIMAL}device-list-strategy = []\n");
    assert_invalid(
        &text,
        4,
        Some("module[0].device-list-strategy"),
        "the device-list strategy is empty",
    );
}

#[test]
fn a_cdi_strategy_without_answers_prepared_ahead_is_refused() {
    let text = format!("{MINIMAL}allocate-ahead = false\ndevice-list-strategy = \"cdi-cri\"\n");
    assert_invalid(
        &text,
        5,
        Some("module[0].device-list-strategy"),
        "needs `allocate-ahead = true`",
    );
}

#[test]
fn sharing_per_module_per_resource_and_per_device() {
    let text = format!(
        "{MINIMAL}[module.sharing]\nreplicas = 2\nrename = true\n\
         [module.sharing.resources.gpu]\nreplicas = 4\ndevices = {{ \"gpu-0\" = 1 }}\n"
    );
    let registry = parse(&text).unwrap();
    let sharing = &registry.modules[0].sharing;
    assert_eq!(
        (sharing.default.replicas, sharing.default.rename),
        (2, true)
    );
    let gpu = sharing.rule("gpu");
    assert_eq!(
        (gpu.replicas, gpu.rename),
        (4, true),
        "the module's keys are inherited"
    );
    assert_eq!((gpu.replicas_of("gpu-0"), gpu.replicas_of("gpu-1")), (1, 4));
    assert_eq!(sharing.rule("other").replicas, 2);
    assert!(!super::ShareRule::default().shares());
}

#[test]
fn bad_sharing_values_name_the_key() {
    for (table, key, needle) in [
        (
            "replicas = 0",
            "module[0].sharing.replicas",
            "expected 1 to 256",
        ),
        (
            "replicas = \"2\"",
            "module[0].sharing.replicas",
            "expected a number of replicas",
        ),
        (
            "rename = 1",
            "module[0].sharing.rename",
            "expected true or false",
        ),
        (
            "replica = 2",
            "module[0].sharing.replica",
            "did you mean `replicas`?",
        ),
        (
            "resources.gpu.devices = { a = 999 }",
            "module[0].sharing.resources.gpu.devices.a",
            "expected 1 to 256",
        ),
    ] {
        let text = format!("{MINIMAL}[module.sharing]\n{table}\n");
        assert_invalid(&text, 5, Some(key), needle);
    }
}

#[test]
fn a_shared_device_id_with_the_replica_separator_is_refused() {
    let text = format!("{MINIMAL}[module.sharing.resources.gpu]\ndevices = {{ \"gpu::1\" = 2 }}\n");
    let (line, _, _, message) = invalid(&text);
    assert_eq!(line, 5);
    assert!(message.contains("separates replica numbers"), "{message}");
}

#[test]
fn unknown_grants_key() {
    let text =
        "[[module]]\nname = \"a\"\npath = \"a.wasm\"\n[module.grants]\ndevs = [\"/dev/fuse\"]\n";
    assert_invalid(
        text,
        5,
        Some("module[0].grants.devs"),
        "allowed here: sysfs, dev",
    );
}

#[test]
fn config_is_free_form() {
    let text = format!(
        "{MINIMAL}[module.config]\nanything = {{ goes = [\"here\", 1] }}\nhealth_interval = 3\n"
    );
    let registry = parse(&text).unwrap();
    assert_eq!(
        registry.modules[0].config,
        json!({ "anything": { "goes": ["here", 1] }, "health_interval": 3 })
    );
}

#[test]
fn config_values_json_cannot_carry() {
    let text = format!("{MINIMAL}[module.config]\nlimits = {{ ratio = nan }}\n");
    assert_invalid(
        &text,
        5,
        Some("module[0].config.limits.ratio"),
        "JSON has no NaN or infinity",
    );
    let text = format!("{MINIMAL}config = \"verbose\"\n");
    assert_invalid(&text, 4, Some("module[0].config"), "expected a table");
}

#[test]
fn wrong_types() {
    let cases = [
        (
            "host-root = 1\n",
            1,
            "host-root",
            "expected a string, found an integer",
        ),
        (
            "resource-domain = [\"a\"]\n",
            1,
            "resource-domain",
            "expected a string, found an array",
        ),
    ];
    for (prefix, line, key, needle) in cases {
        assert_invalid(&format!("{prefix}{MINIMAL}"), line, Some(key), needle);
    }
    let cases = [
        (
            "name = 7",
            "module[0].name",
            "expected a string, found an integer",
        ),
        (
            "path = true",
            "module[0].path",
            "expected a string, found a boolean",
        ),
        (
            "health-interval = 5",
            "module[0].health-interval",
            "expected a duration string such as \"5s\"",
        ),
        (
            "call-deadline = 1.5",
            "module[0].call-deadline",
            "found a float",
        ),
        (
            "memory-limit = 67108864",
            "module[0].memory-limit",
            "expected a size string such as \"64MiB\"",
        ),
        (
            "sha256 = 1979-05-27",
            "module[0].sha256",
            "found a datetime",
        ),
        (
            "allocate-ahead = \"yes\"",
            "module[0].allocate-ahead",
            "expected true or false, found a string",
        ),
        (
            "grants = [\"/dev/fuse\"]",
            "module[0].grants",
            "expected a table of grants",
        ),
        (
            "grants.dev = \"/dev/fuse\"",
            "module[0].grants.dev",
            "expected an array of glob patterns, e.g. [\"/dev/*\"]",
        ),
        (
            "grants.dev = [\"/dev/fuse\", 3]",
            "module[0].grants.dev[1]",
            "expected a string, found an integer",
        ),
    ];
    for (line, key, needle) in cases {
        let mut text = format!("[[module]]\n{line}\n");
        if !line.starts_with("name") {
            text.push_str("name = \"a\"\n");
        }
        if !line.starts_with("path") {
            text.push_str("path = \"a.wasm\"\n");
        }
        assert_invalid(&text, 2, Some(key), needle);
    }
    // `[module]` instead of `[[module]]`.
    assert_invalid(
        "[module]\nname = \"a\"\npath = \"a.wasm\"\n",
        1,
        Some("module"),
        "expected an array of tables, written [[module]], found a table",
    );
    assert_invalid(
        "module = [\"a\"]\n",
        1,
        Some("module[0]"),
        "expected a table, written [[module]], found a string",
    );
}

#[test]
fn missing_required_keys() {
    let text = "[[module]]\nname = \"a\"\npath = \"a.wasm\"\n\n[[module]]\nname = \"b\"\n";
    assert_invalid(
        text,
        5,
        Some("module[1].path"),
        "missing required key `path`",
    );
    let text = "[[module]]\npath = \"a.wasm\"\n";
    let (_, column, _, _) = invalid(text);
    assert_eq!(column, 1);
    assert_invalid(
        text,
        1,
        Some("module[0].name"),
        "missing required key `name`",
    );
    // Inline: point at the brace that opens the module.
    assert_invalid(
        "module = [\n  { path = \"a.wasm\" },\n]\n",
        2,
        Some("module[0].name"),
        "missing required key `name`",
    );
}

#[test]
fn invalid_module_names() {
    let cases = [
        ("\"\"", 1, "it is empty"),
        ("\"Generic\"", 2, "'G' is not allowed"),
        ("\"gen_dev\"", 5, "'_' is not allowed"),
        ("\"-dev\"", 2, "must not start with '-'"),
        ("\"dev-\"", 5, "must not end with '-'"),
    ];
    for (value, column, needle) in cases {
        let text = format!("[[module]]\nname = {value}\npath = \"a.wasm\"\n");
        let (_, got_column, _, _) = invalid(&text);
        // The column points at the offending character inside the string (8 is the quote).
        assert_eq!(got_column, 7 + column, "{value}");
        assert_invalid(&text, 2, Some("module[0].name"), needle);
    }
    let long = "x".repeat(64);
    let text = format!("[[module]]\nname = \"{long}\"\npath = \"a.wasm\"\n");
    assert_invalid(
        &text,
        2,
        Some("module[0].name"),
        "64 characters is longer than 63",
    );
}

#[test]
fn duplicate_module_names_point_at_the_second() {
    let text = "[[module]]\nname = \"a\"\npath = \"a.wasm\"\n\n[[module]]\nname = \"b\"\npath = \"b.wasm\"\n\n[[module]]\nname = \"a\"\npath = \"c.wasm\"\n";
    assert_invalid(
        text,
        10,
        Some("module[2].name"),
        "duplicate module name \"a\": `module[0]` at line 2 already has it",
    );
}

#[test]
fn bad_durations() {
    let text = format!("{MINIMAL}call-deadline = \"2 s\"\n");
    let rendered = assert_invalid(
        &text,
        4,
        Some("module[0].call-deadline"),
        "invalid duration \"2 s\"",
    );
    assert!(rendered.ends_with("e.g. 500ms, 2s, 1m"), "{rendered}");
    let text = format!("{MINIMAL}health-interval = \"1h30m\"\n");
    assert_invalid(
        &text,
        4,
        Some("module[0].health-interval"),
        "e.g. 500ms, 2s, 1m",
    );
}

#[test]
fn bad_sizes() {
    let text = format!("{MINIMAL}memory-limit = \"64 MiB\"\n");
    assert_invalid(
        &text,
        4,
        Some("module[0].memory-limit"),
        "invalid size \"64 MiB\"",
    );
    let text = format!("{MINIMAL}memory-limit = \"64mb\"\n");
    assert_invalid(&text, 4, Some("module[0].memory-limit"), "e.g. 64MiB");
}

#[test]
fn bad_sha256() {
    let text = format!("{MINIMAL}sha256 = \"abc123\"\n");
    assert_invalid(
        &text,
        4,
        Some("module[0].sha256"),
        "expected exactly 64 hexadecimal digits, found 6",
    );
    let text = format!("{MINIMAL}sha256 = \"{}z\"\n", "0".repeat(63));
    let (_, column, _, _) = invalid(&text);
    assert_eq!(column, 10 + 63 + 1);
    assert_invalid(
        &text,
        4,
        Some("module[0].sha256"),
        "'z' is not a hexadecimal digit",
    );
}

#[test]
fn out_of_range_values() {
    let cases = [
        (
            "health-interval = \"50ms\"",
            "module[0].health-interval",
            "duration \"50ms\" is out of range: expected 100ms to 1h",
        ),
        (
            "health-interval = \"2h\"",
            "module[0].health-interval",
            "expected 100ms to 1h",
        ),
        (
            "call-deadline = \"0ms\"",
            "module[0].call-deadline",
            "duration \"0ms\" is out of range: expected 1ms to 10s",
        ),
        (
            "call-deadline = \"11s\"",
            "module[0].call-deadline",
            "expected 1ms to 10s",
        ),
        (
            "memory-limit = \"512KiB\"",
            "module[0].memory-limit",
            "size \"512KiB\" is out of range: expected 1MiB to 4GiB",
        ),
        (
            "memory-limit = \"5GB\"",
            "module[0].memory-limit",
            "expected 1MiB to 4GiB",
        ),
        (
            "memory-limit = \"99999999999GiB\"",
            "module[0].memory-limit",
            "too large",
        ),
    ];
    for (line, key, needle) in cases {
        assert_invalid(&format!("{MINIMAL}{line}\n"), 4, Some(key), needle);
    }
}

#[test]
fn bad_grants() {
    let cases = [
        (
            "sysfs = [\"/dev/fuse\"]",
            "module[0].grants.sysfs[0]",
            "grant \"/dev/fuse\" is not under /sys/",
        ),
        (
            "dev = [\"/dev/fuse\", \"fuse\"]",
            "module[0].grants.dev[1]",
            "grant \"fuse\" is not under /dev/",
        ),
        (
            "dev = [\"/dev/../etc/shadow\"]",
            "module[0].grants.dev[0]",
            "is not a normalised absolute path",
        ),
        (
            "dev = [\"/dev/tty[\"]",
            "module[0].grants.dev[0]",
            "is not a valid glob pattern",
        ),
        (
            "sysfs = [\"/sys/class/**x\"]",
            "module[0].grants.sysfs[0]",
            "is not a valid glob pattern",
        ),
    ];
    for (line, key, needle) in cases {
        assert_invalid(
            &format!("{MINIMAL}[module.grants]\n{line}\n"),
            5,
            Some(key),
            needle,
        );
    }
}

#[test]
fn bad_resource_domains() {
    assert_invalid(
        &format!("resource-domain = \"Example.com\"\n{MINIMAL}"),
        1,
        Some("resource-domain"),
        "invalid resource domain \"Example.com\"",
    );
    assert_invalid(
        &format!("{MINIMAL}resource-domain = \"squat..ai\"\n"),
        4,
        Some("module[0].resource-domain"),
        "it is empty",
    );
}

#[test]
fn host_root_must_be_absolute() {
    assert_invalid(
        &format!("host-root = \"fixtures/host\"\n{MINIMAL}"),
        1,
        Some("host-root"),
        "not an absolute path",
    );
    assert_invalid(
        &format!("host-root = \"\"\n{MINIMAL}"),
        1,
        Some("host-root"),
        "not an absolute path",
    );
}

#[test]
fn empty_path() {
    assert_invalid(
        "[[module]]\nname = \"a\"\npath = \"\"\n",
        3,
        Some("module[0].path"),
        "the module path is empty",
    );
}

#[test]
fn no_modules() {
    for text in ["", "# nothing yet\n", "host-root = \"/\"\n"] {
        let (_, column, _, _) = invalid(text);
        assert_eq!(column, 1);
        assert_invalid(text, 1, Some("module"), "the registry lists no modules");
    }
    assert_invalid(
        "host-root = \"/\"\nmodule = []\n",
        2,
        Some("module"),
        "the registry lists no modules",
    );
}

#[test]
fn health_deadline_defaults_to_the_call_deadline_and_can_differ() {
    let registry = parse(&format!("{MINIMAL}call-deadline = \"3s\"\n")).unwrap();
    assert_eq!(registry.modules[0].health_deadline, Duration::from_secs(3));
    let registry = parse(&format!("{MINIMAL}health-deadline = \"50ms\"\n")).unwrap();
    assert_eq!(
        registry.modules[0].health_deadline,
        Duration::from_millis(50)
    );
    assert_eq!(
        registry.modules[0].call_deadline,
        super::DEFAULT_CALL_DEADLINE
    );
    // Health work is off the kubelet's path: it may take longer than a kubelet call, up to 60s.
    let registry = parse(&format!("{MINIMAL}health-deadline = \"30s\"\n")).unwrap();
    assert_eq!(registry.modules[0].health_deadline, Duration::from_secs(30));
    assert_invalid(
        &format!("{MINIMAL}health-deadline = \"2m\"\n"),
        4,
        Some("module[0].health-deadline"),
        "out of range",
    );
}

#[test]
fn unknown_vendor_libraries_are_refused_by_name() {
    let text = format!("{MINIMAL}[module.grants]\nlibraries = [\"nvml\", \"cuda\"]\n");
    let message = assert_invalid(
        &text,
        5,
        Some("module[0].grants.libraries[1]"),
        "unknown vendor library \"cuda\"",
    );
    assert!(message.contains("known: nvml"), "{message}");
    let text = format!("{MINIMAL}[module.grants]\nlibraries = [\"nvml\"]\n");
    let registry = Registry::parse(&text, Path::new("/etc/devicelet/registry.toml")).unwrap();
    assert!(registry.modules[0].grants.has_library("nvml"));
}

#[test]
fn mount_grants_name_directories_outside_the_device_trees() {
    let text = format!("{MINIMAL}[module.grants]\nmounts = [\"/run/nvidia/mps\"]\n");
    let registry = Registry::parse(&text, Path::new("/etc/devicelet/registry.toml")).unwrap();
    assert_eq!(
        registry.modules[0].grants.mounts[0].as_str(),
        "/run/nvidia/mps"
    );
    for bad in [
        "/run",
        "/proc/driver",
        "/sys/class",
        "/dev/shm",
        "/*/x",
        "/etc/nvidia",
        "/var/lib/kubelet/pods",
        "/var/lib/kube*",
        "/var/lib/[k]ubelet",
        "/var/lib/*",
        "/var/lib/k?belet",
        "/var/lib/containerd",
        "/var/lib",
        "/var/run/cdi",
    ] {
        let text = format!("{MINIMAL}[module.grants]\nmounts = [\"{bad}\"]\n");
        assert_invalid(&text, 5, Some("module[0].grants.mounts[0]"), "mount grant");
    }
    let text = format!("{MINIMAL}[module.grants]\nmounts = [\"/\"]\n");
    assert_invalid(
        &text,
        5,
        Some("module[0].grants.mounts[0]"),
        "not a normalised",
    );
    let text = format!("{MINIMAL}[module.grants]\nmounts = [\"run/x\"]\n");
    assert_invalid(&text, 5, Some("module[0].grants.mounts[0]"), "not under /");
}

#[test]
fn front_end_defaults_to_the_device_plugin_and_dra_takes_an_optional_driver() {
    use super::FrontEnd;
    let registry = parse(MINIMAL).expect("valid");
    assert_eq!(registry.modules[0].front_end, FrontEnd::DevicePlugin);
    let registry = parse(&format!("{MINIMAL}front-end = \"dra\"\n")).expect("valid");
    assert_eq!(
        registry.modules[0].front_end,
        FrontEnd::Dra { driver: None }
    );
    let registry = parse(&format!(
        "{MINIMAL}front-end = \"dra\"\ndra-driver = \"gpu.example.com\"\n"
    ))
    .expect("valid");
    assert_eq!(
        registry.modules[0].front_end,
        FrontEnd::Dra {
            driver: Some("gpu.example.com".into())
        }
    );
    let registry = parse(&format!("{MINIMAL}front-end = \"device-plugin\"\n")).expect("valid");
    assert_eq!(registry.modules[0].front_end, FrontEnd::DevicePlugin);
}

#[test]
fn both_front_ends_at_once_are_refused_citing_double_advertising() {
    let rendered = assert_invalid(
        &format!("{MINIMAL}front-end = [\"device-plugin\", \"dra\"]\n"),
        4,
        Some("module[0].front-end"),
        "advertise every device twice",
    );
    assert!(rendered.contains("one front end per module"), "{rendered}");
    assert_invalid(
        &format!("{MINIMAL}front-end = \"csi\"\n"),
        4,
        Some("module[0].front-end"),
        "expected \"device-plugin\" (the default) or \"dra\"",
    );
}

#[test]
fn dra_driver_must_be_a_dns_subdomain_and_needs_the_dra_front_end() {
    assert_invalid(
        &format!("{MINIMAL}front-end = \"dra\"\ndra-driver = \"GPU_example\"\n"),
        5,
        Some("module[0].dra-driver"),
        "`dra-driver` \"GPU_example\"",
    );
    assert_invalid(
        &format!("{MINIMAL}dra-driver = \"gpu.example.com\"\n"),
        4,
        Some("module[0].dra-driver"),
        "has no `front-end = \"dra\"`",
    );
}

#[test]
fn device_plugin_only_keys_are_refused_beside_the_dra_front_end() {
    assert_invalid(
        &format!("{MINIMAL}front-end = \"dra\"\n[module.sharing]\nreplicas = 2\n"),
        5,
        Some("module[0].sharing"),
        "DRA shares a device by a ResourceClaim",
    );
    assert_invalid(
        &format!("{MINIMAL}allocation-policy = \"packed\"\nfront-end = \"dra\"\n"),
        4,
        Some("module[0].allocation-policy"),
        "the scheduler picks the devices",
    );
    assert_invalid(
        &format!("{MINIMAL}front-end = \"dra\"\ndevice-list-strategy = \"cdi-cri\"\n"),
        5,
        Some("module[0].device-list-strategy"),
        "always answers with CDI devices",
    );
}

#[test]
fn a_module_comes_from_a_path_or_a_pinned_source_never_both() {
    let digest = "4f6c3a5e9b0d2a1c8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d";
    let good = format!(
        "[[module]]\nname = \"a\"\nsource = \"oci://registry.example.com/vendor/a:1.0@sha256:{digest}\"\n"
    );
    let registry = parse(&good).expect("a pinned source");
    let source = registry.modules[0].source.as_ref().expect("the source");
    assert_eq!(source.digest, digest);
    assert_eq!(source.tag.as_deref(), Some("1.0"));
    assert_eq!(registry.modules[0].path, std::path::PathBuf::new());

    assert_invalid(
        "[[module]]\nname = \"a\"\nsource = \"oci://registry.example.com/vendor/a:1.0\"\n",
        3,
        Some("module[0].source"),
        "has no digest",
    );
    assert_invalid(
        &format!(
            "[[module]]\nname = \"a\"\npath = \"a.wasm\"\n{}",
            &good[22..]
        ),
        1,
        Some("module[0]"),
        "`path` and `source` both name the module's file",
    );
    assert_invalid(
        &format!("{good}sha256 = \"{digest}\"\n"),
        1,
        Some("module[0]"),
        "a `source` is pinned by its own digest already",
    );
    assert_invalid(
        "[[module]]\nname = \"a\"\n",
        1,
        Some("module[0].path"),
        "or `source` (oci://",
    );
}

#[test]
fn a_verify_key_is_a_p256_public_key_and_checks_a_source_only() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("vendor.pub");
    std::fs::write(
        &key,
        "-----BEGIN PUBLIC KEY-----\n\
         MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEAY7Z3YkmbCO0hfXf436ONc0QU5G7\n\
         1tHsfhqjhMmo3yf6+dnHGpQ+9m9ryP7EHwKV96MXWfCu4kniGyJjvlC3ig==\n\
         -----END PUBLIC KEY-----\n",
    )
    .unwrap();
    let source = format!(
        "source = \"oci://registry.example.com/vendor/a@sha256:{}\"\n",
        "4".repeat(64)
    );
    let good = format!(
        "[[module]]\nname = \"a\"\n{source}verify-key = \"{}\"\n",
        key.display()
    );
    let registry = parse(&good).expect("a signed source");
    let verify = registry.modules[0].verify_key.as_ref().expect("the key");
    assert_eq!(verify.path, key);

    assert_invalid(
        &format!("[[module]]\nname = \"a\"\n{source}verify-key = \"/nonexistent.pub\"\n"),
        4,
        Some("module[0].verify-key"),
        "reading /nonexistent.pub",
    );
    assert_invalid(
        &format!(
            "[[module]]\nname = \"a\"\n{source}verify-key = \"{}\"\n",
            concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")
        ),
        4,
        Some("module[0].verify-key"),
        "not a PEM public key",
    );
    assert_invalid(
        &format!(
            "[[module]]\nname = \"a\"\npath = \"a.wasm\"\nverify-key = \"{}\"\n",
            key.display()
        ),
        4,
        Some("module[0].verify-key"),
        "a `path` is pinned by `sha256`",
    );
}
