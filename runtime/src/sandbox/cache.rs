//! The compile cache: components precompiled by this host, so a restart deserializes them (a
//! memory map, milliseconds) instead of compiling them again (hundreds of milliseconds each).
//!
//! An entry is `<module sha256>-<engine key>.cwasm`, where the engine key is 16 hex digits of a
//! sha256 over [`Engine::precompile_compatibility_hash`]: a module is cached once per engine
//! configuration and wasmtime version, and the key is the same in every process.
//!
//! Deserializing a file runs the machine code in it, so we only ever load files this host wrote:
//! - the directory and every directory above it can be changed by nobody but root and us
//!   ([`crate::trust`]); it is created 0700 and must be ours. It is opened once, and every entry
//!   is reached through that open directory, so no rename of a path above it can redirect us;
//! - every file we load is a regular file owned by us, not group- or world-writable (a symlink is
//!   refused), and what is deserialized is that very open file (through `/proc/self/fd`), never
//!   the path opened again;
//! - next to each `.cwasm` lies `<name>.crc32`, the CRC-32 and length of the `.cwasm` we wrote.
//!   The sidecar is put in place before the `.cwasm` (both written to a temporary file, synced
//!   and renamed), and a `.cwasm` whose contents do not match its sidecar (truncated, garbage,
//!   missing sidecar) is never deserialized. The sidecar catches damage, not an attacker: whoever
//!   could rewrite a `.cwasm` could rewrite its sidecar too, which the directory's trust rules
//!   above rule out. So a checksum that costs a few hundredths of a millisecond at every start
//!   does the job (a sha256 of a 650 KB module took 0.4 ms of a 9 ms start).
//!
//! A directory that fails those checks is not used at all: [`CompileCache::open`] says why, and
//! the agent compiles in memory, saying so in its log, `status` and metrics.
//!
//! Anything wrong with an entry (including a file wasmtime refuses to deserialize, e.g. after an
//! upgrade) is logged, the entry deleted, the module compiled again and the entry rewritten.
//! Failing to write the cache is logged and otherwise ignored: the cache only saves time.
//!
//! Processes sharing a cache compile a module once when they can: a miss takes the entry's lock
//! file before compiling, and a process that finds it held waits (boundedly) and then loads the
//! entry ([`super::entry_lock`]).

use std::hash::{Hash, Hasher};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cap_std::fs::{Dir, MetadataExt as _, OpenOptions, OpenOptionsExt};
use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::entry_lock;
use crate::digest::hex;
use crate::trust::{self, euid};

/// Largest precompiled component read back; a real one is a few MiB.
const MAX_CWASM: u64 = 256 << 20;

/// Why a compile-cache directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("compile cache {path}: {reason}, so refusing to load precompiled code from it ({fix})")]
    Untrusted {
        path: PathBuf,
        reason: trust::Untrusted,
        fix: String,
    },
    #[error("compile cache {path}: cannot open it: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How a [`CompileCache::load`] got its component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Deserialized from the cache; nothing was compiled.
    Hit,
    /// Not cached: compiled (and written to the cache, if that worked).
    Miss,
    /// The cached entry was unusable: deleted, compiled again and rewritten.
    Replaced { reason: String },
}

/// What the cache did since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub replaced: u64,
    /// Loads that found another process compiling their module and waited for it.
    pub waited: u64,
}

/// A directory of precompiled components. Share it (behind an `Arc`) between loads.
#[derive(Debug)]
pub struct CompileCache {
    path: PathBuf,
    /// The directory as opened and checked: every entry is reached through it.
    dir: Dir,
    /// One lock per digest being loaded: modules start in parallel, and two registry entries of
    /// the same file must compile it once, the second finding it cached.
    loading:
        std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<std::sync::Mutex<()>>>>,
    hits: AtomicU64,
    misses: AtomicU64,
    replaced: AtomicU64,
    /// Loads that found another process compiling their entry and waited for it.
    waits: AtomicU64,
    /// How long such a load waits before compiling the module itself.
    wait_limit: std::time::Duration,
    /// Components compiled ahead of time (an image's, by `devicelet precompile`), looked in
    /// when this cache has no entry: a new node's first start deserializes them instead of
    /// compiling. Read only: nothing is ever written or deleted there.
    precompiled: Option<Box<CompileCache>>,
}

fn untrusted(path: &Path, reason: trust::Untrusted) -> CacheError {
    CacheError::Untrusted {
        path: path.to_owned(),
        fix: reason.fix(),
        reason,
    }
}

