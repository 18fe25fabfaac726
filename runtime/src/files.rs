//! Reading the files an operator names (the registry, module files): only regular files, and
//! only up to a size, so a path that names a FIFO, a device node or something huge is a clear
//! error instead of a hung or bloated agent.

use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Largest registry file read.
pub const MAX_REGISTRY: u64 = 1 << 20;
/// Largest module file read; a real module is a few MiB at most.
pub const MAX_MODULE: u64 = 64 << 20;

/// Reads `path` if it is a regular file of at most `max` bytes. Opened non-blocking so that a
/// FIFO cannot park the caller before its type is known.
pub fn read_regular(path: &Path, max: u64) -> io::Result<Vec<u8>> {
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
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

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
