//! Dotted key paths such as `module[0].grants.dev[1]`. Every registry has several `[[module]]`
//! entries with the same keys, so an error must say which entry it means, not just `dev`.

use std::fmt;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct KeyPath(String);

impl KeyPath {
    /// The document itself; an error at the root names no key.
    pub(super) fn root() -> Self {
        Self::default()
    }

    pub(super) fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// The path of `name` inside the table at `self`. Keys that are not bare TOML keys (possible
    /// inside a free-form `config` table) are quoted so the path stays unambiguous.
    pub(super) fn key(&self, name: &str) -> Self {
        let mut path = self.0.clone();
        if !path.is_empty() {
            path.push('.');
        }
        let bare = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if bare {
            path.push_str(name);
        } else {
            path.push_str(&format!("{name:?}"));
        }
        KeyPath(path)
    }

    /// The path of the `index`th element of the array at `self`.
    pub(super) fn index(&self, index: usize) -> Self {
        KeyPath(format!("{}[{index}]", self.0))
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::KeyPath;

    #[test]
    fn paths_render_like_the_toml_that_wrote_them() {
        let root = KeyPath::root();
        assert!(root.is_root());
        assert_eq!(
            root.key("module").index(2).key("call-deadline").to_string(),
            "module[2].call-deadline"
        );
        assert_eq!(
            root.key("a").key("b.c").key("").to_string(),
            "a.\"b.c\".\"\""
        );
    }
}
