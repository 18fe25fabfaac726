//! Watches, as the real server streams them (`?watch=true`): one JSON `WatchEvent` per line
//! (`ADDED`, `MODIFIED`, `DELETED`, `ERROR`) on a chunked body, filtered by the field selector,
//! starting after the `resourceVersion` asked for — or, without one (or `"0"`), with an `ADDED`
//! for every object there now — and ended by the server after `timeoutSeconds`. Changes are
//! kept in a bounded history; a watch from a version older than it holds gets the real server's
//! `410 Expired` error event, so a client has to list again.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, StreamBody};
use hyper::Response;
use hyper::body::{Bytes, Frame};
use serde_json::{Value, json};

use super::{ApiError, Body, Key, Store, field_selector, field_value, lock, param, reply, route};

/// The most changes kept for watches to resume from.
const HISTORY: usize = 4096;
/// How long a watch runs when the client gives no `timeoutSeconds` (the real server picks
/// 30–60 minutes).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// One change to an object, as a watch event reports it.
pub(crate) struct Change {
    version: u64,
    key: Key,
    kind_of_change: &'static str,
    object: Value,
}

/// What the store keeps for watches.
#[derive(Default)]
pub(crate) struct Watches {
    history: VecDeque<Change>,
    /// Changes up to this version are no longer kept.
    forgotten_up_to: u64,
    /// Woken after every change.
    changed: Arc<tokio::sync::Notify>,
    /// Watches being served now.
    open: Arc<AtomicUsize>,
    /// Answer watches 403, as a server whose RBAC does not grant `watch`.
    pub(crate) refused: bool,
}

impl Watches {
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

impl Store {
    /// Keeps `object`'s change for watches; its `resourceVersion` is the change's.
    pub(crate) fn record(&mut self, key: &Key, kind_of_change: &'static str, object: &Value) {
        let version = object["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .unwrap_or(self.resource_version);
        let watches = &mut self.watches;
        watches.history.push_back(Change {
            version,
            key: key.clone(),
            kind_of_change,
            object: object.clone(),
        });
        while watches.history.len() > HISTORY {
            if let Some(old) = watches.history.pop_front() {
                watches.forgotten_up_to = old.version;
            }
        }
        watches.changed.notify_waiters();
    }

    /// Removes an object as a delete does: a new resourceVersion for the deletion, reported to
    /// watches with the object as it was last.
    pub(crate) fn remove(&mut self, key: &Key) -> Option<Value> {
        let mut object = self.objects.remove(key)?;
        object["metadata"]["resourceVersion"] = json!(self.next_version());
        self.record(key, "DELETED", &object);
        Some(object)
    }
}

/// Whether the request asks for a watch.
pub(super) fn asked(query: &str) -> bool {
    param(query, "watch").is_some_and(|v| v == "true" || v == "1")
}

/// Answers a watch of the collection at `path`.
pub(super) fn serve(store: &Arc<Mutex<Store>>, path: &str, query: &str) -> Response<Body> {
    match start(store, path, query) {
        Ok(body) => {
            let mut response = Response::new(body);
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(e) => reply(Err(e)).map(BodyExt::boxed),
    }
}

fn start(store: &Arc<Mutex<Store>>, path: &str, query: &str) -> Result<Body, ApiError> {
    let (kind, namespace) = match route(path) {
        Some((kind, namespace, None, None)) => (kind, namespace),
        _ => {
            return Err(ApiError::bad_request(format!(
                "a watch is served on a collection, not on {path}"
            )));
        }
    };
    let mut selector = field_selector(query)?;
    let timeout = match param(query, "timeoutSeconds") {
        None => DEFAULT_TIMEOUT,
        Some(t) => Duration::from_secs(
            t.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {t:?}")))?,
        ),
    };
    let mut guard = lock(store);
    let s = &mut *guard;
    s.requests.push(("watch".into(), kind, None));
    if s.watches.refused {
        return Err(ApiError {
            code: 403,
            reason: "Forbidden",
            message: format!(
                "{} is forbidden: User \"system:serviceaccount:kube-system:devicelet\" cannot \
                 watch resource \"{}\" in API group \"{}\" at the cluster scope",
                kind.qualified(),
                kind.plural(),
                kind.group()
            ),
        });
    }
    if s.ignore_selectors {
        selector.clear();
    }
    let matches = move |key: &Key, object: &Value| {
        key.0 == kind
            && (namespace.is_empty() || key.1 == namespace)
            && selector
                .iter()
                .all(|(field, want)| field_value(object, field) == *want)
    };
    let mut first = Vec::new();
    let from = match param(query, "resourceVersion").unwrap_or("") {
        "" | "0" => {
            for (key, object) in &s.objects {
                if matches(key, object) {
                    first.push(line("ADDED", object));
                }
            }
            s.resource_version
        }
        given => given.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!("invalid resourceVersion {given:?} for a watch"))
        })?,
    };
    let (changed, open) = (s.watches.changed.clone(), s.watches.open.clone());
    drop(guard);

    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::convert::Infallible>>(16);
    let store = store.clone();
    open.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(async move {
        let _open = Open(open);
        let deadline = tokio::time::Instant::now() + timeout;
        let mut seen = from;
        let mut lines = first;
        loop {
            let notified = changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let ended = {
                let s = lock(&store);
                let gone = seen < s.watches.forgotten_up_to;
                if gone {
                    lines.push(expired(seen, s.resource_version));
                } else {
                    lines.extend(
                        s.watches
                            .history
                            .iter()
                            .filter(|c| c.version > seen && matches(&c.key, &c.object))
                            .map(|c| line(c.kind_of_change, &c.object)),
                    );
                    seen = s.resource_version;
                }
                gone
            };
            for l in lines.drain(..) {
                if tx.send(Ok(Frame::data(l))).await.is_err() {
                    return;
                }
            }
            if ended {
                return;
            }
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(deadline) => return,
                () = tx.closed() => return,
            }
        }
    });
    Ok(BodyExt::boxed(StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    )))
}

/// Counts a watch as open while it lives.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn line(kind_of_change: &str, object: &Value) -> Bytes {
    let mut text = json!({"type": kind_of_change, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

/// The real server's answer to a watch from a version it no longer holds.
fn expired(asked: u64, now: u64) -> Bytes {
    let status = ApiError {
        code: 410,
        reason: "Expired",
        message: format!("too old resource version: {asked} ({now})"),
    };
    line("ERROR", &status.status())
}
