//! The HTTP endpoint an operator's Prometheus and the kubelet's probes use: figures that follow
//! what happens on the node, scraped over real HTTP and parsed as Prometheus text.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use devicelet_simulator::Simulator;
use devicelet_tests::{Node, Sample, WAIT, generic_dev, http_get, metric, misbehaving, scrape};

const FUSE: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;

/// Scrapes until `cond` holds; the figures change as the agent's tasks catch up.
async fn scrape_until(
    addr: SocketAddr,
    what: &str,
    cond: impl Fn(&[Sample]) -> bool,
) -> Vec<Sample> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let samples = scrape(addr).await;
        if cond(&samples) {
            return samples;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}; last scrape: {samples:#?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn on_loopback(o: &mut devicelet::agent::AgentOptions) {
    o.metrics_addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
}

fn modules() -> String {
    format!(
        "{}\n{}",
        generic_dev(FUSE),
        misbehaving("trapper", "resource = \"bad\"\nallocate = \"trap\"", "1s")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_allocations_a_kubelet_restart_a_trap_and_a_hot_reload() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent_with(&modules(), on_loopback).await;
    let addr = agent.metrics_addr().expect("serving metrics");
    let fuse = [("resource", "devicelet.io/fuse"), ("module", "generic-dev")];

    let first = scrape_until(addr, "both resources registered", |s| {
        metric(s, "devicelet_ready", &[]) == Some(1.0)
    })
    .await;
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        metric(&first, "devicelet_build_info", &[("version", version)]),
        Some(1.0)
    );
    // generic-dev speaks 0.2 and says its crate version.
    assert_eq!(
        metric(
            &first,
            "devicelet_module_info",
            &[("module", "generic-dev"), ("version", "0.1.0")]
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&first, "devicelet_resource_devices", &fuse),
        Some(2.0)
    );
    assert_eq!(
        metric(&first, "devicelet_resource_devices_healthy", &fuse),
        Some(2.0)
    );
    assert_eq!(
        metric(&first, "devicelet_resource_devices_allocated", &fuse),
        Some(0.0)
    );
    assert_eq!(
        metric(&first, "devicelet_resource_registrations_total", &fuse),
        Some(1.0)
    );
    assert_eq!(
        metric(&first, "devicelet_resource_registered", &fuse),
        Some(1.0)
    );

    // An allocation: counted as held, and as a call into the module (answered ahead of time or
    // by the kubelet's own call, both are calls to its `allocate`). Registered is not yet
    // listed: the kubelet has the devices once the first ListAndWatch snapshot reaches it.
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("listed");
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocate");
    let allocated = scrape(addr).await;
    assert_eq!(
        metric(&allocated, "devicelet_resource_devices_allocated", &fuse),
        Some(1.0)
    );
    let ok_allocates = metric(
        &allocated,
        "devicelet_module_call_duration_seconds_count",
        &[
            ("module", "generic-dev"),
            ("call", "allocate"),
            ("outcome", "ok"),
        ],
    )
    .expect("allocate calls counted");
    assert!(ok_allocates >= 1.0);
    assert!(
        metric(
            &allocated,
            "devicelet_module_call_duration_seconds_count",
            &[
                ("module", "generic-dev"),
                ("call", "enumerate"),
                ("outcome", "ok")
            ],
        )
        .is_some_and(|n| n >= 1.0),
        "enumerations counted"
    );

    // A module that traps: its own counters, nobody else's.
    node.kubelet
        .allocate("devicelet.io/bad", 1)
        .await
        .expect_err("the trapping module's allocate fails");
    let trapped = scrape(addr).await;
    let trapper = [("module", "trapper")];
    assert_eq!(
        metric(&trapped, "devicelet_module_traps_total", &trapper),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &trapped,
            "devicelet_module_call_duration_seconds_count",
            &[
                ("module", "trapper"),
                ("call", "allocate"),
                ("outcome", "trap")
            ],
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &trapped,
            "devicelet_module_traps_total",
            &[("module", "generic-dev")]
        ),
        Some(0.0)
    );

    // A kubelet restart: seen, and registered again.
    node.kubelet.restart().await.expect("kubelet restart");
    let restarted = scrape_until(addr, "the second registration", |s| {
        metric(s, "devicelet_resource_registrations_total", &fuse) == Some(2.0)
            && metric(s, "devicelet_resource_registered", &fuse) == Some(1.0)
    })
    .await;
    assert_eq!(
        metric(&restarted, "devicelet_kubelet_restarts_seen_total", &fuse),
        Some(1.0)
    );

    // A hot reload applied, then an edit refused.
    node.registry(&modules().replace("health-interval = \"100ms\"", "health-interval = \"200ms\""));
    scrape_until(addr, "the edit applied", |s| {
        metric(
            s,
            "devicelet_registry_reloads_total",
            &[("result", "applied")],
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;
    // Replaced in one step: an in-place write could be read half-done (an empty registry is a
    // valid one with no modules).
    let staged = node.dir.path().join(".broken.toml");
    std::fs::write(&staged, "[[module]\nbroken").expect("stage a broken registry");
    std::fs::rename(&staged, node.dir.path().join("registry.toml")).expect("break the registry");
    let refused = scrape_until(addr, "the broken edit refused", |s| {
        metric(
            s,
            "devicelet_registry_reloads_total",
            &[("result", "refused")],
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;
    assert_eq!(
        metric(&refused, "devicelet_resource_devices", &fuse),
        Some(2.0)
    );
    assert_eq!(
        metric(&refused, "devicelet_module_load_errors", &[]),
        Some(0.0)
    );

    let (status, body) = http_get(addr, "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, _) = http_get(addr, "/nowhere").await;
    assert_eq!(status, 404);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_false_until_every_module_is_registered() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    // A kubelet directory no kubelet serves yet.
    let later = node.dir.path().join("later").join("device-plugins");
    let agent = node
        .start_agent_with(&modules(), |o| {
            on_loopback(o);
            o.plugin_dir = later.clone();
        })
        .await;
    let addr = agent.metrics_addr().expect("serving metrics");

    let (status, body) = http_get(addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("devicelet.io/fuse (module `generic-dev`) is not registered")
            && body.contains("devicelet.io/bad (module `trapper`) is not registered"),
        "{body}"
    );
    let (status, _) = http_get(addr, "/healthz").await;
    assert_eq!(status, 200, "alive while waiting for the kubelet");
    assert_eq!(
        metric(&scrape(addr).await, "devicelet_ready", &[]),
        Some(0.0)
    );

    let kubelet = Simulator::start(&later)
        .await
        .expect("the kubelet comes up");
    for resource in ["devicelet.io/fuse", "devicelet.io/bad"] {
        kubelet
            .wait_until(resource, WAIT, |r| r.registrations == 1)
            .await
            .expect("registered");
    }
    readyz_until(addr, 200).await;

    // The kubelet goes away: it no longer holds the registrations, and readiness says so.
    kubelet.shutdown().await;
    let body = readyz_until(addr, 503).await;
    assert!(body.contains("is not registered"), "{body}");
    agent.shutdown().await;
}

/// Asks `/readyz` until it answers `status`; its body.
async fn readyz_until(addr: SocketAddr, status: u16) -> String {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (now, body) = http_get(addr, "/readyz").await;
        if now == status {
            return body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/readyz never answered {status}: {now} {body}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A port nobody listens on now.
fn free_port() -> SocketAddr {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    probe.local_addr().expect("its address")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_answer_while_modules_load_and_a_module_that_fails_to_load_does_not_hold_readiness()
{
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let addr = free_port();
    // Its init spins until its 2 s deadline: it never loads.
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        misbehaving("stuck", "resource = \"bad\"\ninit = \"loop\"", "2s")
    );
    let registry = devicelet::config::Registry::load(&node.registry(&modules)).expect("registry");
    let mut options = node.agent_options(registry);
    options.metrics_addr = Some(addr);
    let starting = tokio::spawn(devicelet::agent::Agent::start(options));

    // Alive, and not ready, while the modules load.
    let deadline = std::time::Instant::now() + WAIT;
    let (status, body) = loop {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(_) => break http_get(addr, "/readyz").await,
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "never listened: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    };
    assert!(!starting.is_finished(), "the stuck module is still loading");
    assert_eq!(
        (status, body.as_str()),
        (503, "modules are still loading\n")
    );
    assert_eq!(http_get(addr, "/healthz").await.0, 200);

    let agent = starting
        .await
        .expect("the start task")
        .expect("the agent starts without the stuck module");
    assert!(
        agent.load_errors().iter().any(|e| e.contains("stuck")),
        "{:?}",
        agent.load_errors()
    );
    readyz_until(addr, 200).await;
    let samples = scrape(addr).await;
    assert_eq!(
        metric(&samples, "devicelet_module_load_errors", &[]),
        Some(1.0)
    );
    assert_eq!(metric(&samples, "devicelet_ready", &[]), Some(1.0));
    agent.shutdown().await;
}

/// Any pod can reach the port: one client holding connections open is turned away from its
/// ninth, idle ones are closed after the header timeout, and other clients (the kubelet, from
/// the node's address) are answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hoarding_connections_cannot_starve_the_probes() {
    use tokio::io::AsyncReadExt;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent_with(&generic_dev(FUSE), on_loopback).await;
    let addr = agent.metrics_addr().expect("serving metrics");
    let hoarder = || async {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 2], 0)))
            .expect("bind to another loopback address");
        socket.connect(addr).await.expect("connect")
    };
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(hoarder().await);
    }
    // A ninth from the same address takes the place of the oldest, which is closed at once.
    let ninth = hoarder().await;
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(WAIT, held[0].read(&mut buf))
        .await
        .expect("the oldest is closed at once");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    held[0] = ninth;
    // The kubelet's probe, from another address, is answered while they are held.
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    // Idle connections that never send a request are closed by the server.
    for conn in &mut held {
        let read = tokio::time::timeout(WAIT, conn.read(&mut buf))
            .await
            .expect("closed within the header timeout");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    agent.shutdown().await;
}

/// A kubelet that stops waiting for an Allocate (here: a client whose call times out) leaves
/// the call counted as cancelled, not lost from the figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_its_caller_gave_up_on_is_counted_as_cancelled() {
    use devicelet::kubelet::api::deviceplugin::device_plugin_client::DevicePluginClient;
    use devicelet::kubelet::api::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
    let node = Node::new().await;
    // The spin outlasts the caller's 200 ms by far; it is spent CPU until its deadline.
    let modules = misbehaving("spinner", "resource = \"bad\"\nallocate = \"loop\"", "1s");
    let agent = node.start_agent_with(&modules, on_loopback).await;
    let addr = agent.metrics_addr().expect("serving metrics");
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("registered");
    let socket = agent.resource("devicelet.io/bad").expect("served").socket;
    let mut plugin = DevicePluginClient::new(
        devicelet::kubelet::uds::connect(&socket)
            .await
            .expect("dial"),
    );
    let mut request = tonic::Request::new(AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: vec!["dev-0".into()],
        }],
    });
    request.set_timeout(std::time::Duration::from_millis(200));
    plugin
        .allocate(request)
        .await
        .expect_err("the caller gives up first");
    scrape_until(addr, "the cancelled call", |s| {
        metric(
            s,
            "devicelet_module_call_duration_seconds_count",
            &[
                ("module", "spinner"),
                ("call", "allocate"),
                ("outcome", "cancelled"),
            ],
        ) == Some(1.0)
    })
    .await;
    agent.shutdown().await;
}

