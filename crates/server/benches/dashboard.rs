//! The dashboard's table and summary against the number of sandboxes, side by side in one run:
//! a page of 50 (newest first, unfiltered; filtered by job and a search; the last page), the
//! overview's summary, and the v1 listing of everything (`GET /v1/sandboxes` without a filter)
//! for comparison, at 3,000, 12,000 and 48,000 sandboxes on the fake provider, in-process (the
//! service itself: no HTTP, no daemons). It prints each call's median time and its time per
//! sandbox; a flat time per sandbox across the sizes is linear.
//!
//! `cargo bench -p sandman-server --bench dashboard`; `SANDMAN_BENCH_SIZES=3000,12000` sets the sizes.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandman_provider::Endpoint;
use sandman_provider::fake::FakeProvider;
use sandman_server::provider::AnyProvider;
use sandman_server::service::{Daemons, Service, Settings};
use sandman_server::ui::view::{self, PageQuery};
use sandman_wire::server::{CreateSandbox, ListQuery, SandboxState};

const RUNS: usize = 21;

fn median(mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[RUNS / 2]
}

async fn fleet(dir: &std::path::Path, n: usize) -> Arc<Service> {
    let settings = Settings { create_rate: None, daemons: Daemons::Absent, ..Settings::new(dir.to_path_buf()) };
    let provider = AnyProvider::Fake(FakeProvider::new(Endpoint::Unix(dir.join("none.sock"))));
    let service = Service::new(settings, provider, "t".into());
    service.start_background();
    for i in 0..n {
        let mut labels = std::collections::BTreeMap::new();
        labels.insert("task".to_string(), format!("t{}", i % 100));
        let req = CreateSandbox {
            image: "python:3.12".into(),
            job: Some(format!("job-{}", i % 8)),
            labels,
            wait: false,
            ..CreateSandbox::default()
        };
        service.create(req).await.unwrap();
    }
    while service.snapshot().iter().any(|s| s.state() != SandboxState::Ready) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    service
}

fn main() {
    let sizes: Vec<usize> = std::env::var("SANDMAN_BENCH_SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![3_000, 12_000, 48_000]);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    println!("dashboard table and summary, median of {RUNS} runs (time, and ns per sandbox)");
    println!(
        "{:>8} {:>22} {:>22} {:>22} {:>22} {:>22}",
        "sandboxes", "page 1", "job + search", "last page", "summary", "v1 list (all)"
    );
    for n in sizes {
        let dir = tempfile::tempdir().unwrap();
        let service = rt.block_on(fleet(dir.path(), n));
        let page = |q: PageQuery| {
            let p = q.check().unwrap();
            let out = p.apply(&service.snapshot());
            assert!(out.total > 0);
        };
        let cells = [
            median(|| page(PageQuery::default())),
            median(|| page(PageQuery { job: Some("job-2".into()), q: Some("T42".into()), ..PageQuery::default() })),
            median(|| page(PageQuery { offset: Some(n - 50), ..PageQuery::default() })),
            median(|| {
                let s = view::summarize(&service.snapshot(), 0);
                assert_eq!(s.total, n);
            }),
            median(|| {
                let all = service.list(&ListQuery::default()).unwrap();
                assert_eq!(all.len(), n);
            }),
        ];
        let cell =
            |d: &Duration| format!("{:>8.2} ms {:>6.0} ns", d.as_secs_f64() * 1e3, d.as_nanos() as f64 / n as f64);
        println!("{n:>8} {}", cells.iter().map(|d| format!("{:>22}", cell(d))).collect::<Vec<_>>().join(" "));
        service.cancel.cancel();
    }
}