impl CompileCache {
    /// Opens the cache at `path`, creating it (and its parents) 0700 if it is missing. It must be
    /// ours, and neither it nor any directory above it may be writable by others than root and
    /// us ([`trust::private_dir`]), or it is refused: whoever can write there could make us run
    /// their code.
    pub fn open(path: &Path) -> Result<CompileCache, CacheError> {
        trust::private_dir(path).map_err(|reason| untrusted(path, reason))?;
        Self::open_checked(path, 0o077)
    }

    /// Opens a directory of components compiled ahead of time (`devicelet precompile`), under
    /// the same trust rules as the cache: it holds machine code we will run. Only read: it is
    /// neither created nor narrowed (an image's may be on a read-only root), so it may be
    /// readable by others, never writable. `Ok(None)` when there is no such directory.
    pub fn open_precompiled(path: &Path) -> Result<Option<CompileCache>, CacheError> {
        if let Err(e) = std::fs::symlink_metadata(path)
            && e.kind() == std::io::ErrorKind::NotFound
        {
            return Ok(None);
        }
        trust::check_dir(path).map_err(|reason| untrusted(path, reason))?;
        Self::open_checked(path, 0o022).map(Some)
    }

    /// Opens `path`, already checked from above, and checks the directory itself through the
    /// handle every access goes through: ours, and no `forbidden` mode bits.
    fn open_checked(path: &Path, forbidden: u32) -> Result<CompileCache, CacheError> {
        let opened = |source| CacheError::Open {
            path: path.to_owned(),
            source,
        };
        let dir = Dir::open_ambient_dir(path, cap_std::ambient_authority()).map_err(opened)?;
        // What was opened is what was checked: nothing above it can be swapped by others.
        let meta = dir.dir_metadata().map_err(opened)?;
        let uid = euid();
        if meta.uid() != uid {
            return Err(untrusted(
                path,
                trust::Untrusted::Owner {
                    path: path.to_owned(),
                    owner: meta.uid(),
                    uid,
                },
            ));
        }
        if meta.mode() & forbidden != 0 {
            return Err(untrusted(
                path,
                trust::Untrusted::Writable {
                    path: path.to_owned(),
                    mode: meta.mode() & 0o7777,
                },
            ));
        }
        Ok(CompileCache {
            path: path.to_owned(),
            dir,
            loading: Default::default(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            replaced: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            wait_limit: entry_lock::WAIT_LIMIT,
            precompiled: None,
        })
    }

    /// Looks in `precompiled` for what this cache does not hold. Its entries count as hits: a
    /// module found there is not compiled.
    pub fn with_precompiled(mut self, precompiled: CompileCache) -> CompileCache {
        self.precompiled = Some(Box::new(precompiled));
        self
    }

    /// The cache at `dir`, looking in `precompiled` on a miss: `run` and `validate` open them
    /// alike, so that a check finds what the agent would. Neither is needed to load a module,
    /// so what cannot be used is said through `warn` and left out; `Err` (why) means modules
    /// are compiled in memory.
    pub fn open_with_precompiled(
        dir: &Path,
        precompiled: Option<&Path>,
        warn: &dyn Fn(&str),
    ) -> Result<CompileCache, String> {
        let precompiled = precompiled.and_then(|path| {
            CompileCache::open_precompiled(path).unwrap_or_else(|e| {
                warn(&format!("{e}; not using the modules precompiled there"));
                None
            })
        });
        let cache = CompileCache::open(dir).map_err(|e| {
            warn(&format!("{e}; compiling modules without a cache"));
            e.to_string()
        })?;
        Ok(match precompiled {
            Some(precompiled) => cache.with_precompiled(precompiled),
            None => cache,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.path
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            replaced: self.replaced.load(Ordering::Relaxed),
            waited: self.waits.load(Ordering::Relaxed),
        }
    }

    /// The component for `wasm`, from the cache or compiled (and then cached). `digest` is the
    /// sha256 of `wasm`, lowercase hex, as the loader computed it when checking the registry's
    /// digest. Only a failure to compile `wasm` is an error; nothing about the cache is.
    ///
    /// CPU-bound on a miss: call it from a blocking thread.
    pub fn load(
        &self,
        engine: &Engine,
        wasm: &[u8],
        digest: &str,
    ) -> Result<(Component, CacheOutcome), wasmtime::Error> {
        if digest.len() != 64
            || !digest
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            tracing::warn!(
                module = digest,
                "compile cache: not a sha256 digest; compiling without the cache"
            );
            self.misses.fetch_add(1, Ordering::Relaxed);
            return Ok((compile(engine, wasm, digest)?, CacheOutcome::Miss));
        }
        let lock = {
            let mut loading = self.loading.lock().unwrap_or_else(|p| p.into_inner());
            loading.entry(digest.to_owned()).or_default().clone()
        };
        let _one_at_a_time = lock.lock().unwrap_or_else(|p| p.into_inner());
        let name = format!("{digest}-{}", engine_key(engine));
        let cwasm = format!("{name}.cwasm");
        let sidecar = format!("{name}.{SIDECAR}");
        // A first look without the lock: a warm start takes no lock file. A damaged entry is
        // dealt with under the lock, below.
        match self.try_load(engine, &cwasm, &sidecar) {
            Ok(Some(component)) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok((component, CacheOutcome::Hit));
            }
            Ok(None) => {
                if let Some(component) = self.precompiled_entry(engine, &cwasm, &sidecar) {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok((component, CacheOutcome::Hit));
                }
            }
            Err(_) => {}
        }
        // Another process (a `validate`, an agent starting beside this one) may be compiling
        // it: wait for it, then look again.
        let waiting = || {
            self.waits.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                module = digest,
                "compile cache: another process is compiling this module; waiting for it"
            );
        };
        let _compiling =
            entry_lock::lock(&self.dir, format!("{name}.lock"), self.wait_limit, &waiting)
                .inspect_err(|why| {
                    tracing::warn!(
                        module = digest,
                        "compile cache: compiling it unlocked: {why}"
                    );
                })
                .ok();
        let outcome = match self.try_load(engine, &cwasm, &sidecar) {
            Ok(Some(component)) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok((component, CacheOutcome::Hit));
            }
            Ok(None) => {
                // A sidecar without its .cwasm: a write interrupted between the two renames.
                self.remove_if_present(&sidecar);
                CacheOutcome::Miss
            }
            Err(reason) => {
                tracing::warn!(
                    file = %self.path.join(&cwasm).display(),
                    module = digest,
                    "compile cache: discarding the cached component ({reason}); compiling it again"
                );
                self.remove_if_present(&cwasm);
                self.remove_if_present(&sidecar);
                CacheOutcome::Replaced { reason }
            }
        };
        let component = match super::compiler::child() {
            Some(exe) => self.compile_in_child(exe, engine, wasm, digest, (&cwasm, &sidecar))?,
            None => self.compile_here(engine, wasm, digest, (&cwasm, &sidecar))?,
        };
        match outcome {
            CacheOutcome::Miss => self.misses.fetch_add(1, Ordering::Relaxed),
            _ => self.replaced.fetch_add(1, Ordering::Relaxed),
        };
        Ok((component, outcome))
    }

    /// The entry from the precompiled directory, if it has a usable one for this engine (one
    /// compiled for another CPU or wasmtime has another name, and is simply not found). A bad
    /// one is logged and left alone: the directory is read only.
    fn precompiled_entry(&self, engine: &Engine, cwasm: &str, sidecar: &str) -> Option<Component> {
        let precompiled = self.precompiled.as_deref()?;
        match precompiled.try_load(engine, cwasm, sidecar) {
            Ok(Some(component)) => {
                tracing::debug!(
                    file = %precompiled.path.join(cwasm).display(),
                    "compile cache: loaded the precompiled component"
                );
                Some(component)
            }
            Ok(None) => None,
            Err(reason) => {
                tracing::warn!(
                    file = %precompiled.path.join(cwasm).display(),
                    "precompiled component not used ({reason}); compiling the module"
                );
                None
            }
        }
    }

    /// Compiles in this process and caches the result.
    fn compile_here(
        &self,
        engine: &Engine,
        wasm: &[u8],
        digest: &str,
        (cwasm, sidecar): (&str, &str),
    ) -> wasmtime::Result<Component> {
        let component = compile(engine, wasm, digest)?;
        let stored = component
            .serialize()
            .map_err(|e| anyhow::anyhow!("serializing: {e:#}"))
            .and_then(|bytes| self.store(&bytes, cwasm, sidecar));
        if let Err(e) = stored {
            tracing::warn!(
                file = %self.path.join(cwasm).display(),
                module = digest,
                "compile cache: cannot write the compiled component (not fatal): {e:#}"
            );
        }
        Ok(component)
    }

    /// Compiles in a child process, caches the result and maps it from the cache, as a warm
    /// start does; compiles here instead when the child cannot run or its result cannot be used,
    /// but never after the child refused or died on the module.
    fn compile_in_child(
        &self,
        exe: &Path,
        engine: &Engine,
        wasm: &[u8],
        digest: &str,
        (cwasm, sidecar): (&str, &str),
    ) -> wasmtime::Result<Component> {
        use super::compiler::ChildCompile;
        let started = Instant::now();
        let why = match super::compiler::compile_in_child(exe, wasm) {
            ChildCompile::Refused(message) => return Err(wasmtime::Error::msg(message)),
            ChildCompile::NotRun(why) => why,
            ChildCompile::Compiled(bytes) => {
                let loaded = match self.store(&bytes, cwasm, sidecar) {
                    Ok(()) => self
                        .try_load(engine, cwasm, sidecar)
                        .and_then(|c| c.ok_or_else(|| "the written entry is gone".to_owned())),
                    // The cache cannot take it (disk full): use the bytes in hand.
                    Err(e) => {
                        tracing::warn!(
                            file = %self.path.join(cwasm).display(),
                            module = digest,
                            "compile cache: cannot write the compiled component (not fatal): {e:#}"
                        );
                        // SAFETY: the bytes are what this binary's own `compile-module` child
                        // just produced with this engine's configuration, never read from
                        // anywhere else.
                        unsafe { Component::deserialize(engine, &bytes) }
                            .map_err(|e| format!("wasmtime cannot deserialize it: {e:#}"))
                    }
                };
                drop(bytes);
                super::compiler::return_freed_memory();
                match loaded {
                    Ok(component) => {
                        tracing::debug!(
                            module = digest,
                            elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                            "compiled in a child process"
                        );
                        return Ok(component);
                    }
                    Err(why) => why,
                }
            }
        };
        tracing::warn!(
            module = digest,
            "compile cache: compiling in a child process did not give a usable component \
             ({why}); compiling in the agent"
        );
        self.remove_if_present(cwasm);
        self.remove_if_present(sidecar);
        self.compile_here(engine, wasm, digest, (cwasm, sidecar))
    }

    /// `Ok(None)`: not cached. `Err(reason)`: there is an entry, and it must not be used.
    /// Changes nothing in the directory (the precompiled one is read through it too).
    fn try_load(
        &self,
        engine: &Engine,
        cwasm: &str,
        sidecar: &str,
    ) -> Result<Option<Component>, String> {
        let file = match self.open_entry(cwasm) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot open it: {e}")),
        };
        check_ours(&file).map_err(|e| format!("the .cwasm {e}"))?;
        let expected = self.read_sidecar(sidecar)?;
        let actual = Checksum::of_file(&file).map_err(|e| format!("cannot read it: {e}"))?;
        if actual != expected {
            return Err(format!(
                "its {actual} but {sidecar} says {expected}: truncated or corrupt"
            ));
        }
        let started = Instant::now();
        let component = deserialize_open(engine, &file)
            .map_err(|e| format!("wasmtime cannot deserialize it: {e:#}"))?;
        tracing::debug!(
            file = %self.path.join(cwasm).display(),
            elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
            "compile cache: deserialized"
        );
        Ok(Some(component))
    }

    /// Opens an entry of the cache for reading: never through a symlink, never blocking on a
    /// FIFO someone might have put there.
    fn open_entry(&self, name: &str) -> std::io::Result<std::fs::File> {
        let mut options = OpenOptions::new();
        options
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
        Ok(self.dir.open_with(name, &options)?.into_std())
    }

    fn read_sidecar(&self, sidecar: &str) -> Result<Checksum, String> {
        let file = match self.open_entry(sidecar) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(format!("its checksum file {sidecar} is missing"));
            }
            Err(e) => return Err(format!("cannot open {sidecar}: {e}")),
        };
        check_ours(&file).map_err(|e| format!("its checksum file {e}"))?;
        let mut text = String::new();
        file.take(100)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read {sidecar}: {e}"))?;
        Checksum::parse(&text)
            .ok_or_else(|| format!("{sidecar} does not hold a CRC-32 and a length"))
    }

    /// Writes the entry by [`crate::files::write_all_atomically`] (0600): both files written
    /// first, then the sidecar renamed into place and the `.cwasm` right after it, so a `.cwasm`
    /// never sits beside a stale checksum, and another agent sharing the cache sees a sidecar
    /// without its `.cwasm` only between two renames.
    fn store(&self, bytes: &[u8], cwasm: &str, sidecar: &str) -> anyhow::Result<()> {
        let sum = Checksum::of(bytes).line();
        crate::files::write_all_atomically(
            &self.dir,
            &[(sidecar, sum.as_bytes()), (cwasm, bytes)],
            0o600,
        )?;
        Ok(())
    }

    fn remove_if_present(&self, name: &str) {
        match self.dir.remove_file(name) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                "compile cache: cannot remove {}: {e}",
                self.path.join(name).display()
            ),
        }
    }
}

