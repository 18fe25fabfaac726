//! `devicelet validate` refuses each kind of bad registry (or bad module) with a message naming
//! the file, the line and the key (or the module), and accepts a good one.

use std::process::Command;

use devicelet_tests::{
    Node, devicelet_bin, generic_dev, hostile, misbehaving, module_dir, workspace_root,
};

/// Runs `devicelet validate` on a registry and returns (success, stdout + stderr).
fn validate(node: &Node, modules: &str) -> (bool, String) {
    devicelet_tests::validate_registry(&node.registry(modules), &[])
}

fn assert_refused(node: &Node, modules: &str, expected: &[&str]) {
    let (ok, text) = validate(node, modules);
    assert!(!ok, "validate accepted:\n{modules}\n{text}");
    for e in expected {
        assert!(text.contains(e), "expected {e:?} in:\n{text}");
    }
}

const GOOD: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#;

#[tokio::test]
async fn a_good_registry_validates_and_lists_what_the_module_may_touch() {
    let node = Node::new().await;
    let (ok, text) = validate(&node, &generic_dev(GOOD));
    assert!(ok, "{text}");
    assert!(text.contains("resource devicelet.io/fuse"), "{text}");
    assert!(text.contains("may use device nodes: /dev/*"), "{text}");
    let latest = devicelet::sandbox::bindings::imports::LATEST;
    assert!(
        text.contains(&format!("implements devicelet:plugin@{latest}")),
        "{text}"
    );
    assert!(
        text.contains(&format!("devicelet:plugin/devnodes@{latest}")),
        "{text}"
    );
    assert!(
        !text.contains("devicelet:plugin/sysfs"),
        "generic-dev does not read sysfs: {text}"
    );
}

/// `devicelet validate … | head` with the reader gone: ended by SIGPIPE, as a Unix filter is,
/// not a panic.
#[tokio::test]
async fn validate_into_a_closed_pipe_ends_by_sigpipe_without_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    let node = Node::new().await;
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(devicelet_bin())
        .args(["validate", "--config"])
        .arg(node.registry(&generic_dev(GOOD)))
        .stdout(writer)
        .output()
        .expect("running devicelet validate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {stderr}",
        out.status
    );
}

#[tokio::test]
async fn validate_calls_enumerate_and_prints_the_devices_each_resource_would_advertise() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let (ok, text) = validate(&node, &generic_dev(GOOD));
    assert!(ok, "{text}");
    assert!(text.contains("1 devices, 1 healthy"), "{text}");
    assert!(
        text.contains("\n    fuse Healthy {path=/dev/fuse, dev=10:229}\n"),
        "{text}"
    );

    // Granted the wrong paths: still valid (another node may have the hardware), but said.
    let wrong = r#"groups = [{ name = "fuse", paths = ["/dev/fuse-missing"] }]"#;
    let (ok, text) = validate(&node, &generic_dev(wrong));
    assert!(ok, "{text}");
    assert!(text.contains("0 devices now (warning"), "{text}");
}

