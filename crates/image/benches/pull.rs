//! The image store's pull against skopeo's, side by side in one run: a multi-layer image (about
//! 100 MiB unpacked, 67 MiB compressed, over 5 layers of varied files: 3,000 small text files,
//! large incompressible ones, medium mixed ones, a large log, links) pushed to a local registry, then pulled cold each round into a new
//! store (downloaded, verified and unpacked) and, alternating, copied cold by
//! `skopeo copy docker://… oci:DIR` (downloaded and verified, not unpacked) and, when an engine
//! answers, `docker pull` (downloaded, verified and unpacked, as the store does; the engine's
//! storage is its own, under /var/lib/docker, not the benchmark's file system). Prints each side's
//! throughput in compressed MiB/s and the store's ratio to each (target: 0.8x or more).
//!
//! Both write to one ext4 file system of the benchmark's own (a loop device, with a journal): on
//! a journal-less ext4 (this project's test machines' root) every inode allocation walks the
//! inodes freed in the last minute, which a store making thousands of files per pull after many
//! removals pays and skopeo's few blobs do not (see docs/process-provider.md); and `syncfs` there
//! flushes only what the pulls wrote.
//!
//! Needs root, `/usr/bin/docker-registry`, `skopeo` and `mkfs.ext4`:
//! `cargo bench -p sandman-image --bench pull`. `SANDMAN_BENCH_ROUNDS` (default 4) sets the rounds,
//! `SANDMAN_BENCH_LAYERS` the store's layers at once (its default otherwise). Also printed: the
//! CPU each side spends per pull (the store's own process; skopeo's), which on a 2-core machine
//! bounds the ratio when both are busy.
#![allow(clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

use std::process::Command;
use std::time::{Duration, Instant};

use sandman_image::{ImageStore, Progress, StoreConfig};
use sandman_testkit::registry::{Auth, Compression, LayerBuilder, Registry, TestImage};

/// Deterministic bytes: `compressible` ones repeat words, the others do not compress.
fn bytes(seed: u64, len: usize, compressible: bool) -> Vec<u8> {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    if !compressible {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&next().to_le_bytes());
        }
        out.truncate(len);
        return out;
    }
    const WORDS: &[&str] = &[
        "import", "def", "return", "self", "value", "None", "for", "in", "range", "if", "else", "class", "print", "(",
        ")", ":", "\n    ",
    ];
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[(next() % WORDS.len() as u64) as usize].as_bytes());
        out.push(b' ');
    }
    out.truncate(len);
    out
}

fn image() -> TestImage {
    // Like a language runtime's many small source files.
    let mut small = LayerBuilder::new().dir("usr").dir("usr/lib").dir("usr/lib/python");
    for i in 0..3000 {
        small = small.file(
            &format!("usr/lib/python/mod{}/file{i}.py", i % 60),
            &bytes(i, 2_000 + (i as usize % 9) * 1_000, true),
        );
    }
    // Large binaries and archives: incompressible.
    let mut large = LayerBuilder::new().dir("opt");
    for i in 0..4 {
        large = large.file_with(&format!("opt/blob{i}.bin"), &bytes(100 + i, 10 << 20, false), 0o755, 0, 0);
    }
    // Medium files, half compressible.
    let mut medium = LayerBuilder::new().dir("srv");
    for i in 0..120 {
        medium = medium
            .file(&format!("srv/data{i}"), &bytes(1_000 + i, 50_000 + (i as usize * 3_719) % 400_000, i % 2 == 0));
    }
    // Logs and text: compressible.
    let text = LayerBuilder::new().dir("var/log").file("var/log/big.log", &bytes(7, 16 << 20, true));
    // Links and a whiteout of the layers below.
    let mut links = LayerBuilder::new().dir("etc").whiteout("srv/data3").opaque("var/log");
    for i in 0..200 {
        links = links.symlink(&format!("etc/link{i}"), &format!("/usr/lib/python/mod{}/file{i}.py", i % 60));
    }
    TestImage::new(vec![
        small.build(Compression::Gzip),
        large.build(Compression::Gzip),
        medium.build(Compression::Gzip),
        text.build(Compression::Gzip),
        links.build(Compression::Gzip),
    ])
}

/// An ext4 file system in a file, loop-mounted at `dir`; unmounted when dropped.
struct Scratch {
    dir: std::path::PathBuf,
}

