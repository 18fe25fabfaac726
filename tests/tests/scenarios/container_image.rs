//! The container image, as an operator builds it with `scripts/image.sh`: on a machine without a
//! container engine the script says so and what to install; with podman, the prebuilt image
//! holds the agent, the glibc it and the host's NVML link, and the reference modules, and the
//! agent starts from that tree alone. Nothing here runs a container: the image's files are read
//! from a created (never started) container's export.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use devicelet_tests::{devicelet_node_bin, module_dir, workspace_root};

const TAG: &str = "localhost/devicelet:test";
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The image's modules, by the name the registry uses, and cargo's name for each.
const MODULES: &[(&str, &str)] = &[
    ("generic-dev", "generic_dev.wasm"),
    ("amd-gpu", "amd_gpu.wasm"),
    ("nvidia-gpu", "nvidia_gpu.wasm"),
    ("vfio-pci", "vfio_pci.wasm"),
];
/// The glibc libraries NVIDIA's libnvidia-ml.so.1 links besides libc, which the agent dlopens.
const NVML_NEEDS: &[&str] = &["libdl.so.2", "libpthread.so.0", "librt.so.1", "libm.so.6"];

fn script(name: &str) -> PathBuf {
    workspace_root().join("scripts").join(name)
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8(run(cmd).stdout).expect("UTF-8 output")
}

/// `name` on this process's PATH.
fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

#[test]
fn image_script_says_clearly_when_no_engine_is_present() {
    // A PATH with bash and, as on this project's dev machines, a docker client whose daemon is
    // not there: `docker` is found but `docker info` fails. No podman, no buildah.
    let bin = tempfile::tempdir().unwrap();
    let bash = which("bash").expect("bash on PATH");
    std::os::unix::fs::symlink(bash, bin.path().join("bash")).unwrap();
    let docker = bin.path().join("docker");
    std::fs::write(
        &docker,
        "#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock.' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&docker, std::fs::Permissions::from_mode(0o755)).unwrap();

    let out = Command::new(script("image.sh"))
        .arg("--prebuilt")
        .env_clear()
        .env("PATH", bin.path())
        .output()
        .expect("running scripts/image.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);

    assert_eq!(out.status.code(), Some(2), "exit status 2:\n{stderr}");
    for line in [
        "no usable container engine found (tried podman, buildah, docker)",
        "podman:  not installed",
        "buildah: not installed",
        "docker:  ",
        "is installed, but `docker info` fails",
        "Cannot connect to the Docker daemon",
        "Install podman (Debian/Ubuntu: apt-get install podman",
    ] {
        assert!(stderr.contains(line), "{line:?} missing from:\n{stderr}");
    }
    assert!(
        out.stdout.is_empty(),
        "nothing built, nothing reported as built: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn prebuilt_image_holds_the_agent_its_libraries_and_the_modules() {
    // What the script builds, built as the other scenarios build it (a debug agent, release
    // modules): the script's own cargo builds then have nothing to do.
    let agent = devicelet_node_bin();
    let modules = module_dir();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");

    let podman = Command::new("podman").arg("--version").output();
    if !podman.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "container_image: podman is not installed: checked the tree scripts/image-rootfs.sh \
             assembles for the image, NOT an image built from it (install podman to check that)"
        );
        run(Command::new(script("image-rootfs.sh"))
            .arg(agent)
            .arg(modules)
            .arg(&root));
        check_tree(&root, agent, modules);
        return;
    }

    // Cargo as the tests' own, for the script's builds.
    let cargo = PathBuf::from(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    let mut path = cargo
        .parent()
        .map(Path::to_owned)
        .into_iter()
        .collect::<Vec<_>>();
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let built = stdout(
        devicelet_tests::without_test_env(&mut Command::new(script("image.sh")))
            .args([
                "--engine",
                "podman",
                "--prebuilt",
                "--profile",
                "debug",
                "--tag",
                TAG,
            ])
            .env("PATH", std::env::join_paths(path).unwrap()),
    );
    let summary = |key: &str| {
        built
            .lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key:?} line in the script's output:\n{built}"))
            .trim()
            .to_owned()
    };
    // The engine line names podman's flags (its storage driver), which reaching the image needs.
    let engine: Vec<String> = summary("engine:").split(' ').map(str::to_owned).collect();
    let podman = || {
        let mut cmd = Command::new(&engine[0]);
        cmd.args(&engine[1..]);
        cmd
    };
    let _image = Image { podman: podman() };
    assert_eq!(engine[0], "podman", "the engine asked for: {engine:?}");
    assert_eq!(summary("tag:"), TAG);
    assert_eq!(
        summary("entrypoint:"),
        r#"["/usr/bin/devicelet","run"] ["--config","/etc/devicelet/registry.toml"]"#
    );
    assert!(!summary("size:").is_empty());

    let config: serde_json::Value = serde_json::from_str(&stdout(podman().args([
        "image",
        "inspect",
        "--format",
        "{{json .Config}}",
        TAG,
    ])))
    .expect("the image's config as JSON");
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!(["/usr/bin/devicelet", "run"])
    );
    assert_eq!(
        config["Cmd"],
        serde_json::json!(["--config", "/etc/devicelet/registry.toml"])
    );
    assert_eq!(
        config["User"], "0:0",
        "root: it writes the kubelet's sockets"
    );
    let labels = &config["Labels"];
    assert_eq!(labels["org.opencontainers.image.version"], VERSION);
    assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
    assert!(
        labels["org.opencontainers.image.source"]
            .as_str()
            .is_some_and(|s| s.starts_with("https://")),
        "{labels}"
    );

    // The image's files: created, never started, and exported.
    let container = stdout(podman().args(["create", TAG])).trim().to_owned();
    let _container = Container {
        podman: podman(),
        id: container.clone(),
    };
    let tar = dir.path().join("image.tar");
    run(podman()
        .arg("export")
        .arg("--output")
        .arg(&tar)
        .arg(&container));
    std::fs::create_dir(&root).unwrap();
    run(Command::new("tar")
        .arg("--extract")
        .arg("--same-permissions")
        .arg("--file")
        .arg(&tar)
        .arg("--directory")
        .arg(&root));
    check_tree(&root, agent, modules);
}

