//! `prepare IMAGES…`: makes images ready ahead of the creates that need them. One request per
//! image, a few at once, so that each is reported (on stderr, `[2/5] python:3.12 ready (3.4s)`)
//! as soon as it is done; the results go to stdout, one line per image.

use std::process::ExitCode;
use std::time::Instant;

use futures_util::StreamExt;
use sandman_client::Client;
use sandman_wire::server::{PrepareRequest, PrepareResult, PreparedImage};

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
    let mut done = 0;
    let mut results = Vec::with_capacity(total);
    let mut stream = futures_util::stream::iter(cmd.images.clone()).map(one).buffer_unordered(CONCURRENCY);
    while let Some((image, result)) = stream.next().await {
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
