//! A real OCI registry for the module-source scenarios: Debian's `docker-registry` (the CNCF
//! distribution registry, installed by `scripts/test.sh`), serving plain HTTP on 127.0.0.1 at a
//! free port from a scratch directory, stopped when dropped.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct TestRegistry {
    /// `127.0.0.1:<port>`.
    pub addr: String,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl TestRegistry {
    pub fn start() -> TestRegistry {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut registry = TestRegistry {
            addr: format!("127.0.0.1:{port}"),
            dir,
            child: None,
        };
        registry.up();
        registry
    }

    /// Serves (again, on the same address and storage).
    pub fn up(&mut self) {
        let config = self.dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: {}\n",
                self.dir.path().join("data").display(),
                self.addr
            ),
        )
        .expect("registry config");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting docker-registry (scripts/test.sh installs Debian's docker-registry)");
        self.child = Some(child);
        let deadline = Instant::now() + crate::WAIT;
        while !self.answers() {
            assert!(Instant::now() < deadline, "the registry never answered");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops serving; what it holds stays.
    pub fn down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `GET /v2/` answers 200.
    fn answers(&self) -> bool {
        let Ok(mut stream) = std::net::TcpStream::connect(&self.addr) else {
            return false;
        };
        let request = format!("GET /v2/ HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr);
        let mut answer = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut answer).is_ok()
            && answer.lines().next().is_some_and(|l| l.contains(" 200 "))
    }

    /// `devicelet module push FILE oci://<this>/<repository>:<tag>`, as a vendor runs it: the
    /// registry line it prints.
    pub fn push(&self, file: &Path, repository: &str, tag: &str) -> String {
        let out = Command::new(crate::devicelet_bin())
            .args(["module", "push"])
            .arg(file)
            .arg(format!("oci://{}/{repository}:{tag}", self.addr))
            .args(["--insecure-registry", &self.addr, "--log", "warn"])
            .output()
            .expect("running devicelet module push");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "push failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("registry line: "))
            .unwrap_or_else(|| panic!("no registry line in:\n{stdout}"))
            .to_owned()
    }
}

impl TestRegistry {
    /// One HTTP/1.0 request; the head (status line and headers) and body of the answer.
    fn request(&self, method: &str, path: &str, body: &[u8]) -> (String, String) {
        let mut stream = std::net::TcpStream::connect(&self.addr).expect("the registry");
        let head = format!(
            "{method} {path} HTTP/1.0\r\nHost: {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n",
            self.addr,
            if path.contains("/manifests/") {
                "application/vnd.oci.image.manifest.v1+json"
            } else {
                "application/octet-stream"
            },
            body.len()
        );
        stream.write_all(head.as_bytes()).expect("request");
        stream.write_all(body).expect("body");
        let mut answer = String::new();
        stream.read_to_string(&mut answer).expect("answer");
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
        (head.to_owned(), body.to_owned())
    }

    /// Pushes an artifact by hand, as any tool following the distribution API would: a config
    /// and one layer of the given media types and bytes, and its manifest under `tag`; the
    /// manifest's digest (hex).
    pub fn push_raw(
        &self,
        repository: &str,
        tag: &str,
        (config_type, config): (&str, &[u8]),
        (layer_type, layer): (&str, &[u8]),
    ) -> String {
        let sha = |b: &[u8]| devicelet::digest::sha256_hex(b);
        for blob in [config, layer] {
            // An upload session, then the blob in one PUT to where it says.
            let (head, body) =
                self.request("POST", &format!("/v2/{repository}/blobs/uploads/"), b"");
            assert!(head.contains(" 202 "), "upload session: {head} {body}");
            let location = head
                .lines()
                .find_map(|l| l.trim_end().strip_prefix("Location: "))
                .expect("the session's location");
            let path = location
                .split_once(self.addr.as_str())
                .map_or(location, |(_, path)| path);
            let joiner = if path.contains('?') { '&' } else { '?' };
            let (head, body) = self.request(
                "PUT",
                &format!("{path}{joiner}digest=sha256:{}", sha(blob)),
                blob,
            );
            assert!(head.contains(" 201 "), "blob upload: {head} {body}");
        }
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": config_type, "digest": format!("sha256:{}", sha(config)), "size": config.len()},
            "layers": [{"mediaType": layer_type, "digest": format!("sha256:{}", sha(layer)), "size": layer.len()}],
        }))
        .expect("manifest");
        let (status, body) = self.request(
            "PUT",
            &format!("/v2/{repository}/manifests/{tag}"),
            &manifest,
        );
        assert!(status.contains(" 201 "), "manifest: {status} {body}");
        sha(&manifest)
    }
}

impl TestRegistry {
    /// `devicelet module inspect REFERENCE`: (success, stdout and stderr).
    pub fn inspect(&self, reference: &str) -> (bool, String) {
        let out = Command::new(crate::devicelet_bin())
            .args(["module", "inspect", reference])
            .args(["--insecure-registry", &self.addr, "--log", "warn"])
            .output()
            .expect("running devicelet module inspect");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.down();
    }
}
