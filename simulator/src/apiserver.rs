//! A small Kubernetes API server: the objects a DRA driver and the kubelet's DRA manager touch
//! (`Node`, `resource.k8s.io/v1` `ResourceSlice`, `ResourceClaim`, `DeviceClass`), served as the
//! real one serves them to a client such as `kube`: JSON over HTTP/1.1 on 127.0.0.1, the REST
//! paths and verbs (get, list with field selectors, create with `generateName`, update, delete,
//! delete-collection), `metadata.resourceVersion` bumped on every write with **409 Conflict** for
//! an update that carries a stale one, `metadata.uid` and `generation` assigned, and
//! `metav1.Status` errors with the real reasons and wording (NotFound, AlreadyExists, Conflict,
//! Invalid with the field path). ResourceSlices are validated against the API's limits
//! (`validation.rs`). Watches are streamed as the real server streams them (`watch.rs`).
//!
//! It can be stopped and started again on the same address, for "the API server is down for a
//! while" scenarios; what it holds survives.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::validation;

mod watch;

/// The kinds served, as their REST collections name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Node,
    ResourceSlice,
    ResourceClaim,
    DeviceClass,
}

impl Kind {
    /// The resource's name in its API group, as RBAC rules name it.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Node => "nodes",
            Kind::ResourceSlice => "resourceslices",
            Kind::ResourceClaim => "resourceclaims",
            Kind::DeviceClass => "deviceclasses",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Node => "Node",
            Kind::ResourceSlice => "ResourceSlice",
            Kind::ResourceClaim => "ResourceClaim",
            Kind::DeviceClass => "DeviceClass",
        }
    }

    /// The API group (`""` for the core group), as RBAC rules name it.
    pub fn group(self) -> &'static str {
        match self {
            Kind::Node => "",
            _ => "resource.k8s.io",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::Node => "v1",
            _ => "resource.k8s.io/v1",
        }
    }

    /// `resourceslices.resource.k8s.io`, as errors name the resource.
    fn qualified(self) -> String {
        match self {
            Kind::Node => self.plural().to_string(),
            _ => format!("{}.resource.k8s.io", self.plural()),
        }
    }

    fn namespaced(self) -> bool {
        self == Kind::ResourceClaim
    }
}

/// Where an object lives: its kind, namespace ("" when cluster-scoped) and name.
pub(crate) type Key = (Kind, String, String);

#[derive(Default)]
pub(crate) struct Store {
    pub(crate) objects: BTreeMap<Key, Value>,
    resource_version: u64,
    uids: u64,
    /// Requests answered, by verb, kind and subresource, for tests that count what a client
    /// did.
    requests: Vec<(String, Kind, Option<&'static str>)>,
    /// Claim reads held back until this many have arrived, then answered together
    /// ([`ApiServer::release_claim_reads_together`]).
    claim_reads: Option<(usize, Arc<tokio::sync::Barrier>)>,
    /// Claim reads answered with their headers at once and their body this many bytes a
    /// second ([`ApiServer::trickle_claim_reads`]).
    trickle: Option<usize>,
    /// Lists answered with every object of the kind, whatever the field selector
    /// ([`ApiServer::ignore_field_selectors`]).
    ignore_selectors: bool,
    /// The DRADeviceTaints feature is off ([`ApiServer::drop_device_taints`]).
    taints_off: bool,
    /// The DRAConsumableCapacity feature is off ([`ApiServer::drop_consumable_capacity`]).
    consumable_off: bool,
    /// Every `User-Agent` clients sent ([`ApiServer::user_agents`]).
    user_agents: std::collections::BTreeSet<String>,
    /// Which field manager owns each `status.devices` entry of a claim, by (driver, pool,
    /// device): what server-side apply tracks in `managedFields`.
    pub(crate) status_owners: BTreeMap<Key, BTreeMap<(String, String, String), String>>,
    /// Changes kept for watches, and the watches open.
    pub(crate) watches: watch::Watches,
}

/// An API error as `metav1.Status`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl ApiError {
    pub(crate) fn not_found(kind: Kind, name: &str) -> ApiError {
        ApiError {
            code: 404,
            reason: "NotFound",
            message: format!("{} {name:?} not found", kind.qualified()),
        }
    }

    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            code: 400,
            reason: "BadRequest",
            message: message.into(),
        }
    }

    fn status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

