//! Modules from an OCI registry (`source = "oci://…@sha256:…"`), against a real registry
//! (Debian's docker-registry, plain HTTP on 127.0.0.1, listed as insecure): pushed with
//! `devicelet module push`, pulled by digest into the module store, served from the store with
//! the registry down, and refused by name when they are not what the digest pins. A registry
//! that attacks instead of serving: `hostile_registry.rs`.

use devicelet_tests::oci::TestRegistry;
use devicelet_tests::{Node, WAIT, module_dir};

/// generic-dev serving /dev/fuse, from `source_line` (`source = "…"`).
fn fuse_from(source_line: &str) -> String {
    format!(
        "[[module]]\nname = \"generic-dev\"\n{source_line}\nhealth-interval = \"100ms\"\n\
         [module.grants]\ndev = [\"/dev/fuse\"]\n[module.config]\n\
         groups = [{{ name = \"fuse\", paths = [\"/dev/fuse\"] }}]\n"
    )
}

/// The pending entry of `agent` once a pull failed at least once.
pub(crate) async fn failed_try(
    agent: &devicelet::agent::Agent,
    what: &str,
) -> devicelet::agent::PendingStatus {
    devicelet_tests::eventually_some(what, || {
        agent.pending().into_iter().find(|p| p.attempts >= 1)
    })
    .await
}

/// generic-dev pushed with `devicelet module push`: the registry line it printed.
fn pushed(registry: &TestRegistry, repository: &str, tag: &str) -> String {
    registry.push(&module_dir().join("generic_dev.wasm"), repository, tag)
}

/// The `oci://…` reference in a registry line.
fn reference_of(line: &str) -> &str {
    line.trim_start_matches("source = \"").trim_end_matches('"')
}

async fn agent(node: &Node, modules: &str, registry: &TestRegistry) -> devicelet::agent::Agent {
    agent_reaching(node, modules, registry.access(None)).await
}

