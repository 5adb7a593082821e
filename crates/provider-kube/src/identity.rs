//! The transport of the identity check of a sandbox's daemon at its pod's address: a pod's IP
//! is reused once the pod is gone, and a watch can be behind, so before a create hands out
//! `ip:port` it has the daemon there prove the sandbox's token ([`sandman_provider::identity`],
//! the same check the server makes for other providers), over a plain HTTP/1.1 connection to
//! the pod. Start at [`prove`].

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use sandman_provider::identity::{self, Unproven};
use sandman_wire::daemon::Health;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The largest health answer read.
const MAX_ANSWER: usize = 16 * 1024;
/// How long a running pod's daemon may stay silent before it is logged.
const SILENT_FOR: std::time::Duration = std::time::Duration::from_secs(10);

/// Has the daemon at `addr` prove `token` ([`identity::prove`]), trying again while nothing
/// answers, until `deadline`. Any answer decides at once. Still no answer after [`SILENT_FOR`]
/// is logged once (the pod runs, so the server cannot reach pods: a network policy, a CNI or a
/// host firewall), since the create may wait long after that.
pub async fn prove(addr: &str, token: &str, deadline: Instant) -> Result<(), Unproven> {
    let started = Instant::now();
    let mut told = false;
    identity::prove(token, deadline, |challenge| {
        // Every call after the first follows one that got no answer.
        if !told && started.elapsed() >= SILENT_FOR {
            told = true;
            tracing::warn!(
                addr,
                "the sandbox's pod runs but its daemon has not answered for {} s; can this server reach pod IPs?",
                SILENT_FOR.as_secs()
            );
        }
        health(addr, challenge)
    })
    .await
}

/// One `GET /v1/health?challenge=` on a connection of its own; any answer but a 200 with a
/// health body is an error (the caller tries again).
async fn health(addr: &str, challenge: String) -> Result<Health, String> {
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

    use std::time::Duration;

    use sandman_testkit::standin::StandIn;
    use tokio::net::TcpListener;

    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    /// One health call decides, and it never carries the token.
    #[tokio::test]
    async fn the_sandboxs_own_daemon_proves_its_token_in_one_call_without_it() {
        let (daemon, addr) = StandIn::tcp(Some("token-ours")).await;
        prove(&addr, "token-ours", soon()).await.unwrap();
        assert_eq!((daemon.health_calls(), daemon.calls_with_a_token()), (1, 0));
    }

    #[tokio::test]
    async fn a_reused_pod_ip_answered_by_another_sandboxs_daemon_is_not_taken_for_ours() {
        let (_daemon, addr) = StandIn::tcp(Some("token-theirs")).await;
        assert_eq!(prove(&addr, "token-ours", soon()).await, Err(Unproven::Stranger));
        let (_old, addr) = StandIn::tcp(None).await;
        let err = prove(&addr, "token-ours", soon()).await.unwrap_err();
        assert!(matches!(err, Unproven::NoProof { ref version } if version == "0.0.1"), "{err:?}");
    }

    #[tokio::test]
    async fn nothing_listening_until_the_deadline_is_silence() {
        // A port just freed: nothing listens there.
        let addr = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().to_string();
        let err = prove(&addr, "t", Instant::now() + Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(err, Unproven::Silent { ref last } if last.contains("cannot connect")), "{err:?}");
    }
}
