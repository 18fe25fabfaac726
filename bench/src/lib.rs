//! The benchmarks' statistics and their report: a library of its own so that their tests build
//! without compiling every benchmark a second time (the binary has no tests of its own).

pub mod report;
pub mod stats;
