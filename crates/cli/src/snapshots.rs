//! `snapshot [create|ls|get|rm|export]` and `fork`: a sandbox's files recorded as a snapshot,
//! new sandboxes started from one (`create snapshot:<id>`), or both at once.

use std::collections::BTreeMap;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use sandman_client::Client;
use sandman_wire::snapshots::{CreateSnapshot, ForkRequest, Snapshot, SnapshotQuery};

use crate::cli::Connection;
use crate::format::{self, age, bytes, table};
use crate::report::{self, outln};

#[derive(Debug, Args)]
pub struct SnapshotCmd {
    #[command(flatten)]
    pub conn: Connection,
    #[command(subcommand)]
    pub action: SnapshotAction,
    /// Print JSON.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum SnapshotAction {
    /// Record a sandbox's files (not its processes) as a snapshot and print its id; start
    /// sandboxes from it with `sandman create snapshot:<id>`.
    Create {
        /// The sandbox.
        id: String,
        /// A name to show beside the id.
        #[arg(long)]
        name: Option<String>,
        /// Record only this directory (repeatable): what the kubernetes provider needs; the
        /// others record the whole file system and refuse it.
        #[arg(long = "path", value_name = "DIR")]
        paths: Vec<String>,
    },
    /// List the snapshots, oldest first.
    Ls {
        /// Only this job's.
        #[arg(long)]
        job: Option<String>,
    },
    /// Show one snapshot.
    Get { snapshot: String },
    /// Delete snapshots (the sandboxes started from them keep running).
    Rm {
        #[arg(required = true)]
        snapshots: Vec<String>,
    },
    /// Push a snapshot as an image to a registry (`registry/repository:tag`).
    Export { snapshot: String, reference: String },
}

#[derive(Debug, Args)]
pub struct ForkCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The sandbox to fork.
    pub id: String,
    /// How many new sandboxes.
    #[arg(short = 'n', long, default_value_t = 1)]
    pub count: u64,
    /// The snapshot's name.
    #[arg(long)]
    pub name: Option<String>,
    /// Record only this directory in the snapshot (repeatable): what the kubernetes provider
    /// needs.
    #[arg(long = "path", value_name = "DIR")]
    pub paths: Vec<String>,
    /// The children's job [default: the source's].
    #[arg(long)]
    pub job: Option<String>,
    /// The children's labels, instead of the source's (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub labels: Vec<(String, String)>,
    /// Environment added to the source's (repeatable).
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE", value_parser = key_value)]
    pub env: Vec<(String, String)>,
    /// Answer at once instead of when every child is ready.
    #[arg(long)]
    pub no_wait: bool,
    /// Print JSON: the snapshot and the new sandboxes.
    #[arg(long)]
    pub json: bool,
}

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("`{text}` is not KEY=VALUE")),
    }
}

pub async fn snapshot(client: &Client, cmd: SnapshotCmd) -> anyhow::Result<ExitCode> {
    match cmd.action {
        SnapshotAction::Create { id, name, paths } => {
            let made = client.snapshot(&id, &CreateSnapshot { name, paths }).await?;
            if cmd.json {
                outln!("{}", format::json(&made)?)?;
            } else {
                outln!("{}", made.id)?;
            }
        }
        SnapshotAction::Ls { job } => {
            let list = client.snapshots(&SnapshotQuery { job }).await?;
            if cmd.json {
                outln!("{}", format::json(&list)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            let now = format::now_ms();
            let rows: Vec<Vec<String>> = list.iter().map(|s| row(s, now)).collect();
            outln!(
                "{}",
                table(&["SNAPSHOT", "NAME", "SOURCE", "JOB", "BASE IMAGE", "SIZE", "CREATED"], &rows).trim_end()
            )?;
        }
        SnapshotAction::Get { snapshot } => {
            let s = client.get_snapshot(&snapshot).await?;
            if cmd.json {
                outln!("{}", format::json(&s)?)?;
            } else {
                outln!("{}", describe(&s, format::now_ms()).trim_end())?;
            }
        }
        SnapshotAction::Rm { snapshots } => {
            let mut worst = 0u8;
            for snapshot in &snapshots {
                match client.delete_snapshot(snapshot).await {
                    Ok(s) if cmd.json => outln!("{}", format::json(&s)?)?,
                    Ok(s) => outln!("{}", s.id)?,
                    Err(err) => {
                        let err = anyhow::Error::new(err);
                        report::error(&err);
                        worst = worst.max(if report::is_gone(&err) { report::NO } else { 2 });
                    }
                }
            }
            return Ok(ExitCode::from(worst));
        }
        SnapshotAction::Export { snapshot, reference } => {
            let pushed = client.export_snapshot(&snapshot, &reference).await?;
            if cmd.json {
                outln!("{}", format::json(&pushed)?)?;
            } else {
                outln!("{}@{}", pushed.reference, pushed.digest)?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn fork(client: &Client, cmd: ForkCmd) -> anyhow::Result<ExitCode> {
    let req = ForkRequest {
        count: cmd.count,
        name: cmd.name,
        paths: cmd.paths,
        job: cmd.job,
        labels: (!cmd.labels.is_empty()).then(|| cmd.labels.into_iter().collect()),
        env: cmd.env.into_iter().collect::<BTreeMap<_, _>>(),
        wait: !cmd.no_wait,
        ..ForkRequest::default()
    };
    let forked = client.fork(&cmd.id, &req).await?;
    if cmd.json {
        outln!("{}", format::json(&forked)?)?;
    } else {
        for sandbox in &forked.sandboxes {
            outln!("{}", sandbox.id)?;
        }
        report::status(&format!(
            "snapshot {} (delete it with `sandman snapshot rm {}`)",
            forked.snapshot.id, forked.snapshot.id
        ));
    }
    Ok(ExitCode::SUCCESS)
}

fn row(s: &Snapshot, now: u64) -> Vec<String> {
    vec![
        s.id.clone(),
        s.name.clone().unwrap_or_default(),
        s.source.clone(),
        s.job.clone().unwrap_or_default(),
        s.base_image.clone(),
        s.size.map(bytes).unwrap_or_default(),
        age(s.created_at_ms, now),
    ]
}

/// `key: value` lines for one snapshot, only the fields it has.
fn describe(s: &Snapshot, now: u64) -> String {
    let mut fields: Vec<(&str, String)> = vec![("id", s.id.clone())];
    if let Some(name) = &s.name {
        fields.push(("name", name.clone()));
    }
    fields.push(("image", s.image.clone()));
    fields.push(("source", s.source.clone()));
    if let Some(job) = &s.job {
        fields.push(("job", job.clone()));
    }
    fields.push(("provider", s.provider.clone()));
    fields.push(("base image", s.base_image.clone()));
    if let Some(size) = s.size {
        fields.push(("size", bytes(size)));
    }
    fields.push(("created", age(s.created_at_ms, now)));
    fields.iter().map(|(k, v)| format!("{k}: {v}\n")).collect()
}
