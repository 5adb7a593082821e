//! Serving a router over HTTP/1.1 with the edge limits the daemon and the server share: a
//! header-read timeout (a connection that sends nothing, or dribbles its request head, is
//! closed; so is a kept-alive connection idle that long), a bound on open connections with a
//! warning when it is reached, and graceful shutdown that drains with a deadline. `axum::serve`
//! offers none of the first two. Start at [`serve`]; [`serve_draining`] adds the phase before
//! shutdown in which every answer closes its connection.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::serve::Listener;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

/// Open connections the server serves at once by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 8192;
/// How often, at most, reaching the connection limit is logged.
const LIMIT_WARN_EVERY: Duration = Duration::from_secs(60);

/// The limits at the edge.
#[derive(Debug, Clone, Copy)]
pub struct Edge {
    /// A connection that has not sent a whole request head this long after it opened, or after
    /// its last answer, is closed: this is also the idle timeout of kept-alive connections.
    pub header_read_timeout: Duration,
    /// Connections open at once; past it, new connections wait in the listen backlog.
    pub max_connections: usize,
    /// After shutdown is asked, how long open connections get to finish their requests.
    pub drain: Duration,
}

/// The header every answer carries once draining has begun.
const CLOSE: hyper::header::HeaderValue = hyper::header::HeaderValue::from_static("close");

/// Serves `app` on `listener` until `shutdown` resolves, then lets open connections finish the
/// request they are on (new ones are no longer accepted) for at most `edge.drain`.
pub async fn serve<L>(listener: L, app: Router, edge: Edge, shutdown: impl Future<Output = ()> + Send)
where
    L: Listener,
    L::Addr: std::fmt::Debug,
{
    serve_by(listener, move |_| app.clone(), edge, shutdown).await;
}

/// [`serve`], with a phase before shutdown: once `draining` is cancelled, new connections are
/// still accepted and every call still served, but each answer carries `Connection: close`, so
/// that a client's kept-alive connection ends after its next call and the client connects
/// again, through a load balancer, to a replica that is not going away. `shutdown` then stops
/// accepting as in [`serve`].
pub async fn serve_draining<L>(
    listener: L,
    app: Router,
    edge: Edge,
    draining: CancellationToken,
    shutdown: impl Future<Output = ()> + Send,
) where
    L: Listener,
    L::Addr: std::fmt::Debug,
{
    serve_inner(listener, move |_| app.clone(), edge, Some(draining), shutdown).await;
}

/// [`serve`], each connection served by the router `app_for` chooses for its peer's address (a
/// daemon serves a caller from inside its sandbox otherwise than one from outside), chosen once
/// per connection: a call costs nothing more.
pub async fn serve_by<L, F>(listener: L, app_for: F, edge: Edge, shutdown: impl Future<Output = ()> + Send)
where
    L: Listener,
    L::Addr: std::fmt::Debug,
    F: Fn(&L::Addr) -> Router,
{
    serve_inner(listener, app_for, edge, None, shutdown).await;
}