/// Slow clients from 16 addresses, 8 connections each, fill the endpoint's 128 connections and
/// keep reopening whatever is closed. The probes still answer, each within a second: a new
/// connection takes the place of the oldest one that has sent nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_answer_while_slow_clients_from_many_addresses_fill_the_endpoint() {
    use tokio::io::AsyncReadExt;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent_with(&generic_dev(FUSE), on_loopback).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("registered");
    let addr = agent.metrics_addr().expect("serving metrics");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut flood = tokio::task::JoinSet::new();
    for peer in 0..16u8 {
        for _ in 0..8 {
            let stop = stop.clone();
            flood.spawn(async move {
                // Connect, send nothing, and when the server closes it, connect again.
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
                    socket
                        .bind(SocketAddr::from(([127, 0, 1, peer + 1], 0)))
                        .expect("bind a loopback address");
                    let Ok(mut conn) = socket.connect(addr).await else {
                        continue;
                    };
                    let mut buf = [0u8; 16];
                    let _ = conn.read(&mut buf).await;
                    // Back at once, as far as a probe is concerned.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        }
    }
    let mut slow = 0;
    for _ in 0..40 {
        let answer = tokio::time::timeout(Duration::from_secs(1), http_get(addr, "/healthz")).await;
        match answer {
            Ok((200, _)) => {}
            other => {
                slow += 1;
                eprintln!("a probe got {other:?}");
            }
        }
        let (status, _) = tokio::time::timeout(Duration::from_secs(1), http_get(addr, "/readyz"))
            .await
            .expect("/readyz within a second");
        assert_eq!(status, 200);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flood.abort_all();
    assert_eq!(slow, 0, "probes not answered within a second");
    agent.shutdown().await;
}
