"""The official OpenAI Python SDK over HTTPS to `equiroute serve` (`[server.tls]`), with a
certificate authority made here (the `cryptography` package): a completion and a streamed
one through a client that trusts the CA, and a client that does not is refused.

Run by `.ci/run` (which installs `openai` and `cryptography` into a virtualenv):
    python tests/sdk/test_tls.py target/debug/equiroute
"""

import datetime
import http.client
import ipaddress
import os
import sys
import tempfile

import openai
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from harness import mock_and_gateway, run_checks, stop

MESSAGES = [{"role": "user", "content": "what is the capital of france?"}]


def pem_key(key):
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca_and_server_cert(work):
    """Writes ca.pem, cert.pem and key.pem (a certificate for 127.0.0.1 and localhost signed
    by the CA) into `work`; returns their paths."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "equiroute sdk test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "equiroute")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {name: os.path.join(work, f"{name}.pem") for name in ("ca", "cert", "key")}
    with open(paths["ca"], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(paths["cert"], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(paths["key"], "wb") as f:
        f.write(pem_key(key))
    return paths


def config(paths):
    def for_mock(mock_addr):
        return f"""
[server.tls]
cert_file = "{paths['cert']}"
key_file = "{paths['key']}"

[interfaces.chat]
kind = "chat"

[[interfaces.chat.providers]]
id = "mock"
kind = "openai"
model = "m"
base_url = "http://{mock_addr}/v1"
"""
    return for_mock


def check_completion(client):
    raw = client.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
    assert raw.headers.get("x-equiroute-provider") == "mock", raw.headers
    r = raw.parse()
    assert r.object == "chat.completion", r
    assert r.choices[0].message.role == "assistant", r
    assert r.choices[0].message.content, r


def check_stream(client):
    chunks = list(client.chat.completions.create(model="chat", messages=MESSAGES, stream=True))
    assert len(chunks) >= 2, chunks
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text, chunks
    assert any(c.choices and c.choices[0].finish_reason == "stop" for c in chunks), chunks[-1]


def check_untrusted(base_url):
    # The SDK's default client trusts the system's CAs: the test CA is not among them.
    untrusting = openai.OpenAI(
        base_url=base_url, api_key="unused", max_retries=0, http_client=openai.DefaultHttpxClient()
    )
    try:
        untrusting.chat.completions.create(model="chat", messages=MESSAGES)
    except openai.APIConnectionError as e:
        causes, cause = [], e
        while cause is not None:
            causes.append(repr(cause))
            cause = cause.__cause__ or cause.__context__
        assert any("CERTIFICATE_VERIFY_FAILED" in c or "certificate" in c.lower() for c in causes), causes
        return
    raise AssertionError("a client that does not trust the CA was answered")


def check_plain_http(addr):
    # Plain HTTP to the HTTPS port gets no HTTP answer.
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
    except (http.client.HTTPException, OSError):
        return
    finally:
        conn.close()
    raise AssertionError(f"plain HTTP was answered: {r.status}")


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/equiroute"
    work = tempfile.mkdtemp(prefix="equiroute-sdk-tls-")
    procs = []
    failed = 1
    try:
        paths = make_ca_and_server_cert(work)
        _, addr = mock_and_gateway(binary, config(paths), dict(os.environ), work, procs)
        base_url = f"https://{addr}/v1"
        client = openai.OpenAI(
            base_url=base_url,
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=paths["ca"]),
        )
        checks = [
            ("completion", lambda: check_completion(client)),
            ("stream", lambda: check_stream(client)),
            ("untrusted client refused", lambda: check_untrusted(base_url)),
            ("plain http not answered", lambda: check_plain_http(addr)),
        ]
        failed = run_checks(checks, "sdk over https")
    finally:
        stop(procs, work)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
