//! Reading the files an operator names (the registry, module files): only regular files, and
//! only up to a size, so a path that names a FIFO, a device node or something huge is a clear
//! error instead of a hung or bloated agent. And writing the agent's own files (the ledger, CDI
//! specs, compile-cache entries) one way, with one durability.

use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use cap_std::fs::{Dir, OpenOptions, OpenOptionsExt as _};

/// Largest registry file read.
pub const MAX_REGISTRY: u64 = 1 << 20;
/// Largest module file read; a real module is a few MiB at most.
pub const MAX_MODULE: u64 = 64 << 20;

/// Reads `path` if it is a regular file of at most `max` bytes. Opened non-blocking so that a
/// FIFO cannot park the caller before its type is known.
pub fn read_regular(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    read_regular_with_metadata(path, max).map(|(bytes, _)| bytes)
}

/// [`read_regular`], and the metadata of the file it read (taken from the open file, so it
/// is that file's even if the path changes meanwhile).
pub fn read_regular_with_metadata(
    path: &Path,
    max: u64,
) -> io::Result<(Vec<u8>, std::fs::Metadata)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let meta = file.metadata()?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_dir() {
            "a directory"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device node"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "something else"
        };
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("not a regular file but {what}"),
        ));
    }
    if meta.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} bytes; at most {max} are read", meta.len()),
        ));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it grew past {max} bytes while being read"),
        ));
    }
    Ok((bytes, meta))
}

/// The prefix of the temporary names [`write_atomically`] uses for `name`: a dot (hidden, and
/// not ending in `.json`, so a CDI runtime scanning the directory skips it), then the name.
pub fn temp_prefix(name: &str) -> String {
    format!(".{name}.tmp-")
}

/// Replaces `name` in `dir` with `bytes` so that a reader sees the old file or the new one, never
/// part of one, and a power cut after return keeps the new one: a temp file created exclusively
/// (never through a symlink) with exactly `mode`, written, fsynced, renamed over `name`, and the
/// directory fsynced. A failed write leaves no temp file behind.
pub fn write_atomically(dir: &Dir, name: &str, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_all_atomically(dir, &[(name, bytes)], mode)
}

/// [`write_atomically`] of `path`, in the directory it names.
pub fn write_file_atomically(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Err(io::Error::other(format!(
            "{} has no directory or file name",
            path.display()
        )));
    };
    let dir = Dir::open_ambient_dir(dir, cap_std::ambient_authority())?;
    write_atomically(&dir, name, bytes, mode)
}

/// [`write_atomically`] for several files that belong together: every temp file is written and
/// fsynced first, then they are renamed into place in the order given, one right after the
/// other, and the directory is fsynced once. A reader sees each file old or new, and the window
/// in which some are new and others old is two renames long, not a write.
pub fn write_all_atomically(dir: &Dir, files: &[(&str, &[u8])], mode: u32) -> io::Result<()> {
    let mut temps = Vec::with_capacity(files.len());
    for (name, bytes) in files {
        match write_temp(dir, name, bytes, mode) {
            Ok(temp) => temps.push(temp),
            Err(e) => {
                for temp in &temps {
                    let _ = dir.remove_file(temp);
                }
                return Err(e);
            }
        }
    }
    for (i, ((name, _), temp)) in files.iter().zip(&temps).enumerate() {
        if let Err(e) = dir.rename(temp, dir, name) {
            for temp in &temps[i..] {
                let _ = dir.remove_file(temp);
            }
            return Err(e);
        }
    }
    sync_dir(dir)
}

/// A new temp file beside `name` holding `bytes` (exactly `mode`, fsynced); its name.
fn write_temp(dir: &Dir, name: &str, bytes: &[u8], mode: u32) -> io::Result<String> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let temp = format!(
        "{}{}-{nanos}-{}",
        temp_prefix(name),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let mut options = OpenOptions::new();
    options
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW);
    let mut file = dir.open_with(&temp, &options)?.into_std();
    let written = file
        // The umask may have taken bits away; state the mode exactly.
        .set_permissions(std::fs::Permissions::from_mode(mode))
        .and_then(|()| file.write_all(bytes))
        .and_then(|()| file.sync_all());
    if let Err(e) = written {
        let _ = dir.remove_file(&temp);
        return Err(e);
    }
    Ok(temp)
}

/// Makes the directory's entries (a rename, a removal) durable.
pub fn sync_dir(dir: &Dir) -> io::Result<()> {
    #[cfg(test)]
    tests::DIR_SYNCS.with(|n| n.set(n.get() + 1));
    // A `Dir` handle may be an `O_PATH` descriptor, which fsync refuses: sync the directory
    // opened for reading through it.
    dir.open(".")?.sync_all()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// Directory fsyncs on this thread, so a writer's test can see that it made its rename
        /// durable.
        pub static DIR_SYNCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// How many directory fsyncs `f` made on this thread.
    pub fn dir_syncs_during(f: impl FnOnce()) -> usize {
        let before = DIR_SYNCS.with(|n| n.get());
        f();
        DIR_SYNCS.with(|n| n.get()) - before
    }

    #[test]
    fn an_atomic_write_replaces_the_file_with_the_exact_mode_and_leaves_no_temp() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open_ambient_dir(tmp.path(), cap_std::ambient_authority()).unwrap();
        std::fs::write(tmp.path().join("spec.json"), "old").unwrap();
        let syncs =
            dir_syncs_during(|| write_atomically(&dir, "spec.json", b"new", 0o644).unwrap());
        assert_eq!(syncs, 1, "the rename is made durable");
        assert_eq!(std::fs::read(tmp.path().join("spec.json")).unwrap(), b"new");
        let mode = std::fs::metadata(tmp.path().join("spec.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o644);
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["spec.json"]);
        // A name that cannot be replaced (a directory) fails, and no temp file is left.
        std::fs::create_dir(tmp.path().join("busy")).unwrap();
        std::fs::write(tmp.path().join("busy/x"), "x").unwrap();
        assert!(write_atomically(&dir, "busy", b"x", 0o600).is_err());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2);
    }

    #[test]
    fn fifos_directories_and_oversized_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_regular(&fifo, 100).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        let e = read_regular(dir.path(), 100).unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        let big = dir.path().join("big");
        std::fs::write(&big, vec![0u8; 101]).unwrap();
        assert!(read_regular(&big, 100).is_err());
        assert_eq!(read_regular(&big, 101).unwrap().len(), 101);
    }
}
