//! The module's logic against its fixture nodes, through the SDK's test kit.

use devicelet_sdk::testing::{FakeHost, Harness};
use devicelet_sdk::{Health, NodeKind};

use super::AmdGpu;

fn node(fixture: &str) -> FakeHost {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(fixture);
    FakeHost::from_fixture(&dir)
        .expect("the fixture reads")
        .grant_sysfs("/sys/bus/pci/devices/*")
        .grant_dev("/dev/kfd")
        .grant_dev("/dev/dri/*")
}

fn module(fixture: &str) -> Harness<AmdGpu> {
    Harness::init(node(fixture), "{}").expect("init")
}

#[test]
fn every_amd_gpu_is_a_device_with_its_numa_node_and_nothing_else_is() {
    let mut gpus = module("2-gpus");
    assert_eq!(gpus.resources()[0].name, "gpu");
    let devices = gpus.enumerate("gpu").unwrap();
    let seen: Vec<(&str, Health, &[i64])> = devices
        .iter()
        .map(|d| (d.id.as_str(), d.health, d.numa_nodes.as_slice()))
        .collect();
    // Not the GPU's audio function (class 0x04), not another vendor's device.
    assert_eq!(
        seen,
        [
            ("0000:03:00.0", Health::Healthy, &[0][..]),
            ("0000:23:00.0", Health::Healthy, &[1][..])
        ]
    );
    assert_eq!(devices[0].text("device-id"), Some("0x740f"));
    assert_eq!(devices[0].text("pci-address"), Some("0000:03:00.0"));
}

#[test]
fn partition_modes_are_attributes_where_sysfs_has_them() {
    let mut gpus = module("8-gpus");
    let devices = gpus.enumerate("gpu").unwrap();
    assert_eq!(devices.len(), 8);
    assert_eq!(
        devices.iter().filter(|d| d.numa_nodes == [1]).count(),
        4,
        "two NUMA nodes"
    );
    assert_eq!(devices[7].text("current-compute-partition"), Some("SPX"));
}

#[test]
fn a_container_gets_kfd_and_its_gpus_drm_nodes_from_a_fresh_instance() {
    let enumerating = module("2-gpus");
    // The agent asks a second instance, which never enumerated.
    let mut kubelet = enumerating.another("{}").unwrap();
    let edits = kubelet.allocate("gpu", &["0000:23:00.0"]).unwrap();
    let nodes: Vec<&str> = edits.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(nodes, ["/dev/kfd", "/dev/dri/card1", "/dev/dri/renderD129"]);
    let e = kubelet.allocate("gpu", &["0000:99:00.0"]).unwrap_err();
    assert!(
        e.to_string().contains("\"0000:99:00.0\" is not a device"),
        "{e}"
    );
}

#[test]
fn a_missing_render_node_makes_its_gpu_unhealthy_until_it_returns() {
    let mut gpus = module("2-gpus");
    gpus.host().remove("/dev/dri/renderD129");
    let health = |gpus: &mut Harness<AmdGpu>| -> Vec<Health> {
        gpus.enumerate("gpu")
            .unwrap()
            .iter()
            .map(|d| d.health)
            .collect()
    };
    assert_eq!(health(&mut gpus), [Health::Healthy, Health::Unhealthy]);
    gpus.host()
        .add_node("/dev/dri/renderD129", NodeKind::Character, 226, 129);
    assert_eq!(health(&mut gpus), [Health::Healthy, Health::Healthy]);
    gpus.host().remove("/dev/kfd");
    assert_eq!(health(&mut gpus), [Health::Unhealthy, Health::Unhealthy]);
}

#[test]
fn a_gpu_that_falls_off_the_bus_stays_listed_unhealthy() {
    let mut gpus = module("2-gpus");
    assert_eq!(gpus.enumerate("gpu").unwrap().len(), 2);
    gpus.host().remove("/sys/bus/pci/devices/0000:23:00.0");
    let devices = gpus.enumerate("gpu").unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[1].id, "0000:23:00.0");
    assert_eq!(devices[1].health, Health::Unhealthy);
    assert_eq!(devices[1].numa_nodes, [1]);
}

#[test]
fn without_grants_the_module_reads_nothing() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/1-gpu");
    let bare = FakeHost::from_fixture(&dir).unwrap();
    let mut gpus = Harness::<AmdGpu>::init(bare, "{}").unwrap();
    let e = gpus.enumerate("gpu").unwrap_err();
    assert!(e.to_string().contains("no sysfs grant at all"), "{e}");
    // Granted one device that is not there: listing shows only what is granted, so the GPU
    // that is there stays out of reach.
    let narrow = FakeHost::from_fixture(&dir)
        .unwrap()
        .grant_sysfs("/sys/bus/pci/devices/0000:99:00.0");
    let mut gpus = Harness::<AmdGpu>::init(narrow, "{}").unwrap();
    assert!(gpus.enumerate("gpu").unwrap().is_empty());
    let mut pci = Harness::<AmdGpu>::init(node("1-gpu"), "{}").unwrap();
    assert_eq!(
        pci.enumerate("gpu").unwrap().len(),
        1,
        "granted, it is there"
    );
}

#[test]
fn config_is_checked() {
    let gpus = Harness::<AmdGpu>::init(node("1-gpu"), r#"{"resource": "mi300x"}"#).unwrap();
    assert_eq!(gpus.resources()[0].name, "mi300x");
    let e = Harness::<AmdGpu>::init(node("1-gpu"), r#"{"resurce": "x"}"#)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("unknown field `resurce`"), "{e}");
}
