//! Tells a sandbox's own daemon from another answering at its address. A pod's IP is reused once
//! the pod is gone, and a watch can be behind, so before a create hands out `ip:port` the
//! provider asks the daemon there to prove the sandbox's token: `GET /v1/health?challenge=<fresh
//! random>` must answer `proof` = HMAC-SHA256(token, challenge). The token itself is never sent,
//! so a stranger learns nothing it could use. Start at [`prove`].

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use ring::rand::{SecureRandom, SystemRandom};
use sandman_wire::daemon::{Health, health_proof_input};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long one health call may take before it is tried again.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a running pod's daemon may stay silent before it is logged.
const SILENT_FOR: Duration = Duration::from_secs(10);
/// The largest health answer read.
const MAX_ANSWER: usize = 16 * 1024;
/// Bytes of randomness in a challenge (sent as hex).
const CHALLENGE_BYTES: usize = 16;

/// Why the daemon at a pod's address was not taken for the sandbox's own.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A daemon answered, with a proof made with another token: it serves another sandbox.
    #[error(
        "the daemon at {addr} answered for another sandbox (its health proof was not made with this sandbox's token)"
    )]
    Stranger { addr: String },
    /// A daemon answered without a proof: one too old to give it, so it cannot be told apart.
    #[error(
        "the daemon at {addr} (version {version}) gave no health proof, so it cannot be told from another sandbox's: the daemon image is older than this server"
    )]
    NoProof { addr: String, version: String },
    /// No daemon answered before the deadline.
    #[error("no daemon answered its health check at {addr}: {last}")]
    Unreachable { addr: String, last: String },
    /// No randomness for the challenge.
    #[error("cannot draw a random challenge")]
    Random,
}

