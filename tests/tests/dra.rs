//! The DRA front end against the kubelet simulator's DRA plugin manager and its API server
//! stand-in.

use devicelet::dra::api::ApiClient;
use devicelet_simulator::apiserver::{ApiServer, Kind};
use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;

/// The agent's API client through a kubeconfig naming the stand-in, as `--kubeconfig` does.
async fn client(api: &ApiServer) -> (tempfile::TempDir, ApiClient) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("kubeconfig");
    std::fs::write(&file, api.kubeconfig()).expect("kubeconfig");
    let client = ApiClient::connect(Some(&file)).await.expect("client");
    (dir, client)
}

fn slice(node: &str, devices: &[&str]) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            generate_name: Some(format!("{node}-gpu.example.com-")),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: "gpu.example.com".into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 0,
                resource_slice_count: 1,
            },
            devices: Some(
                devices
                    .iter()
                    .map(|name| Device {
                        name: name.to_string(),
                        ..Device::default()
                    })
                    .collect(),
            ),
            ..ResourceSliceSpec::default()
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_api_client_reads_claims_and_writes_slices_as_kube_does() {
    let api = ApiServer::start().await.expect("API server");
    let (_dir, client) = client(&api).await;
    api.create(Kind::Node, "", json!({"metadata": {"name": "node-a"}}))
        .expect("node");
    api.create(
        Kind::ResourceClaim,
        "team-a",
        json!({"metadata": {"name": "gpu"}, "spec": {"devices": {"requests": []}}}),
    )
    .expect("claim");

    let uid = client.node_uid("node-a").await.expect("node uid");
    assert_eq!(
        Some(uid.as_str()),
        api.get(Kind::Node, "", "node-a").expect("node")["metadata"]["uid"].as_str()
    );
    let claim = client.claim("team-a", "gpu").await.expect("claim");
    assert_eq!(claim.metadata.namespace.as_deref(), Some("team-a"));
    let missing = client.claim("team-a", "nope").await.unwrap_err();
    assert!(missing.is_not_found(), "{missing}");
    assert!(
        missing
            .to_string()
            .contains("getting ResourceClaim team-a/nope"),
        "{missing}"
    );

    let created = client
        .create_slice(&slice("node-a", &["gpu-0", "gpu-1"]))
        .await
        .expect("created");
    client
        .create_slice(&slice("node-b", &["gpu-0"]))
        .await
        .expect("created");
    let mine = client
        .slices("gpu.example.com", "node-a")
        .await
        .expect("listed");
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].metadata.name, created.metadata.name);

    // A stale copy is a conflict; the current one replaces.
    let mut newer = created.clone();
    newer.spec.pool.generation = 1;
    client.replace_slice(&newer).await.expect("replaced");
    let stale = client.replace_slice(&created).await.unwrap_err();
    assert!(stale.is_conflict(), "{stale}");

    // Invalid at the server: its reason and field come through.
    let bad = client
        .create_slice(&slice("node-a", &["0000:3b:00.0"]))
        .await
        .unwrap_err();
    assert!(bad.to_string().contains("spec.devices[0].name"), "{bad}");

    // Deleting what is already gone is fine; a precondition on a replaced copy is a conflict.
    let conflict = client.delete_slice(&created).await.unwrap_err();
    assert!(conflict.is_conflict(), "{conflict}");
    let current = client
        .slices("gpu.example.com", "node-a")
        .await
        .expect("listed");
    client.delete_slice(&current[0]).await.expect("deleted");
    client
        .delete_slice(&current[0])
        .await
        .expect("gone is fine");
    assert!(
        client
            .slices("gpu.example.com", "node-a")
            .await
            .expect("listed")
            .is_empty()
    );

    api.down().await;
    let down = client.claim("team-a", "gpu").await.unwrap_err();
    assert!(
        matches!(down, devicelet::dra::api::ApiError::Unreachable { .. }),
        "{down}"
    );
}
