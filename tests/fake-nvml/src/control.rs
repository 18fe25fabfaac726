//! The control file: an append-only file of commands a test writes to change the node while
//! the agent runs (inject an XID, drop a GPU off the bus, wedge the driver).
//!
//! The fake reads new complete lines on every API call and while waiting for events. It tracks
//! the byte offset it has read up to, so each line applies once, in order, and a line still
//! being written (no newline yet) waits for the next read.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

/// One line of the control file. Indexes are GPU indexes in the fixture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `xid <index> <code>`: an XID critical-error event.
    Xid(usize, u64),
    /// `xid <index> <code> <gpu instance> <compute instance>`: an XID raised inside one MIG
    /// device, as NVML attributes it.
    MigXid(usize, u64, u32, u32),
    /// `dbe <index>`: a double-bit ECC error event.
    Dbe(usize),
    /// `lost <index>`: the GPU fell off the bus; queries on it fail with `GPU_IS_LOST`.
    Lost(usize),
    /// `found <index>`: undoes `lost`.
    Found(usize),
    /// `hang`: device queries block until `unhang`.
    Hang,
    Unhang,
    /// `hang-after-create`: until `create-returns`, each compute instance made (its MIG device
    /// exists, and is kept) blocks its caller, as when an agent is killed between making an
    /// instance and recording it.
    HangAfterCreate,
    CreateReturns,
}

/// Parses one line against a node of `gpus` GPUs; `None` when it is not a command.
pub fn parse(line: &str, gpus: usize) -> Option<Command> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let gpu = |word: &str| word.parse::<usize>().ok().filter(|&i| i < gpus);
    match words.as_slice() {
        ["xid", index, code] => Some(Command::Xid(gpu(index)?, code.parse().ok()?)),
        ["xid", index, code, gi, ci] => Some(Command::MigXid(
            gpu(index)?,
            code.parse().ok()?,
            gi.parse().ok()?,
            ci.parse().ok()?,
        )),
        ["dbe", index] => Some(Command::Dbe(gpu(index)?)),
        ["lost", index] => Some(Command::Lost(gpu(index)?)),
        ["found", index] => Some(Command::Found(gpu(index)?)),
        ["hang"] => Some(Command::Hang),
        ["unhang"] => Some(Command::Unhang),
        ["hang-after-create"] => Some(Command::HangAfterCreate),
        ["create-returns"] => Some(Command::CreateReturns),
        _ => None,
    }
}

/// Where the control file is and how much of it has been applied.
#[derive(Debug, Default)]
pub struct Control {
    path: Option<PathBuf>,
    offset: u64,
}

impl Control {
    /// Reads `path` from its start: lines written before `nvmlInit` describe the node's state
    /// when the library starts.
    pub fn new(path: Option<PathBuf>) -> Control {
        Control { path, offset: 0 }
    }

    /// The complete lines appended since the last call (blank ones skipped). A missing or
    /// unreadable file has no lines yet.
    pub fn read_new(&mut self) -> Vec<String> {
        let Some(path) = &self.path else {
            return Vec::new();
        };
        let mut tail = Vec::new();
        let read = File::open(path).and_then(|mut file| {
            file.seek(SeekFrom::Start(self.offset))?;
            file.read_to_end(&mut tail)
        });
        if read.is_err() {
            return Vec::new();
        }
        let Some(end) = tail.iter().rposition(|&b| b == b'\n') else {
            return Vec::new();
        };
        self.offset += end as u64 + 1;
        String::from_utf8_lossy(&tail[..end])
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands() {
        assert_eq!(parse("xid 1 79", 2), Some(Command::Xid(1, 79)));
        assert_eq!(parse("xid 1 43 2 0", 2), Some(Command::MigXid(1, 43, 2, 0)));
        assert_eq!(parse(" dbe 0 ", 2), Some(Command::Dbe(0)));
        assert_eq!(parse("lost 0", 2), Some(Command::Lost(0)));
        assert_eq!(parse("found 1", 2), Some(Command::Found(1)));
        assert_eq!(parse("hang", 2), Some(Command::Hang));
        assert_eq!(parse("unhang", 2), Some(Command::Unhang));
        assert_eq!(
            parse("hang-after-create", 2),
            Some(Command::HangAfterCreate)
        );
        for bad in ["xid 2 79", "xid 0", "xid 0 x", "lost", "hang 1", "reboot"] {
            assert_eq!(parse(bad, 2), None, "{bad:?}");
        }
    }

    #[test]
    fn partial_lines_wait() {
        let dir = std::env::temp_dir().join(format!("fake-nvml-control-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("control");
        let mut control = Control::new(Some(file.clone()));
        assert!(control.read_new().is_empty(), "no file yet");
        std::fs::write(&file, "hang\nxid 0").expect("write");
        assert_eq!(control.read_new(), ["hang"]);
        std::fs::write(&file, "hang\nxid 0 13\n\nunhang\n").expect("write");
        assert_eq!(control.read_new(), ["xid 0 13", "unhang"]);
        assert!(control.read_new().is_empty());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
