//! `job put|get|rm|heartbeat|usage|fusion-url`: a job's quota, release-all, heartbeat, what it
//! used, and its SandboxFusion URL.

use std::process::ExitCode;

use sandman_client::Client;
use sandman_wire::server::{Job, JobAction, JobSpec, JobUsage};

use crate::cli::JobCmd;
use crate::format::{self, age};
use crate::report::outln;

pub async fn job(client: &Client, cmd: JobCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        JobCmd::Put(put) => {
            let spec = JobSpec {
                max_sandboxes: put.max_sandboxes,
                create_rate: put.create_rate,
                weight: put.weight,
                lease_s: put.lease,
            };
            show_job(&client.put_job(&put.name, &spec).await?, put.json)?;
        }
        JobCmd::Get(get) => show_job(&client.get_job(&get.name).await?, get.json)?,
        JobCmd::Rm(rm) => show_action(&client.delete_job(&rm.name).await?, rm.json, "released")?,
        JobCmd::Heartbeat(hb) => show_action(&client.heartbeat(&hb.name).await?, hb.json, "renewed the lease of")?,
        JobCmd::FusionUrl(cmd) => {
            let key = if cmd.revoke {
                client.revoke_fusion_key(&cmd.name).await?
            } else {
                client.fusion_key(&cmd.name).await?
            };
            if cmd.json {
                outln!("{}", format::json(&key)?)?;
            } else if let Some(url) = &key.url {
                outln!("{url}")?;
            } else {
                outln!("job `{}`: its SandboxFusion URL is revoked", key.job)?;
            }
        }
        JobCmd::Usage(cmd) => {
            let usage = client.job_usage(&cmd.name).await?;
            if cmd.json {
                outln!("{}", format::json(&usage)?)?;
            } else {
                outln!("{}", describe_usage(&usage))?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn show_job(job: &Job, json: bool) -> anyhow::Result<()> {
    if json {
        return outln!("{}", format::json(job)?);
    }
    let limit = |v: Option<String>| v.unwrap_or_else(|| "none".to_owned());
    let mut lines = vec![
        ("job", job.name.clone()),
        ("live", job.live.to_string()),
        ("created", job.created.to_string()),
        ("max sandboxes", limit(job.spec.max_sandboxes.map(|n| n.to_string()))),
        ("create rate", limit(job.spec.create_rate.map(|r| format!("{r}/s")))),
        ("weight", job.spec.weight.unwrap_or(1.0).to_string()),
        ("lease", limit(job.spec.lease_s.map(|s| format!("{s}s")))),
    ];
    if let Some(at) = job.last_heartbeat_ms {
        lines.push(("last heartbeat", format!("{} ago", age(at, format::now_ms()))));
    }
    let width = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let text: String = lines.iter().map(|(k, v)| format!("{:<width$} {v}\n", format!("{k}:"))).collect();
    outln!("{}", text.trim_end())
}

fn show_action(action: &JobAction, json: bool, verb: &str) -> anyhow::Result<()> {
    if json {
        return outln!("{}", format::json(action)?);
    }
    let plural = if action.sandboxes == 1 { "" } else { "es" };
    outln!("job `{}`: {verb} {} sandbox{plural}", action.job, action.sandboxes)
}

/// `key: value` lines of a job's usage. CPU and memory come only from sandboxes whose daemon
/// reported them, so their lines say how many that was when it was not all of them.
fn describe_usage(usage: &JobUsage) -> String {
    let by_reason = if usage.by_reason.is_empty() {
        "-".to_owned()
    } else {
        usage.by_reason.iter().map(|(reason, n)| format!("{reason}={n}")).collect::<Vec<_>>().join(" ")
    };
    let partial = if usage.with_usage < usage.sandboxes {
        format!(" (from {} of {} sandboxes)", usage.with_usage, usage.sandboxes)
    } else {
        String::new()
    };
    let peak = usage.peak_memory_kib.map_or_else(|| "-".to_owned(), |kib| format::bytes(kib.saturating_mul(1024)));
    format::fields(&[
        ("job", usage.job.clone()),
        ("ended", usage.sandboxes.to_string()),
        ("live", usage.live.to_string()),
        ("by reason", by_reason),
        ("sandbox-seconds", format::decimal(usage.sandbox_seconds, 1)),
        ("cpu-seconds", format!("{}{partial}", format::decimal(usage.cpu_seconds, 1))),
        ("peak memory", format!("{peak}{partial}")),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_says_when_cpu_and_memory_are_partial() {
        let usage = JobUsage {
            job: "j".into(),
            sandboxes: 3,
            live: 1,
            by_reason: [("released".to_owned(), 2), ("lease_expired".to_owned(), 1)].into(),
            sandbox_seconds: 90.04,
            cpu_seconds: 12.5,
            with_usage: 2,
            peak_memory_kib: Some(2048),
        };
        assert_eq!(
            describe_usage(&usage),
            "job:             j\nended:           3\nlive:            1\nby reason:       lease_expired=1 released=2\n\
             sandbox-seconds: 90\ncpu-seconds:     12.5 (from 2 of 3 sandboxes)\n\
             peak memory:     2.0 MiB (from 2 of 3 sandboxes)"
        );
        let none = JobUsage { job: "j".into(), ..JobUsage::default() };
        assert!(
            describe_usage(&none)
                .ends_with("by reason:       -\nsandbox-seconds: 0\ncpu-seconds:     0\npeak memory:     -")
        );
    }
}