/// Checks an image tree: the agent as built, its loader at the path it names, every library it
/// names and NVML's beside libc, the modules as built, an empty /tmp (1777) and /etc/devicelet,
/// nothing else; and, where this test may chroot, that the agent starts from that tree alone.
fn check_tree(root: &Path, agent: &Path, modules: &Path) {
    let at = |path: &str| root.join(path.trim_start_matches('/'));
    let files = files_in(root);
    let mut expected = BTreeSet::new();

    let image_agent = at("/usr/bin/devicelet");
    assert!(
        std::fs::read(&image_agent).ok() == std::fs::read(agent).ok(),
        "/usr/bin/devicelet is the built agent ({})",
        agent.display()
    );
    assert_eq!(
        std::fs::metadata(&image_agent)
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
    expected.insert(PathBuf::from("/usr/bin/devicelet"));

    let headers = stdout(
        Command::new("readelf")
            .args(["--program-headers", "--wide"])
            .arg(agent),
    );
    let interp = headers
        .lines()
        .find_map(|l| l.trim().strip_prefix("[Requesting program interpreter: "))
        .and_then(|l| l.strip_suffix(']'))
        .expect("the agent names its loader (PT_INTERP)");
    assert!(
        files.contains(Path::new(interp)),
        "the loader {interp} is a file in the image, at exactly that path: {files:#?}"
    );
    expected.insert(PathBuf::from(interp));

    let dynamic = stdout(
        Command::new("readelf")
            .args(["--dynamic", "--wide"])
            .arg(agent),
    );
    let needed: Vec<&str> = dynamic
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split_once('[')?.1.strip_suffix(']'))
        .collect();
    assert!(needed.contains(&"libc.so.6"), "a glibc binary: {needed:?}");
    let library = |name: &str| {
        files
            .iter()
            .find(|f| f.file_name().is_some_and(|n| n == name))
            .unwrap_or_else(|| panic!("{name} is not in the image: {files:#?}"))
            .clone()
    };
    // The loader may be NEEDED too (Rust's std links it): it is the file PT_INTERP names.
    for name in needed
        .iter()
        .filter(|n| !interp.ends_with(&format!("/{n}")))
    {
        let lib = library(name);
        assert!(
            lib.starts_with("/lib") || lib.starts_with("/usr/lib"),
            "{} where the loader looks",
            lib.display()
        );
        expected.insert(lib);
    }
    let libc_dir = library("libc.so.6").parent().unwrap().to_owned();
    for name in NVML_NEEDS {
        let lib = library(name);
        assert_eq!(
            lib.parent(),
            Some(&*libc_dir),
            "{name} beside libc, for NVML"
        );
        expected.insert(lib);
    }

    for (name, built) in MODULES {
        let path = format!("/opt/devicelet/modules/{name}.wasm");
        assert!(
            std::fs::read(at(&path)).ok() == std::fs::read(modules.join(built)).ok(),
            "{path} is the built {built}"
        );
        expected.insert(PathBuf::from(path));
    }

    // Each module compiled ahead of time, under the compile cache's rules (a private directory,
    // files only we can write), named for this wasmtime and CPU as the agent looks them up.
    let precompiled = at("/opt/devicelet/precompiled");
    let meta = std::fs::metadata(&precompiled).expect("/opt/devicelet/precompiled");
    assert_eq!(
        meta.permissions().mode() & 0o7777,
        0o700,
        "the precompiled directory's mode"
    );
    let engine = devicelet::sandbox::engine::new_engine().expect("an engine");
    let key = devicelet::sandbox::cache::engine_key(&engine);
    for (_, built) in MODULES {
        let wasm = std::fs::read(modules.join(built)).expect("the module");
        let name = format!("{}-{key}", devicelet::digest::sha256_hex(&wasm));
        for file in [format!("{name}.cwasm"), format!("{name}.crc32")] {
            let path = format!("/opt/devicelet/precompiled/{file}");
            let meta = std::fs::metadata(at(&path)).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!(meta.permissions().mode() & 0o7777, 0o600, "{path}'s mode");
            expected.insert(PathBuf::from(path));
        }
    }

    for (dir, mode) in [("/tmp", 0o1777), ("/etc/devicelet", 0o755)] {
        let meta = std::fs::metadata(at(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
        assert!(meta.is_dir(), "{dir} is a directory");
        assert_eq!(meta.permissions().mode() & 0o7777, mode, "{dir}'s mode");
        assert_eq!(
            std::fs::read_dir(at(dir)).unwrap().count(),
            0,
            "{dir} is empty"
        );
    }

    // Besides libraries beside libc (those its libraries link in turn), anything else is
    // something the image does not need, such as a shell.
    let extra: Vec<_> = files
        .iter()
        .filter(|f| !expected.contains(*f))
        .filter(|f| f.parent() != Some(&*libc_dir) || !f.to_string_lossy().contains(".so"))
        .collect();
    assert!(
        extra.is_empty(),
        "nothing but the agent, its libraries and modules: {extra:?}"
    );

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "container_image: not root: did not start the agent from {} (chroot needs root)",
            root.display()
        );
        return;
    }
    let chrooted = |args: &[&str]| {
        stdout(
            // The agent's environment is empty: nothing of this machine's leaks in.
            Command::new(which("chroot").expect("chroot on PATH"))
                .arg(root)
                .arg("/usr/bin/devicelet")
                .args(args)
                .env_clear(),
        )
    };
    assert_eq!(
        chrooted(&["--version"]).trim(),
        format!("devicelet {VERSION}")
    );
    assert!(chrooted(&["validate", "--help"]).contains("--config"));
    // The node agent alone: the simulator's commands are not in the image.
    let help = chrooted(&["--help"]);
    for tool in ["simulate", "demo", "try"] {
        assert!(
            !help.lines().any(|l| l.trim_start().starts_with(tool)),
            "{help}"
        );
    }
    assert!(help.contains("precompile"), "{help}");
}

/// Everything under `root` but directories, as absolute paths inside it.
fn files_in(root: &Path) -> BTreeSet<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_symlink() || !path.is_dir() {
                out.insert(Path::new("/").join(path.strip_prefix(root).unwrap()));
            } else {
                walk(root, &path, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

/// Removes the test's image when the test ends, passed or failed.
struct Image {
    podman: Command,
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = self.podman.args(["rmi", "--force", TAG]).output();
    }
}

/// Removes the created container when the test ends, passed or failed.
struct Container {
    podman: Command,
    id: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = self.podman.args(["rm", "--force", &self.id]).output();
    }
}