impl Store {
    /// A UID no other object (or share) of this server has, as the API server makes them.
    pub(crate) fn next_uid(&mut self) -> String {
        self.uids += 1;
        format!("00000000-0000-4000-8000-{:012x}", self.uids)
    }

    pub(crate) fn next_version(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }

    pub(crate) fn create(
        &mut self,
        kind: Kind,
        namespace: &str,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        let meta = object
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| ApiError::bad_request("the object has no metadata"))?;
        let name = match (
            meta.get("name").and_then(Value::as_str),
            meta.get("generateName").and_then(Value::as_str),
        ) {
            (Some(name), _) if !name.is_empty() => name.to_string(),
            (_, Some(prefix)) if !prefix.is_empty() => {
                self.uids += 1;
                format!("{prefix}{:05x}", self.uids)
            }
            _ => {
                return Err(invalid(
                    kind,
                    "",
                    vec!["metadata.name: Required value: name or generateName is required".into()],
                ));
            }
        };
        let key = (kind, namespace.to_string(), name.clone());
        if self.objects.contains_key(&key) {
            return Err(ApiError {
                code: 409,
                reason: "AlreadyExists",
                message: format!("{} {name:?} already exists", kind.qualified()),
            });
        }
        let uid = self.next_uid();
        meta.insert("name".into(), json!(name));
        meta.insert("uid".into(), json!(uid));
        meta.insert("generation".into(), json!(1));
        if kind.namespaced() {
            meta.insert("namespace".into(), json!(namespace));
        }
        object["apiVersion"] = json!(kind.api_version());
        object["kind"] = json!(kind.name());
        if kind == Kind::ResourceSlice {
            self.prepare_slice(&mut object, None);
        }
        check(kind, &name, &object)?;
        object["metadata"]["resourceVersion"] = json!(self.next_version());
        self.record(&key, "ADDED", &object);
        self.objects.insert(key, object.clone());
        Ok(object)
    }

    /// What the server does to a ResourceSlice before validating a write
    /// (`pkg/registry/resource/resourceslice/strategy.go`): with DRADeviceTaints off, taints
    /// are dropped unless the stored slice already had some; with it on, a taint without
    /// `timeAdded` gets the current time.
    fn prepare_slice(&self, object: &mut Value, old: Option<&Value>) {
        let has_taints = |slice: &Value| {
            slice["spec"]["devices"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|d| d.get("taints").is_some_and(|t| !t.is_null()))
        };
        let drop = self.taints_off && !old.is_some_and(has_taints);
        // As dropDisabledFields: with DRAConsumableCapacity off, a device's
        // allowMultipleAllocations and its capacities' request policies go, unless the stored
        // slice already used them.
        let shares = |slice: &Value| {
            slice["spec"]["devices"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|d| {
                    d.get("allowMultipleAllocations")
                        .is_some_and(|a| !a.is_null())
                })
        };
        if self.consumable_off && !old.is_some_and(shares) {
            for device in object["spec"]["devices"]
                .as_array_mut()
                .into_iter()
                .flatten()
            {
                let Some(device) = device.as_object_mut() else {
                    continue;
                };
                device.remove("allowMultipleAllocations");
                let capacities = device.get_mut("capacity").and_then(Value::as_object_mut);
                for capacity in capacities.into_iter().flat_map(|c| c.values_mut()) {
                    if let Some(capacity) = capacity.as_object_mut() {
                        capacity.remove("requestPolicy");
                    }
                }
            }
        }
        let now = devicelet_api::timestamp::now_rfc3339();
        let devices = object["spec"]["devices"].as_array_mut();
        for device in devices.into_iter().flatten() {
            let Some(device) = device.as_object_mut() else {
                continue;
            };
            if drop {
                device.remove("taints");
                continue;
            }
            for taint in device
                .get_mut("taints")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                if taint.get("timeAdded").is_none_or(Value::is_null) && taint.is_object() {
                    taint["timeAdded"] = json!(now);
                }
            }
        }
    }

    fn update(
        &mut self,
        kind: Kind,
        namespace: &str,
        name: &str,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        let key = (kind, namespace.to_string(), name.to_string());
        let current = self
            .objects
            .get(&key)
            .ok_or_else(|| ApiError::not_found(kind, name))?;
        let given = object["metadata"]["resourceVersion"].as_str().unwrap_or("");
        if given.is_empty() {
            return Err(invalid(
                kind,
                name,
                vec![
                    "metadata.resourceVersion: Invalid value: 0: must be specified for an update"
                        .into(),
                ],
            ));
        }
        if given
            != current["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or("")
        {
            return Err(ApiError {
                code: 409,
                reason: "Conflict",
                message: format!(
                    "Operation cannot be fulfilled on {} {name:?}: the object has been modified; \
                     please apply your changes to the latest version and try again",
                    kind.qualified()
                ),
            });
        }
        if object["metadata"]["name"].as_str() != Some(name) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({}) does not match the name on the URL ({name})",
                object["metadata"]["name"]
            )));
        }
        // Server-owned fields are kept; the spec's generation moves only when the spec changes.
        let generation = current["metadata"]["generation"].as_i64().unwrap_or(1);
        let changed = current.get("spec") != object.get("spec");
        object["metadata"]["uid"] = current["metadata"]["uid"].clone();
        object["metadata"]["generation"] = json!(generation + i64::from(changed));
        if kind.namespaced() {
            object["metadata"]["namespace"] = json!(namespace);
        }
        object["apiVersion"] = json!(kind.api_version());
        object["kind"] = json!(kind.name());
        if kind == Kind::ResourceSlice {
            let old = current.clone();
            self.prepare_slice(&mut object, Some(&old));
        }
        check(kind, name, &object)?;
        object["metadata"]["resourceVersion"] = json!(self.next_version());
        self.record(&key, "MODIFIED", &object);
        self.objects.insert(key, object.clone());
        Ok(object)
    }

    pub(crate) fn list(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        selector: &[(String, String)],
    ) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((k, ns, _), _)| *k == kind && namespace.is_none_or(|n| n == ns))
            .filter(|(_, object)| {
                selector
                    .iter()
                    .all(|(field, want)| field_value(object, field) == *want)
            })
            .map(|(_, object)| object.clone())
            .collect()
    }
}

