//! TLS files: the `[server.tls]` table (the HTTPS listener's certificate chain and key) and the
//! PEM reading it shares with a reload ([`read_pair`]), and the CA file of a private Redis CA
//! ([`read_ca`]). A pair is checked whole before it is used: both files are read, each holds
//! PEM of the right kind, and the key is the certificate's.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// `[server.tls]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
}

/// The HTTPS listener's files (`[server.tls]`), checked at load: both exist, hold PEM, and
/// the key is the certificate's. Relative paths are from the gateway's working directory.
/// Re-read when they change (the certificate reload), never held open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsConfig {
    /// The certificate chain, the server's own certificate first (PEM).
    pub cert_file: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// Why a certificate/key pair cannot serve: the field (`cert_file` or `key_file`) whose file
/// is at fault, and what is wrong with it and how to mend it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairProblem {
    pub field: &'static str,
    pub why: String,
}

impl std::fmt::Display for PairProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "server.tls.{}: {}", self.field, self.why)
    }
}

/// Validates `[server.tls]`: both files named, readable, PEM, and a matching pair.
pub(super) fn validate(raw: RawTls) -> Result<TlsConfig, Vec<(String, String)>> {
    let mut problems = Vec::new();
    let mut need = |value: Option<PathBuf>, field: &str, example: &str| {
        if value.is_none() {
            problems.push((
                format!("server.tls.{field}"),
                format!("HTTPS needs both files: add {field} = \"{example}\" (PEM)"),
            ));
        }
        value
    };
    let cert_file = need(raw.cert_file, "cert_file", "/etc/equiroute/tls/cert.pem");
    let key_file = need(raw.key_file, "key_file", "/etc/equiroute/tls/key.pem");
    let (Some(cert_file), Some(key_file)) = (cert_file, key_file) else {
        return Err(problems);
    };
    let config = TlsConfig {
        cert_file,
        key_file,
    };
    match read_pair(&config) {
        Ok(_) => Ok(config),
        Err(p) => Err(vec![(format!("server.tls.{}", p.field), p.why)]),
    }
}

/// Reads `path` whole, or says why not (naming the file).
fn read(path: &Path, field: &'static str) -> Result<Vec<u8>, PairProblem> {
    std::fs::read(path).map_err(|e| PairProblem {
        field,
        why: if e.kind() == std::io::ErrorKind::NotFound {
            format!(
                "{} does not exist: give the path of an existing PEM file (relative paths are from the gateway's working directory)",
                path.display()
            )
        } else {
            format!(
                "{} cannot be read ({e}): let the gateway's user read it",
                path.display()
            )
        },
    })
}

/// The certificate chain and key of `tls`, read now and checked: each file holds PEM of its
/// kind, and the key is the certificate's.
///
/// # Errors
/// What is wrong, with the field whose file it is.
pub fn read_pair(tls: &TlsConfig) -> Result<CertifiedKey, PairProblem> {
    let certs = read(&tls.cert_file, "cert_file")?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&certs)
        .collect::<Result<_, _>>()
        .map_err(|e| PairProblem {
            field: "cert_file",
            why: format!("{} is not valid PEM ({e}): give the certificate chain in PEM, the server's certificate first", tls.cert_file.display()),
        })?;
    if chain.is_empty() {
        return Err(PairProblem {
            field: "cert_file",
            why: format!(
                "{} holds no certificate (no BEGIN CERTIFICATE block): give the certificate chain in PEM, the server's certificate first",
                tls.cert_file.display()
            ),
        });
    }
    let key_pem = read(&tls.key_file, "key_file")?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| PairProblem {
        field: "key_file",
        why: format!(
            "{} holds no private key in PEM ({e}): give the certificate's key (BEGIN PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY)",
            tls.key_file.display()
        ),
    })?;
    CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider()).map_err(|e| {
        let mismatch = matches!(e, rustls::Error::InconsistentKeys(_));
        PairProblem {
            field: "key_file",
            why: if mismatch {
                format!(
                    "{} is not the key of the certificate in {}: give the pair's own key",
                    tls.key_file.display(),
                    tls.cert_file.display()
                )
            } else {
                format!(
                    "{} or {} cannot be used ({e}): give a certificate and its key (RSA, ECDSA or Ed25519)",
                    tls.key_file.display(),
                    tls.cert_file.display()
                )
            },
        }
    })
}

/// The certificates of the CA file `path` (PEM), for a private CA's Redis: the bytes, checked
/// to hold at least one certificate.
///
/// # Errors
/// The fix, for the field that names the file.
pub fn read_ca(path: &Path) -> Result<Vec<u8>, String> {
    let bytes = read(path, "tls_ca_file").map_err(|p| p.why)?;
    let certs: Result<Vec<CertificateDer<'static>>, _> =
        CertificateDer::pem_slice_iter(&bytes).collect();
    match certs {
        Ok(certs) if !certs.is_empty() => Ok(bytes),
        Ok(_) => Err(format!(
            "{} holds no certificate (no BEGIN CERTIFICATE block): give the CA's certificate in PEM",
            path.display()
        )),
        Err(e) => Err(format!(
            "{} is not valid PEM ({e}): give the CA's certificate in PEM",
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A fresh directory with `files` written in it.
    fn dir(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let d = std::env::temp_dir().join(format!("equiroute-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for (f, text) in files {
            std::fs::write(d.join(f), text).unwrap();
        }
        d
    }

    fn pair(d: &Path) -> TlsConfig {
        TlsConfig {
            cert_file: d.join("cert.pem"),
            key_file: d.join("key.pem"),
        }
    }

    #[test]
    fn every_bad_pair_names_its_field_and_the_fix() {
        let a = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let b = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert, key) = (a.cert.pem(), a.signing_key.serialize_pem());
        let ok = dir("ok", &[("cert.pem", &cert), ("key.pem", &key)]);
        assert!(read_pair(&pair(&ok)).is_ok());
        let missing = dir("missing", &[("key.pem", &key)]);
        let p = read_pair(&pair(&missing)).unwrap_err();
        assert_eq!(p.field, "cert_file");
        assert!(p.why.contains("does not exist"), "{}", p.why);
        let not_pem = dir("notpem", &[("cert.pem", "hello"), ("key.pem", &key)]);
        let p = read_pair(&pair(&not_pem)).unwrap_err();
        assert!(
            p.field == "cert_file" && p.why.contains("no certificate"),
            "{p}"
        );
        let no_key = dir("nokey", &[("cert.pem", &cert), ("key.pem", &cert)]);
        let p = read_pair(&pair(&no_key)).unwrap_err();
        assert!(
            p.field == "key_file" && p.why.contains("no private key"),
            "{p}"
        );
        let other = b.signing_key.serialize_pem();
        let wrong = dir("wrong", &[("cert.pem", &cert), ("key.pem", &other)]);
        let p = read_pair(&pair(&wrong)).unwrap_err();
        assert!(
            p.field == "key_file" && p.why.contains("is not the key of"),
            "{p}"
        );
        let e = validate(RawTls {
            cert_file: Some(ok.join("cert.pem")),
            key_file: None,
        })
        .unwrap_err();
        assert_eq!(e[0].0, "server.tls.key_file");
        assert!(read_ca(&ok.join("cert.pem")).is_ok());
        assert!(read_ca(&ok.join("key.pem"))
            .unwrap_err()
            .contains("no certificate"));
        for d in [ok, missing, not_pem, no_key, wrong] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