/// An agent with a state directory, reaching registries as `access` says.
pub(crate) async fn agent_reaching(
    node: &Node,
    modules: &str,
    access: devicelet::oci::access::Access,
) -> devicelet::agent::Agent {
    let state = node.state_dir();
    node.start_agent_with(modules, move |o| {
        o.state_dir = Some(state);
        o.registry_access = access;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_module_is_served_by_digest_and_from_the_store_with_the_registry_down() {
    let mut registry = TestRegistry::start();
    // Pushed as if it had TLS (no --insecure-registry), the plain-HTTP registry's answer is a
    // TLS error; the message says what to add.
    let out = std::process::Command::new(devicelet_tests::devicelet_bin())
        .args(["module", "push"])
        .arg(module_dir().join("generic_dev.wasm"))
        .arg(format!(
            "oci://{}/devicelet/generic-dev:0.2.0",
            registry.addr
        ))
        .output()
        .expect("running devicelet module push");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("give --insecure-registry {}", registry.addr)),
        "{stderr}"
    );
    let line = pushed(&registry, "devicelet/generic-dev", "0.2.0");
    let digest = line
        .rsplit_once("@sha256:")
        .map(|(_, d)| d.trim_end_matches('"').to_owned())
        .expect("a digest in the registry line");
    // What a vendor or operator sees of it before any node pulls it.
    let reference = reference_of(&line);
    let (ok, shown) = registry.inspect(reference);
    assert!(ok, "{shown}");
    for needle in [
        "implements devicelet:plugin@0.3.1",
        "layer: application/wasm",
        "devicelet:plugin/devnodes@0.3.1",
        "a node would pull and load it",
    ] {
        assert!(shown.contains(needle), "{needle:?} in:\n{shown}");
    }
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = fuse_from(&line);

    let first = agent(&node, &modules, &registry).await;
    assert!(first.load_errors().is_empty(), "{:?}", first.load_errors());
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served from the registry");
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocated");
    let store = node.state_dir().join("modules/sha256");
    assert!(
        store.join(&digest).is_file(),
        "the manifest is stored by its digest"
    );
    first.shutdown().await;

    // The registry is down: the node starts from its store.
    registry.down();
    let offline = agent(&node, &modules, &registry).await;
    assert!(
        offline.load_errors().is_empty(),
        "{:?}",
        offline.load_errors()
    );
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations >= 2 && r.allocatable == 1
        })
        .await
        .expect("served from the store");
    offline.shutdown().await;

    // A store entry whose bytes no longer match its name is deleted; with the registry down
    // the module waits for its pull, and says why; with it back, it is pulled and served.
    let layer = std::fs::read_dir(&store)
        .expect("the store")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().is_some_and(|n| n != digest.as_str()))
        .expect("the module's entry");
    std::fs::write(&layer, b"tampered").expect("tamper");
    let waiting = agent(&node, &modules, &registry).await;
    assert!(!layer.exists(), "the tampered entry is deleted");
    let pending = devicelet_tests::eventually_some("a failed pull reported", || {
        waiting
            .pending()
            .into_iter()
            .find(|p| p.attempts >= 1 && p.module == "generic-dev")
    })
    .await;
    assert!(!pending.running);
    assert!(
        pending
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("fetching the manifest")),
        "{pending:?}"
    );
    registry.up();
    devicelet_tests::eventually("pulled again and served", || {
        waiting.pending().is_empty() && waiting.resource("devicelet.io/fuse").is_some()
    })
    .await;
    assert!(layer.is_file(), "pulled again");
    assert!(
        waiting.load_errors().is_empty(),
        "{:?}",
        waiting.load_errors()
    );
    waiting.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_digest_does_not_pin_or_is_not_a_wasm_component_is_refused_by_name() {
    let registry = TestRegistry::start();
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);

    // A container image's layout under a module's name.
    let image = registry.push_raw(
        "vendor/not-wasm",
        "1.0",
        ("application/vnd.oci.image.config.v1+json", b"{}"),
        (
            "application/vnd.oci.image.layer.v1.tar+gzip",
            b"not a module",
        ),
    );
    let line = format!(
        "source = \"oci://{}/vendor/not-wasm:1.0@sha256:{image}\"",
        registry.addr
    );
    let (_, shown) = registry.inspect(reference_of(&line));
    assert!(
        shown.contains("a node would refuse it") && shown.contains("not a wasm component artifact"),
        "{shown}"
    );
    let refused = agent(&node, &fuse_from(&line), &registry).await;
    // Refused for good: no retry changes what a digest pins.
    devicelet_tests::eventually("the artifact refused by name", || {
        refused.load_errors().iter().any(|e| {
            e.contains("application/vnd.oci.image.config.v1+json")
                && e.contains("not a wasm component artifact")
        })
    })
    .await;
    assert!(refused.pending().is_empty(), "{:?}", refused.pending());
    refused.shutdown().await;

    // A module whose config lists an import its grants do not allow (devnodes, with no /dev
    // grant) is refused from the config: its module is never fetched, nor compiled.
    let devnodes = pushed(&registry, "devicelet/generic-dev", "0.2.0");
    let ungranted = format!(
        "[[module]]\nname = \"generic-dev\"\n{devnodes}\n[module.grants]\nsysfs = [\"/sys/class\"]\n"
    );
    let state = node.state_dir();
    let cache = node.dir.path().join("cache");
    let refused = node
        .start_agent_with(&ungranted, {
            let (state, cache, access) = (state.clone(), cache.clone(), registry.access(None));
            move |o| {
                o.state_dir = Some(state);
                o.cache_dir = Some(cache);
                o.registry_access = access;
            }
        })
        .await;
    devicelet_tests::eventually("refused from its config", || {
        refused.load_errors().iter().any(|e| {
            e.contains("devicelet:plugin/devnodes@0.3.1")
                && e.contains("registry grants do not allow")
                && e.contains("refused before fetching the module")
        })
    })
    .await;
    let layer = devicelet::digest::sha256_hex(
        &std::fs::read(module_dir().join("generic_dev.wasm")).expect("the module"),
    );
    assert!(
        !state.join("modules/sha256").join(&layer).exists(),
        "the module was not fetched"
    );
    let stats = refused.cache_stats().expect("a compile cache");
    assert_eq!((stats.hits, stats.misses), (0, 0), "nothing compiled");
    refused.shutdown().await;

    // The wasm layout, but the digest pins nothing there.
    let wrong = format!(
        "source = \"oci://{}/vendor/not-wasm:1.0@sha256:{}\"",
        registry.addr,
        "0".repeat(64)
    );
    // Not (yet) there is no refusal: the module waits for its pull, tried again with backoff.
    let missing = agent(&node, &fuse_from(&wrong), &registry).await;
    let pending = failed_try(&missing, "the failed pull reported").await;
    assert!(
        pending
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("fetching the manifest") && e.contains("manifest unknown")),
        "{pending:?}"
    );
    assert!(pending.next_attempt_in_ms.is_some(), "{pending:?}");
    assert!(
        missing.load_errors().is_empty(),
        "{:?}",
        missing.load_errors()
    );
    // Taken out of the registry, it stops waiting.
    node.registry(
        &fuse_from("path = \"generic_dev.wasm\"")
            .replace("name = \"generic-dev\"", "name = \"local\""),
    );
    devicelet_tests::eventually("the pull dropped with its entry", || {
        missing.pending().iter().all(|p| p.module != "generic-dev")
    })
    .await;
    missing.shutdown().await;

    // The registry serves other bytes than the manifest names (its storage changed under it):
    // refused, nothing stored, tried again.
    registry.tamper_blob(&layer);
    let tampered = agent(&node, &fuse_from(&devnodes), &registry).await;
    let pending = failed_try(&tampered, "the tampered layer refused").await;
    assert!(
        pending
            .last_error
            .as_deref()
            // oci-client's stream check or ours, whichever sees it first, names the digest.
            .is_some_and(|e| e.contains("fetching the module") || e.contains("not the manifest's"))
            && pending
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains(&layer)),
        "{pending:?}"
    );
    assert!(!state.join("modules/sha256").join(&layer).exists());
    assert!(tampered.resource("devicelet.io/fuse").is_none());
    tampered.shutdown().await;

    // A config that lists no imports lets the module be fetched; the loader then refuses its
    // ungranted import (it has no grants at all), and the wait ends as that load error.
    // (amd-gpu: generic-dev's layer is the one tampered with above.)
    let wasm = std::fs::read(module_dir().join("amd_gpu.wasm")).expect("the module");
    let unlisted = registry.push_raw(
        "vendor/unlisted",
        "1.0",
        (
            "application/vnd.wasm.config.v0+json",
            b"{\"architecture\":\"wasm\"}",
        ),
        ("application/wasm", &wasm),
    );
    let entry = format!(
        "[[module]]\nname = \"generic-dev\"\nsource = \"oci://{}/vendor/unlisted@sha256:{unlisted}\"\n",
        registry.addr
    );
    let loaded = agent(&node, &entry, &registry).await;
    devicelet_tests::eventually("refused by the loader after the pull", || {
        loaded.pending().is_empty()
            && loaded.load_errors().iter().any(|e| {
                e.contains("registry grants do not allow") && !e.contains("before fetching")
            })
    })
    .await;
    loaded.shutdown().await;
}

