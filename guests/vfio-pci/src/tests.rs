//! The module's logic against its fixture node, through the SDK's test kit.
//!
//! `fixtures/sriov-node`: an Intel X710 (PF `0000:3b:00.0` on `i40e`) with five VFs `02.0`-`02.4`
//! in IOMMU groups 41-45: three on `vfio-pci`, one on `iavf`, one unbound; a Mellanox VF on
//! `vfio-pci` (group 70); two NVIDIA RTX A6000 on `vfio-pci`, each with its audio function in its
//! group (50: `ca:00.0`/`.1`, 60: `cb:00.0`/`.1`) behind root ports on `pcieport`.

use devicelet_sdk::testing::{FakeHost, Harness};
use devicelet_sdk::{AttributeValue, Device, Health, NodeKind};

use super::{VfioPci, env_suffix};

const VFS: &str = r#"{"resources": [{"name": "x710-vf", "ids": ["8086:154c"], "vfs-only": true}]}"#;
const GPUS: &str = r#"{"resources": [{"name": "a6000", "ids": ["10de:2230", "10de:1aef"]}]}"#;
const DRIVERS: &str = "/sys/bus/pci/drivers";
const DEVICES: &str = "/sys/bus/pci/devices";

fn node() -> FakeHost {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sriov-node");
    FakeHost::from_fixture(&dir)
        .expect("the fixture reads")
        .grant_sysfs("/sys/bus/pci/devices/*")
        .grant_sysfs("/sys/kernel/iommu_groups/*")
        .grant_dev("/dev/vfio/*")
}

fn module(config: &str) -> Harness<VfioPci> {
    Harness::init_in(node(), config, "intel.com").expect("init")
}

fn summary(devices: &[Device]) -> Vec<(&str, Health, Option<&str>)> {
    devices
        .iter()
        .map(|d| (d.id.as_str(), d.health, d.health_reason.as_deref()))
        .collect()
}

fn attribute<'a>(device: &'a Device, name: &str) -> Option<&'a AttributeValue> {
    device
        .attributes
        .iter()
        .find(|a| a.name == name)
        .map(|a| &a.value)
}

/// Unbinds a function the way the kernel shows it: no `driver` link in its directory (`real`,
/// where `/sys/bus/pci/devices/<address>` leads), gone from the driver's directory.
fn unbind(host: &FakeHost, real: &str, driver: &str) {
    host.remove(&format!("{real}/driver"));
    let address = real.rsplit('/').next().unwrap_or_default();
    host.remove(&format!("{DRIVERS}/{driver}/{address}"));
}

#[test]
fn only_vfs_on_vfio_pci_are_devices_each_exclusive_with_its_facts() {
    let mut vfs = module(VFS);
    assert_eq!(vfs.resources()[0].name, "x710-vf");
    let devices = vfs.enumerate("x710-vf").unwrap();
    // Not the PF (i40e), not the VF on iavf nor the unbound one, not the Mellanox VF.
    assert_eq!(
        summary(&devices),
        [
            ("0000:3b:02.0", Health::Healthy, None),
            ("0000:3b:02.1", Health::Healthy, None),
            ("0000:3b:02.2", Health::Healthy, None),
        ]
    );
    let vf = &devices[1];
    assert!(vf.exclusive);
    assert_eq!(vf.group, None, "alone in its IOMMU group");
    assert_eq!(vf.numa_nodes, [0]);
    assert_eq!(vf.text("pci-address"), Some("0000:3b:02.1"));
    assert_eq!(vf.text("physfn"), Some("0000:3b:00.0"));
    assert_eq!(attribute(vf, "iommuGroup"), Some(&AttributeValue::Int(42)));
    assert_eq!(
        attribute(vf, "virtualFunction"),
        Some(&AttributeValue::Boolean(true))
    );
    assert_eq!(vf.text("deviceID"), Some("154c"));
}

