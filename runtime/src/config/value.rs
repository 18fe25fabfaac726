//! A typed view over the parsed TOML document that remembers, for every value, where it came from
//! (its byte span) and what it is called (its key path). Walking the document by hand rather than
//! through serde derive is deliberate: it lets every error, including "unknown key" and "missing
//! key", carry the exact position and full key path, and keeps the free-form `config` table free.

use std::ops::Range;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::error::RegistryError;
use super::keypath::KeyPath;
use super::source::Source;

/// One value of the document, with its position and name.
#[derive(Clone)]
pub(super) struct Node<'a> {
    pub(super) src: &'a Source<'a>,
    pub(super) path: KeyPath,
    pub(super) value: &'a Spanned<DeValue<'a>>,
}

impl<'a> Node<'a> {
    pub(super) fn span(&self) -> Range<usize> {
        self.value.span()
    }

    pub(super) fn get(&self) -> &'a DeValue<'a> {
        self.value.get_ref()
    }

    /// An error about this value as a whole, pointing at its first character.
    /// `file:line` of this value, for messages that arise later (a module refusing its
    /// config) but should still send the reader to the registry.
    pub(super) fn location(&self) -> String {
        self.src.location(self.span().start)
    }

    pub(super) fn error(&self, message: impl Into<String>) -> RegistryError {
        self.src.error(self.span().start, &self.path, message)
    }

    /// An error about the character at `char_index` of this string value, when the source text
    /// spells the string literally (no escapes), so the column points right at the fault;
    /// otherwise at the string as a whole.
    pub(super) fn error_in_str(
        &self,
        char_index: usize,
        message: impl Into<String>,
    ) -> RegistryError {
        let span = self.span();
        let offset = self
            .get()
            .as_str()
            .zip(self.src.text().get(span.clone()))
            .and_then(|(decoded, raw)| {
                let quoted =
                    raw.len() == decoded.len() + 2 && raw.get(1..raw.len() - 1) == Some(decoded);
                let within = decoded.char_indices().nth(char_index).map(|(byte, _)| byte);
                if quoted {
                    within.map(|byte| span.start + 1 + byte)
                } else {
                    None
                }
            })
            .unwrap_or(span.start);
        self.src.error(offset, &self.path, message)
    }

    /// "expected a string, found an integer", and the like.
    pub(super) fn type_error(&self, expected: &str) -> RegistryError {
        let found = self.get().type_str();
        self.error(format!(
            "expected {expected}, found {} {found}",
            article(found)
        ))
    }

    pub(super) fn str(&self) -> Result<&'a str, RegistryError> {
        self.get()
            .as_str()
            .ok_or_else(|| self.type_error("a string"))
    }

    /// The array's elements, each named `path[i]`. `expected` describes the array in the
    /// type error, e.g. "an array of strings".
    pub(super) fn array(&self, expected: &str) -> Result<Vec<Node<'a>>, RegistryError> {
        let array = self
            .get()
            .as_array()
            .ok_or_else(|| self.type_error(expected))?;
        Ok(array
            .iter()
            .enumerate()
            .map(|(index, value)| Node {
                src: self.src,
                path: self.path.index(index),
                value,
            })
            .collect())
    }

    pub(super) fn table(&self, expected: &str) -> Result<Table<'a>, RegistryError> {
        let table = self
            .get()
            .as_table()
            .ok_or_else(|| self.type_error(expected))?;
        Ok(Table {
            src: self.src,
            path: self.path.clone(),
            span: self.span(),
            table,
        })
    }
}

/// A table of the document: a `[header]` table, an inline table or the document root.
pub(super) struct Table<'a> {
    src: &'a Source<'a>,
    path: KeyPath,
    span: Range<usize>,
    table: &'a DeTable<'a>,
}

impl<'a> Table<'a> {
    pub(super) fn root(src: &'a Source<'a>, table: &'a Spanned<DeTable<'a>>) -> Self {
        Table {
            src,
            path: KeyPath::root(),
            span: table.span(),
            table: table.get_ref(),
        }
    }

    /// The entries in the order they appear in the file, so that the first error reported is the
    /// first one the reader meets.
    pub(super) fn entries(&self) -> Vec<Entry<'a>> {
        let mut entries: Vec<Entry<'a>> = self
            .table
            .iter()
            .map(|(key, value)| Entry {
                name: key.get_ref().as_ref(),
                key_span: key.span(),
                node: Node {
                    src: self.src,
                    path: self.path.key(key.get_ref()),
                    value,
                },
            })
            .collect();
        entries.sort_by_key(|entry| entry.key_span.start);
        entries
    }

    /// An error about the table as a whole (two keys that exclude each other), pointing at it.
    pub(super) fn error(&self, message: impl Into<String>) -> RegistryError {
        self.src.error(self.span.start, &self.path, message)
    }

    /// A required key is absent: point at the table that should have held it (its `[[header]]`,
    /// or its opening brace when inline).
    pub(super) fn missing(&self, key: &str) -> RegistryError {
        self.missing_because(key, format!("missing required key `{key}`"))
    }

    /// [`missing`](Self::missing), saying more.
    pub(super) fn missing_because(&self, key: &str, message: impl Into<String>) -> RegistryError {
        self.src
            .error(self.span.start, &self.path.key(key), message)
    }
}

/// One `key = value` of a table.
pub(super) struct Entry<'a> {
    pub(super) name: &'a str,
    key_span: Range<usize>,
    pub(super) node: Node<'a>,
}

impl Entry<'_> {
    /// The key is not one of `allowed`: point at the key itself, and suggest the allowed key it
    /// was probably meant to be.
    pub(super) fn unknown(&self, allowed: &[&str]) -> RegistryError {
        let mut message = String::from("unknown key");
        if let Some(close) = closest(self.name, allowed) {
            message.push_str(&format!("; did you mean `{close}`?"));
        }
        message.push_str(&format!(" (allowed here: {})", allowed.join(", ")));
        self.node
            .src
            .error(self.key_span.start, &self.node.path, message)
    }
}

fn article(type_name: &str) -> &'static str {
    match type_name.as_bytes().first() {
        Some(b'a' | b'e' | b'i' | b'o' | b'u') => "an",
        _ => "a",
    }
}

/// The allowed key nearest to a misspelt one, if any is near enough to be a plausible typo.
fn closest<'k>(name: &str, allowed: &[&'k str]) -> Option<&'k str> {
    let lowered = name.to_ascii_lowercase().replace('_', "-");
    allowed
        .iter()
        .map(|candidate| (edit_distance(&lowered, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= (candidate.len() / 3).max(1))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// Optimal-string-alignment distance: edits plus adjacent transpositions, the usual typos.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::{article, closest};

    #[test]
    fn typos_suggest_the_intended_key() {
        let allowed = [
            "name",
            "path",
            "health-interval",
            "call-deadline",
            "memory-limit",
        ];
        assert_eq!(closest("helth-interval", &allowed), Some("health-interval"));
        assert_eq!(closest("memory_limit", &allowed), Some("memory-limit"));
        assert_eq!(closest("nmae", &allowed), Some("name"));
        assert_eq!(closest("colour", &allowed), None);
        assert_eq!(article("integer"), "an");
        assert_eq!(article("string"), "a");
    }
}
