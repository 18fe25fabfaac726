//! What the kubelet sees of one DRA driver: the plugin watcher's registration socket
//! `<plugins_registry>/<driver>-reg.sock` (`GetInfo`: type `DRAPlugin`, the service socket as the
//! endpoint, `v1.DRAPlugin` then `v1beta1.DRAPlugin`) and the service socket
//! `<plugins>/<driver>/dra.sock` serving both versions of `DRAPlugin` from one implementation
//! (`prepare.rs`) and the device-health stream (`health.rs`), as the kubelet-plugin helper library lays them out. The service socket is
//! served first, so the endpoint the kubelet dials after `GetInfo` is already there. Both are
//! removed when the driver stops. A kubelet restart needs nothing from us: the watcher's scan
//! finds the registration socket again (its directory is not wiped).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use devicelet_api::dra::{self, v1, v1beta1};
use tokio::sync::watch;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

use super::prepare::{ClaimRef, Claims, PreparedDevice};
use crate::plugin_socket::{self, WatcherInfo};
use crate::resource::backend::DeviceBackend;

/// The registration socket of `driver` in the plugin watcher's directory.
pub fn registration_socket(registry_dir: &Path, driver: &str) -> PathBuf {
    registry_dir.join(format!("{driver}-reg.sock"))
}

/// The service socket of `driver` under the kubelet's plugins directory.
pub fn service_socket(plugins_dir: &Path, driver: &str) -> PathBuf {
    plugins_dir.join(driver).join("dra.sock")
}

/// When, after a registration, the pool is checked again (ms).
const REPUBLISH_AFTER_REGISTRATION_MS: [u64; 7] = [0, 250, 500, 1000, 2000, 4000, 8000];

/// Whether the kubelet said it registered the driver (its last `NotifyRegistrationStatus`).
#[derive(Debug, Default)]
pub struct Registered(AtomicBool);

impl Registered {
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The `DRAPlugin` service in both versions over one [`Claims`].
struct Plugin<B>(Arc<Claims<B>>);

impl<B> Clone for Plugin<B> {
    fn clone(&self) -> Self {
        Plugin(self.0.clone())
    }
}

/// Until when a call's claims may be worked on: nine tenths of the time the kubelet gave the
/// call (its `grpc-timeout`; 45 s when it sends none, what the kubelet gives), so an answer,
/// even a refusal, reaches it before it gives up.
fn call_deadline<T>(request: &Request<T>) -> tokio::time::Instant {
    let given = request
        .metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(grpc_timeout)
        .unwrap_or(KUBELET_CALL_TIMEOUT)
        .min(KUBELET_CALL_TIMEOUT);
    tokio::time::Instant::now() + given.mul_f32(0.9)
}

/// The time the kubelet gives a DRA call.
const KUBELET_CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// gRPC's `grpc-timeout`: at most eight digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
fn grpc_timeout(text: &str) -> Option<Duration> {
    let unit = text.chars().last()?;
    let digits = &text[..text.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n.saturating_mul(3600)),
        'M' => Duration::from_secs(n.saturating_mul(60)),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

impl<B: DeviceBackend> Plugin<B> {
    async fn prepare(
        &self,
        claims: Vec<v1::Claim>,
        deadline: tokio::time::Instant,
    ) -> v1::NodePrepareResourcesResponse {
        let refs = claims
            .into_iter()
            .map(|c| ClaimRef {
                namespace: c.namespace,
                name: c.name,
                uid: c.uid,
            })
            .collect();
        let answers = self.0.prepare(refs, deadline).await;
        let claims = answers
            .into_iter()
            .map(|(uid, answer)| {
                let entry = match answer {
                    Ok(devices) => v1::NodePrepareResourceResponse {
                        devices: devices.into_iter().map(wire_device).collect(),
                        error: String::new(),
                    },
                    Err(error) => v1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error: error.to_string(),
                    },
                };
                (uid, entry)
            })
            .collect();
        v1::NodePrepareResourcesResponse { claims }
    }

    async fn unprepare(
        &self,
        claims: Vec<v1::Claim>,
        deadline: tokio::time::Instant,
    ) -> v1::NodeUnprepareResourcesResponse {
        let answers = self
            .0
            .unprepare(claims.into_iter().map(|c| c.uid).collect(), deadline)
            .await;
        let claims = answers
            .into_iter()
            .map(|(uid, answer)| {
                let error = answer.err().map(|e| e.to_string()).unwrap_or_default();
                (uid, v1::NodeUnprepareResourceResponse { error })
            })
            .collect();
        v1::NodeUnprepareResourcesResponse { claims }
    }
}

fn wire_device(d: PreparedDevice) -> v1::Device {
    v1::Device {
        request_names: vec![d.request],
        pool_name: d.pool,
        device_name: d.device,
        cdi_device_ids: d.cdi_ids,
        share_id: None,
    }
}

#[tonic::async_trait]
impl<B: DeviceBackend> v1::dra_plugin_server::DraPlugin for Plugin<B> {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let deadline = call_deadline(&request);
        Ok(Response::new(
            self.prepare(request.into_inner().claims, deadline).await,
        ))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let deadline = call_deadline(&request);
        Ok(Response::new(
            self.unprepare(request.into_inner().claims, deadline).await,
        ))
    }
}