#[tokio::test]
async fn validate_fails_wherever_run_would_refuse_something() {
    let node = Node::new().await;
    let cases: &[(String, &[&str])] = &[
        // A resource outside the module's domain: run serves nothing under it.
        (
            misbehaving("other", r#"resource = "example.com/gpu""#, "1s"),
            &[
                "registry.toml:3: module `other`",
                "outside its resource domain devicelet.io",
            ],
        ),
        // More than 64 resources: run serves the first 64.
        (
            misbehaving("many", "also-declare = 64", "1s"),
            &["registry.toml:3: module `many` declared 65 resources; at most 64 are served"],
        ),
        // A resource two modules declare: run serves it from one only.
        (
            format!(
                "{}\n{}",
                misbehaving("first", r#"resource = "same""#, "1s"),
                misbehaving("second", r#"resource = "same""#, "1s")
            ),
            &[
                "registry.toml:17: module `second` declared devicelet.io/same, which module \
                 `first` already serves",
            ],
        ),
        // Enumerate fails: run would advertise no devices.
        (
            misbehaving("broken", r#"enumerate = "error""#, "1s"),
            &["enumerate failed", "requested failure"],
        ),
        // Enumerate runs past its deadline.
        (
            misbehaving("slow", r#"enumerate = "loop""#, "300ms"),
            &["enumerate failed", "deadline"],
        ),
        // Enumerate answers something the host refuses.
        (hostile("duplicate-ids", None), &["enumerate failed", "dup"]),
    ];
    for (modules, expected) in cases {
        assert_refused(&node, modules, expected);
    }
}

#[tokio::test]
async fn each_kind_of_bad_registry_names_file_line_and_key() {
    let node = Node::new().await;
    // The harness writes `host-root = ...` on line 1 and a blank line 2; modules start on line 3.
    let cases: &[(&str, &[&str])] = &[
        (
            "[[module]]\nname = \"a\"\npath = \"x.wasm\"\nhelth-interval = \"1s\"\n",
            &[
                "registry.toml:6:",
                "module[0].helth-interval",
                "unknown key",
            ],
        ),
        (
            "[[module]]\nname = \"a\"\npath = \"x.wasm\"\ncall-deadline = \"2 s\"\n",
            &[
                "registry.toml:6:",
                "module[0].call-deadline",
                "invalid duration",
            ],
        ),
        (
            "[[module]]\nname = \"a\"\npath = \"x.wasm\"\nmemory-limit = 64\n",
            &["registry.toml:6:", "module[0].memory-limit"],
        ),
        (
            "[[module]]\nname = \"a\"\npath = \"x.wasm\"\ncall-deadline = \"1h\"\n",
            &["registry.toml:6:", "out of range"],
        ),
        (
            "[[module]]\npath = \"x.wasm\"\n",
            &["registry.toml:3:", "module[0].name", "missing required key"],
        ),
        (
            "[[module]]\nname = \"Bad_Name\"\npath = \"x.wasm\"\n",
            &["registry.toml:4:", "module[0].name"],
        ),
        (
            "[[module]]\nname = \"a\"\npath = \"x.wasm\"\n[[module]]\nname = \"a\"\npath = \"y.wasm\"\n",
            &["registry.toml:7:", "module[1].name", "duplicate"],
        ),
        (
            "[[module]]\nname = \"a\"\npath = \"x.wasm\"\n[module.grants]\ndev = [\"/etc/passwd\"]\n",
            &["registry.toml:7:", "module[0].grants.dev[0]"],
        ),
        (
            "[[module]]\nname = \"a\"\npath = \"x.wasm\"\nsha256 = \"abc\"\n",
            &["registry.toml:6:", "module[0].sha256"],
        ),
        (
            "[[module]]\nname = \"a\"\npath = \"x.wasm\"\nhealth-interval = \n",
            &["registry.toml:6:", "invalid TOML"],
        ),
        ("", &["registry.toml:1:", "no modules"]),
    ];
    for (modules, expected) in cases {
        assert_refused(&node, modules, expected);
    }
}

#[tokio::test]
async fn a_missing_or_broken_module_is_named() {
    let node = Node::new().await;
    assert_refused(
        &node,
        "[[module]]\nname = \"ghost\"\npath = \"/nonexistent/ghost.wasm\"\n",
        &["module `ghost`", "/nonexistent/ghost.wasm"],
    );
    let garbage = node.dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"not wasm at all").expect("write");
    assert_refused(
        &node,
        &format!(
            "[[module]]\nname = \"garbage\"\npath = {:?}\n",
            garbage.display().to_string()
        ),
        &["module `garbage`", "not a valid WebAssembly component"],
    );
}

#[tokio::test]
async fn a_module_importing_an_ungranted_interface_fails_to_load() {
    let node = Node::new().await;
    let no_grants = format!(
        "[[module]]\nname = \"generic-dev\"\npath = \"{}/generic_dev.wasm\"\n[module.config]\n{GOOD}\n",
        module_dir().display()
    );
    assert_refused(
        &node,
        &no_grants,
        &[
            "module `generic-dev`",
            "devicelet:plugin/devnodes",
            "grants",
        ],
    );
}

#[tokio::test]
async fn a_module_whose_digest_differs_from_the_registry_is_refused() {
    let node = Node::new().await;
    let wrong = "0".repeat(64);
    let modules = generic_dev(GOOD).replace(
        "health-interval",
        &format!("sha256 = \"{wrong}\"\nhealth-interval"),
    );
    assert_refused(&node, &modules, &["module `generic-dev`", "sha256", &wrong]);
}

#[tokio::test]
async fn a_module_rejecting_its_config_is_named_with_its_reason() {
    let node = Node::new().await;
    let modules = generic_dev(r#"groups = [{ name = "fuse", pathz = ["/dev/fuse"] }]"#);
    let (ok, text) = validate(&node, &modules);
    assert!(!ok, "{text}");
    // The harness writes the module's `[module.config]` header on line 12.
    assert!(
        text.contains("module `generic-dev` refused its [module.config] ("),
        "{text}"
    );
    assert!(text.contains("registry.toml:12): "), "{text}");
    assert!(text.contains("pathz"), "{text}");
    assert!(!text.contains("column"), "no JSON position: {text}");
    assert_eq!(
        text.matches("generic-dev`").count(),
        1,
        "named once: {text}"
    );
}

#[tokio::test]
async fn validate_shows_the_sharing_and_preferred_allocation_in_effect() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let shared = format!(
        "{}\n[module.sharing]\nreplicas = 2\nrename = true\n",
        generic_dev(GOOD)
    );
    let (ok, text) = validate(&node, &shared);
    assert!(ok, "{text}");
    assert!(text.contains("resource devicelet.io/fuse.shared"), "{text}");
    assert!(
        text.contains("preferred allocation: the host's, distributed"),
        "{text}"
    );
    assert!(
        text.contains("sharing: 2 replicas per device, served as .shared"),
        "{text}"
    );
    assert!(
        text.contains("\n    fuse::0 Healthy"),
        "replicas as run serves them: {text}"
    );

    let (ok, text) = validate(&node, &generic_dev(GOOD));
    assert!(ok, "{text}");
    assert!(
        text.contains("preferred allocation: the host's, packed") && text.contains("sharing: none"),
        "{text}"
    );
}

#[tokio::test]
async fn validate_shows_the_device_list_strategy_and_the_cdi_spec_run_would_write() {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    node.add_char("/dev/ttyUSB1", 188, 1);
    let serial = r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"] }]"#;
    let cdi = generic_dev(serial).replace(
        "health-interval",
        "device-list-strategy = [\"devices\", \"cdi-cri\"]\nhealth-interval",
    );
    let (ok, text) = validate(&node, &cdi);
    assert!(ok, "{text}");
    assert!(
        text.contains(
            "device list: devices, cdi-cri; CDI spec /var/run/cdi/devicelet_devicelet.io_serial.json \
             (kind devicelet.devicelet.io/serial, annotation cdi.k8s.io/devicelet_devicelet.io_serial)"
        ),
        "{text}"
    );
    assert!(
        text.contains("CDI spec: cdiVersion 0.3.0, 2 of 2 devices named"),
        "{text}"
    );

    let (ok, text) = validate(&node, &generic_dev(serial));
    assert!(ok, "{text}");
    assert!(
        text.contains("device list: devices (no CDI spec)"),
        "{text}"
    );

    // CDI is stricter than Kubernetes (a class starts with a letter, and CDI 0.5 takes no
    // dot): such names are spelled as CDI takes them. With CDI alone, validate warns.
    let digit = r#"groups = [{ name = "1serial.x", paths = ["/dev/ttyUSB*"] }]"#;
    let cdi = generic_dev(digit).replace(
        "health-interval",
        "device-list-strategy = \"cdi-cri\"\nhealth-interval",
    );
    let (ok, text) = validate(&node, &cdi);
    assert!(ok, "{text}");
    assert!(
        text.contains("(kind devicelet.devicelet.io/n_1serial_dx,"),
        "{text}"
    );
    assert!(
        text.contains("warning: only CDI names the devices; containerd before 1.7 ignores"),
        "{text}"
    );
}

#[tokio::test]
async fn a_sharing_rule_for_a_resource_the_module_does_not_declare_is_refused() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let typo = format!(
        "{}\n[module.sharing.resources.fsue]\nreplicas = 2\n",
        generic_dev(GOOD)
    );
    assert_refused(
        &node,
        &typo,
        &[
            "registry.toml:3: module `generic-dev`: [module.sharing.resources.fsue] names no \
             resource it declares (it declares: fuse)",
        ],
    );
}

/// A module on the DRA front end: `validate` shows the driver it is served as (the resource
/// turned around); `run` without the node's name cannot serve it and says what to give, while
/// the node's other modules serve as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dra_module_validates_with_its_driver_and_without_a_node_name_is_refused_by_name() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/net/tun", 10, 200);
    let dra = generic_dev(GOOD).replace(
        "call-deadline = \"2s\"\n",
        "call-deadline = \"2s\"\nfront-end = \"dra\"\n",
    );
    assert!(dra.contains("front-end"), "{dra}");
    let (ok, text) = validate(&node, &dra);
    assert!(ok, "{text}");
    assert!(
        text.contains("resource devicelet.io/fuse served as DRA driver fuse.devicelet.io"),
        "{text}"
    );
    let tun = generic_dev(r#"groups = [{ name = "tun", paths = ["/dev/net/tun"] }]"#)
        .replace("name = \"generic-dev\"", "name = \"tun\"");
    let agent = node.start_agent(&format!("{dra}\n{tun}")).await;
    node.kubelet
        .wait_until("devicelet.io/tun", devicelet_tests::WAIT, |r| {
            r.allocatable == 1
        })
        .await
        .expect("the other module serves");
    let errors = agent.load_errors();
    assert!(
        errors.iter().any(|e| e.contains(
            "module `generic-dev` has `front-end = \"dra\"`, but the agent serves no DRA drivers"
        ) && e.contains("--node-name")),
        "{errors:?}"
    );
    assert!(agent.resource("devicelet.io/fuse").is_none());
    agent.shutdown().await;
}

/// A registry of 9,000 modules (964 KiB) once made the agent serve for a second and then abort,
/// leaving sockets behind: it is refused at the first module over the limit, by `validate`, at
/// start, and on hot reload as a whole while the running set keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_of_9000_modules_is_refused_at_the_first_one_over_the_limit() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let many: String = (0..9000)
        .map(|i| format!("[[module]]\nname = \"m{i}\"\npath = \"@MODULES@/generic_dev.wasm\"\n"))
        .collect();
    let over = devicelet::config::MAX_MODULES;
    // Modules start on line 3, three lines each.
    let line = 3 + 3 * over;
    assert_refused(
        &node,
        &many,
        &[
            &format!("registry.toml:{line}:"),
            &format!("module[{over}]"),
            "9000 modules",
            &format!("at most {over}"),
        ],
    );

    let agent = node.start_agent(&generic_dev(GOOD)).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", devicelet_tests::WAIT, |r| {
            r.allocatable == 1
        })
        .await
        .expect("served");
    node.registry(&many);
    devicelet_tests::eventually("the edit to be refused", || agent.reload_error().is_some()).await;
    let error = agent.reload_error().unwrap_or_default();
    assert!(error.contains(&format!("registry.toml:{line}:")), "{error}");
    assert_eq!(agent.resources().len(), 1, "the running set keeps serving");
    let sockets = std::fs::read_dir(node.plugin_dir())
        .expect("plugin dir")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("devicelet-"))
        })
        .count();
    assert_eq!(sockets, 1, "one socket, the running resource's");
    agent.shutdown().await;
}

