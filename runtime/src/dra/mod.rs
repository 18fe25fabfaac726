//! The Dynamic Resource Allocation front end (issue 25, in progress): the same modules serving
//! ResourceClaims through the kubelet's DRA plugin API. So far the names it publishes; see the
//! README's DRA section for what works today.

pub mod api;
pub mod names;