/// The sidecar's file extension.
const SIDECAR: &str = "crc32";

/// What a sidecar records of its `.cwasm`: enough to tell it was not truncated or damaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Checksum {
    crc32: u32,
    len: u64,
}

impl Checksum {
    fn of(bytes: &[u8]) -> Checksum {
        Checksum {
            crc32: crc32fast::hash(bytes),
            len: bytes.len() as u64,
        }
    }

    /// Of the whole of `file`, read from its start; an error past [`MAX_CWASM`] bytes.
    fn of_file(file: &std::fs::File) -> std::io::Result<Checksum> {
        let mut hasher = crc32fast::Hasher::new();
        let mut buffer = vec![0u8; 256 << 10];
        let mut len = 0u64;
        let mut file = file.take(MAX_CWASM + 1);
        loop {
            let n = match file.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            hasher.update(&buffer[..n]);
            len += n as u64;
        }
        if len > MAX_CWASM {
            return Err(std::io::Error::other(format!(
                "it is over {MAX_CWASM} bytes"
            )));
        }
        Ok(Checksum {
            crc32: hasher.finalize(),
            len,
        })
    }

    /// `<8 hex digits> <length>`, as the sidecar holds it.
    fn parse(text: &str) -> Option<Checksum> {
        let (crc, len) = text.trim().split_once(' ')?;
        if crc.len() != 8 || !crc.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        Some(Checksum {
            crc32: u32::from_str_radix(crc, 16).ok()?,
            len: len.parse().ok()?,
        })
    }

