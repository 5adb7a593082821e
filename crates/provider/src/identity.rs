//! Tells a sandbox's own daemon from another answering at its address, the one check that every
//! create passes before its sandbox is ready. An address is reused once its sandbox is gone (a
//! pod IP, a socket path), and a watch can be behind, so the daemon there proves the sandbox's
//! token: `GET /v1/health?challenge=<fresh random>` must answer `proof` = HMAC-SHA256(token,
//! [`health_proof_input`]). The token itself is never sent, so a stranger learns nothing it
//! could use. Start at [`prove`]; the caller brings the transport (one health call).
//!
//! Who runs it: the server, after [`Provider::create`](crate::Provider::create), unless the
//! provider says it has already ([`Provider::proves_daemon`](crate::Provider::proves_daemon));
//! and the server again on every new connection it opens to a daemon, before it sends the token
//! on it ([`challenge`] and [`check`] on the connection's first exchange), so that whatever took
//! the daemon's place later (a socket moved aside by the sandbox's own code) never receives it.

use std::future::Future;
use std::time::Duration;

use ring::rand::{SecureRandom, SystemRandom};
use sandman_wire::daemon::{Health, health_proof_input};
use sandman_wire::server::Reason;
use tokio::time::Instant;

/// How long one health call may take before it is given up and tried again.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Bytes of randomness in a challenge (sent as hex).
const CHALLENGE_BYTES: usize = 16;
/// The first pause between calls while nothing answers; it doubles up to [`MAX_PAUSE`]. Short:
/// a process provider's daemon binds its socket a millisecond or two after it is spawned, and
/// every create waits out whatever part of this pause is left after that (a failed call to a
/// socket not there yet costs microseconds).
const FIRST_PAUSE: Duration = Duration::from_millis(1);
const MAX_PAUSE: Duration = Duration::from_millis(100);

/// Why the daemon at a sandbox's address was not taken for the sandbox's own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unproven {
    /// Nothing answered a health check before the deadline; the last failure.
    #[error("no daemon answered its health check: {last}")]
    Silent { last: String },
    /// A daemon answered without a proof: one too old to give it, so it cannot be told apart.
    #[error(
        "the daemon answering (version {version}) gave no health proof, so it cannot be told from another \
         sandbox's: the daemon is older than this server"
    )]
    NoProof { version: String },
    /// A daemon answered with a proof not made with this sandbox's token: it serves another
    /// sandbox (a reused address), or it is not the sandbox's daemon at all.
    #[error("the daemon answering does not hold the sandbox's token: it serves another sandbox or impersonates it")]
    Stranger,
    /// What answers gave no health answer to the challenge (another status, or not a health
    /// answer at all): the sandbox's daemon answers a challenge from the server, so this is not
    /// it, or it refused because the call came from inside the sandbox (a relay).
    #[error("what answers at the daemon's address refused the health challenge: {0}")]
    Refused(String),
    /// No randomness for the challenge.
    #[error("cannot draw a random challenge")]
    Random,
}

impl Unproven {
    /// The lifecycle reason a create that ends here fails with: `ready_timeout` for silence,
    /// `daemon_start_failed` for a daemon that is not the sandbox's.
    pub fn reason(&self) -> Reason {
        match self {
            Unproven::Silent { .. } => Reason::ReadyTimeout,
            Unproven::NoProof { .. } | Unproven::Stranger | Unproven::Refused(_) => Reason::DaemonStartFailed,
            Unproven::Random => Reason::ProviderError,
        }
    }
}

/// Has the daemon prove `token`: calls `health` with a fresh challenge (the caller sends
/// `GET /v1/health?challenge=<it>`, without the token, and answers the decoded body; any other
/// answer is an error as text), trying again while nothing answers, backing off from 1 ms to
/// 100 ms, each call given at most [`CALL_TIMEOUT`], until `deadline`. The first answer decides.
pub async fn prove<F, Fut>(token: &str, deadline: Instant, mut health: F) -> Result<(), Unproven>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<Health, String>>,
{
    let challenge = challenge()?;
    until_answered(deadline, || {
        let call = health(challenge.clone());
        async {
            match call.await {
                Ok(answer) => check(token, &challenge, &answer).map_err(Attempt::Decided),
                Err(why) => Err(Attempt::Again(why)),
            }
        }
    })
    .await
}

/// How one attempt of [`until_answered`] ended, when it did not succeed.
#[derive(Debug)]
pub enum Attempt {
    /// Nothing answered (yet): the last failure, and another try.
    Again(String),
    /// An answer decided against the daemon: no more tries.
    Decided(Unproven),
}

