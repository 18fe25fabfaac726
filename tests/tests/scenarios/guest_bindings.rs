//! The guests' WIT bindings are committed source (`sdk-guest/bindgen` writes them, so no module
//! build compiles wit-bindgen's macro): each file must still be what the generator writes today.

use devicelet_tests::workspace_root;

/// The generator's digests: its own file, included as it is.
#[path = "../../../sdk-guest/bindgen/src/digest.rs"]
mod digest;

use digest::{sha256, wit_digest};

/// Every bindings file the generator writes (its `BINDINGS` list).
const BINDINGS: &[&str] = &[
    "sdk-guest/src/bindings.rs",
    "guests/testing/partitions/src/bindings.rs",
    "guests/testing/wit-0-2-0/src/bindings.rs",
    "guests/testing/wit-0-1-0/src/bindings.rs",
];

/// The generator's header: five lines, the last three digests.
const HEADER_LINES: usize = 5;

/// A new WIT folder for the SDK (`sdk-guest/wit` pointed at it), an edit of the generator's
/// options, or a hand edit of a bindings file, without `cargo run -p devicelet-sdk-bindgen`,
/// would ship modules built from bindings nobody generated: the header's digests catch each.
#[test]
fn each_guest_bindings_file_is_what_the_generator_writes_today() {
    let root = workspace_root();
    let generator = sha256(
        &std::fs::read(root.join("sdk-guest/bindgen/src/main.rs")).expect("the generator's source"),
    );
    let mut stale = Vec::new();
    for file in BINDINGS {
        let text = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("{file}: {e} (run `cargo run -p devicelet-sdk-bindgen`)"));
        let header: Vec<&str> = text.lines().take(HEADER_LINES).collect();
        let field = |key: &str| {
            header
                .iter()
                .find_map(|l| l.strip_prefix(key))
                .unwrap_or_else(|| panic!("{file}: no `{key}` line in its header"))
        };
        let dir = field("// wit: ")
            .split_whitespace()
            .next()
            .expect("a WIT folder");
        let body = text
            .splitn(HEADER_LINES + 1, '\n')
            .nth(HEADER_LINES)
            .expect("text below the header");
        for (what, recorded, now) in [
            (
                "its WIT folder",
                field("// wit-sha256: "),
                wit_digest(&root.join(dir)).expect("the WIT folder's digest"),
            ),
            (
                "the generator",
                field("// generator-sha256: "),
                generator.clone(),
            ),
            (
                "its own text",
                field("// body-sha256: "),
                sha256(body.as_bytes()),
            ),
        ] {
            if recorded != now {
                stale.push(format!("{file}: {what} changed since it was written"));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "run `cargo run -p devicelet-sdk-bindgen`: {stale:#?}"
    );
}
