//! The compile cache across agent restarts: the first start compiles and writes the cache, the
//! next one loads the module precompiled; a corrupt cache file is replaced, not trusted.

use std::path::{Path, PathBuf};

use devicelet::agent::Agent;
use devicelet::sandbox::cache::CacheStats;
use devicelet_tests::{Node, WAIT, generic_dev};

const FUSE: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;

async fn start_and_serve(node: &Node, cache: &Path, registrations: u32) -> Agent {
    let cache = cache.to_owned();
    let agent = node
        .start_agent_with(&generic_dev(FUSE), |o| o.cache_dir = Some(cache))
        .await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == registrations && r.streaming && r.allocatable == 2
        })
        .await
        .expect("fuse is served");
    agent
}

fn stats(hits: u64, misses: u64, replaced: u64) -> Option<CacheStats> {
    Some(CacheStats {
        hits,
        misses,
        replaced,
        // No other process shares these agents' caches.
        waited: 0,
    })
}

fn cwasm_files(cache: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(cache)
        .expect("the cache directory exists")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_start_loads_the_module_precompiled() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let cache = node.dir.path().join("cache");

    let first = start_and_serve(&node, &cache, 1).await;
    assert_eq!(
        first.cache_stats(),
        stats(0, 1, 0),
        "the first start compiles"
    );
    first.shutdown().await;
    assert_eq!(cwasm_files(&cache).len(), 1, "the module was cached");

    let second = start_and_serve(&node, &cache, 2).await;
    assert_eq!(
        second.cache_stats(),
        stats(1, 0, 0),
        "the second start compiled nothing"
    );
    second.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_cache_file_is_replaced_and_the_module_still_served() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let cache = node.dir.path().join("cache");

    let first = start_and_serve(&node, &cache, 1).await;
    first.shutdown().await;
    let [cwasm] = &cwasm_files(&cache)[..] else {
        panic!("one cached module expected");
    };
    let len = std::fs::metadata(cwasm).expect("cwasm metadata").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(cwasm)
        .and_then(|f| f.set_len(len / 2))
        .expect("truncating the cached module");

    let second = start_and_serve(&node, &cache, 2).await;
    assert_eq!(second.cache_stats(), stats(0, 0, 1), "compiled once more");
    second.shutdown().await;

    let third = start_and_serve(&node, &cache, 3).await;
    assert_eq!(
        third.cache_stats(),
        stats(1, 0, 0),
        "the rewritten entry is used"
    );
    third.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsafe_cache_dir_is_not_used_but_modules_are_served() {
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let cache = node.dir.path().join("cache");
    std::fs::create_dir(&cache).expect("creating the cache dir");
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777))
        .expect("making it world-writable");

    let agent = start_and_serve(&node, &cache, 1).await;
    assert_eq!(agent.cache_stats(), None, "the cache was refused");
    assert!(cwasm_files(&cache).is_empty(), "nothing written to it");
    agent.shutdown().await;
}

/// Modules compiled ahead of time (`devicelet precompile`, as the image carries them) serve a
/// new node's first start: nothing is compiled and nothing is copied; where they cannot be
/// trusted (a directory others can write, an entry changed since), the module compiles as
/// without them, and they are left as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_loads_precompiled_modules_and_compiles_only_what_it_cannot_trust() {
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let precompiled = node.dir.path().join("precompiled");
    let wasm = devicelet_tests::module_dir().join("generic_dev.wasm");
    let out = std::process::Command::new(devicelet_tests::devicelet_bin())
        .args(["precompile", "--out"])
        .arg(&precompiled)
        .arg(&wasm)
        .output()
        .expect("devicelet precompile");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains(": compiled: "), "{said}");
    let entry = cwasm_files(&precompiled);
    assert_eq!(entry.len(), 1, "one entry: {entry:?}");

    let start = |cache: PathBuf, registrations: u32| {
        let precompiled = precompiled.clone();
        let node = &node;
        async move {
            let agent = node
                .start_agent_with(&generic_dev(FUSE), |o| {
                    o.cache_dir = Some(cache);
                    o.precompiled_dir = Some(precompiled);
                })
                .await;
            assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
            node.kubelet
                .wait_until("devicelet.io/fuse", WAIT, |r| {
                    r.registrations == registrations && r.allocatable == 2
                })
                .await
                .expect("fuse is served");
            agent
        }
    };

    let cache = node.dir.path().join("cache-1");
    let first = start(cache.clone(), 1).await;
    assert_eq!(
        first.cache_stats(),
        stats(1, 0, 0),
        "precompiled: nothing compiled"
    );
    assert!(
        cwasm_files(&cache).is_empty(),
        "nothing copied into the node's cache"
    );
    first.shutdown().await;

    // Writable by others: not trusted at all.
    std::fs::set_permissions(&precompiled, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let cache = node.dir.path().join("cache-2");
    let second = start(cache.clone(), 2).await;
    assert_eq!(
        second.cache_stats(),
        stats(0, 1, 0),
        "compiled, as without them"
    );
    second.shutdown().await;
    std::fs::set_permissions(&precompiled, std::fs::Permissions::from_mode(0o700)).expect("chmod");

    // An entry changed since it was written: its checksum file no longer matches.
    let mut bytes = std::fs::read(&entry[0]).expect("the entry");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&entry[0], &bytes).expect("changing the entry");
    let cache = node.dir.path().join("cache-3");
    let third = start(cache.clone(), 3).await;
    assert_eq!(
        third.cache_stats(),
        stats(0, 1, 0),
        "compiled, as without it"
    );
    assert_eq!(
        cwasm_files(&cache).len(),
        1,
        "and cached in the node's own cache"
    );
    assert_eq!(
        std::fs::read(&entry[0]).ok(),
        Some(bytes),
        "the precompiled entry is left alone"
    );
    third.shutdown().await;
}