    fn line(&self) -> String {
        format!("{:08x} {}\n", self.crc32, self.len)
    }
}

impl std::fmt::Display for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CRC-32 is {:08x} over {} bytes", self.crc32, self.len)
    }
}

/// The component in `file`, an open cache entry whose owner, mode and checksum were checked.
///
/// Mapped through `/proc/self/fd`, which reaches the very inode `file` has open (never the
/// path it was opened by), so its code is shared with the page cache instead of copied into the
/// agent's own memory; read from `file` itself where `/proc` is not mounted.
fn deserialize_open(engine: &Engine, file: &std::fs::File) -> wasmtime::Result<Component> {
    use std::io::Seek;
    use std::os::fd::AsRawFd;
    let fd = format!("/proc/self/fd/{}", file.as_raw_fd());
    if Path::new(&fd).exists() {
        // SAFETY: the file is one this host wrote with `Component::serialize` (our uid, in a
        // directory only we can change), its contents match the checksum we recorded when
        // writing it, and we never modify a cache file in place (entries are replaced by
        // rename), so the mapping stays valid for as long as the component lives.
        return unsafe { Component::deserialize_file(engine, &fd) };
    }
    let mut bytes = Vec::new();
    let mut file = file;
    file.seek(std::io::SeekFrom::Start(0))?;
    file.take(MAX_CWASM).read_to_end(&mut bytes)?;
    // SAFETY: as above, read from the same open file.
    unsafe { Component::deserialize(engine, &bytes) }
}

