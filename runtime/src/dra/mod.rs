//! The Dynamic Resource Allocation front end: the same modules serving ResourceClaims through
//! the kubelet's DRA plugin API, with ResourceSlices published to the API server. One driver
//! per served resource (`driver.rs`), built on the resource core like the device-plugin front
//! end. The README's DRA section says what works today and what does not yet.

pub mod api;
pub mod checkpoint;
pub mod claim;
pub mod driver;
pub mod health;
pub mod names;
pub mod prepare;
pub mod server;
pub mod slices;
