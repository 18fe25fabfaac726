//! What the host decides for every resource, whatever module serves it: pure functions over the
//! device snapshot, free of WebAssembly and of gRPC, so they are tested and measured alone.

pub mod groups;
pub mod preferred;
pub mod sharing;
pub mod topology;

pub use crate::config::AllocationPolicy;

/// Who answers GetPreferredAllocation for one resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preferred {
    Module,
    Host(preferred::Spread),
    Off,
}

impl AllocationPolicy {
    /// Who answers for a resource whose module does (or does not) ask for preferred calls.
    pub fn for_resource(self, module_offers: bool) -> Preferred {
        use preferred::Spread;
        match self {
            AllocationPolicy::Module if module_offers => Preferred::Module,
            AllocationPolicy::Module | AllocationPolicy::Packed => Preferred::Host(Spread::Packed),
            AllocationPolicy::Distributed => Preferred::Host(Spread::Distributed),
            AllocationPolicy::None => Preferred::Off,
        }
    }
}