/// Runs `attempt` until it succeeds or decides, trying again while it answers
/// [`Attempt::Again`], backing off from 1 ms to 100 ms, each attempt given at most
/// [`CALL_TIMEOUT`], until `deadline` ([`Unproven::Silent`] with the last failure).
pub async fn until_answered<T, F, Fut>(deadline: Instant, mut attempt: F) -> Result<T, Unproven>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Attempt>>,
{
    let mut pause = FIRST_PAUSE;
    loop {
        let allowed = deadline.saturating_duration_since(Instant::now()).min(CALL_TIMEOUT);
        let last = match tokio::time::timeout(allowed, attempt()).await {
            Ok(Ok(done)) => return Ok(done),
            Ok(Err(Attempt::Decided(unproven))) => return Err(unproven),
            Ok(Err(Attempt::Again(why))) => why,
            Err(_) => format!("no answer within {} ms", allowed.as_millis()),
        };
        if Instant::now() + pause > deadline {
            return Err(Unproven::Silent { last });
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// Whether `answer` proves `token` for `challenge`; the comparison takes the same time wherever
/// the proof differs.
pub fn check(token: &str, challenge: &str, answer: &Health) -> Result<(), Unproven> {
    let Some(proof) = answer.proof.as_deref() else {
        return Err(Unproven::NoProof { version: answer.version.clone() });
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    match hex::decode(proof) {
        Ok(tag) if ring::hmac::verify(&key, &health_proof_input(challenge), &tag).is_ok() => Ok(()),
        _ => Err(Unproven::Stranger),
    }
}

/// A fresh random challenge, as hex.
pub fn challenge() -> Result<String, Unproven> {
    let mut bytes = [0u8; CHALLENGE_BYTES];
    SystemRandom::new().fill(&mut bytes).map_err(|_| Unproven::Random)?;
    Ok(hex::encode(bytes))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;

    use super::*;

    /// The proof a daemon holding `token` gives for `challenge`, made as `sandmand` makes it.
    use sandman_testkit::standin::proof;

    fn answer(proof: Option<String>) -> Health {
        Health { status: "ok".into(), version: "0.0.1".into(), proof }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    #[tokio::test]
    async fn the_sandboxs_own_daemon_proves_its_token() {
        let asked = Mutex::new(Vec::new());
        let health = |c: String| {
            asked.lock().unwrap().push(c.clone());
            async move { Ok(answer(Some(proof("tok", &c)))) }
        };
        assert_eq!(prove("tok", soon(), health).await, Ok(()));
        let asked = asked.into_inner().unwrap();
        assert_eq!(asked.len(), 1, "one answer decides");
        assert_eq!(asked[0].len(), 2 * CHALLENGE_BYTES);
    }

    #[tokio::test]
    async fn another_sandboxs_daemon_is_a_stranger_and_decides_at_once() {
        let health = |c: String| async move { Ok(answer(Some(proof("theirs", &c)))) };
        let err = prove("ours", soon(), health).await.unwrap_err();
        assert_eq!(err, Unproven::Stranger);
        assert_eq!(err.reason(), Reason::DaemonStartFailed);
        assert!(err.to_string().contains("another sandbox"), "{err}");
    }

    #[tokio::test]
    async fn a_daemon_without_proofs_is_refused_naming_its_version() {
        let err = prove("tok", soon(), |_| async { Ok(answer(None)) }).await.unwrap_err();
        assert_eq!(err, Unproven::NoProof { version: "0.0.1".into() });
        assert_eq!(err.reason(), Reason::DaemonStartFailed);
        assert!(err.to_string().contains("older than this server"), "{err}");
    }

    /// Calls that fail are tried again; the first answer decides.
    #[tokio::test(start_paused = true)]
    async fn a_daemon_not_answering_yet_is_asked_again() {
        let calls = Mutex::new(0);
        let health = |c: String| {
            let n = {
                let mut calls = calls.lock().unwrap();
                *calls += 1;
                *calls
            };
            async move { if n < 4 { Err("connection refused".to_string()) } else { Ok(answer(Some(proof("tok", &c)))) } }
        };
        assert_eq!(prove("tok", soon(), health).await, Ok(()));
        assert_eq!(calls.into_inner().unwrap(), 4);
    }

    /// Nothing answering is silence at the deadline (`ready_timeout`), with the last failure;
    /// a call that hangs is given up, not waited for past the deadline.
    #[tokio::test(start_paused = true)]
    async fn nothing_answering_until_the_deadline_is_silence() {
        let deadline = Instant::now() + Duration::from_secs(1);
        let err = prove("tok", deadline, |_| async { Err("connection refused".to_string()) }).await.unwrap_err();
        assert_eq!(err, Unproven::Silent { last: "connection refused".into() });
        assert_eq!(err.reason(), Reason::ReadyTimeout);
        let deadline = Instant::now() + Duration::from_secs(60);
        let hangs = |_| std::future::pending::<Result<Health, String>>();
        let err = prove("tok", deadline, hangs).await.unwrap_err();
        assert!(matches!(err, Unproven::Silent { ref last } if last.starts_with("no answer within")), "{err:?}");
        assert!(Instant::now() <= deadline);
    }

    #[test]
    fn a_proof_for_another_challenge_or_malformed_is_refused() {
        assert_eq!(check("tok", "c1", &answer(Some(proof("tok", "c1")))), Ok(()));
        // Replayed from another challenge, cut short, not hex, empty.
        for bad in [proof("tok", "c0"), proof("tok", "c1")[..62].to_string(), "zz".repeat(32), String::new()] {
            assert_eq!(check("tok", "c1", &answer(Some(bad.clone()))), Err(Unproven::Stranger), "{bad}");
        }
    }

    #[test]
    fn challenges_are_fresh() {
        let (a, b) = (challenge().unwrap(), challenge().unwrap());
        assert_eq!(a.len(), 2 * CHALLENGE_BYTES);
        assert_ne!(a, b);
    }
}
