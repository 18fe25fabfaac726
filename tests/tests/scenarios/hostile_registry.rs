//! A registry that attacks the agent instead of serving it (`tests/hostile_registry.rs`): huge
//! manifests, bodies trickled a few bytes a second, huge error bodies, token floods, an image
//! index where a module's manifest should be, a config too large to read. Each is refused by
//! name within its deadline, `devicelet validate`'s peak RSS stays under a bound while it
//! happens, and an agent pulling from it keeps allocating its other modules' devices.

use std::process::Command;

use devicelet_tests::hostile_registry::{Answer, HostileRegistry, digest_of};
use devicelet_tests::{Node, WAIT, devicelet_bin, module_dir};

/// The most RSS `devicelet validate` may reach while a registry attacks it.
const RSS_BOUND_MIB: u64 = 64;

fn module_line(registry: &HostileRegistry, digest: &str) -> String {
    format!(
        "[[module]]\nname = \"generic-dev\"\nsource = \"oci://{}/vendor/dev@{digest}\"\n\
         [module.grants]\ndev = [\"/dev/fuse\"]\n[module.config]\n\
         groups = [{{ name = \"fuse\", paths = [\"/dev/fuse\"] }}]\n",
        registry.addr
    )
}

/// `devicelet validate` of one module pulled from `registry`: whether it passed, its output,
/// and its peak RSS in MiB. GNU time measures it: the kernel's peak for a process forked from
/// this big, many-threaded test process would count this process's pages too.
fn validate(registry: &HostileRegistry, digest: &str) -> (bool, String, u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("registry.toml");
    std::fs::write(&file, module_line(registry, digest)).expect("writing the registry");
    let out = Command::new("/usr/bin/time")
        .args(["-f", "peak-rss-kb %M"])
        .arg(devicelet_bin())
        .args(["validate", "--config"])
        .arg(&file)
        .args(["--insecure-registry", &registry.addr])
        .output()
        .expect("running devicelet validate under /usr/bin/time (Debian's `time`)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let peak_kb: u64 = stderr
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("peak-rss-kb "))
        .and_then(|kb| kb.trim().parse().ok())
        .expect("time's report");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &stderr;
    (out.status.success(), text, peak_kb / 1024)
}

/// A digest no manifest here has: for answers that never get as far as checking one.
fn any_digest() -> String {
    digest_of(b"whatever is pinned")
}

#[test]
fn a_huge_manifest_is_refused_as_it_streams_past_its_cap() {
    let registry = HostileRegistry::start(Answer::Huge { bytes: 500 << 20 });
    let (passed, text, rss) = validate(&registry, &any_digest());
    assert!(!passed, "{text}");
    assert!(
        text.contains("the registry sent more than 4194304 bytes"),
        "{text}"
    );
    assert!(rss < RSS_BOUND_MIB, "peak RSS {rss} MiB:\n{text}");
    let sent = registry.sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(sent < 100 << 20, "read {sent} bytes of 500 MiB");
    // Every request names devicelet and its version, for the registry's logs.
    let agents = registry.user_agents.lock().expect("agents").clone();
    assert_eq!(
        agents,
        [format!("devicelet/{}", env!("CARGO_PKG_VERSION"))].into()
    );
}

#[test]
fn a_huge_error_body_is_read_only_in_part_and_cut_short_in_the_error() {
    let registry = HostileRegistry::start(Answer::ErrorBody {
        status: 404,
        bytes: 20 << 20,
    });
    let (passed, text, rss) = validate(&registry, &any_digest());
    assert!(!passed, "{text}");
    assert!(text.contains("HTTP 404 Not Found"), "{text}");
    assert!(text.len() < 8 << 10, "{} bytes of output", text.len());
    assert!(rss < RSS_BOUND_MIB, "peak RSS {rss} MiB:\n{text}");
}

