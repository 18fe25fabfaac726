//! Does nothing: it exists so that the `[build-dependencies]` in Cargo.toml, there only to align
//! the host side's features with the agent's (see the comment there), are part of the build.

fn main() {
    // Not run again when the scenarios change.
    println!("cargo:rerun-if-changed=build.rs");
}