/// A field selector's value of `object` (`spec.nodeName`, `metadata.name`...).
fn field_value(object: &Value, field: &str) -> String {
    let value = field.split('.').fold(object, |v, part| &v[part]);
    match value {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn invalid(kind: Kind, name: &str, causes: Vec<String>) -> ApiError {
    ApiError {
        code: 422,
        reason: "Invalid",
        message: format!(
            "{}.{} {name:?} is invalid: {}",
            kind.name(),
            group_of(kind),
            causes.join(", ")
        ),
    }
}

fn group_of(kind: Kind) -> &'static str {
    match kind {
        Kind::Node => "",
        _ => "resource.k8s.io",
    }
}

fn check(kind: Kind, name: &str, object: &Value) -> Result<(), ApiError> {
    let causes = match kind {
        Kind::ResourceSlice => validation::resource_slice(name, object),
        _ => validation::object_name(name),
    };
    if causes.is_empty() {
        Ok(())
    } else {
        Err(invalid(kind, name, causes))
    }
}

/// The stand-in's objects as the simulated kubelet and scheduler in the same process reach them
/// (`scheduler.rs`): their requests are not counted among the clients' in
/// [`ApiServer::requests`]. Cheap to clone.
#[derive(Clone)]
pub struct ApiHandle {
    pub(crate) store: Arc<Mutex<Store>>,
}

impl std::fmt::Debug for ApiHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiHandle")
    }
}

