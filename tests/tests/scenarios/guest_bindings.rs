//! The guests' WIT bindings are committed source (`sdk-guest/bindgen` writes them, so no module
//! build compiles wit-bindgen's macro): each file must still be what its WIT says.

use devicelet_tests::workspace_root;
use sha2::{Digest, Sha256};

/// Every bindings file the generator writes (its `BINDINGS` list).
const BINDINGS: &[&str] = &[
    "sdk-guest/src/bindings.rs",
    "guests/testing/partitions/src/bindings.rs",
    "guests/testing/wit-0-2-0/src/bindings.rs",
    "guests/testing/wit-0-1-0/src/bindings.rs",
];

/// The digest the generator records: the directory's `.wit` files by name, each name, a NUL,
/// its bytes, a NUL (as `wit_digest` in `sdk-guest/bindgen`).
fn wit_digest(dir: &std::path::Path) -> String {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "wit"))
        .collect();
    names.sort();
    let mut hash = Sha256::new();
    for path in names {
        hash.update(path.file_name().expect("a name").as_encoded_bytes());
        hash.update([0]);
        hash.update(std::fs::read(&path).expect("reading a WIT file"));
        hash.update([0]);
    }
    format!("{:x}", hash.finalize())
}

/// A WIT edit without `cargo run -p devicelet-sdk-bindgen` would ship modules built against
/// the old interface; the recorded digest of each file's WIT directory catches it.
#[test]
fn each_guest_bindings_file_is_written_from_todays_wit() {
    let root = workspace_root();
    let mut stale = Vec::new();
    for file in BINDINGS {
        let text = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("{file}: {e} (run `cargo run -p devicelet-sdk-bindgen`)"));
        let field = |key: &str| {
            text.lines()
                .take(3)
                .find_map(|l| l.strip_prefix(key))
                .unwrap_or_else(|| panic!("{file}: no `{key}` line in its header"))
                .to_owned()
        };
        let wit = field("// wit: ");
        let dir = wit.split_whitespace().next().expect("a WIT directory");
        let recorded = field("// wit-sha256: ");
        let now = wit_digest(&root.join(dir));
        if recorded != now {
            stale.push(format!(
                "{file} ({dir}: written from {recorded}, now {now})"
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "bindings older than their WIT; run `cargo run -p devicelet-sdk-bindgen`: {stale:#?}"
    );
}
