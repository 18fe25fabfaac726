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
