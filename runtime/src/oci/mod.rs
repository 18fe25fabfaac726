//! Modules from OCI registries: the `source` reference (`reference.rs`), the content-addressed
//! store under the state directory (`store.rs`), pulling by digest with every byte checked
//! (`pull.rs`) and pushing a module as a wasm component artifact (`push.rs`). The README's
//! "Modules from OCI registries" says what works today; `docs/design/oci.md` the plan.

pub mod pull;
pub mod push;
pub mod reference;
pub mod store;

pub use pull::Fetcher;
pub use reference::OciSource;
