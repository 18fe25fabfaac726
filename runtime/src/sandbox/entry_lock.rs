//! One compile of a module at a time among the processes sharing a compile cache (the agent,
//! `validate`, `precompile`, `try`, an agent's successor starting beside it): the first to miss
//! an entry takes `<entry>.lock` while it compiles; the others wait for it and then find the
//! entry written, instead of compiling the same module at the same moment.
//!
//! The lock only saves work. Entries are written whole and checked at every load, so a waiter
//! that gives up (after [`WAIT_LIMIT`]: the holder may be stopped, stuck or compiling something
//! huge) compiles the module itself, as it would without the lock, and so does one that cannot
//! make or lock the file, and one whose holder could not compile the module. A lock file is
//! removed by its holder when done, and the lock dies with its process.

use std::fs::{File, TryLockError};
use std::time::{Duration, Instant};

use cap_std::fs::{Dir, MetadataExt as _, OpenOptions, OpenOptionsExt};

/// How long a load waits for another process compiling the same entry: far longer than a
/// reference module's compile (seconds), shorter than the compiler child's own limit, so a
/// holder that is stopped, stuck or slow costs a waiter at most this and a compile of its own.
pub(super) const WAIT_LIMIT: Duration = Duration::from_secs(120);

const FIRST_PAUSE: Duration = Duration::from_millis(5);
const LONGEST_PAUSE: Duration = Duration::from_millis(100);

/// Held while this process compiles an entry; its file goes when it is dropped.
pub(super) struct EntryLock<'a> {
    dir: &'a Dir,
    name: String,
    file: File,
}

/// Takes the lock file `name` in `dir`, waiting at most `limit` for another holder (`waiting` is
/// called once, when the first try finds it held). Err (why) when it is not taken: compile
/// without it. Blocking (it sleeps between tries): call it from a blocking thread.
pub(super) fn lock<'a>(
    dir: &'a Dir,
    name: String,
    limit: Duration,
    waiting: &dyn Fn(),
) -> Result<EntryLock<'a>, String> {
    let started = Instant::now();
    let mut pause = FIRST_PAUSE;
    let mut waited = false;
    loop {
        let file = match open(dir, &name) {
            Ok(file) => file,
            Err(e) => return Err(format!("cannot open {name}: {e}")),
        };
        match file.try_lock() {
            // Still the file at `name`? A holder that just finished removed it, and a newcomer
            // may have made another: lock that one instead.
            Ok(()) if is_at(dir, &name, &file) => return Ok(EntryLock { dir, name, file }),
            Ok(()) | Err(TryLockError::WouldBlock) => {}
            Err(TryLockError::Error(e)) => return Err(format!("cannot lock {name}: {e}")),
        }
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(format!(
                "another process has been compiling it for {}s",
                limit.as_secs()
            ));
        }
        // Not held across the pause: a file taken but no longer at `name` is let go now.
        drop(file);
        if !waited {
            waiting();
            waited = true;
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

fn open(dir: &Dir, name: &str) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    Ok(dir.open_with(name, &options)?.into_std())
}

/// Whether `name` in `dir` is still `file`.
fn is_at(dir: &Dir, name: &str, file: &File) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let (Ok(there), Ok(held)) = (dir.symlink_metadata(name), file.metadata()) else {
        return false;
    };
    there.dev() == held.dev() && there.ino() == held.ino()
}

impl Drop for EntryLock<'_> {
    fn drop(&mut self) {
        // Removed while still held, so a waiter that then takes this file sees it gone and
        // looks again; the lock itself goes with the file when `file` is closed.
        if is_at(self.dir, &self.name, &self.file) {
            let _ = self.dir.remove_file(&self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tmp: &tempfile::TempDir) -> Dir {
        Dir::open_ambient_dir(tmp.path(), cap_std::ambient_authority()).unwrap()
    }

    #[test]
    fn a_free_lock_is_taken_at_once_and_its_file_removed_after() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = dir(&tmp);
        let lock = lock(&dir, "e.lock".into(), WAIT_LIMIT, &|| panic!("waited"));
        assert!(lock.is_ok());
        assert!(tmp.path().join("e.lock").exists());
        drop(lock);
        assert!(!tmp.path().join("e.lock").exists());
    }

    #[test]
    fn a_held_lock_is_waited_for_up_to_the_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = dir(&tmp);
        // Another open file description, as another process would have.
        let other = open(&dir, "e.lock").unwrap();
        other.lock().unwrap();
        let limit = Duration::from_millis(50);
        let started = Instant::now();
        let Err(why) = lock(&dir, "e.lock".into(), limit, &|| ()) else {
            panic!("took a lock another holds");
        };
        assert!(started.elapsed() >= limit, "gave up before the limit");
        assert!(why.contains("another process"), "{why}");
        // The holder's file is left alone.
        assert!(tmp.path().join("e.lock").exists());
    }

    #[test]
    fn a_lock_let_go_is_taken_after_waiting() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = dir(&tmp);
        let Ok(held) = lock(&dir, "e.lock".into(), WAIT_LIMIT, &|| panic!("waited")) else {
            panic!("a free lock was not taken at once");
        };
        let (tried, first_try) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn({
            let path = tmp.path().to_owned();
            move || {
                let dir = Dir::open_ambient_dir(&path, cap_std::ambient_authority()).unwrap();
                let waiting = move || tried.send(()).unwrap();
                lock(&dir, "e.lock".into(), WAIT_LIMIT, &waiting).is_ok()
            }
        });
        // Let go only once the waiter found it held; it then takes a new file's lock.
        first_try.recv().unwrap();
        drop(held);
        assert!(
            waiter.join().unwrap(),
            "the waiter did not take it after waiting"
        );
        assert!(!tmp.path().join("e.lock").exists());
    }
}
