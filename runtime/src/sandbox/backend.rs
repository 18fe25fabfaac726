//! A running module as the kubelet side sees it: a [`DeviceBackend`].

use std::future::Future;

use super::error::CallError;
use super::module::ModuleHandle;
use crate::device::{ContainerEdits, Device};
use crate::kubelet::backend::{BackendError, DeviceBackend};

impl From<CallError> for BackendError {
    fn from(e: CallError) -> Self {
        let message = e.to_string();
        match e {
            CallError::Plugin { .. } | CallError::InvalidOutput { .. } => {
                BackendError::Failed(message)
            }
            CallError::Deadline { .. } => BackendError::Deadline(message),
            CallError::Trap { .. } | CallError::Unavailable { .. } => {
                BackendError::Unavailable(message)
            }
        }
    }
}

impl DeviceBackend for ModuleHandle {
    fn name(&self) -> &str {
        ModuleHandle::name(self)
    }

    fn enumerate(
        &self,
        resource: &str,
    ) -> impl Future<Output = Result<Vec<Device>, BackendError>> + Send {
        async move { Ok(ModuleHandle::enumerate(self, resource).await?) }
    }

    fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> impl Future<Output = Result<ContainerEdits, BackendError>> + Send {
        async move { Ok(ModuleHandle::allocate(self, resource, ids).await?) }
    }

    fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> impl Future<Output = Result<Vec<String>, BackendError>> + Send {
        async move { Ok(ModuleHandle::preferred(self, resource, available, must_include, size).await?) }
    }

    fn prestart(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        async move { Ok(ModuleHandle::prestart(self, resource, ids).await?) }
    }

    fn release(&self, resource: &str) {
        ModuleHandle::release(self, resource);
    }
}