/// A registry whose `host-root` is a fixture node (as `try` takes: `sys/` and a `dev.list`):
/// `validate` makes the listed device nodes in a scratch copy, so the module sees its devices.
#[test]
fn validate_on_a_fixture_host_root_makes_its_dev_list_into_nodes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = workspace_root().join("guests/amd-gpu/fixtures/2-gpus");
    let file = dir.path().join("registry.toml");
    std::fs::write(
        &file,
        format!(
            r#"host-root = {:?}
resource-domain = "amd.com"

[[module]]
name = "amd-gpu"
path = {:?}

[module.grants]
sysfs = ["/sys/bus/pci/devices/*"]
dev = ["/dev/kfd", "/dev/dri/*"]
"#,
            fixture.display().to_string(),
            module_dir().join("amd_gpu.wasm").display().to_string()
        ),
    )
    .expect("registry");
    let (ok, text) = devicelet_tests::validate_registry(&file, &[]);
    assert!(ok, "{text}");
    assert!(
        text.contains("is a fixture: its dev.list made into device nodes"),
        "{text}"
    );
    assert!(text.contains("2 devices, 2 healthy"), "{text}");
    assert!(!text.contains("none is Healthy"), "{text}");

    // `run` on the same registry refuses at once, saying what to use instead.
    let out = std::process::Command::new(devicelet_tests::devicelet_bin())
        .args(["run", "--config"])
        .arg(&file)
        .args(["--kubelet-dir"])
        .arg(dir.path().join("kubelet"))
        .args(["--state-dir"])
        .arg(dir.path().join("state"))
        .output()
        .expect("running devicelet run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("is a fixture node (a dev.list and no dev/)")
            && stderr.contains("devicelet try --module M.wasm --fixture"),
        "{stderr}"
    );
}

