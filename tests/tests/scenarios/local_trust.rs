//! Another local user against what the agent trusts because of where it is: its state directory,
//! the compile cache (machine code), the ledger file and the status socket. The other user is
//! `tests/intruder.rs`, run as `nobody`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use devicelet::agent::status;
use devicelet::agent::{Agent, AgentOptions};
use devicelet::config::Registry;
use devicelet_tests::{Node, WAIT, eventually, generic_dev, module_dir};

/// The uid (and gid) the other local user runs as.
const NOBODY: u32 = 65534;

/// `tests/intruder.rs`, as [`NOBODY`].
fn intruder() -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_intruder"));
    cmd.uid(NOBODY).gid(NOBODY);
    cmd
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn fuse(name: &str) -> String {
    generic_dev(&format!(
        "groups = [{{ name = \"{name}\", paths = [\"/dev/fuse\"] }}]\n\n\
         [module.sharing]\nreplicas = 2"
    ))
}

/// A directory every user may write to, inside the node's scratch directory (opened up so that
/// the other user can reach it).
fn open_dir(node: &Node) -> PathBuf {
    chmod(node.dir.path(), 0o755);
    let open = node.dir.path().join("open");
    std::fs::create_dir(&open).expect("creating the open directory");
    chmod(&open, 0o777);
    open
}

async fn start(node: &Node, modules: &str, adjust: impl FnOnce(&mut AgentOptions)) -> Agent {
    node.start_agent_with(modules, adjust).await
}

/// The hostile module, compiled as the agent would, filed in a compile cache at `dir` under
/// generic-dev's digest: what would run if the agent ever loaded generic-dev from there.
fn plant_hostile(dir: &Path) {
    let compiler = devicelet::sandbox::cache::CompileCache::open(dir).expect("cache");
    let engine = devicelet::sandbox::engine::new_engine().expect("engine");
    let hostile = std::fs::read(module_dir().join("hostile.wasm")).expect("hostile.wasm");
    let generic = std::fs::read(module_dir().join("generic_dev.wasm")).expect("generic");
    compiler
        .load(&engine, &hostile, &devicelet::digest::sha256_hex(&generic))
        .expect("compiling the hostile module");
}

/// `intruder swap a b`, started from `cmd`: exchanges the two paths until [`stop_swapping`].
fn start_swapping(mut cmd: Command, a: &Path, b: &Path, stop: &Path) -> Child {
    cmd.arg("swap")
        .args([a, b, stop])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the swapper")
}

/// Stops the swapper; how many exchanges it made.
fn stop_swapping(swapper: Child, stop: &Path) -> u64 {
    std::fs::write(stop, "").expect("stop file");
    let report = swapper.wait_with_output().expect("the swapper's report");
    let text = String::from_utf8_lossy(&report.stdout);
    text.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {text:?}"))
}