/// Asks the daemon at `addr` to prove `token`, trying again (backing off from 10 ms to 200 ms)
/// while nothing answers, until `deadline`. Any answer with a proof decides at once. Still no
/// answer after [`SILENT_FOR`] is logged once (the pod runs, so the server cannot reach pods:
/// a network policy, a CNI or host firewall), since the create may wait long after that.
pub async fn prove(addr: &str, token: &str, deadline: Instant) -> Result<(), IdentityError> {
    let challenge = challenge()?;
    let mut pause = Duration::from_millis(10);
    let started = Instant::now();
    let mut told = false;
    loop {
        let last = match tokio::time::timeout(CALL_TIMEOUT, health(addr, &challenge)).await {
            Ok(Ok(answer)) => return check(addr, token, &challenge, &answer),
            Ok(Err(why)) => why,
            Err(_) => format!("no answer within {} s", CALL_TIMEOUT.as_secs()),
        };
        if Instant::now() + pause > deadline {
            return Err(IdentityError::Unreachable { addr: addr.to_string(), last });
        }
        if !told && started.elapsed() >= SILENT_FOR {
            told = true;
            tracing::warn!(
                addr,
                last = %last,
                "the sandbox's pod runs but its daemon has not answered for {} s; can this server reach pod IPs?",
                SILENT_FOR.as_secs()
            );
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Whether `answer` proves `token` for `challenge`; the comparison takes the same time wherever
/// the proof differs.
pub fn check(addr: &str, token: &str, challenge: &str, answer: &Health) -> Result<(), IdentityError> {
    let Some(proof) = answer.proof.as_deref() else {
        return Err(IdentityError::NoProof { addr: addr.to_string(), version: answer.version.clone() });
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    match hex_decode(proof) {
        Some(tag) if ring::hmac::verify(&key, &health_proof_input(challenge), &tag).is_ok() => Ok(()),
        _ => Err(IdentityError::Stranger { addr: addr.to_string() }),
    }
}

/// A fresh random challenge, as hex.
fn challenge() -> Result<String, IdentityError> {
    let mut bytes = [0u8; CHALLENGE_BYTES];
    SystemRandom::new().fill(&mut bytes).map_err(|_| IdentityError::Random)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len() / 2).map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()).collect()
}

/// One `GET /v1/health?challenge=` on a connection of its own; any answer but a 200 with a
/// health body is an error (the caller tries again).
async fn health(addr: &str, challenge: &str) -> Result<Health, String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| format!("cannot connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
    let req = http::Request::get(format!("/v1/health?challenge={challenge}"))
        .header(http::header::HOST, "sandbox")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    // The sender goes with the exchange, so that the connection, driven beside it here, ends
    // once the answer is read.
    let exchange = async move {
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_ANSWER).collect().await;
        Ok::<_, String>((status, body.map_err(|e| format!("reading the answer: {e}"))?.to_bytes()))
    };
    let (answer, _) = tokio::join!(exchange, conn);
    let (status, bytes) = answer?;
    if !status.is_success() {
        return Err(format!("health answered {status}: {}", String::from_utf8_lossy(&bytes)));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("cannot decode the health answer: {e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A daemon stand-in holding `token` (or none: an old daemon without proofs) at a loopback
    /// address: it answers each health call with the proof its token makes.
    async fn daemon(token: Option<&'static str>) -> (String, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut buf = vec![0u8; 4096];
                let mut len = 0;
                while !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf[len..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => len += n,
                    }
                }
                let head = String::from_utf8_lossy(&buf[..len]).to_string();
                let challenge = head.split("challenge=").nth(1).and_then(|r| r.split(' ').next()).unwrap_or("");
                let mut answer = serde_json::json!({"status": "ok", "version": "0.0.1"});
                if let Some(t) = token {
                    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, t.as_bytes());
                    let tag = ring::hmac::sign(&key, &health_proof_input(challenge));
                    answer["proof"] = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect::<String>().into();
                }
                let body = answer.to_string();
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(reply.as_bytes()).await;
            }
        });
        (addr, task)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    #[tokio::test]
    async fn the_sandboxs_own_daemon_proves_its_token() {
        let (addr, _d) = daemon(Some("token-ours")).await;
        prove(&addr, "token-ours", soon()).await.unwrap();
    }

    #[tokio::test]
    async fn a_reused_pod_ip_answered_by_another_sandboxs_daemon_is_not_taken_for_ours() {
        let (addr, _d) = daemon(Some("token-theirs")).await;
        match prove(&addr, "token-ours", soon()).await {
            Err(IdentityError::Stranger { addr: a }) => assert_eq!(a, addr),
            other => panic!("a stranger's daemon was taken for ours: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_daemon_without_proofs_is_refused_naming_its_version() {
        let (addr, _d) = daemon(None).await;
        let err = prove(&addr, "token-ours", soon()).await.unwrap_err();
        assert!(matches!(err, IdentityError::NoProof { ref version, .. } if version == "0.0.1"), "{err:?}");
        assert!(err.to_string().contains("older than this server"), "{err}");
    }

    #[test]
    fn a_proof_for_another_challenge_or_malformed_is_refused() {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"tok");
        let proof = |c: &str| -> String {
            ring::hmac::sign(&key, &health_proof_input(c)).as_ref().iter().map(|b| format!("{b:02x}")).collect()
        };
        let answer = |p: &str| Health { status: "ok".into(), version: "v".into(), proof: Some(p.into()) };
        assert!(check("a", "tok", "c1", &answer(&proof("c1"))).is_ok());
        // Replayed from another challenge, cut short, not hex, empty.
        for bad in [proof("c0"), proof("c1")[..62].to_string(), "zz".repeat(32), String::new()] {
            assert!(matches!(check("a", "tok", "c1", &answer(&bad)), Err(IdentityError::Stranger { .. })), "{bad}");
        }
    }

    #[test]
    fn challenges_are_fresh() {
        let (a, b) = (challenge().unwrap(), challenge().unwrap());
        assert_eq!(a.len(), 2 * CHALLENGE_BYTES);
        assert_ne!(a, b);
    }

    #[tokio::test]
    async fn nothing_listening_until_the_deadline_is_unreachable() {
        // A port just freed: nothing listens there.
        let addr = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().to_string();
        let err = prove(&addr, "t", Instant::now() + Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(err, IdentityError::Unreachable { .. }), "{err:?}");
    }
}