#[test]
fn a_container_gets_the_vfio_container_its_groups_and_the_addresses_in_env() {
    let mut kubelet = module(VFS);
    let edits = kubelet
        .allocate("x710-vf", &["0000:3b:02.2", "0000:3b:02.0"])
        .unwrap();
    let nodes: Vec<&str> = edits.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(nodes, ["/dev/vfio/vfio", "/dev/vfio/41", "/dev/vfio/43"]);
    assert!(
        edits
            .devices
            .iter()
            .all(|d| d.container_path == d.host_path)
    );
    assert_eq!(
        edits.envs,
        [
            (
                "PCIDEVICE_INTEL_COM_X710-VF".to_string(),
                "0000:3b:02.2,0000:3b:02.0".to_string()
            ),
            (
                "PCI_RESOURCE_INTEL_COM_X710-VF".to_string(),
                "0000:3b:02.2,0000:3b:02.0".to_string()
            ),
        ]
    );
    // A function the resource does not serve never reaches the module.
    let e = kubelet.allocate("x710-vf", &["0000:5e:00.0"]).unwrap_err();
    assert!(e.to_string().contains("is not a device of x710-vf"), "{e}");
    // One rebound since the last enumeration does, and the module refuses it.
    kubelet.enumerate("x710-vf").unwrap();
    kubelet.host().set_symlink(
        "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.2/driver",
        "../../../../bus/pci/drivers/iavf",
    );
    let e = kubelet.allocate("x710-vf", &["0000:3b:02.2"]).unwrap_err();
    assert!(e.to_string().contains("bound to iavf, not vfio-pci"), "{e}");
}

#[test]
fn a_gpu_and_its_audio_function_form_one_group_never_split() {
    let mut gpus = module(GPUS);
    let devices = gpus.enumerate("a6000").unwrap();
    let groups: Vec<(&str, Option<&str>, Health)> = devices
        .iter()
        .map(|d| (d.id.as_str(), d.group.as_deref(), d.health))
        .collect();
    assert_eq!(
        groups,
        [
            ("0000:ca:00.0", Some("iommu-50"), Health::Healthy),
            ("0000:ca:00.1", Some("iommu-50"), Health::Healthy),
            ("0000:cb:00.0", Some("iommu-60"), Health::Healthy),
            ("0000:cb:00.1", Some("iommu-60"), Health::Healthy),
        ]
    );
    assert_eq!(devices[2].numa_nodes, [1]);
    let e = gpus.allocate("a6000", &["0000:ca:00.0"]).unwrap_err();
    assert!(e.to_string().contains("splits device group"), "{e}");
    let edits = gpus
        .allocate("a6000", &["0000:ca:00.0", "0000:ca:00.1"])
        .unwrap();
    let nodes: Vec<&str> = edits.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(nodes, ["/dev/vfio/vfio", "/dev/vfio/50"], "one group, once");
}

#[test]
fn unbinding_a_vf_makes_it_unhealthy_with_why_and_binding_it_back_heals_it() {
    let mut vfs = module(VFS);
    assert_eq!(vfs.enumerate("x710-vf").unwrap().len(), 3);
    let vf = "0000:3b:02.1";
    let real = "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.1";
    unbind(vfs.host(), real, "vfio-pci");
    vfs.host().remove("/dev/vfio/42");
    let devices = vfs.enumerate("x710-vf").unwrap();
    assert_eq!(
        summary(&devices)[1],
        (vf, Health::Unhealthy, Some("unbound from vfio-pci"))
    );
    // Bound to the host's VF driver: still listed, and the reason says where it went.
    vfs.host().set_symlink(
        &format!("{real}/driver"),
        "../../../../bus/pci/drivers/iavf",
    );
    let devices = vfs.enumerate("x710-vf").unwrap();
    assert_eq!(
        summary(&devices)[1],
        (vf, Health::Unhealthy, Some("bound to iavf, not vfio-pci"))
    );
    // Back on vfio-pci, but its group node not made yet: Unhealthy until it is.
    vfs.host().set_symlink(
        &format!("{real}/driver"),
        "../../../../bus/pci/drivers/vfio-pci",
    );
    let devices = vfs.enumerate("x710-vf").unwrap();
    assert_eq!(
        summary(&devices)[1],
        (vf, Health::Unhealthy, Some("/dev/vfio/42 is missing"))
    );
    vfs.host()
        .add_node("/dev/vfio/42", NodeKind::Character, 243, 1);
    let devices = vfs.enumerate("x710-vf").unwrap();
    assert!(devices.iter().all(|d| d.health == Health::Healthy));
}