/// `times` registry edits, each making the agent load generic-dev again (with a new resource name
/// it serves once loaded).
async fn reload(node: &Node, agent: &Agent, times: usize) {
    for i in 1..=times {
        let name = format!("fuse{i}");
        node.registry(&fuse(&name));
        let served = node
            .kubelet
            .wait_until(&format!("devicelet.io/{name}"), WAIT, |r| {
                r.allocatable == 2
            })
            .await;
        if let Err(e) = served {
            panic!(
                "the edited module, loaded again, does not serve: {e}; {:?} {:?}",
                agent.load_errors(),
                agent.reload_error()
            );
        }
    }
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    let names: Vec<String> = agent.resources().into_iter().map(|r| r.name).collect();
    assert_eq!(names, [format!("devicelet.io/fuse{times}")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_dir_others_may_write_to_is_refused_naming_the_fix() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let state = open_dir(&node);
    let registry = Registry::load(&node.registry(&fuse("fuse"))).expect("a valid registry");
    let mut options = AgentOptions::new(registry, node.plugin_dir());
    options.state_dir = Some(state.clone());
    let error = match Agent::start(options).await {
        Ok(_) => panic!("an agent started on a state directory anyone may write to"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        error.contains(&state.display().to_string())
            && error.contains("mode 0777")
            && error.contains(&format!("chmod 0755 {}", state.display())),
        "{error}"
    );

    // One only readable by others is ours alone to write: it is narrowed and used.
    chmod(&state, 0o755);
    let agent = start(&node, &fuse("fuse"), |o| o.state_dir = Some(state.clone())).await;
    let mode = std::fs::metadata(&state)
        .expect("state dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    agent.shutdown().await;
}

/// The original attack: with the cache in a directory another user may write to, that user
/// swaps the cache directory with one of their own in a loop while registry edits make the agent
/// load the module again and again. Their directory holds another module's code, precompiled
/// under this module's cache key with a matching digest. It must never run: the cache is not
/// used at all, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_another_user_can_swap_is_never_loaded_from() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let open = open_dir(&node);
    let cache = open.join("cache");

    // The other user's directory: the hostile module, compiled as the agent would, filed under
    // generic-dev's digest.
    let planted = open.join("planted");
    let staging = node.dir.path().join("staging");
    plant_hostile(&staging);
    std::fs::create_dir(&planted).expect("planted dir");
    for entry in std::fs::read_dir(&staging).expect("staging") {
        let from = entry.expect("entry").path();
        let to = planted.join(from.file_name().expect("a name"));
        std::fs::copy(&from, &to).expect("planting");
        chmod(&to, 0o600);
        std::os::unix::fs::chown(&to, Some(NOBODY), Some(NOBODY)).expect("chown");
    }
    std::os::unix::fs::chown(&planted, Some(NOBODY), Some(NOBODY)).expect("chown");

    let cache_dir = cache.clone();
    let agent = start(&node, &fuse("fuse0"), |o| o.cache_dir = Some(cache_dir)).await;
    let refused = agent
        .status()
        .cache
        .and_then(|c| c.refused)
        .expect("the cache is refused");
    assert!(
        refused.contains(&open.display().to_string()) && refused.contains("mode 0777"),
        "{refused}"
    );
    node.kubelet
        .wait_until("devicelet.io/fuse0", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served, compiled in memory");

    // The cache directory exists (the agent made it): from now on the two are exchanged.
    assert!(cache.is_dir());
    let stop = node.dir.path().join("stop-swapping");
    let swapper = start_swapping(intruder(), &cache, &planted, &stop);
    // Three loads: with the cache refused, each compiles in memory, and any use of the cache on
    // any of them would show in the stats below whichever way the paths stood at the time.
    reload(&node, &agent, 3).await;
    let swaps = stop_swapping(swapper, &stop);
    assert!(swaps >= 2000, "only {swaps} exchanges were made");
    assert_eq!(
        agent.cache_stats(),
        None,
        "nothing was loaded from or written to the cache"
    );
    agent.shutdown().await;
}

/// The cache in use, and its path exchanged thousands of times with a directory holding another
/// module's code filed under this module's key, owned by root like the real entries and with a
/// matching digest, while registry edits make the agent load the module again and again (only
/// root could do this to a trusted cache; it stands for any way the path might change under the
/// agent). Every load comes from the directory the agent opened: the other code never runs, and
/// nothing is written into the other directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_whose_path_is_swapped_while_in_use_loads_only_from_what_it_opened() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    // Not beside the registry: the agent watches that directory, and a storm of renames there
    // would only delay the edits.
    let cache = node.dir.path().join("c/cache");
    let planted = node.dir.path().join("c/planted");
    plant_hostile(&planted);
    let listing = |dir: &Path| -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .expect("a directory")
            .map(|e| {
                let e = e.expect("an entry");
                let bytes = std::fs::read(e.path()).expect("a file");
                (e.file_name().to_string_lossy().into_owned(), bytes)
            })
            .collect();
        files.sort();
        files
    };
    let before = listing(&planted);

    let cache_dir = cache.clone();
    let agent = start(&node, &fuse("fuse0"), |o| o.cache_dir = Some(cache_dir)).await;
    node.kubelet
        .wait_until("devicelet.io/fuse0", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");
    // As root: only root could do this to a cache the agent trusts.
    let stop = node.dir.path().join("stop-swapping");
    let swapper = start_swapping(
        Command::new(env!("CARGO_BIN_EXE_intruder")),
        &cache,
        &planted,
        &stop,
    );
    reload(&node, &agent, 10).await;
    let swaps = stop_swapping(swapper, &stop);
    assert!(swaps >= 2000, "only {swaps} exchanges were made");
    let stats = agent.cache_stats().expect("the cache is used");
    assert!(stats.hits >= 10, "{stats:?}");
    // Whichever path it ends at, the planted directory is as it was.
    let (now_planted, now_cache) = (listing(&planted), listing(&cache));
    assert!(
        now_planted == before || now_cache == before,
        "the other directory was written to"
    );
    agent.shutdown().await;
}

/// A FIFO at the ledger's path would block a plain open until someone writes to it: it is set
/// aside like a corrupt file and the agent starts at once with an empty ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_in_place_of_the_ledger_is_set_aside_at_start() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let state = node.state_dir();
    std::fs::create_dir(&state).expect("state dir");
    chmod(&state, 0o700);
    let ledger = state.join(devicelet::ledger::FILE_NAME);
    let c = std::ffi::CString::new(ledger.to_str().expect("utf-8")).expect("no NUL");
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let agent = tokio::time::timeout(WAIT, start(&node, &fuse("fuse"), node.with_ledger()))
        .await
        .expect("the agent starts without waiting on the FIFO");
    assert_eq!(agent.status().ledger.entries, 0);
    let aside: Vec<String> = std::fs::read_dir(&state)
        .expect("state dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ledger.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocates");
    eventually("the new ledger is written", || ledger.is_file()).await;
    agent.shutdown().await;
}

/// A ledger another user wrote, or one anybody may write, could hand a device out twice (or
/// keep one from every pod): the agent refuses to start on it, naming the file and the fix,
/// and writes nothing over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_planted_by_another_user_or_left_writable_is_refused_at_start() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let state = node.state_dir();
    std::fs::create_dir(&state).expect("state dir");
    chmod(&state, 0o700);
    let ledger = state.join(devicelet::ledger::FILE_NAME);
    // A claim holding fuse, as a hostile writer would forge it.
    let forged = r#"{"version":1,"next_id":1,"entries":[],"claims":{"u":{"driver":"fuse.devicelet.io","resource":"devicelet.io/fuse","namespace":"x","name":"forged","requests":[{"request":"fuse","devices":[["fuse","fuse"]],"config":"","cdi_ids":[]}],"spec_file":null}}}"#;
    let refused = |adjust: fn(&Path)| {
        std::fs::write(&ledger, forged).expect("ledger");
        adjust(&ledger);
        let registry =
            devicelet::config::Registry::load(&node.registry(&fuse("fuse"))).expect("registry");
        let mut options = node.agent_options(registry);
        node.with_ledger()(&mut options);
        options
    };
    for (adjust, says) in [
        ((|p: &Path| chmod(p, 0o666)) as fn(&Path), "mode 0666"),
        (
            |p: &Path| std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY)).expect("chown"),
            "owned by uid 65534",
        ),
    ] {
        let options = refused(adjust);
        let error = match devicelet::agent::Agent::start(options).await {
            Ok(agent) => {
                agent.shutdown().await;
                panic!("the agent started on a ledger it cannot trust ({says})");
            }
            Err(e) => format!("{e:#}"),
        };
        assert!(
            error.contains(&ledger.display().to_string()) && error.contains(says),
            "{error}"
        );
        assert!(
            error.contains("chmod 0600") || error.contains("rm "),
            "{error}"
        );
        assert_eq!(
            std::fs::read_to_string(&ledger).expect("still there"),
            forged,
            "left as it was"
        );
        std::fs::remove_file(&ledger).expect("rm");
    }
}

