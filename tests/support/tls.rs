//! A certificate authority and a server certificate for 127.0.0.1 signed by it, for the tests
//! of TLS against servers they start (mosquitto, redis-server).

use std::path::{Path, PathBuf};

/// The files [`write_ca_and_server`] writes.
pub struct Certs {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Write `ca.pem`, `server.pem` and `server.key` into `dir`: a CA, and a certificate for
/// `localhost` and 127.0.0.1 that it signed, with its key.
pub fn write_ca_and_server(dir: &Path) -> Certs {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params
        .subject_alt_names
        .push(rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    let certs = Certs {
        ca: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    };
    std::fs::write(&certs.ca, ca.pem()).unwrap();
    std::fs::write(&certs.cert, cert.pem()).unwrap();
    std::fs::write(&certs.key, key.serialize_pem()).unwrap();
    certs
}
