//! Modules from OCI registries: the `source` reference (parsed with the registry,
//! `config/oci_source.rs`), how registries are
//! reached (`access.rs`: TLS, insecure ones, credentials), the content-addressed store under
//! the state directory (`store.rs`), every read capped and under a deadline (`reader.rs`),
//! pulling by digest with every byte checked (`pull.rs`),
//! vendor signatures (`signature.rs`) and pushing a module as a wasm component artifact
//! (`push.rs`). `docs/oci.md` says what works; `docs/design/oci.md`
//! the facts behind it.

pub mod access;
pub mod pull;
pub mod push;
pub mod reader;
pub mod signature;
pub mod store;

pub use crate::config::OciSource;
pub use pull::Fetcher;