#[tonic::async_trait]
impl<B: DeviceBackend> v1beta1::dra_plugin_server::DraPlugin for Plugin<B> {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let deadline = call_deadline(&request);
        let claims = request.into_inner().claims.into_iter().map(Into::into);
        Ok(Response::new(
            self.prepare(claims.collect(), deadline).await.into(),
        ))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let deadline = call_deadline(&request);
        let claims = request.into_inner().claims.into_iter().map(Into::into);
        Ok(Response::new(
            self.unprepare(claims.collect(), deadline).await.into(),
        ))
    }
}

/// Where a driver is served, and whether the kubelet registered it.
pub struct Served {
    pub registration: PathBuf,
    pub service: PathBuf,
    pub registered: Arc<Registered>,
    /// The two servers; each removes its socket when it ends.
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Serves `claims`' driver until `stop` flips, then removes both sockets.
/// `republish` is woken right after each registration: a kubelet before 1.34 wipes a driver's
/// slices at once when its registration socket is replaced (an agent restarting after a
/// SIGKILL replaces its predecessor's), in the background, so the wipe may land just before or
/// just after the new registration. The watch of the driver's slices sees such a wipe; while
/// none is open (`watching`), the publisher is woken a few more times in the eight seconds
/// after the registration instead.
pub fn serve<B: DeviceBackend>(
    claims: Arc<Claims<B>>,
    (registry_dir, plugins_dir): (&Path, &Path),
    (republish, watching): (Arc<tokio::sync::Notify>, Arc<AtomicBool>),
    stop: watch::Receiver<bool>,
) -> std::io::Result<Served> {
    let driver = claims.driver.clone();
    let service = service_socket(plugins_dir, &driver);
    let registration = registration_socket(registry_dir, &driver);
    if let Some(dir) = service.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::create_dir_all(registry_dir)?;
    let health = super::health::HealthService {
        pool: claims.pool.clone(),
        devices: claims.devices.clone(),
    };
    let plugin = Plugin(claims);
    let routes = Routes::new(v1::dra_plugin_server::DraPluginServer::new(plugin.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(plugin))
        .add_service(dra::health::dra_resource_health_server::DraResourceHealthServer::new(health));
    let shutdown = |mut stop: watch::Receiver<bool>| async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let mut tasks = vec![plugin_socket::serve(
        &service,
        routes,
        None,
        shutdown(stop.clone()),
        true,
    )?];
    let registered = Arc::new(Registered::default());
    let notice = {
        let (driver, registered) = (driver.clone(), registered.clone());
        move |status: devicelet_api::pluginregistration::RegistrationStatus| {
            registered
                .0
                .store(status.plugin_registered, Ordering::Relaxed);
            if status.plugin_registered {
                tracing::info!(driver, "registered with the kubelet as a DRA driver");
                let (republish, watching) = (republish.clone(), watching.clone());
                tokio::spawn(async move {
                    let start = tokio::time::Instant::now();
                    for after_ms in REPUBLISH_AFTER_REGISTRATION_MS {
                        tokio::time::sleep_until(start + Duration::from_millis(after_ms)).await;
                        if after_ms > 0 && watching.load(Ordering::Relaxed) {
                            return;
                        }
                        republish.notify_one();
                    }
                });
            } else {
                tracing::warn!(
                    driver,
                    "the kubelet refused the DRA driver: {}",
                    status.error
                );
            }
        }
    };
    let registrar = plugin_socket::watcher_registration(
        WatcherInfo {
            kind: dra::DRA_PLUGIN,
            name: driver,
            endpoint: service.clone(),
            versions: dra::SUPPORTED_VERSIONS
                .into_iter()
                .chain([super::health::SERVICE])
                .map(String::from)
                .collect(),
        },
        notice,
    );
    tasks.push(plugin_socket::serve(
        &registration,
        Routes::new(registrar),
        None,
        shutdown(stop),
        true,
    )?);
    Ok(Served {
        registration,
        service,
        registered,
        tasks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read_as_grpc_writes_them_and_nonsense_is_none() {
        assert_eq!(grpc_timeout("44999m"), Some(Duration::from_millis(44_999)));
        assert_eq!(grpc_timeout("45S"), Some(Duration::from_secs(45)));
        assert_eq!(grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(grpc_timeout("250000u"), Some(Duration::from_millis(250)));
        for bad in ["", "S", "123456789S", "12x", "-1S", "1.5S", "10s"] {
            assert_eq!(grpc_timeout(bad), None, "{bad:?}");
        }
    }
}
