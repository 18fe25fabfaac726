//! The rules the agent and the SDK's test kit must apply identically, written once: whether a path
//! is inside a module's grants (and how much a host call hands back), what an answer may not
//! repeat, and the fixture `dev.list` format both read. A module tested with the kit meets exactly the agent's answers because both
//! call these functions.

pub mod dev_list;
pub mod edits;
pub mod grants;
