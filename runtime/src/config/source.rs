//! The registry text and its file name, for turning byte offsets into the `file:line:column`
//! positions an operator can find in an editor.

use std::path::Path;

use super::error::RegistryError;
use super::keypath::KeyPath;

pub(super) struct Source<'a> {
    file: &'a Path,
    text: &'a str,
}

impl<'a> Source<'a> {
    pub(super) fn new(file: &'a Path, text: &'a str) -> Self {
        Source { file, text }
    }

    pub(super) fn text(&self) -> &'a str {
        self.text
    }

    /// An error about the text at byte `offset`, naming `key` unless it is the document root.
    pub(super) fn location(&self, offset: usize) -> String {
        let (line, _) = line_column(self.text, offset);
        format!("{}:{line}", self.file.display())
    }

    pub(super) fn error(
        &self,
        offset: usize,
        key: &KeyPath,
        message: impl Into<String>,
    ) -> RegistryError {
        let (line, column) = line_column(self.text, offset);
        RegistryError::Invalid {
            file: self.file.to_path_buf(),
            line,
            column,
            key: (!key.is_root()).then(|| key.to_string()),
            message: message.into(),
        }
    }

    /// A TOML syntax error: the text is not TOML, so there is no key to name, only a position.
    pub(super) fn syntax_error(&self, error: &toml::de::Error) -> RegistryError {
        let span = error.span().unwrap_or(0..0);
        let mut message = format!("invalid TOML: {}", error.message().trim_end());
        // toml says only "duplicate key"; quote the key so the reader need not count columns.
        if message.ends_with("duplicate key")
            && let Some(key) = self.text.get(span.clone())
            && !key.is_empty()
            && !key.contains('\n')
        {
            message.push_str(&format!(" `{key}`"));
        }
        self.error(span.start, &KeyPath::root(), message)
    }
}

/// 1-based line and column (in characters, as editors count them) of byte `offset` in `text`.
/// Offsets past the end, as toml gives for "unexpected end of file", land just after the text.
pub(super) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line_start = before.rfind('\n').map_or(0, |newline| newline + 1);
    let line = before.matches('\n').count() + 1;
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::line_column;

    #[test]
    fn positions_are_one_based_and_count_characters() {
        let text = "a = 1\nbé = \"x\"\n";
        assert_eq!(line_column(text, 0), (1, 1));
        assert_eq!(line_column(text, 4), (1, 5));
        assert_eq!(line_column(text, 6), (2, 1));
        // "bé = " is 6 bytes but 5 characters.
        assert_eq!(line_column(text, 12), (2, 6));
        // Inside a multi-byte character, and past the end.
        assert_eq!(line_column(text, 8), (2, 2));
        assert_eq!(line_column(text, 1000), (3, 1));
        assert_eq!(line_column("", 0), (1, 1));
    }
}
