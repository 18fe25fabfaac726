//! Drivers that left the registry (their module removed, their resource gone, or the module
//! moved to the device-plugin front end) while claims they prepared were still in use. The
//! kubelet unprepares a claim only through the driver that prepared it, and a pod whose claims
//! cannot be unprepared never finishes terminating; so such a driver withdraws its
//! ResourceSlices (no new claim can get its devices) but keeps its sockets and registration,
//! answers prepare only for claims it prepared already (the same answer) and unprepare for
//! all, and stops once its last claim is unprepared. A driver of the same name served again
//! takes over: the retiring one stops first, and the new one reads its checkpoint.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::driver::RunningDriver;

/// How often a retiring driver looks whether its last claim is gone.
const LOOK: Duration = Duration::from_millis(200);

/// The retiring drivers, by driver name. Cheap to clone: clones share them.
#[derive(Clone, Default)]
pub struct Retirees(Arc<Mutex<BTreeMap<String, RunningDriver>>>);

impl std::fmt::Debug for Retirees {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.lock().keys()).finish()
    }
}

impl Retirees {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, RunningDriver>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `driver` serving its prepared claims until the last is unprepared.
    pub fn hold(&self, driver: RunningDriver) {
        let name = driver.driver.clone();
        let claims = driver.claims.clone();
        tracing::info!(
            driver = name,
            claims = claims.prepared(),
            "DRA driver left the registry: it answers for the claims it prepared until they are \
             unprepared"
        );
        if let Some(old) = self.lock().insert(name.clone(), driver) {
            // Not reached: a name is held once, and taken over before it is served again.
            tokio::spawn(old.shutdown());
        }
        let retirees = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(LOOK).await;
                if claims.prepared() > 0 {
                    continue;
                }
                // Still this one (not taken over meanwhile)?
                let retired = {
                    let mut held = retirees.lock();
                    let ours = held
                        .get(&name)
                        .is_some_and(|d| Arc::ptr_eq(&d.claims, &claims));
                    if ours { held.remove(&name) } else { None }
                };
                if let Some(driver) = retired {
                    tracing::info!(
                        driver = name,
                        "retired DRA driver: its last claim is unprepared"
                    );
                    driver.shutdown().await;
                }
                return;
            }
        });
    }

    /// The retiring driver called `name`, if any, stops (its checkpoint stays) so that a new
    /// one can serve the name.
    pub async fn take_over(&self, name: &str) {
        let old = self.lock().remove(name);
        if let Some(old) = old {
            tracing::info!(
                driver = name,
                "served again: the retiring driver hands over"
            );
            old.shutdown().await;
        }
    }

    /// Stops every retiring driver (the agent stops); their checkpoints stay.
    pub async fn stop_all(&self) {
        let all: Vec<RunningDriver> = std::mem::take(&mut *self.lock()).into_values().collect();
        for driver in all {
            driver.shutdown().await;
        }
    }

    /// `f` of each retiring driver, for status.
    pub fn each<T>(&self, f: impl Fn(&RunningDriver) -> T) -> Vec<T> {
        self.lock().values().map(f).collect()
    }
}