#[test]
fn a_group_with_a_member_on_a_host_driver_is_not_viable() {
    let mut gpus = module(GPUS);
    assert_eq!(gpus.enumerate("a6000").unwrap().len(), 4);
    // The audio function taken by the host's sound driver: the kernel refuses to open the
    // group, so neither function can be handed out.
    let audio = "/sys/devices/pci0000:c9/0000:c9:00.0/0000:ca:00.1";
    gpus.host().set_symlink(
        &format!("{audio}/driver"),
        "../../../../bus/pci/drivers/snd_hda_intel",
    );
    let devices = gpus.enumerate("a6000").unwrap();
    assert_eq!(
        summary(&devices)[..2],
        [
            (
                "0000:ca:00.0",
                Health::Unhealthy,
                Some("IOMMU group 50 is not viable: 0000:ca:00.1 is bound to snd_hda_intel")
            ),
            (
                "0000:ca:00.1",
                Health::Unhealthy,
                Some("bound to snd_hda_intel, not vfio-pci")
            ),
        ]
    );
    assert_eq!(devices[2].health, Health::Healthy, "the other GPU's group");
}

#[test]
fn an_unbound_partner_leaves_the_rest_of_its_group_allocatable_alone() {
    let mut gpus = module(GPUS);
    gpus.enumerate("a6000").unwrap();
    let audio = "/sys/devices/pci0000:c9/0000:c9:00.0/0000:ca:00.1";
    unbind(gpus.host(), audio, "vfio-pci");
    let devices = gpus.enumerate("a6000").unwrap();
    let first: Vec<(&str, Option<&str>, Health)> = devices[..2]
        .iter()
        .map(|d| (d.id.as_str(), d.group.as_deref(), d.health))
        .collect();
    assert_eq!(
        first,
        [
            ("0000:ca:00.0", None, Health::Healthy),
            ("0000:ca:00.1", None, Health::Unhealthy),
        ]
    );
    let edits = gpus.allocate("a6000", &["0000:ca:00.0"]).unwrap();
    assert_eq!(edits.devices[1].host_path, "/dev/vfio/50");
}

#[test]
fn bridges_stub_and_unbound_members_keep_a_group_viable_and_a_host_driver_does_not() {
    let mut vfs = module(VFS);
    // Group 41 gains the root port (on pcieport), a VF claimed by pci-stub and the unbound VF.
    let members = "/sys/kernel/iommu_groups/41/devices";
    let pf = "/sys/devices/pci0000:3a/0000:3a:00.0";
    vfs.host().set_symlink(
        &format!("{members}/0000:3a:00.0"),
        "../../../../devices/pci0000:3a/0000:3a:00.0",
    );
    for vf in ["0000:3b:02.3", "0000:3b:02.4"] {
        vfs.host().set_symlink(
            &format!("{members}/{vf}"),
            &format!("../../../../devices/pci0000:3a/0000:3a:00.0/{vf}"),
        );
    }
    vfs.host().set_symlink(
        &format!("{pf}/0000:3b:02.3/driver"),
        "../../../../bus/pci/drivers/pci-stub",
    );
    let reason =
        |vfs: &mut Harness<VfioPci>| vfs.enumerate("x710-vf").unwrap()[0].health_reason.clone();
    assert_eq!(reason(&mut vfs), None);
    vfs.host().set_symlink(
        &format!("{pf}/0000:3b:02.4/driver"),
        "../../../../bus/pci/drivers/iavf",
    );
    assert_eq!(
        reason(&mut vfs).as_deref(),
        Some("IOMMU group 41 is not viable: 0000:3b:02.4 is bound to iavf")
    );
}

#[test]
fn vfs_only_leaves_out_a_physical_function_on_vfio() {
    let config = |vfs_only: bool| {
        format!(
            r#"{{"resources": [{{"name": "x710", "ids": ["8086:1572", "8086:154c"], "vfs-only": {vfs_only}}}]}}"#
        )
    };
    let host = node();
    host.set_symlink(
        "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/driver",
        "../../../../bus/pci/drivers/vfio-pci",
    );
    host.add_node("/dev/vfio/31", NodeKind::Character, 243, 9);
    let mut all = Harness::<VfioPci>::init_in(host, &config(false), "intel.com").unwrap();
    let devices = all.enumerate("x710").unwrap();
    let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "0000:3b:00.0",
            "0000:3b:02.0",
            "0000:3b:02.1",
            "0000:3b:02.2"
        ]
    );
    assert_eq!(
        attribute(&devices[0], "virtualFunction"),
        Some(&AttributeValue::Boolean(false))
    );
    let mut vfs = all.another(&config(true)).unwrap();
    assert_eq!(vfs.enumerate("x710").unwrap().len(), 3);
}

