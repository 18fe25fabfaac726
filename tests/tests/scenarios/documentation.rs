//! The documentation against the code: every `devicelet` subcommand and every registry key is
//! described in the README or `docs/`, so moving text between them can lose nothing unnoticed.

use clap::CommandFactory;
use devicelet_tests::workspace_root;

/// The README and every Markdown file under `docs/`, as one text.
fn documentation() -> String {
    let mut text = std::fs::read_to_string(workspace_root().join("README.md")).expect("README");
    let mut dirs = vec![workspace_root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("docs/").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                text += &std::fs::read_to_string(&path).expect("a doc");
            }
        }
    }
    text
}

#[test]
fn every_subcommand_and_registry_key_is_documented() {
    let docs = documentation();
    // Subcommands, nested ones by their whole command line (`devicelet module push`).
    let mut missing = Vec::new();
    let mut stack = vec![(String::from("devicelet"), devicelet::cli::Cli::command())];
    while let Some((line, command)) = stack.pop() {
        for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
            if sub.get_name() == "help" {
                continue;
            }
            let full = format!("{line} {}", sub.get_name());
            if !docs.contains(&full) {
                missing.push(full.clone());
            }
            stack.push((full, sub.clone()));
        }
    }
    // Registry keys, as written in a registry (`key =`) or named in the text (`` `key` ``).
    for (table, key) in devicelet::config::registry_keys() {
        let written = [
            format!("{key} ="),
            format!("`{key}`"),
            format!("[{table}.{key}]"),
            // A table of tables: `[module.sharing.resources.fuse]`.
            format!("[{table}.{key}."),
        ];
        let named = written.iter().any(|w| docs.contains(w.as_str()))
            || (key == "module" && docs.contains("[[module]]"));
        if !named {
            missing.push(format!("registry key `{key}` (in [{table}])"));
        }
    }
    assert!(missing.is_empty(), "not documented: {missing:?}");
}
