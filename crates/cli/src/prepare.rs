//! `prepare IMAGES…`: makes images ready ahead of the creates that need them. One request per
//! image, a few at once, so that each is reported (on stderr, `[2/5] python:3.12 ready (3.4s)`)
//! as soon as it is done, and while they pull, each node's progress from the server's events
//! (`python:3.12 [#####     ] 2/4 nodes  node-b: pulled`); the results go to stdout, one line
//! per image.

use std::process::ExitCode;
use std::time::Instant;

use futures_util::StreamExt;
use sandman_client::Client;
use sandman_wire::server::{Event, EventKind, EventsQuery, PreparePhase, PrepareRequest, PrepareResult, PreparedImage};

use crate::cli::PrepareCmd;
use crate::format;
use crate::report::{self, outln};

/// Images prepared at once.
const CONCURRENCY: usize = 4;

pub async fn prepare(client: &Client, cmd: PrepareCmd) -> anyhow::Result<ExitCode> {
    let total = cmd.images.len();
    let started = Instant::now();
    let job = cmd.job.clone();
    let one = |image: String| {
        let req = PrepareRequest { images: vec![image.clone()], job: job.clone(), hold_until: cmd.hold_until };
        async move {
            let result = client.prepare(&req).await;
            (image, result)
        }
    };
    // Events from now on only: the newest one's number first.
    let start = client.events(&EventsQuery::default()).await.ok().and_then(|e| e.last().map(|e| e.seq)).unwrap_or(0);
    let mut done = 0;
    let mut results = Vec::with_capacity(total);
    let mut stream = futures_util::stream::iter(cmd.images.clone()).map(one).buffer_unordered(CONCURRENCY);
    let nodes = show_nodes(client, &cmd.images, cmd.job.clone(), start);
    tokio::pin!(nodes);
    loop {
        let next = tokio::select! {
            next = stream.next() => next,
            () = &mut nodes => stream.next().await,
        };
        let Some((image, result)) = next else { break };
        done += 1;
        let prepared = match result {
            Ok(mut r) if !r.images.is_empty() => r.images.remove(0),
            Ok(_) => PreparedImage {
                image,
                ok: false,
                message: Some("no answer for it".into()),
                nodes_ready: 0,
                nodes_total: 0,
                duration_ms: 0,
            },
            Err(e) => return Err(e.into()),
        };
        let how = match &prepared.message {
            None if prepared.nodes_total > 1 => {
                format!("ready on {} of {} nodes", prepared.nodes_ready, prepared.nodes_total)
            }
            None => "ready".to_owned(),
            Some(m) => format!("failed: {m}"),
        };
        eprintln!("[{done}/{total}] {} {how} ({:.1}s)", prepared.image, prepared.duration_ms as f64 / 1000.0);
        results.push(prepared);
    }
    drop(stream);
    // Answer in the order asked.
    results.sort_by_key(|r| cmd.images.iter().position(|i| *i == r.image));
    let failed = results.iter().filter(|r| !r.ok).count();
    if cmd.json {
        outln!("{}", format::json(&PrepareResult { images: results })?)?;
    } else {
        for r in &results {
            outln!("{}\t{}", r.image, if r.ok { "ready" } else { "failed" })?;
        }
    }
    if failed > 0 {
        eprintln!("{failed} of {total} images could not be prepared ({:.1}s)", started.elapsed().as_secs_f64());
        return Ok(ExitCode::from(report::NO));
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints each node's progress on `images` as the server reports it (`pulling` events after
/// `start`); ends when the server stops streaming, or never.
async fn show_nodes(client: &Client, images: &[String], job: Option<String>, start: u64) {
    let query = EventsQuery { job, after: Some(start), follow: true, ..EventsQuery::default() };
    let Ok(mut events) = client.follow_events(&query).await else { return };
    while let Some(Ok(event)) = events.next().await {
        if let Some(line) = node_line(&event, images) {
            report::status(&line);
        }
    }
}

/// `IMAGE [#####     ] 2/4 nodes  NODE: MESSAGE` for a node's progress on one of `images`.
fn node_line(e: &Event, images: &[String]) -> Option<String> {
    let image = e.image.as_ref().filter(|i| images.contains(i))?;
    if e.kind != EventKind::Prepare || e.phase != Some(PreparePhase::Pulling) {
        return None;
    }
    let (ready, total) = (e.nodes_ready.unwrap_or(0), e.nodes_total.unwrap_or(0).max(1));
    const WIDTH: u32 = 10;
    let filled = (ready.min(total) * WIDTH / total) as usize;
    let bar = format!("{}{}", "#".repeat(filled), " ".repeat(WIDTH as usize - filled));
    let node = e.node.as_deref().unwrap_or("?");
    let message = e.message.as_deref().unwrap_or("");
    Some(format!("{image} [{bar}] {ready}/{total} nodes  {node}: {message}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nodes_progress_is_a_bar_of_the_nodes_that_have_the_image() {
        let e = Event {
            seq: 9,
            time_ms: 0,
            kind: EventKind::Prepare,
            sandbox: String::new(),
            job: None,
            state: None,
            reason: None,
            message: Some("pulled".into()),
            queue_position: None,
            estimated_wait_ms: None,
            image: Some("python:3.12".into()),
            phase: Some(PreparePhase::Pulling),
            node: Some("node-b".into()),
            nodes_ready: Some(2),
            nodes_total: Some(4),
            idempotency_key: None,
        };
        let images = vec!["python:3.12".to_string()];
        assert_eq!(node_line(&e, &images).as_deref(), Some("python:3.12 [#####     ] 2/4 nodes  node-b: pulled"));
        assert_eq!(node_line(&e, &["other".to_string()]), None);
        let ready = Event { phase: Some(PreparePhase::Ready), ..e };
        assert_eq!(node_line(&ready, &images), None);
    }
}