/// A stable key for the engine's compilation settings: the same settings give the same key in
/// every process (unlike `DefaultHasher`/`RandomState`), different settings a different one.
pub fn engine_key(engine: &Engine) -> String {
    let mut hasher = Sha256Hasher(Sha256::new());
    engine.precompile_compatibility_hash().hash(&mut hasher);
    hex(&hasher.0.finalize()[..8])
}

/// Feeds everything hashed into sha256.
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(&self) -> u64 {
        let digest = self.0.clone().finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first)
    }
}

fn compile(engine: &Engine, wasm: &[u8], digest: &str) -> wasmtime::Result<Component> {
    let started = Instant::now();
    let component = super::compiler::compile(engine, wasm)?;
    tracing::debug!(
        module = digest,
        elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
        "compiled"
    );
    Ok(component)
}

/// A cache file must be a regular file owned by us and writable by nobody else.
fn check_ours(file: &std::fs::File) -> Result<(), String> {
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot be inspected: {e}"))?;
    if !meta.file_type().is_file() {
        return Err("is not a regular file".into());
    }
    let uid = euid();
    if meta.uid() != uid {
        return Err(format!(
            "is owned by uid {}, not by us (uid {uid})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "has mode {:o}, writable by others than us",
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::sha256_hex;
    use std::fs::OpenOptions;
    use std::os::unix::fs::PermissionsExt;
    use wasmtime::component::Linker;
    use wasmtime::{Config, Store};

    /// The smallest valid component: no imports, no exports.
    const EMPTY: &[u8] = b"\0asm\x0d\x00\x01\x00";

    fn digest_of(wasm: &[u8]) -> String {
        sha256_hex(wasm)
    }

    fn engine() -> Engine {
        Engine::new(&Config::new()).unwrap()
    }

    fn fuel_engine() -> Engine {
        let mut config = Config::new();
        config.consume_fuel(true);
        Engine::new(&config).unwrap()
    }

    fn cache_in(tmp: &tempfile::TempDir) -> CompileCache {
        CompileCache::open(&tmp.path().join("cache")).unwrap()
    }

    fn entry(cache: &CompileCache, engine: &Engine) -> (PathBuf, PathBuf) {
        let name = format!("{}-{}", digest_of(EMPTY), engine_key(engine));
        (
            cache.dir().join(format!("{name}.cwasm")),
            cache.dir().join(format!("{name}.{SIDECAR}")),
        )
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    fn instantiates(engine: &Engine, component: &Component) {
        let mut store = Store::new(engine, ());
        Linker::<()>::new(engine)
            .instantiate(&mut store, component)
            .unwrap();
    }

    fn load(cache: &CompileCache, engine: &Engine) -> CacheOutcome {
        let (component, outcome) = cache.load(engine, EMPTY, &digest_of(EMPTY)).unwrap();
        instantiates(engine, &component);
        outcome
    }

    #[test]
    fn the_same_module_loaded_twice_at_once_is_compiled_once() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let engine = engine();
        let digest = digest_of(EMPTY);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| cache.load(&engine, EMPTY, &digest).unwrap());
            }
        });
        let stats = cache.stats();
        assert_eq!((stats.misses, stats.hits), (1, 1));
    }

    /// What another process sharing the cache would hold while compiling `wasm`: the entry's
    /// lock file, locked through a file description of its own.
    fn held_elsewhere(cache: &CompileCache, engine: &Engine, wasm: &[u8]) -> std::fs::File {
        let name = format!("{}-{}.lock", digest_of(wasm), engine_key(engine));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(cache.dir().join(name))
            .unwrap();
        file.lock().unwrap();
        file
    }

    #[test]
    fn a_module_another_process_is_compiling_is_waited_for_and_found_cached() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let other = cache_in(&tmp);
        let engine = engine();
        let held = held_elsewhere(&other, &engine, EMPTY);
        std::thread::scope(|s| {
            let loading = s.spawn(|| load(&cache, &engine));
            while cache.stats().waited == 0 {
                assert!(!loading.is_finished(), "the load did not wait");
                std::thread::yield_now();
            }
            // The other process's compile lands, then its lock goes.
            let (cwasm, sidecar) = entry(&cache, &engine);
            let bytes = compile(&engine, EMPTY, "empty")
                .unwrap()
                .serialize()
                .unwrap();
            let names = |p: &Path| p.file_name().unwrap().to_str().unwrap().to_owned();
            other
                .store(&bytes, &names(&cwasm), &names(&sidecar))
                .unwrap();
            drop(held);
            assert_eq!(loading.join().unwrap(), CacheOutcome::Hit);
        });
        assert_eq!((cache.stats().misses, cache.stats().hits), (0, 1));
    }

    #[test]
    fn a_compile_stuck_elsewhere_holds_a_load_back_only_until_the_wait_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let mut cache = cache_in(&tmp);
        cache.wait_limit = std::time::Duration::from_millis(50);
        let engine = engine();
        let _held = held_elsewhere(&cache, &engine, EMPTY);
        let started = Instant::now();
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        assert!(started.elapsed() >= cache.wait_limit);
        assert_eq!(cache.stats().waited, 1);
        // Compiled and cached all the same, for the next start.
        assert_eq!(load(&cache, &engine), CacheOutcome::Hit);
    }

    #[test]
    fn miss_then_hit_with_private_files() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let engine = engine();
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        assert_eq!(load(&cache, &engine), CacheOutcome::Hit);
        assert_eq!(
            cache.stats(),
            CacheStats {
                hits: 1,
                misses: 1,
                replaced: 0,
                waited: 0,
            }
        );

        let (cwasm, sidecar) = entry(&cache, &engine);
        let names = files(cache.dir());
        assert_eq!(names.len(), 2, "no temporaries left behind: {names:?}");
        assert!(cwasm.is_file() && sidecar.is_file(), "{names:?}");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(cache.dir()), 0o700);
        assert_eq!(mode(&cwasm), 0o600);
        assert_eq!(mode(&sidecar), 0o600);
        let recorded = std::fs::read_to_string(&sidecar).unwrap();
        let bytes = std::fs::read(&cwasm).unwrap();
        let actual = format!("{:08x} {}\n", crc32fast::hash(&bytes), bytes.len());
        assert_eq!(recorded, actual);
    }

    #[test]
    fn a_second_cache_on_the_same_dir_hits() {
        let tmp = tempfile::tempdir().unwrap();
        let engine = engine();
        assert_eq!(load(&cache_in(&tmp), &engine), CacheOutcome::Miss);
        // Another engine with the same settings: the key does not depend on the instance.
        assert_eq!(load(&cache_in(&tmp), &self::engine()), CacheOutcome::Hit);
    }

    #[test]
    fn engine_key_is_stable_and_depends_on_the_settings() {
        let key = engine_key(&engine());
        assert_eq!(key.len(), 16);
        assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(key, engine_key(&engine()));
        assert_ne!(key, engine_key(&fuel_engine()));
    }

    fn assert_replaced(outcome: CacheOutcome, mentions: &str) {
        match outcome {
            CacheOutcome::Replaced { reason } => {
                assert!(reason.contains(mentions), "{reason}")
            }
            other => panic!("expected Replaced, got {other:?}"),
        }
    }

    #[test]
    fn truncated_cwasm_is_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let engine = engine();
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        let (cwasm, _) = entry(&cache, &engine);
        let len = std::fs::metadata(&cwasm).unwrap().len();
        OpenOptions::new()
            .write(true)
            .open(&cwasm)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        assert_replaced(load(&cache, &engine), "truncated or corrupt");
        assert_eq!(load(&cache, &engine), CacheOutcome::Hit, "rewritten");
        assert_eq!(
            cache.stats(),
            CacheStats {
                hits: 1,
                misses: 1,
                replaced: 1,
                waited: 0,
            }
        );
    }

    /// A damaged entry is deleted and the module compiled again even where a precompiled
    /// directory holds it: otherwise the damaged file would stay and be read at every start.
    #[test]
    fn a_damaged_entry_is_replaced_even_with_a_precompiled_copy() {
        let tmp = tempfile::tempdir().unwrap();
        let engine = engine();
        let precompiled = CompileCache::open(&tmp.path().join("precompiled")).unwrap();
        assert_eq!(load(&precompiled, &engine), CacheOutcome::Miss);
        let cache = cache_in(&tmp).with_precompiled(precompiled);
        assert_eq!(
            load(&cache, &engine),
            CacheOutcome::Hit,
            "found precompiled"
        );
        let (cwasm, sidecar) = entry(&cache, &engine);
        std::fs::write(&cwasm, b"garbage").unwrap();
        std::fs::write(&sidecar, format!("{:08x} 7\n", crc32fast::hash(b"garbage"))).unwrap();
        assert_replaced(load(&cache, &engine), "deserialize");
        assert_eq!(load(&cache, &engine), CacheOutcome::Hit, "rewritten");
    }

    #[test]
    fn garbage_cwasm_is_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let engine = engine();
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        let (cwasm, _) = entry(&cache, &engine);
        std::fs::write(&cwasm, b"\x7fELF but not really").unwrap();
        assert_replaced(load(&cache, &engine), "truncated or corrupt");
        assert_eq!(load(&cache, &engine), CacheOutcome::Hit);
    }

    #[test]
    fn missing_or_bad_sidecar_is_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let engine = engine();
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        let (_, sidecar) = entry(&cache, &engine);
        std::fs::remove_file(&sidecar).unwrap();
        assert_replaced(load(&cache, &engine), "missing");
        std::fs::write(&sidecar, "not a checksum").unwrap();
        assert_replaced(load(&cache, &engine), "does not hold a CRC-32");
        assert_eq!(load(&cache, &engine), CacheOutcome::Hit);
    }

    #[test]
    fn a_cwasm_wasmtime_refuses_is_replaced() {
        // What an upgrade or a configuration change looks like: a file this host wrote, intact,
        // that the engine cannot use. Simulated by placing the fuel engine's entry under the
        // plain engine's name, with a matching sidecar.
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let (engine, fuel) = (engine(), fuel_engine());
        assert_eq!(load(&cache, &fuel), CacheOutcome::Miss);
        let (fuel_cwasm, fuel_sidecar) = entry(&cache, &fuel);
        let (cwasm, sidecar) = entry(&cache, &engine);
        std::fs::copy(&fuel_cwasm, &cwasm).unwrap();
        std::fs::copy(&fuel_sidecar, &sidecar).unwrap();
        assert_replaced(load(&cache, &engine), "cannot deserialize");
        assert_eq!(load(&cache, &engine), CacheOutcome::Hit);
        assert_eq!(load(&cache, &fuel), CacheOutcome::Hit, "untouched");
    }

    #[test]
    fn a_different_engine_config_gets_its_own_entry() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let (engine, fuel) = (engine(), fuel_engine());
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        assert_eq!(load(&cache, &fuel), CacheOutcome::Miss);
        assert_eq!(load(&cache, &engine), CacheOutcome::Hit);
        assert_eq!(load(&cache, &fuel), CacheOutcome::Hit);
        assert_eq!(files(cache.dir()).len(), 4);
    }

    #[test]
    fn files_writable_by_others_or_symlinks_are_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let engine = engine();
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        let (cwasm, _) = entry(&cache, &engine);
        std::fs::set_permissions(&cwasm, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_replaced(load(&cache, &engine), "writable by others");
        assert_eq!(std::fs::metadata(&cwasm).unwrap().mode() & 0o777, 0o600);

        let elsewhere = tmp.path().join("planted.cwasm");
        std::fs::rename(&cwasm, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &cwasm).unwrap();
        assert_replaced(load(&cache, &engine), "cannot open");
        assert!(!std::fs::symlink_metadata(&cwasm).unwrap().is_symlink());

        // Only root can give a file away; elsewhere this case cannot be set up.
        if euid() == 0 {
            std::os::unix::fs::chown(&cwasm, Some(65534), None).unwrap();
            assert_replaced(load(&cache, &engine), "owned by uid 65534");
            assert_eq!(std::fs::metadata(&cwasm).unwrap().uid(), 0);
        }
    }

    #[test]
    fn invalid_wasm_is_an_error_and_not_cached() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let wasm = b"\0asm\x0d\x00\x01\x00garbage";
        assert!(cache.load(&engine(), wasm, &digest_of(wasm)).is_err());
        assert!(files(cache.dir()).is_empty());
    }

    fn untrusted(result: Result<CompileCache, CacheError>) -> trust::Untrusted {
        match result {
            Err(CacheError::Untrusted { reason, .. }) => reason,
            other => panic!("expected an untrusted cache, got {other:?}"),
        }
    }

    #[test]
    fn open_creates_a_private_dir_and_refuses_unsafe_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let nested = tmp.path().join("a/b/cache");
        CompileCache::open(&nested).unwrap();
        assert_eq!(std::fs::metadata(&nested).unwrap().mode() & 0o777, 0o700);

        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = CompileCache::open(&open).unwrap_err().to_string();
        assert!(
            err.contains("mode 0777") && err.contains("refusing"),
            "{err}"
        );

        let group = tmp.path().join("group");
        std::fs::create_dir(&group).unwrap();
        std::fs::set_permissions(&group, std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(matches!(
            untrusted(CompileCache::open(&group)),
            trust::Untrusted::Writable { .. }
        ));

        let file = tmp.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(CompileCache::open(&file).is_err());

        // A cache below a directory others may write to: they could swap the cache itself.
        let below = open.join("cache");
        let reason = untrusted(CompileCache::open(&below));
        assert_eq!(reason.path(), open, "{reason}");
    }

    #[test]
    fn open_refuses_a_dir_owned_by_someone_else() {
        let tmp = tempfile::tempdir().unwrap();
        let theirs = tmp.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        // Only root can give a directory away; anyone else already has one that is not theirs.
        if euid() != 0 {
            let owner = std::fs::metadata("/").unwrap().uid();
            assert_ne!(owner, euid(), "/ is ours: no directory to test with");
            assert!(CompileCache::open(Path::new("/")).is_err());
            return;
        }
        std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
        let reason = untrusted(CompileCache::open(&theirs));
        assert!(
            matches!(reason, trust::Untrusted::Owner { owner: 65534, .. }),
            "{reason}"
        );
    }

    #[test]
    fn a_cache_whose_path_is_swapped_after_opening_loads_only_what_it_opened() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let engine = engine();
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        // Someone moves the directory away and puts another at its path, with an entry of the
        // same name whose sidecar matches: it must never be read.
        let path = cache.dir().to_owned();
        std::fs::rename(&path, tmp.path().join("moved")).unwrap();
        std::fs::create_dir(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
        let (cwasm, sidecar) = entry(&cache, &engine);
        std::fs::write(&cwasm, b"planted").unwrap();
        std::fs::write(&sidecar, Checksum::of(b"planted").line()).unwrap();
        assert_eq!(
            load(&cache, &engine),
            CacheOutcome::Hit,
            "from what was opened"
        );
        assert_eq!(std::fs::read(&cwasm).unwrap(), b"planted", "untouched");
    }

    #[test]
    fn a_cache_that_cannot_be_written_still_compiles() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_in(&tmp);
        let engine = engine();
        std::fs::set_permissions(cache.dir(), std::fs::Permissions::from_mode(0o500)).unwrap();
        assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        if euid() != 0 {
            // Root writes regardless of the mode.
            assert!(files(cache.dir()).is_empty());
            assert_eq!(load(&cache, &engine), CacheOutcome::Miss);
        }
        std::fs::set_permissions(cache.dir(), std::fs::Permissions::from_mode(0o700)).unwrap();
    }
}