/// `module push` reads the names from the component's sections, without compiling it; they are
/// the names wasmtime finds in the compiled component, which the node's pre-check compares.
#[test]
fn push_lists_the_imports_and_exports_the_compiled_component_has() {
    let engine = devicelet::sandbox::engine::new_engine().expect("an engine");
    for file in ["generic_dev.wasm", "misbehaving.wasm", "wit_0_1_0.wasm"] {
        let wasm = std::fs::read(module_dir().join(file)).expect("the module");
        let (imports, exports) = devicelet::sandbox::loader::interface(&wasm).expect(file);
        let component = devicelet::sandbox::compiler::compile(&engine, &wasm).expect(file);
        let ty = component.component_type();
        let compiled = |names: &mut dyn Iterator<Item = &str>| names.map(str::to_owned).collect();
        let compiled_imports: Vec<String> = compiled(&mut ty.imports(&engine).map(|(n, _)| n));
        let compiled_exports: Vec<String> = compiled(&mut ty.exports(&engine).map(|(n, _)| n));
        assert_eq!(imports, compiled_imports, "{file}");
        assert_eq!(exports, compiled_exports, "{file}");
        assert!(
            imports.iter().any(|i| i.starts_with("devicelet:plugin/")),
            "{imports:?}"
        );
        assert!(
            exports
                .iter()
                .any(|e| e.starts_with("devicelet:plugin/plugin@")),
            "{exports:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_change_pulls_and_upgrades_in_place_and_a_failed_pull_leaves_the_running_version()
{
    let registry = TestRegistry::start();
    let wasm = std::fs::read(module_dir().join("generic_dev.wasm")).expect("the module");
    // Two artifacts of the same module, told apart by their config (another build's date),
    // pushed by hand through the distribution API exactly as `wkg oci push` lays them out
    // (bytecodealliance/rust-oci-wasm's WasmConfig): another tool's artifacts pull and load,
    // their import list checked against the grants first.
    let (imports, exports) = devicelet::sandbox::loader::interface(&wasm).expect("a component");
    let push = |created: &str| {
        let config = serde_json::to_vec(&serde_json::json!({
            "created": format!("{created}T12:00:00.000000001Z"), "author": null,
            "architecture": "wasm", "os": "wasip2",
            "layerDigests": [format!("sha256:{}", devicelet::digest::sha256_hex(&wasm))],
            "component": {"exports": exports, "imports": imports, "target": null},
        }))
        .expect("config");
        registry.push_raw(
            "vendor/generic-dev",
            created,
            ("application/vnd.wasm.config.v0+json", &config),
            ("application/wasm", &wasm),
        )
    };
    let (first, second) = (push("2026-11-01"), push("2026-11-02"));
    let line = |digest: &str| {
        format!(
            "source = \"oci://{}/vendor/generic-dev@sha256:{digest}\"",
            registry.addr
        )
    };
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = agent(&node, &fuse_from(&line(&first)), &registry).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served");

    // A digest that is not there: the running version keeps serving while it is tried.
    node.registry(&fuse_from(&line(&"0".repeat(64))));
    let pending = failed_try(&agent, "the failed pull reported").await;
    assert!(pending.running, "{pending:?}");
    assert!(
        pending
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("manifest unknown")),
        "{pending:?}"
    );
    assert_eq!(
        node.kubelet
            .resource("devicelet.io/fuse")
            .map(|r| r.allocatable),
        Some(1)
    );

    // The second artifact: pulled, and the module upgraded in place (no new registration).
    let registrations = node.kubelet.registrations("devicelet.io/fuse");
    node.registry(&fuse_from(&line(&second)));
    let store = node.state_dir().join("modules/sha256");
    devicelet_tests::eventually("the second artifact pulled and serving", || {
        store.join(&second).is_file()
            && agent.status().modules.iter().any(|m| {
                m.source
                    .as_deref()
                    .is_some_and(|s| s.ends_with(second.as_str()))
            })
    })
    .await;
    assert_eq!(
        node.kubelet.registrations("devicelet.io/fuse"),
        registrations
    );
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocated after the upgrade");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_down_at_first_start_leaves_its_module_pending_and_the_others_serving() {
    let mut registry = TestRegistry::start();
    let line = pushed(&registry, "devicelet/generic-dev", "0.2.0");
    registry.down();
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/net/tun", 10, 200);
    // One module from the registry (serving tun), one from a file (serving fuse).
    let modules = format!(
        "{}\n[[module]]\nname = \"local\"\npath = \"{}\"\nhealth-interval = \"100ms\"\n\
         [module.grants]\ndev = [\"/dev/fuse\"]\n[module.config]\n\
         groups = [{{ name = \"fuse\", paths = [\"/dev/fuse\"] }}]\n",
        fuse_from(&line)
            .replace("/dev/fuse", "/dev/net/tun")
            .replace("name = \"fuse\"", "name = \"tun\""),
        module_dir().join("generic_dev.wasm").display()
    );
    let (state, access) = (node.state_dir(), registry.access(None));
    let agent = node
        .start_agent_with(&modules, move |o| {
            o.state_dir = Some(state);
            o.registry_access = access;
            o.metrics_addr = Some(([127, 0, 0, 1], 0).into());
        })
        .await;
    let addr = agent.metrics_addr().expect("the metrics endpoint");

    // The file module serves and allocates while the other waits for its registry.
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("the file module serves");
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocated meanwhile");
    let pending = failed_try(&agent, "a failed pull reported").await;
    assert_eq!(pending.module, "generic-dev");
    assert!(!pending.running && pending.next_attempt_in_ms.is_some());
    assert!(agent.resource("devicelet.io/tun").is_none());
    let (status, body) = devicelet_tests::http_get(addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("module `generic-dev` waits for its pull"),
        "{body}"
    );
    let (_, metrics) = devicelet_tests::http_get(addr, "/metrics").await;
    for needle in [
        "devicelet_module_pending{module=\"generic-dev\",running=\"0\"} 1",
        "devicelet_module_pulls_total{module=\"generic-dev\",result=\"failed\"}",
    ] {
        assert!(metrics.contains(needle), "{needle} in:\n{metrics}");
    }

    // The registry comes up: the next try pulls it, and it serves beside the other.
    registry.up();
    node.kubelet
        .wait_until("devicelet.io/tun", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served once pulled");
    assert!(agent.pending().is_empty(), "{:?}", agent.pending());
    node.kubelet
        .allocate("devicelet.io/tun", 1)
        .await
        .expect("allocated");
    let mut ready = devicelet_tests::http_get(addr, "/readyz").await;
    let deadline = std::time::Instant::now() + WAIT;
    while ready.0 != 200 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        ready = devicelet_tests::http_get(addr, "/readyz").await;
    }
    assert_eq!(ready.0, 200, "{}", ready.1);
    let (_, metrics) = devicelet_tests::http_get(addr, "/metrics").await;
    assert!(
        metrics.contains("devicelet_module_pulls_total{module=\"generic-dev\",result=\"ok\"} 1"),
        "{metrics}"
    );
    assert!(!metrics.contains("devicelet_module_pending{"), "{metrics}");
    assert_eq!(node.kubelet.registrations("devicelet.io/fuse"), 1);
    agent.shutdown().await;
}

/// An ECDSA P-256 key pair made by `openssl`, as a vendor makes one: (private PKCS#8 PEM,
/// public PEM).
fn key_pair(dir: &std::path::Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let (key, public) = (
        dir.join(format!("{name}.key")),
        dir.join(format!("{name}.pub")),
    );
    for args in [
        vec![
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            key.to_str().expect("utf-8"),
        ],
        vec![
            "pkey",
            "-in",
            key.to_str().expect("utf-8"),
            "-pubout",
            "-out",
            public.to_str().expect("utf-8"),
        ],
    ] {
        devicelet_tests::oci::run(std::process::Command::new("openssl").args(&args));
    }
    (key, public)
}

/// generic-dev from `line`, to be signed with the key at `verify_key`.
fn signed_fuse_from(line: &str, verify_key: &std::path::Path) -> String {
    fuse_from(&format!(
        "{line}\nverify-key = \"{}\"",
        verify_key.display()
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_with_a_verify_key_is_served_only_once_signed_with_that_key() {
    let mut registry = TestRegistry::start();
    let line = pushed(&registry, "vendor/generic-dev", "1.0");
    let reference = reference_of(&line).to_owned();
    let keys = tempfile::tempdir().expect("tempdir");
    let (vendor_key, vendor_pub) = key_pair(keys.path(), "vendor");
    let (other_key, _) = key_pair(keys.path(), "other");
    let (_, third_pub) = key_pair(keys.path(), "third");
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = agent(&node, &signed_fuse_from(&line, &vendor_pub), &registry).await;

    // Unsigned: it waits, saying so; nothing is served.
    let failed_with = |needle: &'static str| {
        let agent = &agent;
        move || {
            agent
                .pending()
                .into_iter()
                .find(|p| p.last_error.as_deref().is_some_and(|e| e.contains(needle)))
        }
    };
    let unsigned =
        devicelet_tests::eventually_some("unsigned, refused", failed_with("not signed:")).await;
    assert!(
        unsigned
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains(".sig")),
        "{unsigned:?}"
    );
    assert!(agent.resource("devicelet.io/fuse").is_none());

    // What `module inspect --verify-key` says, as a node with that key would decide.
    let inspect_checked = || {
        let key = vendor_pub.to_str().expect("utf-8");
        registry
            .module(&["inspect", &reference, "--verify-key", key])
            .1
    };

    // Signed with another key: still refused, naming the key it wants.
    let (ok, said) = registry.module(&["sign", &reference, "--key", other_key.to_str().unwrap()]);
    assert!(ok, "{said}");
    let by_other = devicelet_tests::eventually_some(
        "signed by another key, refused",
        failed_with("none of its 1 signature(s) verifies"),
    )
    .await;
    assert!(
        by_other
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains(&format!("not signed by {}", vendor_pub.display()))),
        "{by_other:?}"
    );
    let shown = inspect_checked();
    assert!(
        shown.contains("a node with that verify-key would refuse it"),
        "{shown}"
    );

    // Signed with the vendor's key (beside the other signature): pulled and served.
    let (ok, said) = registry.module(&["sign", &reference, "--key", vendor_key.to_str().unwrap()]);
    assert!(ok, "{said}");
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served once signed");
    // `validate` says whose signature it checked.
    let file = node.registry(&signed_fuse_from(&line, &vendor_pub));
    let out = devicelet_tests::validate_command()
        .arg("--config")
        .arg(&file)
        .args(registry.args())
        .output()
        .expect("running devicelet validate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("  signature verified by {}", vendor_pub.display())),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, listed) = registry.inspect(&reference);
    assert!(
        listed.contains("signatures: 2 at"),
        "the other key's signature stays:\n{listed}"
    );
    let shown = inspect_checked();
    assert!(
        shown.contains(&format!("signed by {}", vendor_pub.display()))
            && shown.contains("a node would pull and load it"),
        "{shown}"
    );
    agent.shutdown().await;

    // With the registry down, the signature kept in the store is checked again: it verifies
    // with the vendor's key, not with a key nobody signed with.
    registry.down();
    let offline = agent_with_key(&node, &line, &vendor_pub, &registry).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.registrations >= 2)
        .await
        .expect("served from the store, signature and all");
    assert!(offline.pending().is_empty(), "{:?}", offline.pending());
    offline.shutdown().await;
    let rekeyed = agent_with_key(&node, &line, &third_pub, &registry).await;
    let pending = failed_try(&rekeyed, "a new key wants a fresh check").await;
    assert!(!pending.running, "{pending:?}");
    rekeyed.shutdown().await;
}

async fn agent_with_key(
    node: &Node,
    line: &str,
    key: &std::path::Path,
    registry: &TestRegistry,
) -> devicelet::agent::Agent {
    agent(node, &signed_fuse_from(line, key), registry).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_registry_over_tls_with_basic_auth_serves_with_the_right_credentials_only() {
    let registry = TestRegistry::start_secured();
    let secured = registry.secured.as_ref().expect("secured");
    // The vendor pushes with the registry's CA and credentials.
    let line = pushed(&registry, "vendor/generic-dev", "1.0");
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = fuse_from(&line);
    let start = |access| agent_reaching(&node, &modules, access);
    let failed_with =
        |agent: &devicelet::agent::Agent| agent.pending().into_iter().find_map(|p| p.last_error);

    // Without credentials, and with a wrong password: refused, saying which.
    let anonymous = start(registry.access(None)).await;
    let error =
        devicelet_tests::eventually_some("refused without credentials", || failed_with(&anonymous))
            .await;
    assert!(
        error.contains("HTTP 401 Unauthorized") && error.contains("wants credentials"),
        "{error}"
    );
    anonymous.shutdown().await;
    let wrong = devicelet_tests::oci::docker_config(
        node.dir.path(),
        &registry.addr,
        (devicelet_tests::oci::USER.0, "wrong"),
    );
    let refused = start(registry.access(Some(&wrong))).await;
    let error =
        devicelet_tests::eventually_some("refused with a wrong password", || failed_with(&refused))
            .await;
    assert!(
        error.contains(&format!(
            "the credentials --registry-auth gives for {} were refused",
            registry.addr
        )),
        "{error}"
    );
    refused.shutdown().await;

    // Without the CA the registry's certificate is not trusted, and the error says so.
    let untrusted = start(
        devicelet::oci::access::Access::load(Vec::new(), None, Some(&secured.auth))
            .expect("access"),
    )
    .await;
    let error =
        devicelet_tests::eventually_some("refused without the CA", || failed_with(&untrusted))
            .await;
    assert!(error.to_lowercase().contains("certificate"), "{error}");
    untrusted.shutdown().await;

    // With both: pulled over TLS, authenticated, served.
    let agent = start(registry.access(Some(&secured.auth))).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served from the private registry");
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_behind_the_token_flow_serves_with_a_bearer_token_for_good_credentials() {
    let registry = TestRegistry::start_with_token();
    let secured = registry.secured.as_ref().expect("credentials");
    let token = registry.token.as_ref().expect("a token server");
    let line = pushed(&registry, "vendor/generic-dev", "1.0");
    let pushing = token.issued.load(std::sync::atomic::Ordering::Relaxed);
    assert!(pushing > 0, "the push went through the token flow");
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = fuse_from(&line);
    let start = |access| agent_reaching(&node, &modules, access);

    // The token server refuses a wrong password; the registry then refuses the pull.
    let wrong = devicelet_tests::oci::docker_config(
        node.dir.path(),
        &registry.addr,
        (devicelet_tests::oci::USER.0, "wrong"),
    );
    let refused = start(registry.access(Some(&wrong))).await;
    let error = devicelet_tests::eventually_some("refused with a wrong password", || {
        refused.pending().into_iter().find_map(|p| p.last_error)
    })
    .await;
    assert!(
        error.contains("HTTP 401 Unauthorized") && error.contains("were refused"),
        "{error}"
    );
    refused.shutdown().await;
    assert_eq!(
        token.issued.load(std::sync::atomic::Ordering::Relaxed),
        pushing,
        "no token for a wrong password"
    );

    // Good credentials: exchanged for a token, pulled with it, served.
    let agent = start(registry.access(Some(&secured.auth))).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served from the registry behind the token flow");
    assert!(token.issued.load(std::sync::atomic::Ordering::Relaxed) > pushing);
    agent.shutdown().await;
}

/// `scripts/local-registry.sh`, as the vendor guide tells a vendor to start a registry: it
/// serves, and `module push` reaches it with `--insecure-registry`.
#[test]
fn the_local_registry_script_serves_what_module_push_pushes() {
    use std::io::{Read, Write};
    let (dir, addr) = (
        tempfile::tempdir().expect("tempdir"),
        devicelet_tests::oci::free_addr(),
    );
    let mut registry = std::process::Command::new(
        devicelet_tests::workspace_root().join("scripts/local-registry.sh"),
    )
    .arg(&addr)
    .arg(dir.path())
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .expect("running scripts/local-registry.sh");
    let answers = || {
        let Ok(mut stream) = std::net::TcpStream::connect(&addr) else {
            return false;
        };
        let mut answer = String::new();
        stream
            .write_all(format!("GET /v2/ HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .is_ok()
            && stream.read_to_string(&mut answer).is_ok()
            && answer.starts_with("HTTP/1.0 200")
    };
    let deadline = std::time::Instant::now() + WAIT;
    while !answers() {
        assert!(
            std::time::Instant::now() < deadline,
            "the script's registry never answered"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = std::process::Command::new(devicelet_tests::devicelet_bin())
        .args(["module", "push"])
        .arg(module_dir().join("generic_dev.wasm"))
        .arg(format!("oci://{addr}/devicelet/generic-dev:0.1.0"))
        .args(["--insecure-registry", &addr])
        .output()
        .expect("running devicelet module push");
    let _ = registry.kill();
    let _ = registry.wait();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("registry line: "),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
