//! Watches the driver's own ResourceSlices, so that a pool someone else deleted is published
//! again at once instead of at the next resync: the kubelet wipes every slice of its node when
//! it starts, and a driver's slices when its registration goes (at once before 1.34, 30 s later
//! after), whenever its API requests get through; an operator may delete them by hand. The
//! watch only wakes the publisher, which lists, checks ownership and writes as always, so a
//! server that sends other drivers' slices, or nonsense, can cost a sync but never a write.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kube::api::WatchEvent;
use tokio::sync::{Notify, watch};
use tokio_stream::StreamExt;

use super::api::{ApiClient, ApiError, CALL_TIMEOUT, WATCH_WINDOW};
use super::slices::Pool;
use crate::backoff::Backoff;

/// A watch that ends sooner than this is not opened again at once (a server that closes every
/// watch straight away must not be asked in a loop).
const SHORTEST_WATCH: Duration = Duration::from_secs(1);

/// Watches `pool`'s slices until `stop`, waking `republish` whenever one of them is deleted and
/// each time the watch starts over from a list (what went while nothing watched is caught
/// then). `watching` says whether a watch is open now: while it is not, registration wakes the
/// publisher a few more times on its own (`server.rs`).
pub async fn watch_pool(
    api: ApiClient,
    pool: Pool,
    republish: Arc<Notify>,
    watching: Arc<AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    // Up to five minutes apart while the server refuses or fails the watch.
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(300));
    let mut refused = false;
    'list: loop {
        watching.store(false, Ordering::Relaxed);
        let listed = tokio::select! {
            listed = api.slices_version(&pool.driver, &pool.node) => listed,
            _ = stop.wait_for(|s| *s) => return,
        };
        let mut version = match listed {
            Ok(version) => version,
            Err(e) => {
                // The publisher says so too; the watch only waits to try again.
                tracing::debug!(driver = pool.driver, "listing before a watch: {e}");
                if pause(backoff.failed(), &mut stop).await {
                    return;
                }
                continue;
            }
        };
        republish.notify_one();
        loop {
            let opened = tokio::time::Instant::now();
            let events = tokio::select! {
                events = api.watch_slices(&pool.driver, &pool.node, &version) => events,
                _ = stop.wait_for(|s| *s) => return,
            };
            let events = match events {
                Ok(events) => events,
                Err(e) => {
                    watching.store(false, Ordering::Relaxed);
                    if !refused {
                        let hint = if matches!(e, ApiError::Status { code: 403, .. }) {
                            "; `watch` on resourceslices is in deploy/dra/rbac.yaml"
                        } else {
                            ""
                        };
                        tracing::warn!(
                            driver = pool.driver,
                            "cannot watch the driver's own ResourceSlices ({e}): until it can, \
                             slices someone else deletes (the kubelet at its start) are \
                             published again at the next resync{hint}"
                        );
                        refused = true;
                    }
                    if pause(backoff.failed(), &mut stop).await {
                        return;
                    }
                    // Opened again from the same version, unless that is too old (410).
                    if matches!(e, ApiError::Status { code: 410, .. }) {
                        continue 'list;
                    }
                    continue;
                }
            };
            if refused {
                tracing::info!(driver = pool.driver, "watching the driver's ResourceSlices");
                refused = false;
            }
            watching.store(true, Ordering::Relaxed);
            tokio::pin!(events);
            // Held to its window whatever the server does with `timeoutSeconds`.
            let ends = opened + WATCH_WINDOW + CALL_TIMEOUT;
            let relist = loop {
                let next = tokio::select! {
                    next = tokio::time::timeout_at(ends, events.next()) => next,
                    _ = stop.wait_for(|s| *s) => return,
                };
                let event = match next {
                    Err(_) | Ok(None) => break false,
                    Ok(Some(Err(e))) => {
                        tracing::debug!(driver = pool.driver, "the watch ended: {e}");
                        // 410 as a bare Status line: the version is too old to resume from.
                        break matches!(e, ApiError::Status { code: 410, .. });
                    }
                    Ok(Some(Ok(event))) => event,
                };
                match event {
                    WatchEvent::Added(slice) | WatchEvent::Modified(slice) => {
                        version = slice.metadata.resource_version.unwrap_or(version);
                    }
                    WatchEvent::Deleted(slice) => {
                        if pool.owns(&slice) {
                            republish.notify_one();
                        }
                        version = slice.metadata.resource_version.unwrap_or(version);
                    }
                    WatchEvent::Bookmark(mark) => version = mark.metadata.resource_version,
                    // 410 (the version is too old to resume from), or another error: listed
                    // again.
                    WatchEvent::Error(status) => {
                        tracing::debug!(
                            driver = pool.driver,
                            "the watch ended: {} ({})",
                            crate::text::cut(&status.message, 200),
                            status.code
                        );
                        break true;
                    }
                }
            };
            watching.store(false, Ordering::Relaxed);
            if opened.elapsed() < SHORTEST_WATCH {
                if pause(backoff.failed(), &mut stop).await {
                    return;
                }
            } else {
                backoff.reset();
            }
            if relist {
                continue 'list;
            }
        }
    }
}

/// Waits `delay`; true if `stop` came first.
async fn pause(delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(delay) => false,
        _ = stop.wait_for(|s| *s) => true,
    }
}