/// The same server.
impl PartialEq for ApiHandle {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.store, &other.store)
    }
}

impl ApiHandle {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }
}

/// The API server stand-in; dropping it stops serving.
pub struct ApiServer {
    addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl ApiServer {
    /// Serves on 127.0.0.1 at a free port.
    pub async fn start() -> std::io::Result<ApiServer> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let store = Arc::new(Mutex::new(Store::default()));
        let task = tokio::spawn(serve(listener, store.clone()));
        Ok(ApiServer {
            addr,
            store,
            task: Mutex::new(Some(task)),
        })
    }

    /// Its objects, for the simulated kubelet ([`SimConfig::dra_api`](crate::SimConfig)) and
    /// scheduler ([`ApiHandle::allocate_claim`]).
    pub fn handle(&self) -> ApiHandle {
        ApiHandle {
            store: self.store.clone(),
        }
    }

    /// `http://127.0.0.1:<port>`, what a kubeconfig's `server` names.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig that reaches this server (no credentials: it does not authenticate).
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: sim\n  cluster:\n    server: {}\n\
             contexts:\n- name: sim\n  context:\n    cluster: sim\n    user: sim\n\
             current-context: sim\nusers:\n- name: sim\n  user: {{}}\n",
            self.url()
        )
    }

    /// Stops answering (connections are refused once this returns) until [`up`](Self::up);
    /// what it holds stays.
    pub async fn down(&self) {
        let task = lock(&self.task).take();
        if let Some(task) = task {
            task.abort();
            // The listener closes when the aborted task is dropped.
            let _ = task.await;
        }
    }

    /// Serves again on the same address.
    pub async fn up(&self) -> std::io::Result<()> {
        let listener = TcpListener::bind(self.addr).await?;
        let task = tokio::spawn(serve(listener, self.store.clone()));
        if let Some(old) = lock(&self.task).replace(task) {
            old.abort();
        }
        Ok(())
    }

    /// Creates an object as a client would (`generateName` honoured, validated).
    pub fn create(&self, kind: Kind, namespace: &str, object: Value) -> Result<Value, ApiError> {
        lock(&self.store).create(kind, namespace, object)
    }

    /// Replaces an object; `resourceVersion` must be current.
    pub fn update(
        &self,
        kind: Kind,
        namespace: &str,
        name: &str,
        object: Value,
    ) -> Result<Value, ApiError> {
        lock(&self.store).update(kind, namespace, name, object)
    }

    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.store)
            .objects
            .get(&(kind, namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Every object of `kind`, in name order.
    pub fn list(&self, kind: Kind) -> Vec<Value> {
        lock(&self.store).list(kind, None, &[])
    }

    /// Deletes an object, as `kubectl delete` would; true if it existed.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> bool {
        lock(&self.store)
            .remove(&(kind, namespace.to_string(), name.to_string()))
            .is_some()
    }

    /// Holds the next `n` reads of a ResourceClaim until all `n` have arrived, then answers them
    /// at once: what a loaded API server does to claims that kubelets asked for one after the
    /// other, and the way to make a driver's prepares of them overlap.
    pub fn release_claim_reads_together(&self, n: usize) {
        lock(&self.store).claim_reads = Some((n, Arc::new(tokio::sync::Barrier::new(n))));
    }

    /// From now on, claim reads are answered as a hostile or overloaded server might: headers
    /// at once, then the body `bytes_per_second` at a time, in ten steps a second; None: at once
    /// again.
    pub fn trickle_claim_reads(&self, bytes_per_second: Option<usize>) {
        lock(&self.store).trickle = bytes_per_second.map(|n| n.max(1));
    }

    /// From now on, lists ignore their field selector and answer every object of the kind, as
    /// a server that does not implement one would.
    pub fn ignore_field_selectors(&self) {
        lock(&self.store).ignore_selectors = true;
    }

    /// From now on, as a server whose DRADeviceTaints feature is off (the default before
    /// 1.36): taints in a written ResourceSlice are dropped without a word, unless the stored
    /// slice already had some.
    pub fn drop_device_taints(&self) {
        lock(&self.store).taints_off = true;
    }

    /// From now on, as a server whose DRAConsumableCapacity feature is off (the default before
    /// 1.36): `allowMultipleAllocations` and capacities' `requestPolicy` in a written
    /// ResourceSlice are dropped without a word, unless the stored slice already had them.
    pub fn drop_consumable_capacity(&self) {
        lock(&self.store).consumable_off = true;
    }

    /// From now on, watches are refused (403), as by a server whose RBAC grants the client no
    /// `watch`; false: served again.
    pub fn refuse_watches(&self, refused: bool) {
        lock(&self.store).watches.refused = refused;
    }

    /// How many watches are being served now.
    pub fn open_watches(&self) -> usize {
        lock(&self.store).watches.open()
    }

    /// Requests answered so far, as `(verb, kind)`: `get`, `list`, `watch`, `create`,
    /// `update`, `delete`, `deletecollection`.
    pub fn requests(&self) -> Vec<(String, Kind)> {
        lock(&self.store)
            .requests
            .iter()
            .map(|(verb, kind, _)| (verb.clone(), *kind))
            .collect()
    }

    /// Every `User-Agent` header clients sent so far (an empty one for a request without).
    pub fn user_agents(&self) -> std::collections::BTreeSet<String> {
        lock(&self.store).user_agents.clone()
    }

    /// Requests answered so far, as RBAC names them: `(verb, API group, resource)`, the
    /// resource with its subresource (`resourceclaims/status`).
    pub fn rbac_requests(&self) -> Vec<(String, &'static str, String)> {
        lock(&self.store)
            .requests
            .iter()
            .map(|(verb, kind, sub)| {
                let resource = match sub {
                    Some(sub) => format!("{}/{sub}", kind.plural()),
                    None => kind.plural().to_owned(),
                };
                (verb.clone(), kind.group(), resource)
            })
            .collect()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(task) = lock(&self.task).take() {
            task.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Accepts until aborted; its connections are its own tasks, so they close with it, as a server
/// that goes down drops its clients' kept-alive connections.
async fn serve(listener: TcpListener, store: Arc<Mutex<Store>>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        while connections.try_join_next().is_some() {}
        let store = store.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let store = store.clone();
                async move { Ok::<_, Infallible>(respond(&store, request).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The most a request body may be (the real server's limit is 3 MiB).
const MAX_BODY: usize = 3 << 20;

type Body = BoxBody<Bytes, Infallible>;

async fn respond(store: &Arc<Mutex<Store>>, request: Request<Incoming>) -> Response<Body> {
    let (parts, body) = request.into_parts();
    let agent = parts
        .headers
        .get(hyper::header::USER_AGENT)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    lock(store).user_agents.insert(agent);
    let query = parts.uri.query().unwrap_or("");
    if parts.method == Method::GET && watch::asked(query) {
        return watch::serve(store, parts.uri.path(), query);
    }
    let claim_read = parts.method == Method::GET && parts.uri.path().contains("/resourceclaims/");
    if claim_read {
        let barrier = {
            let mut store = lock(store);
            match store.claim_reads.take() {
                Some((n, barrier)) => {
                    if n > 1 {
                        store.claim_reads = Some((n - 1, barrier.clone()));
                    }
                    Some(barrier)
                }
                None => None,
            }
        };
        if let Some(barrier) = barrier {
            barrier.wait().await;
        }
    }
    if parts.method == Method::PATCH
        && parts
            .headers
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            != Some("application/apply-patch+yaml")
    {
        return reply(Err(ApiError {
            code: 415,
            reason: "UnsupportedMediaType",
            message: "the stand-in serves only server-side apply patches \
                      (application/apply-patch+yaml)"
                .into(),
        }))
        .map(BodyExt::boxed);
    }
    let body = match http_body_util::Limited::new(body, MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            return reply(Err(ApiError::bad_request(format!("reading the body: {e}"))))
                .map(BodyExt::boxed);
        }
    };
    let answer = reply(handle(
        store,
        &parts.method,
        parts.uri.path(),
        parts.uri.query().unwrap_or(""),
        &body,
    ));
    let trickle = lock(store).trickle.filter(|_| claim_read);
    match trickle {
        Some(per_second) => answer.map(|full| trickled(full, per_second)),
        None => answer.map(BodyExt::boxed),
    }
}

/// `full`'s bytes, a tenth of `per_second` every 100 ms.
fn trickled(full: Full<Bytes>, per_second: usize) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
    tokio::spawn(async move {
        let Ok(bytes) = full.collect().await.map(|c| c.to_bytes());
        let step = (per_second / 10).max(1);
        for chunk in bytes.chunks(step) {
            let frame = Frame::data(Bytes::copy_from_slice(chunk));
            if tx.send(Ok(frame)).await.is_err() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    });
    BodyExt::boxed(StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    ))
}

fn reply(result: Result<(StatusCode, Value), ApiError>) -> Response<Full<Bytes>> {
    let (status, body) = match result {
        Ok(answer) => answer,
        Err(e) => (
            StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            e.status(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

/// A parsed request path: the kind, namespace, for one object its name, and the subresource.
fn route(path: &str) -> Option<(Kind, String, Option<String>, Option<&'static str>)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let kind_of = |plural: &str| {
        [
            Kind::Node,
            Kind::ResourceSlice,
            Kind::ResourceClaim,
            Kind::DeviceClass,
        ]
        .into_iter()
        .find(|k| k.plural() == plural)
    };
    let (kind, namespace, rest) = match parts.as_slice() {
        ["api", "v1", plural, rest @ ..] => (
            kind_of(plural).filter(|k| *k == Kind::Node)?,
            String::new(),
            rest,
        ),
        [
            "apis",
            "resource.k8s.io",
            "v1",
            "namespaces",
            ns,
            plural,
            rest @ ..,
        ] => (
            kind_of(plural).filter(|k| k.namespaced())?,
            ns.to_string(),
            rest,
        ),
        ["apis", "resource.k8s.io", "v1", plural, rest @ ..] => (
            kind_of(plural).filter(|k| !k.namespaced() && *k != Kind::Node)?,
            String::new(),
            rest,
        ),
        _ => return None,
    };
    match rest {
        [] => Some((kind, namespace, None, None)),
        [name] => Some((kind, namespace, Some(name.to_string()), None)),
        [name, "status"] if kind == Kind::ResourceClaim => {
            Some((kind, namespace, Some(name.to_string()), Some("status")))
        }
        _ => None,
    }
}

/// The raw value of query parameter `name`.
fn param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// `fieldSelector=a=b,c=d` (also `==`); other query parameters are ignored.
fn field_selector(query: &str) -> Result<Vec<(String, String)>, ApiError> {
    let mut selector = Vec::new();
    for (key, value) in query.split('&').filter_map(|kv| kv.split_once('=')) {
        if key != "fieldSelector" {
            continue;
        }
        let decoded = percent_decode(value);
        for term in decoded.split(',').filter(|t| !t.is_empty()) {
            let (field, want) = term
                .split_once("==")
                .or_else(|| term.split_once('='))
                .ok_or_else(|| {
                    ApiError::bad_request(format!("invalid field selector term {term:?}"))
                })?;
            selector.push((field.to_string(), want.to_string()));
        }
    }
    Ok(selector)
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A `<Kind>List` as the server answers a list (and a delete-collection).
fn list_of(kind: Kind, resource_version: u64, items: Vec<Value>) -> Value {
    json!({
        "apiVersion": kind.api_version(),
        "kind": format!("{}List", kind.name()),
        "metadata": { "resourceVersion": resource_version.to_string() },
        "items": items,
    })
}

fn handle(
    store: &Mutex<Store>,
    method: &Method,
    path: &str,
    query: &str,
    body: &[u8],
) -> Result<(StatusCode, Value), ApiError> {
    let (kind, namespace, name, subresource) = route(path).ok_or_else(|| ApiError {
        code: 404,
        reason: "NotFound",
        message: format!("the server could not find the requested resource ({path})"),
    })?;
    let parse = || {
        serde_json::from_slice::<Value>(body)
            .map_err(|e| ApiError::bad_request(format!("the body is not JSON: {e}")))
    };
    let mut store = lock(store);
    let verb = match (method, &name) {
        (&Method::PATCH, Some(_)) if subresource.is_some() => "patch",
        _ if subresource.is_some() => {
            return Err(ApiError {
                code: 405,
                reason: "MethodNotAllowed",
                message: format!("only server-side apply (PATCH) is served on {path}"),
            });
        }
        (&Method::GET, Some(_)) => "get",
        (&Method::GET, None) => "list",
        (&Method::POST, None) => "create",
        (&Method::PUT, Some(_)) => "update",
        (&Method::DELETE, Some(_)) => "delete",
        (&Method::DELETE, None) => "deletecollection",
        _ => {
            return Err(ApiError {
                code: 405,
                reason: "MethodNotAllowed",
                message: format!("{method} is not supported on {path}"),
            });
        }
    };
    store.requests.push((verb.to_string(), kind, subresource));
    let ns = (!namespace.is_empty()).then_some(namespace.as_str());
    match (verb, name) {
        ("get", Some(name)) => store
            .objects
            .get(&(kind, namespace.clone(), name.clone()))
            .cloned()
            .map(|o| (StatusCode::OK, o))
            .ok_or_else(|| ApiError::not_found(kind, &name)),
        ("list", None) => {
            let mut selector = field_selector(query)?;
            if store.ignore_selectors {
                selector.clear();
            }
            let items = store.list(kind, ns, &selector);
            Ok((StatusCode::OK, list_of(kind, store.resource_version, items)))
        }
        ("patch", Some(name)) => {
            let manager = param(query, "fieldManager")
                .map(percent_decode)
                .ok_or_else(|| ApiError::bad_request("fieldManager is required for apply patch"))?;
            store
                .apply_claim_status(&namespace, &name, &manager, parse()?)
                .map(|o| (StatusCode::OK, o))
        }
        ("create", None) => store
            .create(kind, &namespace, parse()?)
            .map(|o| (StatusCode::CREATED, o)),
        ("update", Some(name)) => store
            .update(kind, &namespace, &name, parse()?)
            .map(|o| (StatusCode::OK, o)),
        ("delete", Some(name)) => {
            let key = (kind, namespace.clone(), name.clone());
            let object = store
                .objects
                .get(&key)
                .cloned()
                .ok_or_else(|| ApiError::not_found(kind, &name))?;
            // Preconditions a client may send in DeleteOptions.
            if let Ok(options) = serde_json::from_slice::<Value>(body) {
                let pre = &options["preconditions"];
                for field in ["uid", "resourceVersion"] {
                    if let Some(want) = pre[field].as_str()
                        && object["metadata"][field].as_str() != Some(want)
                    {
                        return Err(ApiError {
                            code: 409,
                            reason: "Conflict",
                            message: format!(
                                "Operation cannot be fulfilled on {} {name:?}: Precondition failed: {field}",
                                kind.qualified()
                            ),
                        });
                    }
                }
            }
            store.remove(&key);
            Ok((
                StatusCode::OK,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                       "details": {"name": name, "kind": kind.plural()}}),
            ))
        }
        ("deletecollection", None) => {
            let selector = field_selector(query)?;
            let gone: Vec<Value> = store.list(kind, ns, &selector);
            for object in &gone {
                let name = object["metadata"]["name"]
                    .as_str()
                    .unwrap_or("")
                    .to_string();
                store.remove(&(kind, namespace.clone(), name));
            }
            Ok((StatusCode::OK, list_of(kind, store.resource_version, gone)))
        }
        _ => Err(ApiError::bad_request(format!("{method} {path}"))),
    }
}