async fn serve_inner<L, F>(
    mut listener: L,
    app_for: F,
    edge: Edge,
    draining: Option<CancellationToken>,
    shutdown: impl Future<Output = ()> + Send,
) where
    L: Listener,
    L::Addr: std::fmt::Debug,
    F: Fn(&L::Addr) -> Router,
{
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(edge.header_read_timeout).keep_alive(true);
    let builder = Arc::new(builder);
    // One permit per open connection: it travels with the connection's task.
    let slots = Arc::new(Semaphore::new(edge.max_connections.max(1)));
    let stop = CancellationToken::new();
    let connections = TaskTracker::new();
    let mut warned: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if warned.is_none_or(|at| at.elapsed() >= LIMIT_WARN_EVERY) {
                    warned = Some(Instant::now());
                    tracing::warn!(
                        max_connections = edge.max_connections,
                        "the connection limit is reached: new connections wait until one closes \
                         (silent and idle ones close after the header-read timeout)"
                    );
                }
                tokio::select! {
                    slot = Arc::clone(&slots).acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_) => break,
                    },
                    () = &mut shutdown => break,
                }
            }
        };
        let (io, addr) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let app = app_for(&addr);
        let builder = Arc::clone(&builder);
        let stop = stop.clone();
        let draining = draining.clone();
        connections.spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let answer = app.clone().oneshot(req.map(Body::new));
                let draining = draining.clone();
                async move {
                    let mut resp = answer.await?;
                    // Not on a switch of protocols, whose connection the two ends then own.
                    if draining.is_some_and(|d| d.is_cancelled())
                        && resp.status() != hyper::StatusCode::SWITCHING_PROTOCOLS
                    {
                        resp.headers_mut().insert(hyper::header::CONNECTION, CLOSE);
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            // With upgrades: a WebSocket to a port in a sandbox switches protocols on this
            // connection, and the proxy and the daemon take it over once it has.
            let conn = builder.serve_connection(TokioIo::new(io), service).with_upgrades();
            tokio::pin!(conn);
            let ended = tokio::select! {
                ended = conn.as_mut() => ended,
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    stop.cancel();
    connections.close();
    if tokio::time::timeout(edge.drain, connections.wait()).await.is_err() {
        tracing::warn!(open = connections.len(), "connections still open after the drain deadline are dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    async fn start(edge: Edge) -> (std::net::SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let app = Router::new().route("/", get(|| async { "ok" })).route("/echo", get(echo_upgrade));
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(serve(listener, app, edge, async move { stopped.cancelled().await }));
        (addr, stop, task)
    }

    /// Switches to a protocol that echoes every byte back, as a WebSocket proxy's far end would.
    async fn echo_upgrade(mut req: axum::extract::Request) -> axum::response::Response {
        let upgraded = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            let Ok(upgraded) = upgraded.await else { return };
            let (mut rd, mut wr) = tokio::io::split(TokioIo::new(upgraded));
            let _ = tokio::io::copy(&mut rd, &mut wr).await;
        });
        axum::response::Response::builder()
            .status(101)
            .header("connection", "upgrade")
            .header("upgrade", "echo")
            .body(Body::empty())
            .unwrap_or_default()
    }

    async fn get_ok(addr: std::net::SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap_or_else(|e| panic!("{e}"));
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap_or_else(|e| panic!("{e}"));
        out
    }

    /// Reads until the peer closes; true when it closed (rather than the wait ending).
    async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 1024];
        tokio::time::timeout(within, async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }

    #[tokio::test]
    async fn silent_and_dribbling_connections_are_closed_at_the_header_timeout() {
        let edge = Edge {
            header_read_timeout: Duration::from_millis(300),
            max_connections: 64,
            drain: Duration::from_secs(1),
        };
        let (addr, stop, task) = start(edge).await;
        let mut silent = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
        let mut dribbling = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
        let dribble = async {
            for b in b"GET / HTTP/1.1\r\nhost: x\r\n" {
                if dribbling.write_all(std::slice::from_ref(b)).await.is_err() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            false
        };
        let cut = dribble.await;
        assert!(cut || closed_within(&mut dribbling, Duration::from_secs(5)).await, "a dribbled head was never cut");
        assert!(closed_within(&mut silent, Duration::from_secs(5)).await, "a silent connection was never closed");
        assert!(get_ok(addr).await.contains("200 OK"));
        stop.cancel();
        let _ = task.await;
    }

    /// Before, connections were served without upgrades: a WebSocket through the server or the
    /// daemon got its `101` and then a closed connection.
    #[tokio::test]
    async fn a_connection_that_switches_protocols_is_handed_over() {
        let edge =
            Edge { header_read_timeout: Duration::from_secs(5), max_connections: 4, drain: Duration::from_secs(1) };
        let (addr, stop, task) = start(edge).await;
        let mut s = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
        s.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            let n = s.read(&mut byte).await.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(n, 1, "closed after {:?}", String::from_utf8_lossy(&head));
            head.push(byte[0]);
        }
        assert!(head.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&head));
        s.write_all(b"ping").await.unwrap_or_else(|e| panic!("{e}"));
        let mut echoed = [0u8; 4];
        s.read_exact(&mut echoed).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&echoed, b"ping");
        stop.cancel();
        let _ = task.await;
    }

    /// While draining, a kept-alive connection is answered and then closed (`Connection: close`),
    /// and new connections are still served; after shutdown, nothing more is accepted.
    #[tokio::test]
    async fn while_draining_answers_close_their_connections_and_new_ones_are_served() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let app = Router::new().route("/", get(|| async { "ok" }));
        let edge =
            Edge { header_read_timeout: Duration::from_secs(30), max_connections: 8, drain: Duration::from_secs(5) };
        let (draining, stop) = (CancellationToken::new(), CancellationToken::new());
        let stopped = stop.clone();
        let task =
            tokio::spawn(serve_draining(
                listener,
                app,
                edge,
                draining.clone(),
                async move { stopped.cancelled().await },
            ));
        let mut kept = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
        kept.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap_or_else(|e| panic!("{e}"));
        let mut buf = [0u8; 1024];
        let n = kept.read(&mut buf).await.unwrap_or_else(|e| panic!("{e}"));
        let first = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
        assert!(first.contains("200 ok") && !first.contains("connection: close"), "{first}");
        draining.cancel();
        kept.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap_or_else(|e| panic!("{e}"));
        let mut rest = Vec::new();
        kept.read_to_end(&mut rest).await.unwrap_or_else(|e| panic!("{e}"));
        let second = String::from_utf8_lossy(&rest).to_ascii_lowercase();
        assert!(second.contains("200 ok") && second.contains("connection: close"), "{second}");
        let fresh = get_ok(addr).await;
        assert!(fresh.contains("200 OK"), "{fresh}");
        stop.cancel();
        let _ = task.await;
        assert!(TcpStream::connect(addr).await.is_err(), "still accepting after shutdown");
    }

    #[tokio::test]
    async fn past_the_connection_limit_new_connections_wait_for_a_free_slot() {
        let edge =
            Edge { header_read_timeout: Duration::from_millis(500), max_connections: 2, drain: Duration::from_secs(1) };
        let (addr, stop, task) = start(edge).await;
        let _a = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
        let _b = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
        // The third is served once a silent one is closed by the header timeout.
        let third = tokio::time::timeout(Duration::from_secs(10), get_ok(addr)).await;
        assert!(third.is_ok_and(|r| r.contains("200 OK")));
        stop.cancel();
        let _ = task.await;
    }
}
