//! A running module as the kubelet side sees it: a [`DeviceBackend`].

use super::error::CallError;
use super::module::ModuleHandle;
use crate::device::{ContainerEdits, Device};
use crate::kubelet::backend::{BackendError, DeviceBackend, ServingPlace};

impl From<CallError> for BackendError {
    fn from(e: CallError) -> Self {
        let message = e.to_string();
        match e {
            CallError::Plugin { .. } | CallError::InvalidOutput { .. } => {
                BackendError::Failed(message)
            }
            CallError::Deadline { .. } | CallError::Overran { .. } => {
                BackendError::Deadline(message)
            }
            CallError::Trap { .. } => BackendError::Crashed(message),
            CallError::Unavailable { .. } => BackendError::Unavailable(message),
        }
    }
}

impl DeviceBackend for ModuleHandle {
    fn name(&self) -> &str {
        ModuleHandle::name(self)
    }

    async fn enumerate(&self, resource: &str) -> Result<Vec<Device>, BackendError> {
        Ok(ModuleHandle::enumerate(self, resource).await?)
    }

    async fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> Result<ContainerEdits, BackendError> {
        Ok(ModuleHandle::allocate(self, resource, ids).await?)
    }

    async fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> Result<Vec<String>, BackendError> {
        Ok(ModuleHandle::preferred(self, resource, available, must_include, size).await?)
    }

    async fn prestart(&self, resource: &str, ids: Vec<String>) -> Result<(), BackendError> {
        Ok(ModuleHandle::prestart(self, resource, ids).await?)
    }

    fn keep_answers(&self, resource: &str, bytes: usize) -> Result<(), String> {
        ModuleHandle::keep_answers(self, resource, bytes)
    }

    fn release(&self, resource: &str) {
        ModuleHandle::release(self, resource);
    }

    fn serving_place(&self) -> Option<ServingPlace> {
        // A lost home (the module failed for good, or no new home could be made) is no place
        // to serve: the servers stay on the agent's runtime and answer that the module is down.
        let home = self.home().filter(|h| !h.is_lost())?;
        Some(ServingPlace {
            runtime: home.handle().clone(),
            lost: home.lost(),
            keep_alive: home,
        })
    }
}
