//! Evaluation under recorded conditions: `conditions ID` shows a sandbox's signed record,
//! `verify FILE` checks one, and `determinism IMAGE -- CMD` runs a command in fresh sandboxes of
//! one spec and says whether their results agree.

use std::collections::BTreeMap;
use std::io::Read;
use std::process::ExitCode;

use anyhow::Context;
use futures_util::StreamExt;
use sandman_client::Client;
use sandman_wire::daemon::{ExecRequest, ExecResult};
use sandman_wire::server::{SignedConditions, Verification};
use serde::Serialize;

use crate::cli::{ConditionsCmd, DeterminismCmd, VerifyCmd};
use crate::exec::{exec_request, release};
use crate::format;
use crate::report::{self, outln};
use crate::sandboxes::{check_not_failed, create_request, fresh_key};

pub async fn conditions(client: &Client, cmd: ConditionsCmd) -> anyhow::Result<ExitCode> {
    let signed = client.conditions(&cmd.id).await?;
    if cmd.json {
        outln!("{}", format::json(&signed)?)?;
    } else {
        outln!("{}", describe(&signed).trim_end())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The record as `key: value` lines: what was asked, then applied and observed side by side.
fn describe(signed: &SignedConditions) -> String {
    let r = &signed.record;
    let o = &r.observed;
    let a = &r.applied;
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let num = |v: Option<f64>| opt(v.map(|v| v.to_string()));
    let int = |v: Option<u64>| opt(v.map(|v| v.to_string()));
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("{k:<12}{v}\n"));
    line("sandbox", r.sandbox.clone());
    line("provider", r.provider.clone());
    line("profile", format::json_word(&r.asked.profile));
    line("image", format!("{} (runs {})", r.asked.image, opt(a.image.clone())));
    line("", "applied / observed".into());
    line("cpu", format!("{} / {}", num(a.cpu), num(o.cgroup_cpu_limit)));
    line("memory", format!("{} / {}", int(a.memory), int(o.cgroup_memory_limit)));
    line("swap", format!("{} / {}", int(a.swap), int(o.cgroup_swap_limit)));
    line("pids", format!("{} / {}", int(a.pids), int(o.cgroup_pids_limit)));
    line("network", format!("{} / {}", opt(a.network.clone()), o.network_interfaces.join(",")));
    line("timezone", format!("{} / {}", opt(a.timezone.clone()), opt(o.timezone.clone())));
    line("locale", format!("{} / {}", opt(a.locale.clone()), opt(o.locale.clone())));
    line("kernel", o.kernel.clone());
    line("cpu model", format!("{} ({} available)", o.cpu_model, o.cpus_available));
    line("daemon", o.daemon_version.clone());
    if r.mismatches.is_empty() {
        line("mismatches", "none".into());
    }
    for m in &r.mismatches {
        line("MISMATCH", format!("{}: applied {}, observed {}", m.field, m.applied, m.observed));
    }
    line("signed", format!("{} (key {})", signed.signature, signed.key_id));
    out
}

pub async fn verify(cmd: VerifyCmd) -> anyhow::Result<ExitCode> {
    let text = if cmd.file == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).context("could not read the record from stdin")?;
        text
    } else {
        std::fs::read_to_string(&cmd.file).with_context(|| format!("could not read `{}`", cmd.file))?
    };
    let signed: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("`{}` is not JSON", cmd.file))?;
    let verdict = match &cmd.key_file {
        Some(path) => {
            let key = std::fs::read(path).with_context(|| format!("could not read the key `{}`", path.display()))?;
            sandman_server::conditions::Signer::new(&key).verify(&signed)
        }
        None => crate::connect(&cmd.conn)?.verify(&signed).await?,
    };
    match verdict {
        Verification { valid: true, .. } => {
            let key = signed.get("key_id").and_then(|k| k.as_str()).unwrap_or("?");
            outln!("valid: the record is intact and signed by key {key}")?;
            Ok(ExitCode::SUCCESS)
        }
        Verification { problem, .. } => {
            outln!("invalid: {}", problem.unwrap_or_else(|| "the signature does not match".into()))?;
            Ok(ExitCode::from(report::NO))
        }
    }
}

/// One run of a determinism check.
#[derive(Debug, Serialize)]
struct Run {
    sandbox: String,
    /// Which distinct result this run gave (0 is the first run's).
    result: usize,
    exit_code: Option<i32>,
    signal: Option<i32>,
    timed_out: bool,
    duration_ms: u64,
    cpu_ms: u64,
    max_rss_kib: u64,
    stdout_bytes: usize,
    stderr_bytes: usize,
}

#[derive(Debug, Serialize)]
struct Verdict {
    agree: bool,
    runs: Vec<Run>,
    /// How many distinct results the runs gave.
    distinct: usize,
    /// What differs between results: `exit`, `stdout`, `stderr`.
    differs_in: Vec<&'static str>,
}

/// What must be the same for two runs to agree.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    exit_code: Option<i32>,
    signal: Option<i32>,
    timed_out: bool,
    stdout: String,
    stderr: String,
}