/// `--log module=NAME:LEVEL` shows one module's own lines (they come from the agent's `log`
/// host interface, not from a target named after the module); a filter that does not parse is an
/// error, not a silent default.
#[tokio::test]
async fn one_modules_lines_are_chosen_by_its_name_and_a_bad_filter_is_refused() {
    let node = Node::new().await;
    let file = node.registry(&generic_dev(GOOD));
    let validate_with = |log: &str| {
        let out = devicelet_tests::validate_command()
            .args(["--log", log, "--config"])
            .arg(&file)
            .output()
            .expect("running devicelet validate");
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (status, quiet) = validate_with("warn");
    assert!(status.success(), "{quiet}");
    assert!(!quiet.contains("generic-dev serving fuse"), "{quiet}");
    let (status, chosen) = validate_with("warn,module=generic-dev:info");
    assert!(status.success(), "{chosen}");
    assert!(chosen.contains("generic-dev serving fuse"), "{chosen}");
    let (_, other) = validate_with("warn,module=someone-else:info");
    assert!(!other.contains("generic-dev serving fuse"), "{other}");
    let (status, bad) = validate_with("devicelet=loud");
    assert_eq!(status.code(), Some(2), "{bad}");
    assert!(bad.contains("--log \"devicelet=loud\""), "{bad}");
}
