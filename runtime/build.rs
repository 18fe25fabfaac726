//! Reads the published WIT versions from `wit/v<version>/plugin.wit`, so the host's version
//! constants (the export name, the range it speaks) come from the frozen files themselves rather
//! than being kept in sync by hand. A folder whose package line disagrees with its name fails the
//! build: a published folder is never edited, a new version gets a new folder.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    pack_relative_relocations();
    startup_order();
    let wit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../wit");
    println!("cargo:rerun-if-changed={}", wit.display());
    let mut versions: Vec<((u64, u64, u64), String)> = Vec::new();
    let entries = std::fs::read_dir(&wit).unwrap_or_else(|e| panic!("{}: {e}", wit.display()));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("{}: {e}", wit.display()));
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(version) = name.strip_prefix('v') else {
            continue;
        };
        let file = entry.path().join("plugin.wit");
        println!("cargo:rerun-if-changed={}", file.display());
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let package = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("package devicelet:plugin@"))
            .and_then(|rest| rest.strip_suffix(';'))
            .unwrap_or_else(|| {
                panic!(
                    "{}: no `package devicelet:plugin@<version>;` line",
                    file.display()
                )
            });
        assert_eq!(
            package,
            version,
            "{} declares devicelet:plugin@{package} but lives in v{version}/: a published version is frozen; add wit/v<new>/ instead",
            file.display()
        );
        let parts: Vec<u64> = version
            .split('.')
            .map(|p| {
                p.parse()
                    .unwrap_or_else(|_| panic!("wit/{name}: not a version"))
            })
            .collect();
        let [major, minor, patch] = parts[..] else {
            panic!("wit/{name}: not major.minor.patch");
        };
        versions.push(((major, minor, patch), version.to_owned()));
    }
    versions.sort();
    let latest = &versions.last().expect("wit/ holds no v<version>/ folder").1;
    let mut out = String::new();
    let list: Vec<String> = versions.iter().map(|(_, v)| format!("{v:?}")).collect();
    writeln!(
        out,
        "pub const PUBLISHED: &[&str] = &[{}];",
        list.join(", ")
    )
    .ok();
    writeln!(out, "pub const LATEST: &str = {latest:?};").ok();
    writeln!(
        out,
        "pub const PLUGIN: &str = \"devicelet:plugin/plugin@{latest}\";"
    )
    .ok();
    let dest =
        Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("wit_versions.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("{}: {e}", dest.display()));
}

/// Release builds lay out the functions a start runs (`startup-order.txt`, written by
/// `scripts/startup-order.sh` from callgrind runs of the agent's start-up benchmark) side by side
/// at the front of the code, with LLD's `--symbol-ordering-file`. Scattered, they are a few
/// hundred page faults, each of which the kernel answers by mapping up to 16 neighbouring pages
/// of the binary: most of what was resident at Register. The list holds names, which cargo
/// derives from the profile, the features and the dependencies' versions: a name the build lacks
/// is skipped without a warning, so a stale list costs locality, never a build. Only where the
/// toolchain links with its own LLD (rustup's, on x86_64 Linux since Rust 1.90) and no other
/// linker is configured.
///
/// Release binaries are stripped here too, by the link, unless `DEVICELET_KEEP_SYMBOLS` is set:
/// the profile keeps `strip = "none"` so that a build with symbols has the shipped build's names.
fn startup_order() {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    println!("cargo:rerun-if-env-changed=DEVICELET_KEEP_SYMBOLS");
    if var("PROFILE") != "release" {
        return;
    }
    if std::env::var_os("DEVICELET_KEEP_SYMBOLS").is_none() {
        println!("cargo:rustc-link-arg-bins=-Wl,--strip-all");
    }
    let list = Path::new(env!("CARGO_MANIFEST_DIR")).join("startup-order.txt");
    println!("cargo:rerun-if-changed={}", list.display());
    let target = var("TARGET");
    // rustup's toolchains carry LLD (`gcc-ld/ld.lld`) and link x86_64 Linux with it; a
    // distribution's rustc may link with the system's `ld`, which knows no ordering file.
    let own_lld = std::process::Command::new(var("RUSTC"))
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .is_some_and(|sysroot| {
            Path::new(sysroot.trim())
                .join("lib/rustlib")
                .join(&target)
                .join("bin/gcc-ld/ld.lld")
                .exists()
        });
    // `-C linker=…`, `-C linker-flavor=…`, `-C link-self-contained=-linker` and the like.
    let other_linker =
        !var("RUSTC_LINKER").is_empty() || var("CARGO_ENCODED_RUSTFLAGS").contains("link");
    // `-Wl,` splits its argument at commas.
    let passable = !list.to_string_lossy().contains(',');
    if target == "x86_64-unknown-linux-gnu"
        && own_lld
        && !other_linker
        && passable
        && list.is_file()
    {
        println!(
            "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
            list.display()
        );
        println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    }
}

/// The agent is a position-independent executable: every pointer in its read-only data (vtables,
/// string tables) is a relative relocation the dynamic loader applies at start. As RELA entries
/// they take 1.5 MB of the binary, all read (so resident) at every start; packed as DT_RELR they
/// take a few kilobytes. The binary then needs glibc 2.36 or later at run time (the linker adds
/// the `GLIBC_ABI_DT_RELR` version), so they are packed only when the build machine's own glibc
/// has it: a native build runs where it was built (the tests spawn it), and the image carries the
/// glibc of its builder (Debian bookworm, 2.36).
fn pack_relative_relocations() {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let native = var("HOST") == var("TARGET");
    if native && var("CARGO_CFG_TARGET_ENV") == "gnu" && host_glibc_at_least(2, 36) {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// Whether the glibc this build script runs on is at least `major.minor`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn host_glibc_at_least(major: u32, minor: u32) -> bool {
    unsafe extern "C" {
        fn gnu_get_libc_version() -> *const std::ffi::c_char;
    }
    // SAFETY: glibc returns a static NUL-terminated string such as "2.36".
    let version = unsafe { std::ffi::CStr::from_ptr(gnu_get_libc_version()) };
    let mut parts = version
        .to_str()
        .unwrap_or_default()
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    found >= (major, minor)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn host_glibc_at_least(_major: u32, _minor: u32) -> bool {
    false
}
