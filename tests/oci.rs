//! A real OCI registry for the module-source scenarios: Debian's `docker-registry` (the CNCF
//! distribution registry, installed by `scripts/test.sh`) on 127.0.0.1 at a free port, from a
//! scratch directory, stopped when dropped. Plain HTTP (listed as insecure); or secured: TLS
//! with a certificate from a CA made here by `openssl`, and basic auth from an htpasswd file
//! (bcrypt, by apache2-utils' `htpasswd`); or plain HTTP behind the token flow (`token.rs`).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct TestRegistry {
    /// `127.0.0.1:<port>`.
    pub addr: String,
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// For a secured one: the CA's certificate (TLS) and the Docker config with good
    /// credentials.
    pub secured: Option<Secured>,
    /// For one behind the token flow: its token server.
    pub token: Option<crate::token::TokenServer>,
}

pub struct Secured {
    pub ca: Option<std::path::PathBuf>,
    pub auth: std::path::PathBuf,
}

/// The user the secured registry knows, and its password.
pub const USER: (&str, &str) = ("vendor", "s3cret-pass");

/// `127.0.0.1:<a port free now>`.
pub fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    format!("127.0.0.1:{port}")
}

/// Runs a tool the scenarios set up with (`openssl`): its stdout; it must succeed.
pub fn run(command: &mut Command) -> Vec<u8> {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A Docker config.json with `user`'s credentials for `registry`, in `dir`.
pub fn docker_config(
    dir: &Path,
    registry: &str,
    (user, password): (&str, &str),
) -> std::path::PathBuf {
    use base64::Engine as _;
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let file = dir.join(format!("config-{user}-{}.json", password.len()));
    std::fs::write(
        &file,
        serde_json::to_vec(&serde_json::json!({"auths": {registry: {"auth": auth}}}))
            .expect("json"),
    )
    .expect("writing the docker config");
    file
}

impl TestRegistry {
    pub fn start() -> TestRegistry {
        let (dir, addr) = (tempfile::tempdir().expect("tempdir"), free_addr());
        let mut registry = TestRegistry {
            addr,
            dir,
            child: None,
            secured: None,
            token: None,
        };
        registry.up();
        registry
    }

    /// Serves over TLS (its certificate from a CA made here, for IP 127.0.0.1) and only to
    /// [`USER`].
    pub fn start_secured() -> TestRegistry {
        let (dir, addr) = (tempfile::tempdir().expect("tempdir"), free_addr());
        let d = dir.path();
        let ca = d.join("ca.crt");
        run(Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
            ])
            .args([
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=devicelet test CA",
                "-keyout",
            ])
            .arg(d.join("ca.key"))
            .arg("-out")
            .arg(&ca));
        run(Command::new("openssl")
            .args([
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
            ])
            .args(["-subj", "/CN=127.0.0.1", "-keyout"])
            .arg(d.join("tls.key"))
            .arg("-out")
            .arg(d.join("tls.csr")));
        let ext = d.join("ext.cnf");
        std::fs::write(
            &ext,
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
        )
        .expect("extensions");
        run(Command::new("openssl")
            .args(["x509", "-req", "-days", "2", "-in"])
            .arg(d.join("tls.csr"))
            .arg("-CA")
            .arg(&ca)
            .arg("-CAkey")
            .arg(d.join("ca.key"))
            .args(["-CAcreateserial", "-extfile"])
            .arg(&ext)
            .arg("-out")
            .arg(d.join("tls.crt")));
        let htpasswd = Command::new("htpasswd")
            .args(["-nbB", USER.0, USER.1])
            .output()
            .expect("htpasswd (scripts/test.sh installs apache2-utils)");
        assert!(htpasswd.status.success());
        std::fs::write(d.join("htpasswd"), &htpasswd.stdout).expect("htpasswd file");
        let auth = docker_config(d, &addr, USER);
        let mut registry = TestRegistry {
            addr,
            dir,
            child: None,
            secured: Some(Secured { ca: Some(ca), auth }),
            token: None,
        };
        registry.up();
        registry
    }

    /// Serves plain HTTP, only with a bearer token from its token server, which hands tokens
    /// to [`USER`].
    pub fn start_with_token() -> TestRegistry {
        let (dir, addr) = (tempfile::tempdir().expect("tempdir"), free_addr());
        let token = crate::token::TokenServer::start(dir.path(), USER);
        let auth = docker_config(dir.path(), &addr, USER);
        let mut registry = TestRegistry {
            addr,
            dir,
            child: None,
            secured: Some(Secured { ca: None, auth }),
            token: Some(token),
        };
        registry.up();
        registry
    }

    /// The flags that reach it: `--insecure-registry`, or its CA and credentials.
    pub fn args(&self) -> Vec<String> {
        let Some(s) = &self.secured else {
            return vec!["--insecure-registry".into(), self.addr.clone()];
        };
        let mut args = match &s.ca {
            Some(ca) => vec!["--registry-ca".into(), ca.display().to_string()],
            None => vec!["--insecure-registry".into(), self.addr.clone()],
        };
        args.extend(["--registry-auth".into(), s.auth.display().to_string()]);
        args
    }

    /// What an agent reaching it is given (with `auth`, when secured: a Docker config).
    pub fn access(&self, auth: Option<&Path>) -> devicelet::oci::access::Access {
        let ca = self.secured.as_ref().and_then(|s| s.ca.as_deref());
        let insecure = match ca {
            Some(_) => Vec::new(),
            None => vec![self.addr.clone()],
        };
        devicelet::oci::access::Access::load(insecure, ca, auth)
            .expect("the test registry's access")
    }

    /// Serves (again, on the same address and storage).
    pub fn up(&mut self) {
        let config = self.dir.path().join("config.yml");
        let d = self.dir.path();
        let secured = match (&self.secured, &self.token) {
            (_, Some(token)) => format!(
                "auth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
                token.realm,
                crate::token::SERVICE,
                crate::token::ISSUER,
                token.certificate.display()
            ),
            (None, None) => String::new(),
            (Some(_), None) => format!(
                "  tls:\n    certificate: {}\n    key: {}\nauth:\n  htpasswd:\n    realm: devicelet-test\n    path: {}\n",
                d.join("tls.crt").display(),
                d.join("tls.key").display(),
                d.join("htpasswd").display()
            ),
        };
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: {}\n{secured}",
                d.join("data").display(),
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

    /// `GET /v2/` answers (200, or 401 behind the token flow); over TLS, its port takes
    /// connections.
    fn answers(&self) -> bool {
        let Ok(mut stream) = std::net::TcpStream::connect(&self.addr) else {
            return false;
        };
        if self.secured.as_ref().is_some_and(|s| s.ca.is_some()) {
            return true;
        }
        let request = format!("GET /v2/ HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr);
        let mut answer = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut answer).is_ok()
            // 401: it answers, and wants a token.
            && answer
                .lines()
                .next()
                .is_some_and(|l| l.contains(" 200 ") || l.contains(" 401 "))
    }

    /// `devicelet module push FILE oci://<this>/<repository>:<tag>`, as a vendor runs it: the
    /// registry line it prints.
    pub fn push(&self, file: &Path, repository: &str, tag: &str) -> String {
        let out = Command::new(crate::devicelet_bin())
            .args(["module", "push"])
            .arg(file)
            .arg(format!("oci://{}/{repository}:{tag}", self.addr))
            .args(self.args())
            .args(["--log", "warn"])
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
        self.module(&["inspect", reference])
    }

    /// Changes the bytes the registry stores for blob `hex` (same length), as a corrupted or
    /// subverted storage would: the registry serves them as they are.
    pub fn tamper_blob(&self, hex: &str) {
        let file = self
            .dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data");
        let mut bytes = std::fs::read(&file).expect("the stored blob");
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&file, bytes).expect("tampering");
    }

    /// `devicelet module ARGS…` against this registry: (success, stdout and stderr).
    pub fn module(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(crate::devicelet_bin())
            .arg("module")
            .args(args)
            .args(self.args())
            .args(["--log", "warn"])
            .output()
            .expect("running devicelet module");
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
