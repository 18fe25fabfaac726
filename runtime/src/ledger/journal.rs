//! The claims' journal: `state_dir/ledger.journal`, beside the checkpoint.
//!
//! A DRA prepare or unprepare must be on disk before it is answered, and must cost what one
//! claim costs, not what the whole ledger does. So a claim's change is one JSON line appended
//! here and flushed (`fdatasync`: one flush, no temp file, no rename, no directory sync), and
//! only the periodic checkpoint rewrites everything, after which the journal starts empty.
//! Changes finishing together share one append and one flush.
//!
//! At start the checkpoint is read, then the journal replayed over it, line by line: each line
//! is the claim's whole record (`{"uid":…,"claim":{…}}`) or its end (`{"uid":…,"claim":null}`),
//! so replaying a line twice, or one the checkpoint already holds, changes nothing. A last line
//! without its newline is a write the agent did not live to finish (never answered): it is
//! dropped. The file is trusted as the checkpoint is (ours, not a link, writable by us alone).

use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::claims::ClaimRecord;

/// The journal's file name inside the state directory.
pub const FILE_NAME: &str = "ledger.journal";
/// Past this many lines a flush rewrites the checkpoint instead, which empties the journal.
pub const COMPACT_AFTER: usize = 4096;
/// Largest journal read back.
const MAX_FILE: u64 = 64 << 20;

/// One change of one claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    pub uid: String,
    /// The claim as prepared, or None: unprepared.
    pub claim: Option<ClaimRecord>,
}

/// The journal file, open for appending.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    /// Lines in the file.
    lines: usize,
}

impl Journal {
    /// Opens (creating it 0600) the journal at `path` and returns it with the lines it holds.
    /// A torn last line is cut off.
    pub fn open(path: &Path) -> io::Result<(Journal, Vec<Line>)> {
        let bytes = match crate::files::read_regular(path, MAX_FILE) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let whole = bytes
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |last| last + 1);
        let mut lines = Vec::new();
        for (n, text) in bytes[..whole].split(|&b| b == b'\n').enumerate() {
            if text.is_empty() {
                continue;
            }
            let line: Line = serde_json::from_slice(text).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidData, format!("line {}: {e}", n + 1))
            })?;
            lines.push(line);
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        if whole < bytes.len() {
            // The torn tail is no change anybody was told of.
            file.set_len(whole as u64)?;
            file.sync_data()?;
        }
        let count = lines.len();
        Ok((
            Journal {
                path: path.to_owned(),
                file,
                lines: count,
            },
            lines,
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Lines in the file now.
    pub fn len(&self) -> usize {
        self.lines
    }

    /// Appends `lines` and flushes them to disk before returning.
    pub fn append(&mut self, lines: &[Line]) -> io::Result<()> {
        if lines.is_empty() {
            return Ok(());
        }
        let mut bytes = Vec::with_capacity(256 * lines.len());
        for line in lines {
            serde_json::to_writer(&mut bytes, line).map_err(io::Error::other)?;
            bytes.push(b'\n');
        }
        self.file.write_all(&bytes)?;
        self.file.sync_data()?;
        self.lines += lines.len();
        Ok(())
    }

    /// Empties the journal: the checkpoint just written holds everything it said.
    pub fn clear(&mut self) -> io::Result<()> {
        if self.lines == 0 {
            return Ok(());
        }
        self.file.set_len(0)?;
        self.file.sync_data()?;
        self.lines = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(name: &str) -> ClaimRecord {
        ClaimRecord {
            driver: "d".into(),
            resource: "r".into(),
            namespace: "n".into(),
            name: name.into(),
            requests: Vec::new(),
            spec_file: None,
            preparing: false,
            by_module: false,
        }
    }

    #[test]
    fn lines_survive_a_reopen_and_a_torn_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let (mut journal, lines) = Journal::open(&path).unwrap();
        assert!(lines.is_empty());
        let written = vec![
            Line {
                uid: "a".into(),
                claim: Some(claim("a")),
            },
            Line {
                uid: "a".into(),
                claim: None,
            },
        ];
        journal.append(&written).unwrap();
        drop(journal);
        // An append the agent did not finish.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"uid":"b","cla"#).unwrap();
        drop(f);
        let (journal, lines) = Journal::open(&path).unwrap();
        assert_eq!(lines, written);
        assert_eq!(journal.len(), 2);
        assert!(std::fs::read(&path).unwrap().ends_with(b"null}\n"));
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}
