//! A module as the resource core sees it. A [`ModuleHandle`] is a [`DeviceBackend`] (its four
//! calls, each failure mapped to a [`BackendError`] that keeps the module's name and the
//! failure's kind, so the front end's status says both unchanged). A [`ModuleSlot`] is where a
//! module's version lives while its resources are served: the backend the core calls, and its
//! upkeep (memory budget, version, runtime), in one.
//!
//! An upgrade swaps the new module version in behind the same sockets, registrations and
//! ListAndWatch streams, so the kubelet never sees the resources go away; a call in flight
//! finishes on the version it started on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use super::error::CallError;
use super::module::ModuleHandle;
use crate::device::{ContainerEdits, Inventory};
use crate::resource::backend::{BackendError, DeviceBackend, Upkeep};

#[derive(Clone)]
pub struct ModuleSlot {
    name: Arc<str>,
    current: Arc<RwLock<Arc<ModuleHandle>>>,
    /// How many times a new version was swapped in: the [`Upkeep::generation`].
    swaps: Arc<AtomicU64>,
}

impl ModuleSlot {
    pub fn new(module: ModuleHandle) -> Self {
        ModuleSlot {
            name: module.name().into(),
            current: Arc::new(RwLock::new(Arc::new(module))),
            swaps: Arc::default(),
        }
    }

    /// The version answering now.
    pub fn current(&self) -> Arc<ModuleHandle> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `next` in place for every later call; returns the version it replaces.
    pub fn replace(&self, next: ModuleHandle) -> Arc<ModuleHandle> {
        let mut slot = self.current.write().unwrap_or_else(PoisonError::into_inner);
        let previous = std::mem::replace(&mut *slot, Arc::new(next));
        self.swaps.fetch_add(1, Ordering::Release);
        previous
    }
}

impl DeviceBackend for ModuleSlot {
    /// The name the module had when this slot was made: an upgrade keeps the module's name.
    fn name(&self) -> &str {
        &self.name
    }

    async fn enumerate(&self, resource: &str) -> Result<Inventory, BackendError> {
        DeviceBackend::enumerate(&*self.current(), resource).await
    }

    async fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> Result<ContainerEdits, BackendError> {
        DeviceBackend::allocate(&*self.current(), resource, ids).await
    }

    async fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> Result<Vec<String>, BackendError> {
        DeviceBackend::preferred(&*self.current(), resource, available, must_include, size).await
    }

    async fn prestart(&self, resource: &str, ids: Vec<String>) -> Result<(), BackendError> {
        DeviceBackend::prestart(&*self.current(), resource, ids).await
    }

    async fn allocate_request(
        &self,
        request: crate::device::Request,
    ) -> Result<ContainerEdits, BackendError> {
        DeviceBackend::allocate_request(&*self.current(), request).await
    }

    async fn release(&self, request: crate::device::Request) -> Result<(), BackendError> {
        DeviceBackend::release(&*self.current(), request).await
    }

    async fn validate_config(&self, resource: &str, config: &str) -> Result<(), BackendError> {
        DeviceBackend::validate_config(&*self.current(), resource, config).await
    }

    fn prepares_claims(&self, resource: &str) -> bool {
        DeviceBackend::prepares_claims(&*self.current(), resource)
    }

    async fn prepare(
        &self,
        request: crate::device::Request,
    ) -> Result<crate::device::Prepared, BackendError> {
        DeviceBackend::prepare(&*self.current(), request).await
    }

    async fn unprepare(&self, request: crate::device::Request) -> Result<(), BackendError> {
        DeviceBackend::unprepare(&*self.current(), request).await
    }

    fn recheck_after(&self, resource: &str) -> Option<std::time::Duration> {
        self.current().recheck_after(resource)
    }
}

impl Upkeep for ModuleSlot {
    fn generation(&self) -> u64 {
        self.swaps.load(Ordering::Acquire)
    }

    fn keep_answers(&self, resource: &str, bytes: usize) -> Result<(), String> {
        self.current().keep_answers(resource, bytes)
    }

    fn release(&self, resource: &str) {
        self.current().forget(resource);
    }
}

impl From<CallError> for BackendError {
    fn from(e: CallError) -> Self {
        let message = e.to_string();
        match e {
            CallError::Plugin { .. } | CallError::InvalidOutput { .. } => {
                BackendError::Failed(message)
            }
            CallError::Deadline { .. } | CallError::Overran { .. } | CallError::Stalled { .. } => {
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

    async fn enumerate(&self, resource: &str) -> Result<Inventory, BackendError> {
        Ok(ModuleHandle::enumerate(self, resource).await?)
    }

    async fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> Result<ContainerEdits, BackendError> {
        let request = crate::device::Request::without_config(resource, ids);
        Ok(ModuleHandle::allocate(self, request).await?)
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

    async fn allocate_request(
        &self,
        request: crate::device::Request,
    ) -> Result<ContainerEdits, BackendError> {
        Ok(ModuleHandle::allocate(self, request).await?)
    }

    /// Only a module that exports `release` is called.
    async fn release(&self, request: crate::device::Request) -> Result<(), BackendError> {
        if self.has_release() {
            ModuleHandle::release(self, request).await?;
        }
        Ok(())
    }

    async fn validate_config(&self, resource: &str, config: &str) -> Result<(), BackendError> {
        Ok(ModuleHandle::validate_config(self, resource, config).await?)
    }

    fn prepares_claims(&self, resource: &str) -> bool {
        ModuleHandle::prepares_claims(self, resource)
    }

    async fn prepare(
        &self,
        request: crate::device::Request,
    ) -> Result<crate::device::Prepared, BackendError> {
        Ok(ModuleHandle::prepare(self, request).await?)
    }

    async fn unprepare(&self, request: crate::device::Request) -> Result<(), BackendError> {
        Ok(ModuleHandle::unprepare(self, request).await?)
    }

    fn recheck_after(&self, resource: &str) -> Option<std::time::Duration> {
        ModuleHandle::recheck_after(self, resource)
    }
}
