//! The registry token flow's other half, for a `docker-registry` configured with `auth.token`:
//! a token server on 127.0.0.1 that checks a user's basic credentials and answers a JWT
//! (ES256, its certificate in the `x5c` header, trusted by the registry's `rootcertbundle`)
//! granting the scopes asked for, as Docker Hub's or Harbor's token service does. The registry
//! then checks every request's bearer token against that certificate.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};

/// The `service` and `issuer` the registry's `auth.token` names.
pub const SERVICE: &str = "devicelet-test";
pub const ISSUER: &str = "devicelet-test-issuer";

pub struct TokenServer {
    /// `http://127.0.0.1:<port>/token`: the registry's `realm`.
    pub realm: String,
    /// The certificate (PEM) the registry trusts tokens signed under.
    pub certificate: PathBuf,
    /// Tokens handed out so far.
    pub issued: Arc<AtomicUsize>,
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
}

impl TokenServer {
    /// Serves tokens to `user` (name, password), with a key and certificate made in `dir`.
    pub fn start(dir: &Path, user: (&str, &str)) -> TokenServer {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
            .expect("a token signing key");
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .expect("the token signing key");
        let key_file = dir.join("token.key");
        std::fs::write(
            &key_file,
            format!(
                "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n",
                STANDARD.encode(pkcs8.as_ref())
            ),
        )
        .expect("writing the token key");
        let certificate = dir.join("token.crt");
        crate::oci::run(
            Command::new("openssl")
                .args(["req", "-x509", "-days", "2"])
                .args(["-subj", "/CN=devicelet test token issuer", "-key"])
                .arg(&key_file)
                .arg("-out")
                .arg(&certificate),
        );
        let der = crate::oci::run(
            Command::new("openssl")
                .args(["x509", "-outform", "DER", "-in"])
                .arg(&certificate),
        );

        let listener = TcpListener::bind("127.0.0.1:0").expect("a port for the token server");
        let addr = listener.local_addr().expect("its address");
        let (issued, stop) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let expected = format!(
            "Basic {}",
            STANDARD.encode(format!("{}:{}", user.0, user.1))
        );
        let signer = Signer {
            key,
            x5c: STANDARD.encode(&der),
            subject: user.0.to_owned(),
        };
        let (counter, stopped) = (issued.clone(), stop.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                if answer(stream, &expected, &signer) {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        TokenServer {
            realm: format!("http://{addr}/token"),
            certificate,
            issued,
            addr,
            stop,
        }
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
    }
}

struct Signer {
    key: EcdsaKeyPair,
    x5c: String,
    subject: String,
}

impl Signer {
    /// A token granting `scopes` (`repository:<name>:<actions>`).
    fn token(&self, scopes: &[String]) -> String {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let access: Vec<serde_json::Value> = scopes
            .iter()
            .filter_map(|scope| {
                let mut parts = scope.splitn(3, ':');
                let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
                Some(serde_json::json!({
                    "type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>(),
                }))
            })
            .collect();
        let header = serde_json::json!({"typ": "JWT", "alg": "ES256", "x5c": [self.x5c]});
        let claims = serde_json::json!({
            "iss": ISSUER, "sub": self.subject, "aud": SERVICE,
            "exp": now + 300, "nbf": now - 10, "iat": now, "jti": format!("{now}-{}", scopes.len()),
            "access": access,
        });
        let signed = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let rng = ring::rand::SystemRandom::new();
        let signature = self.key.sign(&rng, signed.as_bytes()).expect("signing");
        format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()))
    }
}

/// `%3A` → `:`.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], text.get(i + 1..i + 3)) {
            (b'%', Some(hex)) if u8::from_str_radix(hex, 16).is_ok() => {
                out.push(u8::from_str_radix(hex, 16).unwrap_or_default());
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Answers one request; whether it handed out a token.
fn answer(stream: TcpStream, expected: &str, signer: &Signer) -> bool {
    let mut reader = BufReader::new(&stream);
    let mut first = String::new();
    if reader.read_line(&mut first).is_err() {
        return false;
    }
    let mut authorization = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("authorization")
        {
            authorization = Some(value.trim().to_owned());
        }
    }
    let target = first.split_whitespace().nth(1).unwrap_or_default();
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let scopes: Vec<String> = query
        .split('&')
        .filter_map(|kv| kv.strip_prefix("scope="))
        .map(percent_decoded)
        .collect();
    let mut stream = &stream;
    if authorization.as_deref() != Some(expected) {
        let _ = stream.write_all(
            b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        );
        return false;
    }
    let token = signer.token(&scopes);
    let body =
        serde_json::json!({"token": token, "access_token": token, "expires_in": 300}).to_string();
    let _ = stream.write_all(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    true
}
