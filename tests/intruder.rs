//! Another local user, for the trust scenarios (`tests/tests/scenarios/local_trust.rs`): the tests run it
//! under an unprivileged uid and it does what such a user could do to the agent's files.
//!
//! - `swap <a> <b> <stop-file>`: exchanges the two paths (`renameat2(RENAME_EXCHANGE)`) in a loop
//!   until `<stop-file>` exists, then prints how many exchanges it made.
//! - `listen <reply-file>`: standard input is a bound Unix socket; listens on it (so the socket's
//!   credentials are this user's) and answers every connection with the reply file's bytes.
//! - `read <socket>`: connects and prints how many bytes it was sent.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["swap", a, b, stop] => swap(Path::new(a), Path::new(b), Path::new(stop)),
        ["listen", reply] => listen(Path::new(reply)),
        ["read", socket] => read(Path::new(socket)),
        _ => {
            eprintln!(
                "usage: intruder swap <a> <b> <stop-file> | listen <reply-file> | read <socket>"
            );
            std::process::exit(2);
        }
    }
}

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("a path without NUL")
}

fn swap(a: &Path, b: &Path, stop: &Path) {
    let (a, b) = (c_path(a), c_path(b));
    let mut swaps: u64 = 0;
    let mut failures: u64 = 0;
    loop {
        for _ in 0..256 {
            // SAFETY: both are valid NUL-terminated paths.
            let done = unsafe {
                libc::renameat2(
                    libc::AT_FDCWD,
                    a.as_ptr(),
                    libc::AT_FDCWD,
                    b.as_ptr(),
                    libc::RENAME_EXCHANGE,
                )
            };
            if done == 0 {
                swaps += 1;
            } else {
                failures += 1;
            }
        }
        if stop.exists() {
            break;
        }
    }
    println!("{swaps} {failures}");
}

fn listen(reply: &Path) {
    let body = std::fs::read(reply).expect("reading the reply");
    // SAFETY: the test hands over a bound, not yet listening, Unix socket as standard input.
    let listening = unsafe { libc::listen(0, 16) };
    assert_eq!(listening, 0, "listen: {}", std::io::Error::last_os_error());
    // SAFETY: fd 0 is that socket, and nothing else in this process uses it.
    let listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(0) };
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let _ = conn.write_all(&body);
    }
}

fn read(socket: &Path) {
    let mut bytes = Vec::new();
    match std::os::unix::net::UnixStream::connect(socket) {
        Ok(mut conn) => {
            let _ = conn.read_to_end(&mut bytes);
            println!("{}", bytes.len());
        }
        Err(e) => println!("connect: {e}"),
    }
}