/// `devicelet validate` of `registry` with a compile cache and a precompiled directory.
fn validate_with(registry: &Path, cache: &Path, precompiled: &Path) -> std::process::Command {
    let mut command = std::process::Command::new(devicelet_tests::devicelet_bin());
    command
        .args(["validate", "--config"])
        .arg(registry)
        .arg("--cache-dir")
        .arg(cache)
        .arg("--precompiled-dir")
        .arg(precompiled);
    command
}

/// What a `devicelet validate` that must have succeeded printed.
fn succeeded(out: std::process::Output) -> String {
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    said
}

/// Two processes sharing a cache (here two `validate`s started together, as an operator's check
/// may run beside the agent's start) compile a module once: the second waits for the first's
/// compile and loads what it wrote. Whichever way they overlap, one compiles and one finds it
/// compiled, and no lock file is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_sharing_a_cache_compile_a_module_once() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let file = node.registry(&generic_dev(FUSE));
    let cache = node.dir.path().join("cache");
    let validate = || {
        validate_with(&file, &cache, &node.dir.path().join("precompiled"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("devicelet validate")
    };
    // Each one's output read while the other runs: neither blocks on a full pipe.
    let (first, second) = (validate(), validate());
    let waits = [first, second].map(|child| std::thread::spawn(move || child.wait_with_output()));
    let mut compiled = 0;
    let mut found = 0;
    for waiting in waits {
        let said = succeeded(
            waiting
                .join()
                .expect("waiting for devicelet validate")
                .expect("devicelet validate"),
        );
        let line = format!("compile cache {}: ", cache.display());
        let counts = said
            .lines()
            .find_map(|l| l.trim().strip_prefix(&line))
            .unwrap_or_else(|| panic!("no cache line: {said}"));
        let number = |after: &str| -> u32 {
            counts
                .split(", ")
                .find_map(|part| part.strip_suffix(after))
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {after:?} in {counts:?}"))
        };
        compiled += number(" module(s) compiled");
        found += number(" found compiled");
    }
    assert_eq!((compiled, found), (1, 1), "one compile between the two");
    assert_eq!(cwasm_files(&cache).len(), 1);
    let left: Vec<_> = std::fs::read_dir(&cache)
        .expect("the cache")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".lock"))
        .collect();
    assert!(left.is_empty(), "lock files left: {left:?}");
}

/// `validate --cache-dir` and `try --cache-dir` use the cache as `run` does: the first check
/// compiles and fills it, the next finds the module compiled (in the cache, or among the
/// precompiled modules as `run` would); a cache that cannot be trusted is said and left alone,
/// and the check still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_and_try_fill_a_cache_and_compile_nothing_the_second_time() {
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let file = node.registry(&generic_dev(FUSE));
    let cache = node.dir.path().join("cache");
    let validate = |cache: &Path| {
        // Not the machine's own precompiled directory: the first check has nothing to find.
        succeeded(
            validate_with(&file, cache, &node.dir.path().join("precompiled"))
                .output()
                .expect("devicelet validate"),
        )
    };
    let said = validate(&cache);
    let line = format!("compile cache {}: ", cache.display());
    assert!(
        said.contains(&format!("{line}1 module(s) compiled, 0 found compiled")),
        "{said}"
    );
    assert_eq!(cwasm_files(&cache).len(), 1, "the module was cached");
    let said = validate(&cache);
    assert!(
        said.contains(&format!("{line}0 module(s) compiled, 1 found compiled")),
        "{said}"
    );
    // A cache has the precompiled directory's layout: a new cache finds the module there, and
    // nothing is copied into it.
    std::fs::rename(&cache, node.dir.path().join("precompiled")).expect("moving the cache");
    let fresh = node.dir.path().join("fresh");
    let said = validate(&fresh);
    assert!(
        said.contains(&format!(
            "compile cache {}: 0 module(s) compiled, 1 found compiled",
            fresh.display()
        )),
        "{said}"
    );
    assert!(cwasm_files(&fresh).is_empty(), "nothing copied");

    let open = node.dir.path().join("open");
    std::fs::create_dir(&open).expect("creating a directory");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777))
        .expect("making it world-writable");
    let said = validate(&open);
    assert!(
        said.contains("compiling modules without a cache") && !said.contains(" module(s) compiled"),
        "{said}"
    );
    assert!(cwasm_files(&open).is_empty(), "nothing written to it");

    // `try` fills a cache of its own the same way, and the next `try` finds the module there.
    let tried = node.dir.path().join("tried");
    let amd = devicelet_tests::workspace_root().join("guests/amd-gpu/fixtures/2-gpus");
    let try_module = || {
        let out = std::process::Command::new(devicelet_tests::devicelet_bin())
            .arg("try")
            .arg("--cache-dir")
            .arg(&tried)
            .arg("--module")
            .arg(devicelet_tests::module_dir().join("amd_gpu.wasm"))
            .arg("--fixture")
            .arg(&amd)
            .args(["--once", "--log", "warn,devicelet::sandbox=debug"])
            .output()
            .expect("devicelet try");
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{said}");
        said.lines()
            .filter(|l| l.contains("compile cache") && l.contains("outcome="))
            .map(|l| l.split("outcome=").nth(1).unwrap_or_default().to_owned())
            .collect::<Vec<_>>()
    };
    let first = try_module();
    assert!(
        first.len() == 1 && first[0].starts_with("Miss"),
        "{first:?}"
    );
    assert_eq!(cwasm_files(&tried).len(), 1, "try cached the module");
    let second = try_module();
    assert!(
        second.len() == 1 && second[0].starts_with("Hit"),
        "{second:?}"
    );
}