/// The other user listening on a `status.sock` where `devicelet status` would look.
struct Forger {
    child: Child,
}

impl Drop for Forger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A forged status document: a node with nothing on it.
fn forged(dir: &Path) -> PathBuf {
    let reply = dir.join("forged.json");
    std::fs::write(
        &reply,
        r#"{"modules":[],"resources":[],"load_errors":[],"reload_error":null}"#,
    )
    .expect("forged reply");
    chmod(&reply, 0o644);
    reply
}

/// Binds `socket` (as root: the file is root's) and has the other user listen on it, so that the
/// credentials the socket reports are theirs.
fn forge_listener(socket: &Path, reply: &Path) -> Forger {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: plain socket calls on a socket this function owns.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` is a new socket no one else holds.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let bytes = socket.as_os_str().as_encoded_bytes();
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (to, from) in addr.sun_path.iter_mut().zip(bytes) {
        *to = *from as libc::c_char;
    }
    use std::os::fd::AsRawFd;
    // SAFETY: `addr` is a valid sockaddr_un of the given size.
    let bound = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const addr).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    assert_eq!(bound, 0, "bind: {}", std::io::Error::last_os_error());
    let child = intruder()
        .arg("listen")
        .arg(reply)
        .stdin(Stdio::from(fd))
        .spawn()
        .expect("starting the other user");
    Forger { child }
}

async fn wait_for_listener(socket: &Path) {
    eventually("the forged socket to listen", || {
        std::os::unix::net::UnixStream::connect(socket).is_ok()
    })
    .await;
}

/// The state directory is root's and private, and so is the socket file; but the process
/// listening on it runs as another user. `devicelet status` asks the socket who that is
/// (`SO_PEERCRED`) and does not believe it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_does_not_believe_a_socket_another_user_listens_on() {
    let node = Node::new().await;
    let state = node.state_dir();
    std::fs::create_dir(&state).expect("state dir");
    chmod(&state, 0o755);
    let socket = state.join(status::STATUS_SOCKET);
    chmod(node.dir.path(), 0o755);
    let _forger = forge_listener(&socket, &forged(node.dir.path()));
    wait_for_listener(&socket).await;
    let error = status::read(&state)
        .await
        .expect_err("a forged answer was believed");
    let error = format!("{error:#}");
    assert!(error.contains(&format!("runs as uid {NOBODY}")), "{error}");
}

/// In a state directory anyone may write to, another user replaced `status.sock` with their
/// own: `devicelet status` refuses the directory before it asks anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_refuses_a_state_dir_others_may_write_to() {
    let node = Node::new().await;
    let open = open_dir(&node);
    let socket = open.join(status::STATUS_SOCKET);
    let _forger = forge_listener(&socket, &forged(node.dir.path()));
    wait_for_listener(&socket).await;
    let error = format!(
        "{:#}",
        status::read(&open)
            .await
            .expect_err("a forged answer was believed")
    );
    assert!(
        error.contains("mode 0777") && error.contains(&open.display().to_string()),
        "{error}"
    );

    // The command itself says so and fails.
    let out = Command::new(devicelet_tests::devicelet_bin())
        .args(["status", "--state-dir"])
        .arg(&open)
        .output()
        .expect("running devicelet status");
    assert!(!out.status.success());
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("mode 0777"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The agent's own status socket answers root and the agent's user only: another user who could
/// connect (here, after its mode was widened) gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_socket_answers_no_other_user() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = start(&node, &fuse("fuse"), node.with_ledger()).await;
    let state = node.state_dir();
    let socket = state.join(status::STATUS_SOCKET);
    assert!(status::read(&state).await.is_ok(), "root is answered");
    chmod(node.dir.path(), 0o755);
    chmod(&state, 0o755);
    chmod(&socket, 0o666);
    let out = intruder()
        .arg("read")
        .arg(&socket)
        .output()
        .expect("running the other user");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
    agent.shutdown().await;
}