#[test]
fn a_token_flood_is_refused_at_the_token_answer_s_cap() {
    let registry = HostileRegistry::start(Answer::TokenFlood { bytes: 200 << 20 });
    let (passed, text, rss) = validate(&registry, &any_digest());
    assert!(!passed, "{text}");
    assert!(
        text.contains("the token service") && text.contains("more than 65536 bytes"),
        "{text}"
    );
    assert!(rss < RSS_BOUND_MIB, "peak RSS {rss} MiB:\n{text}");
}

#[test]
fn a_trickled_manifest_fails_at_the_request_deadline_not_when_the_registry_finishes() {
    // 2 KB at 40 bytes a second: 50 s to the last byte; the deadline is 30 s.
    let registry = HostileRegistry::start(Answer::Trickle {
        body: vec![b' '; 2000],
        per_second: 40,
    });
    let started = std::time::Instant::now();
    let (passed, text, _) = validate(&registry, &any_digest());
    assert!(!passed, "{text}");
    assert!(text.contains("no whole answer within 30s"), "{text}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(48),
        "held until the registry finished: {:?}",
        started.elapsed()
    );
}

#[test]
fn an_image_index_and_a_config_over_its_cap_are_refused_by_name() {
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [],
    }))
    .expect("json");
    let registry = HostileRegistry::start(Answer::Serve {
        manifests: vec![(
            "application/vnd.oci.image.index.v1+json".into(),
            index.clone(),
        )],
        tags: Vec::new(),
        blobs: Vec::new(),
    });
    let (passed, text, _) = validate(&registry, &digest_of(&index));
    assert!(!passed, "{text}");
    assert!(
        text.contains("pins an image index (application/vnd.oci.image.index.v1+json)"),
        "{text}"
    );

    // A wasm config of 2 MiB: refused by name, never skipped with the import check it holds.
    let config = format!("{{\"pad\": \"{}\"}}", "x".repeat(2 << 20)).into_bytes();
    let module = std::fs::read(module_dir().join("generic_dev.wasm")).expect("the module");
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.wasm.config.v0+json",
                   "digest": digest_of(&config), "size": config.len()},
        "layers": [{"mediaType": "application/wasm", "digest": digest_of(&module),
                    "size": module.len()}],
    }))
    .expect("json");
    let registry = HostileRegistry::start(Answer::Serve {
        manifests: vec![(
            "application/vnd.oci.image.manifest.v1+json".into(),
            manifest.clone(),
        )],
        tags: Vec::new(),
        blobs: vec![config, module],
    });
    let (passed, text, _) = validate(&registry, &digest_of(&manifest));
    assert!(!passed, "{text}");
    assert!(
        text.contains("the artifact's config is 2097")
            && text.contains("a wasm config may be at most 1048576"),
        "{text}"
    );
    let requests = registry.requests.lock().expect("requests").clone();
    assert!(
        !requests.iter().any(|r| r.contains("/blobs/")),
        "nothing fetched past the manifest: {requests:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_pulling_from_a_hostile_registry_keeps_allocating_its_other_modules() {
    let registry = HostileRegistry::start(Answer::Huge { bytes: 500 << 20 });
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/net/tun", 10, 200);
    let modules = format!(
        "{}\n[[module]]\nname = \"local\"\npath = \"{}\"\n\
         [module.grants]\ndev = [\"/dev/fuse\"]\n[module.config]\n\
         groups = [{{ name = \"fuse\", paths = [\"/dev/fuse\"] }}]\n",
        module_line(&registry, &any_digest())
            .replace("/dev/fuse", "/dev/net/tun")
            .replace("name = \"fuse\"", "name = \"tun\""),
        module_dir().join("generic_dev.wasm").display()
    );
    let access = devicelet::oci::access::Access::load(vec![registry.addr.clone()], None, None)
        .expect("access");
    let agent = crate::oci_modules::agent_reaching(&node, &modules, access).await;
    let pending = crate::oci_modules::failed_try(&agent, "the hostile pull failed").await;
    let error = pending.last_error.unwrap_or_default();
    assert!(error.contains("more than 4194304 bytes"), "{error}");
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("the file module serves");
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocated while the other module's registry attacks");
    agent.shutdown().await;
}
