//! The registry as a whole: reading the file, the top-level keys, and the checks that span
//! modules (there is at least one; names are unique).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use toml::de::DeTable;

use super::error::RegistryError;
use super::keypath::KeyPath;
use super::limits::{DEFAULT_HOST_ROOT, DEFAULT_RESOURCE_DOMAIN, MAX_MODULES};
use super::module::{self, ModuleSpec};
use super::source::{Source, line_column};
use super::value::{Node, Table};

/// The node's module registry, validated: every module devicelet is to run, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registry {
    /// The file this was read from, as given; errors found later (a missing module file, a digest
    /// mismatch) can name it.
    pub file: PathBuf,
    /// Where sysfs and /dev are read from: `/` on a node, a fixture tree in tests and demos.
    /// Grants are still written against `/sys/...` and `/dev/...`; this prefix is applied on
    /// access, so the same registry works on a node and against a fixture.
    pub host_root: PathBuf,
    /// At least one; names are unique.
    pub modules: Vec<ModuleSpec>,
}

pub(super) const KEYS: &[&str] = &["host-root", "resource-domain", "module"];

impl Registry {
    /// Reads and validates the registry at `path`.
    pub fn load(path: &Path) -> Result<Registry, RegistryError> {
        let bytes =
            crate::files::read_regular(path, crate::files::MAX_REGISTRY).map_err(|error| {
                RegistryError::Read {
                    file: path.to_path_buf(),
                    error,
                }
            })?;
        match std::str::from_utf8(&bytes) {
            Ok(text) => Registry::parse(text, path),
            Err(error) => {
                // Position the reader at the first bad byte rather than saying only "bad UTF-8".
                let valid = String::from_utf8_lossy(&bytes[..error.valid_up_to()]);
                let (line, column) = line_column(&valid, valid.len());
                Err(RegistryError::Invalid {
                    file: path.to_path_buf(),
                    line,
                    column,
                    key: None,
                    message: "the registry is not valid UTF-8 text".to_string(),
                })
            }
        }
    }

    /// Validates registry `text` as if read from `file`, which names the file in errors and is
    /// the base for relative module paths.
    pub fn parse(text: &str, file: &Path) -> Result<Registry, RegistryError> {
        let src = Source::new(file, text);
        let document = DeTable::parse(text).map_err(|error| src.syntax_error(&error))?;
        let root = Table::root(&src, &document);

        let mut host_root = PathBuf::from(DEFAULT_HOST_ROOT);
        let mut resource_domain = DEFAULT_RESOURCE_DOMAIN.to_string();
        let mut module_list = None;
        for entry in root.entries() {
            match entry.name {
                "host-root" => host_root = host_root_of(&entry.node)?,
                "resource-domain" => resource_domain = module::resource_domain_of(&entry.node)?,
                "module" => module_list = Some(entry.node),
                _ => return Err(entry.unknown(KEYS)),
            }
        }

        let no_modules = "the registry lists no modules; add at least one [[module]] table";
        let Some(module_list) = module_list else {
            return Err(src.error(0, &KeyPath::root().key("module"), no_modules));
        };
        let items = module_list.array("an array of tables, written [[module]]")?;
        if items.is_empty() {
            return Err(module_list.error(no_modules));
        }
        if let Some(over) = items.get(MAX_MODULES) {
            return Err(over.error(format!(
                "the registry lists {} modules; at most {MAX_MODULES} are allowed (this is the \
                 first one over)",
                items.len()
            )));
        }

        let base = file.parent().unwrap_or(Path::new(""));
        // Name -> (the module that first used it, where its name was written).
        let mut seen: HashMap<String, (KeyPath, usize)> = HashMap::new();
        let mut modules = Vec::with_capacity(items.len());
        for item in &items {
            let parsed = module::parse(item, base, &resource_domain)?;
            let name = &parsed.spec.name;
            if let Some((first, offset)) = seen.get(name) {
                let (line, _) = line_column(text, *offset);
                return Err(src.error(
                    parsed.name_span.start,
                    &item.path.key("name"),
                    format!(
                        "duplicate module name {name:?}: `{first}` at line {line} already has it"
                    ),
                ));
            }
            seen.insert(name.clone(), (item.path.clone(), parsed.name_span.start));
            modules.push(parsed.spec);
        }

        Ok(Registry {
            file: file.to_path_buf(),
            host_root,
            modules,
        })
    }

    /// The module called `name`, if the registry lists one.
    pub fn module(&self, name: &str) -> Option<&ModuleSpec> {
        self.modules.iter().find(|module| module.name == name)
    }
}

fn host_root_of(node: &Node<'_>) -> Result<PathBuf, RegistryError> {
    let text = node.str()?;
    let path = PathBuf::from(text);
    if !path.is_absolute() {
        return Err(node.error(format!(
            "host-root {text:?} is not an absolute path; expected e.g. \"/\" on a node or \
             \"/var/lib/devicelet/fixture\" for a fixture tree"
        )));
    }
    Ok(path)
}