impl Scratch {
    fn mount(dir: &std::path::Path, image: &std::path::Path) {
        let run = |cmd: &mut Command| {
            let out = cmd.output().unwrap();
            assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run(Command::new("truncate").args(["-s", "4G"]).arg(image));
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(image));
        std::fs::create_dir_all(dir).unwrap();
        run(Command::new("mount").args(["-o", "loop"]).arg(image).arg(dir));
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// CPU seconds (user and system) of this process and of its reaped children, from /proc.
fn cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<f64> =
        stat.rsplit(')').next().unwrap().split_whitespace().map(|f| f.parse().unwrap_or(0.0)).collect();
    // After the command: state is [0], utime [11], stime [12], cutime [13], cstime [14]; in ticks of 1/100 s.
    ((fields[11] + fields[12]) / 100.0, (fields[13] + fields[14]) / 100.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn mib(bytes: u64, time: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / time.as_secs_f64()
}

fn main() {
    sandman_testkit::require_root();
    let rounds: usize = std::env::var("SANDMAN_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let base = tempfile::tempdir_in("/var/tmp").unwrap();
    let registry = Registry::start(Auth::Anonymous, base.path());
    let mounted = base.path().join("fs");
    Scratch::mount(&mounted, &base.path().join("fs.ext4"));
    let _scratch = Scratch { dir: mounted.clone() };
    let dir = tempfile::tempdir_in(&mounted).unwrap();
    let built = Instant::now();
    let image = image();
    let compressed: u64 = image.layers.iter().map(|l| l.bytes.len() as u64).sum();
    runtime.block_on(registry.push("bench/app", "v1", &image));
    let reference = registry.reference("bench/app", "v1");
    println!(
        "image: {} layers, {:.1} MiB compressed (built and pushed in {:.1}s)",
        image.layers.len(),
        compressed as f64 / (1 << 20) as f64,
        built.elapsed().as_secs_f64()
    );

    let docker = Command::new("docker").args(["info", "--format", "{{.ServerVersion}}"]).output();
    let docker = docker.is_ok_and(|o| o.status.success());
    if !docker {
        println!("docker pull: left out (no docker engine answers)");
    }
    let (mut store_rates, mut skopeo_rates, mut docker_rates) = (Vec::new(), Vec::new(), Vec::new());
    let (store_cpu, skopeo_cpu) = (std::cell::RefCell::new(Vec::new()), std::cell::RefCell::new(Vec::new()));
    let mut unpacked = 0;
    for round in 0..rounds {
        let store_side = |n: usize| {
            let root = dir.path().join(format!("store-{n}"));
            let mut config = StoreConfig::new(&root);
            config.docker_socket = Some(dir.path().join("no-engine.sock"));
            if let Some(n) = std::env::var("SANDMAN_BENCH_LAYERS").ok().and_then(|v| v.parse().ok()) {
                config.concurrent_layers = n;
            }
            let store = ImageStore::open(config).unwrap();
            let (cpu_before, _) = cpu();
            let start = Instant::now();
            let pulled = runtime.block_on(store.resolve(&reference, Progress::none())).unwrap();
            let took = start.elapsed();
            store_cpu.borrow_mut().push(cpu().0 - cpu_before);
            drop(store);
            let _ = std::fs::remove_dir_all(&root);
            (took, pulled.size)
        };
        let skopeo_side = |n: usize| {
            let out = dir.path().join(format!("oci-{n}"));
            let (_, cpu_before) = cpu();
            let start = Instant::now();
            let status = Command::new("skopeo")
                .args(["copy", "--quiet", "--src-tls-verify=false", &format!("docker://{reference}")])
                .arg(format!("oci:{}:v1", out.display()))
                .status()
                .unwrap();
            let took = start.elapsed();
            assert!(status.success(), "skopeo copy");
            skopeo_cpu.borrow_mut().push(cpu().1 - cpu_before);
            let _ = std::fs::remove_dir_all(&out);
            took
        };
        let docker_side = || {
            // Cold: the image and its layers gone from the engine first.
            let _ = Command::new("docker").args(["rmi", "-f", &reference]).output();
            let start = Instant::now();
            let out = Command::new("docker").args(["pull", "--quiet", &reference]).output().unwrap();
            let took = start.elapsed();
            assert!(out.status.success(), "docker pull: {}", String::from_utf8_lossy(&out.stderr));
            let _ = Command::new("docker").args(["rmi", "-f", &reference]).output();
            took
        };
        // Alternate which goes first, so neither always finds a warmer machine.
        let (store_took, skopeo_took) = if round % 2 == 0 {
            let (s, size) = store_side(round);
            unpacked = size;
            (s, skopeo_side(round))
        } else {
            let k = skopeo_side(round);
            let (s, size) = store_side(round);
            unpacked = size;
            (s, k)
        };
        let (store_rate, skopeo_rate) = (mib(compressed, store_took), mib(compressed, skopeo_took));
        let docker_line = if docker {
            let took = docker_side();
            let rate = mib(compressed, took);
            docker_rates.push(rate);
            format!("   docker pull {:>6.0} ms ({rate:>6.1} MiB/s)", took.as_secs_f64() * 1e3)
        } else {
            String::new()
        };
        println!(
            "round {round}: store {:>6.0} ms ({store_rate:>6.1} MiB/s, unpacking {:>6.1} MiB/s)   skopeo {:>6.0} ms ({skopeo_rate:>6.1} MiB/s)   ratio {:.2}x{docker_line}",
            store_took.as_secs_f64() * 1e3,
            mib(unpacked, store_took),
            skopeo_took.as_secs_f64() * 1e3,
            store_rate / skopeo_rate
        );
        store_rates.push(store_rate);
        skopeo_rates.push(skopeo_rate);
    }
    let (store, skopeo) = (median(store_rates), median(skopeo_rates));
    println!();
    println!(
        "pull of {:.1} MiB compressed ({:.1} MiB unpacked), cold, median of {rounds} rounds:",
        compressed as f64 / (1 << 20) as f64,
        unpacked as f64 / (1 << 20) as f64
    );
    println!("  image store (download, verify, unpack)  {store:>7.1} MiB/s");
    println!("  skopeo copy to oci: (download, verify)  {skopeo:>7.1} MiB/s");
    println!("  ratio                                   {:>7.2}x (target >= 0.8x)", store / skopeo);
    if docker {
        let docker = median(docker_rates);
        println!("  docker pull (download, verify, unpack)  {docker:>7.1} MiB/s");
        println!("  ratio                                   {:>7.2}x (target >= 0.8x)", store / docker);
    }
    println!(
        "CPU per pull (user+system, median): image store {:.2}s, skopeo {:.2}s (the registry's own not counted)",
        median(store_cpu.into_inner()),
        median(skopeo_cpu.into_inner())
    );
}
