//! `job put|get|rm|heartbeat`: a job's quota, usage, release-all and heartbeat.

use std::process::ExitCode;

use sandman_client::Client;
use sandman_wire::server::{Job, JobAction, JobSpec};

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