pub async fn determinism(client: &Client, cmd: DeterminismCmd) -> anyhow::Result<ExitCode> {
    if cmd.runs < 2 {
        anyhow::bail!("--runs must be at least 2 to compare anything, not {}", cmd.runs);
    }
    let mut exec = exec_request(cmd.command.clone(), BTreeMap::new(), &cmd.exec)?;
    exec.max_output_bytes = None;
    let parallel = cmd.parallel.clamp(1, cmd.runs);
    let one = |n: usize| {
        let exec = exec.clone();
        let cmd = &cmd;
        async move { (n, run_once(client, cmd, &exec).await) }
    };
    let mut results: Vec<(usize, String, ExecResult)> = Vec::with_capacity(cmd.runs);
    let mut stream = futures_util::stream::iter(1..=cmd.runs).map(one).buffer_unordered(parallel);
    while let Some((n, result)) = stream.next().await {
        let (id, r) = result.with_context(|| format!("run {n} of {}", cmd.runs))?;
        report::status(&format!(
            "[{}/{}] exit {} in {} ms",
            results.len() + 1,
            cmd.runs,
            r.status.exit_code.map_or_else(|| "-".into(), |c| c.to_string()),
            r.status.duration_ms
        ));
        results.push((n, id, r));
    }
    results.sort_by_key(|(n, _, _)| *n);
    let verdict = judge(&results);
    if cmd.json {
        outln!("{}", format::json(&verdict)?)?;
    } else {
        for (run, (n, _, r)) in verdict.runs.iter().zip(&results) {
            let first = r.stdout.lines().next().unwrap_or("");
            outln!(
                "run {n:>2}  result {}  exit {:<3}  {:>6} ms  cpu {:>5} ms  peak {:>7} KiB  stdout {:?}",
                (b'A' + (run.result % 26) as u8) as char,
                run.exit_code.map_or_else(|| "-".into(), |c| c.to_string()),
                run.duration_ms,
                run.cpu_ms,
                run.max_rss_kib,
                shorten(first, 40)
            )?;
        }
        if verdict.agree {
            outln!("agree: all {} runs gave the same exit status, stdout and stderr", verdict.runs.len())?;
        } else {
            outln!(
                "differ: {} runs gave {} distinct results ({} differs)",
                verdict.runs.len(),
                verdict.distinct,
                verdict.differs_in.join(", ")
            )?;
        }
    }
    Ok(if verdict.agree { ExitCode::SUCCESS } else { ExitCode::from(report::NO) })
}

/// Creates a fresh sandbox of the command's spec, runs the command once, releases it.
async fn run_once(client: &Client, cmd: &DeterminismCmd, exec: &ExecRequest) -> anyhow::Result<(String, ExecResult)> {
    let mut create = create_request(&cmd.image, &cmd.sandbox, true);
    create.idempotency_key = Some(fresh_key("determinism"));
    let sandbox = client.create(&create).await?;
    check_not_failed(&sandbox)?;
    let result = client.exec(&sandbox.id, exec).await;
    release(client, &sandbox.id).await;
    Ok((sandbox.id, result?))
}

fn judge(results: &[(usize, String, ExecResult)]) -> Verdict {
    let outcome = |r: &ExecResult| Outcome {
        exit_code: r.status.exit_code,
        signal: r.status.signal,
        timed_out: r.status.timed_out,
        stdout: r.stdout.clone(),
        stderr: r.stderr.clone(),
    };
    let mut distinct: Vec<Outcome> = Vec::new();
    let mut runs = Vec::with_capacity(results.len());
    for (_, id, r) in results {
        let o = outcome(r);
        let result = match distinct.iter().position(|d| *d == o) {
            Some(i) => i,
            None => {
                distinct.push(o);
                distinct.len() - 1
            }
        };
        let usage = &r.status.usage;
        runs.push(Run {
            sandbox: id.clone(),
            result,
            exit_code: r.status.exit_code,
            signal: r.status.signal,
            timed_out: r.status.timed_out,
            duration_ms: r.status.duration_ms,
            cpu_ms: usage.cpu_user_ms + usage.cpu_system_ms,
            max_rss_kib: usage.max_rss_kib,
            stdout_bytes: r.stdout.len(),
            stderr_bytes: r.stderr.len(),
        });
    }
    let mut differs_in = Vec::new();
    if let Some(first) = distinct.first() {
        let any = |f: &dyn Fn(&Outcome) -> bool| distinct.iter().any(f);
        if any(&|d| (d.exit_code, d.signal, d.timed_out) != (first.exit_code, first.signal, first.timed_out)) {
            differs_in.push("exit");
        }
        if any(&|d| d.stdout != first.stdout) {
            differs_in.push("stdout");
        }
        if any(&|d| d.stderr != first.stderr) {
            differs_in.push("stderr");
        }
    }
    Verdict { agree: distinct.len() <= 1, distinct: distinct.len(), differs_in, runs }
}

fn shorten(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandman_wire::daemon::ExitStatus;

    fn result(code: i32, stdout: &str) -> ExecResult {
        ExecResult {
            status: ExitStatus { exit_code: Some(code), ..Default::default() },
            stdout: stdout.into(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
        }
    }

    #[test]
    fn runs_agree_only_when_exit_and_output_are_the_same() {
        let runs = |rs: Vec<ExecResult>| -> Vec<(usize, String, ExecResult)> {
            rs.into_iter().enumerate().map(|(i, r)| (i, format!("sb-{i}"), r)).collect()
        };
        let same = judge(&runs(vec![result(0, "42\n"), result(0, "42\n"), result(0, "42\n")]));
        assert!(same.agree && same.distinct == 1 && same.differs_in.is_empty());
        let varied = judge(&runs(vec![result(0, "1\n"), result(0, "2\n"), result(0, "1\n")]));
        assert!(!varied.agree);
        assert_eq!((varied.distinct, varied.differs_in.clone()), (2, vec!["stdout"]));
        assert_eq!(varied.runs.iter().map(|r| r.result).collect::<Vec<_>>(), [0, 1, 0]);
        let exits = judge(&runs(vec![result(0, "x"), result(1, "x")]));
        assert_eq!(exits.differs_in, ["exit"]);
    }
}
