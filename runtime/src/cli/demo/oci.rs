//! The demo's third part: the module as a signed OCI artifact. Debian's `docker-registry` runs
//! on a loopback port; the demo pushes generic-dev to it (as `devicelet module push`), signs it
//! with a key made here (as `devicelet module sign`), and starts an agent whose registry names
//! the module by digest with that `verify-key`: it pulls, checks the signature, loads and
//! serves it, and the simulator allocates from it. Without `docker-registry` (scripts/demo.sh
//! installs it) the part is skipped, saying so.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;

use crate::agent::{Agent, AgentOptions};
use crate::config::Registry;
use devicelet_simulator::Simulator;

const WAIT: Duration = Duration::from_secs(10);

/// Where `docker-registry` is on the PATH.
fn registry_binary() -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join("docker-registry"))
        .find(|p| p.is_file())
}

/// A loopback address no one listens on now.
fn free_addr() -> anyhow::Result<std::net::SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// A P-256 key pair as `openssl genpkey` writes one: (private PKCS#8 PEM, public PEM).
fn key_pair(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    use ring::signature::KeyPair;
    let rng = ring::rand::SystemRandom::new();
    let alg = &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING;
    let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(alg, &rng)
        .map_err(|e| anyhow::anyhow!("making a key: {e}"))?;
    let pair = ring::signature::EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng)
        .map_err(|e| anyhow::anyhow!("reading the key made: {e}"))?;
    let mut spki = crate::config::verify_key::P256_SPKI_PREFIX.to_vec();
    spki.extend_from_slice(pair.public_key().as_ref());
    let pem = |label: &str, der: &[u8]| {
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            BASE64.encode(der)
        )
    };
    let (key, public) = (dir.join("vendor.key"), dir.join("vendor.pub"));
    std::fs::write(&key, pem("PRIVATE KEY", pkcs8.as_ref()))?;
    std::fs::write(&public, pem("PUBLIC KEY", &spki))?;
    Ok((key, public))
}

pub async fn run(
    work: &Path,
    cache: &Path,
    module_dir: &Path,
    host_root: &Path,
) -> anyhow::Result<()> {
    println!("\n— the same module as a signed OCI artifact —");
    let Some(binary) = registry_binary() else {
        println!(
            "skipped: Debian's docker-registry is not installed (scripts/demo.sh installs it; \
             or `apt-get install docker-registry`)"
        );
        return Ok(());
    };
    let addr = free_addr()?;
    let config = work.join("registry.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            work.join("registry-data").display()
        ),
    )?;
    let mut registry = tokio::process::Command::new(&binary)
        .arg("serve")
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let started = std::time::Instant::now();
    while !matches!(crate::metrics::http::get(addr, "/v2/").await, Ok((200, _))) {
        if started.elapsed() > WAIT {
            anyhow::bail!(
                "{} did not answer on {addr} within {WAIT:?}",
                binary.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("docker-registry serving on http://{addr} (plain HTTP: --insecure-registry {addr})");

    let result = push_sign_pull(work, cache, module_dir, host_root, addr).await;
    let _ = registry.kill().await;
    result
}

async fn push_sign_pull(
    work: &Path,
    cache: &Path,
    module_dir: &Path,
    host_root: &Path,
    addr: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let access = crate::oci::access::Access::load(vec![addr.to_string()], None, None)
        .map_err(anyhow::Error::msg)?;
    let file = module_dir.join("generic_dev.wasm");
    let target = format!("oci://{addr}/devicelet/generic-dev:0.1.0");
    let source = super::super::module::push_file(&file, &target, &access).await?;
    println!(
        "pushed {} (devicelet module push)\n  source = \"{source}\"",
        file.display()
    );

    let (key, public) = key_pair(work)?;
    super::super::module::sign_with(&source, &key, &access).await?;
    println!(
        "signed it with {} (devicelet module sign); a node's registry pins it by digest with \
         verify-key = \"{}\"",
        key.display(),
        public.display()
    );

    let file = work.join("registry.toml");
    std::fs::write(
        &file,
        format!(
            r#"host-root = "{}"

[[module]]
name = "generic-dev"
source = "{source}"
verify-key = "{}"
health-interval = "500ms"

[module.grants]
dev = ["/dev/fuse"]

[module.config]
groups = [{{ name = "fuse", paths = ["/dev/fuse"] }}]
"#,
            host_root.display(),
            public.display()
        ),
    )?;
    let registry = Registry::load(&file)?;
    let plugin_dir = work.join("device-plugins");
    let kubelet = Simulator::start(&plugin_dir).await?;
    let mut options = AgentOptions::new(registry, plugin_dir);
    options.hot_reload = false;
    options.state_dir = Some(work.join("state"));
    options.cache_dir = Some(cache.to_owned());
    options.cdi_dir = work.join("cdi");
    options.registry_access = access;
    let agent = Agent::start(options).await?;
    if let Some(e) = agent.load_errors().first() {
        agent.shutdown().await;
        kubelet.shutdown().await;
        anyhow::bail!("{e}");
    }
    let state = kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await?;
    println!(
        "an agent pulled it by digest into {}, checked its signature against {}, and \
         registered {} ({} device)",
        work.join("state/modules").display(),
        public.display(),
        state.name,
        state.allocatable
    );
    let allocated = kubelet.allocate("devicelet.io/fuse", 1).await?;
    println!(
        "allocated 1 × devicelet.io/fuse from the pulled module: {:?}",
        allocated.device_ids
    );
    agent.shutdown().await;
    kubelet.shutdown().await;
    Ok(())
}