#[test]
fn a_variant_vfio_driver_counts_as_vfio_pci() {
    let mut vfs = module(VFS);
    vfs.host().set_symlink(
        "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.0/driver",
        "../../../../bus/pci/drivers/ice_vfio_pci",
    );
    let devices = vfs.enumerate("x710-vf").unwrap();
    assert_eq!(devices[0].health, Health::Healthy);
}

#[test]
fn a_group_split_between_two_resources_is_unhealthy_in_both() {
    let split = r#"{"resources": [
        {"name": "a6000", "ids": ["10de:2230"]},
        {"name": "a6000-audio", "ids": ["10de:1aef"]}
    ]}"#;
    let mut module = module(split);
    let gpus = module.enumerate("a6000").unwrap();
    assert_eq!(gpus.len(), 2);
    let reason = gpus[0].health_reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("IOMMU group 50 is split between resources a6000 and a6000-audio"),
        "{reason}"
    );
    let audio = module.enumerate("a6000-audio").unwrap();
    assert!(audio.iter().all(|d| d.health == Health::Unhealthy));
}

#[test]
fn a_function_gone_from_the_bus_stays_listed_unhealthy() {
    let mut vfs = module(VFS);
    vfs.enumerate("x710-vf").unwrap();
    vfs.host().remove(&format!("{DEVICES}/0000:3b:02.0"));
    vfs.host()
        .remove("/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.0");
    let devices = vfs.enumerate("x710-vf").unwrap();
    assert_eq!(devices.len(), 3);
    let gone = devices.iter().find(|d| d.id == "0000:3b:02.0").unwrap();
    assert_eq!(gone.health_reason.as_deref(), Some("gone from the PCI bus"));
    assert!(gone.exclusive);
}

#[test]
fn without_the_iommu_or_its_grant_the_reason_says_what_to_do() {
    let mut vfs = module(VFS);
    vfs.host().remove("/dev/vfio/vfio");
    let devices = vfs.enumerate("x710-vf").unwrap();
    assert_eq!(
        devices[0].health_reason.as_deref(),
        Some("/dev/vfio/vfio is missing (is the vfio module loaded?)")
    );
    let real = "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.0";
    vfs.host().remove(&format!("{real}/iommu_group"));
    let devices = vfs.enumerate("x710-vf").unwrap();
    assert!(
        devices[0]
            .health_reason
            .as_deref()
            .is_some_and(|r| r.starts_with("no IOMMU group")),
        "{:?}",
        devices[0].health_reason
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sriov-node");
    let no_groups = FakeHost::from_fixture(&dir)
        .unwrap()
        .grant_sysfs("/sys/bus/pci/devices/*")
        .grant_dev("/dev/vfio/*");
    let mut vfs = Harness::<VfioPci>::init(no_groups, VFS).unwrap();
    let e = vfs.enumerate("x710-vf").unwrap_err();
    assert!(e.to_string().contains("/sys/kernel/iommu_groups/*"), "{e}");
}

#[test]
fn config_is_checked() {
    let refused = |config: &str| {
        Harness::<VfioPci>::init(node(), config)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(refused("{}").contains("missing field `resources`"));
    assert!(refused(r#"{"resources": []}"#).contains("name at least one resource"));
    assert!(
        refused(r#"{"resources": [{"name": "vf", "ids": ["8086-154c"]}]}"#)
            .contains("\"8086-154c\" is not a vendor:device pair")
    );
    assert!(
        refused(r#"{"resources": [{"name": "vf", "ids": ["8086:154c"], "vf-only": true}]}"#)
            .contains("unknown field `vf-only`")
    );
    let twice = r#"{"resources": [{"name": "a", "ids": ["8086:154C"]}, {"name": "b", "ids": ["8086:154c"]}]}"#;
    assert!(refused(twice).contains("8086:154c is selected by both \"a\" and \"b\""));
}

#[test]
fn env_names_follow_the_sriov_plugin_and_kubevirt() {
    assert_eq!(env_suffix("intel.com/x710-vf"), "INTEL_COM_X710-VF");
    assert_eq!(
        env_suffix("nvidia.com/GA102GL_A10"),
        "NVIDIA_COM_GA102GL_A10"
    );
}
