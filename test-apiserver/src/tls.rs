//! The generated PKI (CA, server certificate, client certificates) and the TLS server config.
//!
//! Client certificates are requested but not required at the TLS layer, as kube-apiserver does:
//! any certificate is accepted in the handshake (the client must still prove it holds the key),
//! and the chain is checked against the CA afterwards. A certificate from another CA therefore
//! gives a 401 on the HTTP request, not a handshake failure.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

/// The authenticated identity of a client certificate: CN is the user, O entries are groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CertIdentity {
    pub user: String,
    pub groups: Vec<String>,
}

pub(crate) struct Pki {
    pub ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
    provider: Arc<CryptoProvider>,
    /// The strict CA verifier, used after the handshake to authenticate.
    verifier: Arc<dyn ClientCertVerifier>,
    server_chain: Vec<CertificateDer<'static>>,
    server_key_der: Vec<u8>,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn new_ca(cn: &str) -> (CertificateDer<'static>, String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().expect("generate CA key");
    let cert = params.self_signed(&key).expect("self-sign CA");
    let pem = cert.pem();
    (cert.der().clone(), pem, Issuer::new(params, key))
}

fn client_cert(issuer: &Issuer<'static, KeyPair>, cn: &str, groups: &[&str]) -> (String, String) {
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    // rcgen keeps one value per attribute type; a second O goes in under its raw OID.
    match groups {
        [] => {}
        [o] => params.distinguished_name.push(DnType::OrganizationName, *o),
        [o1, o2] => {
            params.distinguished_name.push(DnType::OrganizationName, *o1);
            params
                .distinguished_name
                .push(DnType::CustomDnType(vec![2, 5, 4, 10]), *o2);
        }
        _ => panic!("issue_client_cert supports at most two groups (O entries), got {groups:?}"),
    }
    params.distinguished_name.push(DnType::CommonName, cn);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().expect("generate client key");
    let cert = params.signed_by(&key, issuer).expect("sign client certificate");
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    pub fn new() -> Pki {
        let provider = provider();
        let (ca_der, ca_pem, issuer) = new_ca("test-apiserver-ca");

        let mut params = CertificateParams::new(vec![
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
            "localhost".to_owned(),
            "kubernetes".to_owned(),
            "kubernetes.default".to_owned(),
            "kubernetes.default.svc".to_owned(),
        ])
        .expect("server SANs");
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, "kube-apiserver");
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate().expect("generate server key");
        let server_cert = params.signed_by(&server_key, &issuer).expect("sign server certificate");

        let mut roots = RootCertStore::empty();
        roots.add(ca_der.clone()).expect("CA into root store");
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .allow_unauthenticated()
            .build()
            .expect("client certificate verifier");

        Pki {
            ca_pem,
            issuer,
            provider,
            verifier,
            server_chain: vec![server_cert.der().clone(), ca_der],
            server_key_der: server_key.serialize_der(),
        }
    }

    pub fn issue_client_cert(&self, cn: &str, groups: &[&str]) -> (String, String) {
        client_cert(&self.issuer, cn, groups)
    }

    /// A client certificate from a throwaway CA the server does not trust.
    pub fn issue_untrusted_client_cert(cn: &str, groups: &[&str]) -> (String, String) {
        let (_, _, issuer) = new_ca("untrusted-ca");
        client_cert(&issuer, cn, groups)
    }

    pub fn server_config(&self, http2: bool) -> ServerConfig {
        let verifier = Arc::new(AnyClientCert {
            strict: self.verifier.clone(),
        });
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.server_key_der.clone()));
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.server_chain.clone(), key)
            .expect("server certificate");
        config.alpn_protocols = if http2 {
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        } else {
            vec![b"http/1.1".to_vec()]
        };
        config
    }

    /// Authenticates the certificates a client presented: `None` when absent or not from the CA.
    pub fn authenticate(&self, chain: &[CertificateDer<'_>]) -> Option<CertIdentity> {
        let (end_entity, intermediates) = chain.split_first()?;
        self.verifier
            .verify_client_cert(end_entity, intermediates, UnixTime::now())
            .ok()?;
        subject_identity(end_entity)
    }
}

/// Accepts any client certificate in the handshake (signatures are still verified, so the client
/// holds the key); authentication happens per request with [`Pki::authenticate`].
#[derive(Debug)]
struct AnyClientCert {
    strict: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for AnyClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.strict.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.strict.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.strict.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.strict.supported_verify_schemes()
    }
}

/// Reads one DER TLV: (tag, contents, rest).
fn der_tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

const OID_CN: &[u8] = &[0x55, 0x04, 0x03];
const OID_O: &[u8] = &[0x55, 0x04, 0x0a];

/// CN and O values of a certificate's subject.
fn subject_identity(cert: &[u8]) -> Option<CertIdentity> {
    let (_, cert, _) = der_tlv(cert)?;
    let (_, tbs, _) = der_tlv(cert)?;
    let (tag, _, mut rest) = der_tlv(tbs)?;
    if tag == 0xa0 {
        rest = der_tlv(rest)?.2; // version was present: skip the serial too
    }
    for _ in 0..3 {
        rest = der_tlv(rest)?.2; // signature algorithm, issuer, validity
    }
    let (_, mut rdns, _) = der_tlv(rest)?;
    let (mut user, mut groups) = (None, Vec::new());
    while !rdns.is_empty() {
        let (_, mut set, next) = der_tlv(rdns)?;
        rdns = next;
        while !set.is_empty() {
            let (_, attr, next) = der_tlv(set)?;
            set = next;
            let (_, oid, value) = der_tlv(attr)?;
            let (_, value, _) = der_tlv(value)?;
            let value = String::from_utf8_lossy(value).into_owned();
            if oid == OID_CN {
                user = Some(value);
            } else if oid == OID_O {
                groups.push(value);
            }
        }
    }
    Some(CertIdentity { user: user?, groups })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn der_of(pem: &str) -> Vec<u8> {
        use base64::Engine as _;
        let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD.decode(b64).unwrap()
    }

    #[test]
    fn issued_cert_identity() {
        let pki = Pki::new();
        let (cert, _key) = pki.issue_client_cert("system:node:gpu-1", &["system:nodes", "gpu"]);
        let der = CertificateDer::from(der_of(&cert));
        let id = pki.authenticate(&[der]).expect("trusted");
        assert_eq!(id.user, "system:node:gpu-1");
        assert_eq!(id.groups, ["system:nodes", "gpu"]);

        let (cert, _key) = Pki::issue_untrusted_client_cert("mallory", &[]);
        assert!(pki.authenticate(&[CertificateDer::from(der_of(&cert))]).is_none());
    }
}
