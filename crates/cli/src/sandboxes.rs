//! `create`, `get`, `ls`, `rm`, `keepalive` and `events`: the sandbox lifecycle.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::{Context, bail};
use futures_util::StreamExt;
use sandman_client::{Client, ClientError};
use sandman_wire::server::{
    CreateSandbox, Event, EventKind, EventsQuery, ListQuery, Quantity, Resources, Sandbox, SandboxState,
};

use crate::cli::{CreateCmd, EventsCmd, IdCmd, LsCmd, RmCmd, SandboxFlags};
use crate::format::{self, age, or_dash, table, timestamp};
use crate::report::{self, outln};

/// The create request of `image` with `flags`.
pub fn create_request(image: &str, flags: &SandboxFlags, wait: bool) -> CreateSandbox {
    CreateSandbox {
        image: image.to_owned(),
        provider: flags.provider.clone(),
        resources: flags.resources.resources(),
        env: flags.env.iter().cloned().collect(),
        labels: flags.labels.iter().cloned().collect(),
        job: flags.job.clone(),
        profile: flags.profile.map(Into::into).unwrap_or_default(),
        network: flags.network.map(Into::into).unwrap_or_default(),
        ttl_s: flags.ttl,
        idle_timeout_s: flags.idle_timeout,
        lease_s: flags.lease,
        pool: flags.pool.clone(),
        setup: flags.setup.clone(),
        idempotency_key: flags.idempotency_key.clone(),
        wait,
        wait_timeout_s: flags.wait_timeout,
        user: flags.default_user.clone(),
        auto_resume: flags.auto_resume,
    }
}

/// A sandbox that failed while it was made is an error, with its reason and message.
pub fn check_not_failed(sandbox: &Sandbox) -> anyhow::Result<()> {
    if sandbox.state == SandboxState::Failed {
        let reason = sandbox.reason.map(|r| format!(" ({r})")).unwrap_or_default();
        let message = sandbox.message.as_deref().map(|m| format!(": {m}")).unwrap_or_default();
        bail!("sandbox `{}` failed{reason}{message}", sandbox.id);
    }
    Ok(())
}

/// A fresh idempotency key for one create of `command` (`run`, `create`).
pub fn fresh_key(command: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("sandman-{command}-{}-{nanos}", std::process::id())
}

/// Makes the sandbox; while a waiting create is made, prints its progress (an image pull) on
/// stderr. The server tags that progress with the create's idempotency key, so `req` must have
/// one. A server that cannot stream it (an older one) only makes the sandbox.
pub async fn create_showing_progress(client: &Client, req: &CreateSandbox) -> Result<Sandbox, ClientError> {
    let created = client.create(req);
    let Some(key) = req.idempotency_key.clone().filter(|_| req.wait) else { return created.await };
    tokio::pin!(created);
    let query = EventsQuery { idempotency_key: Some(key), ..EventsQuery::default() };
    let show = async {
        let Ok(mut stream) = client.follow_events(&query).await else { return };
        while let Some(Ok(event)) = stream.next().await {
            if let Some(message) = event.message {
                report::status(&message);
            }
        }
    };
    tokio::select! {
        created = &mut created => return created,
        () = show => {}
    }
    created.await
}

pub async fn create(client: &Client, cmd: CreateCmd) -> anyhow::Result<ExitCode> {
    let mut req = create_request(cmd.image.as_deref().unwrap_or_default(), &cmd.sandbox, !cmd.no_wait);
    req.idempotency_key.get_or_insert_with(|| fresh_key("create"));
    let sandbox = create_showing_progress(client, &req).await?;
    if cmd.json {
        outln!("{}", format::json(&sandbox)?)?;
    } else {
        outln!("{}", sandbox.id)?;
    }
    check_not_failed(&sandbox)?;
    Ok(ExitCode::SUCCESS)
}

pub async fn get(client: &Client, cmd: IdCmd) -> anyhow::Result<ExitCode> {
    let sandbox = client.get(&cmd.id).await?;
    if cmd.json {
        outln!("{}", format::json(&sandbox)?)?;
    } else {
        outln!("{}", describe(&sandbox, format::now_ms()).trim_end())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `key: value` lines for one sandbox, only the fields it has.
fn describe(sb: &Sandbox, now: u64) -> String {
    let in_ = |at: u64| format::duration(at.saturating_sub(now));
    let mut fields: Vec<(&str, String)> = vec![
        ("id", sb.id.clone()),
        ("image", sb.image.clone()),
        ("provider", sb.provider.clone()),
        ("state", sb.state.to_string()),
    ];
    if let Some(isolation) = sb.isolation {
        fields.insert(3, ("isolation", isolation.as_str().to_string()));
    }
    if let Some(reason) = sb.reason {
        fields.push(("reason", reason.to_string()));
    }
    if let Some(message) = &sb.message {
        fields.push(("message", message.clone()));
    }
    if let Some(job) = &sb.job {
        fields.push(("job", job.clone()));
    }
    if !sb.labels.is_empty() {
        fields.push(("labels", pairs(&sb.labels)));
    }
    fields.push(("profile", format::json_word(&sb.profile)));
    fields.push(("network", format::json_word(&sb.network)));
    if let Some(user) = &sb.user {
        fields.push(("user", user.clone()));
    }
    let resources = resources(&sb.resources);
    if !resources.is_empty() {
        fields.push(("resources", resources));
    }
    fields.push(("created", format!("{} ({} ago)", timestamp(sb.created_at_ms), age(sb.created_at_ms, now))));
    if let Some(at) = sb.ready_at_ms {
        fields.push(("ready", timestamp(at)));
    }
    if let Some(at) = sb.ended_at_ms {
        fields.push(("ended", format!("{} ({} ago)", timestamp(at), age(at, now))));
    }
    match sb.lease_expires_at_ms {
        Some(at) if !sb.state.is_terminal() => {
            fields.push(("lease", format!("{}s, lapses in {}", sb.lease_s, in_(at))))
        }
        _ => fields.push(("lease", format!("{}s", sb.lease_s))),
    }
    if let Some(at) = sb.idle_expires_at_ms.filter(|_| !sb.state.is_terminal()) {
        fields.push(("idle", format!("reclaimed in {}", in_(at))));
    }
    if let Some(at) = sb.ttl_expires_at_ms.filter(|_| !sb.state.is_terminal()) {
        fields.push(("ttl", format!("reclaimed in {}", in_(at))));
    }
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    fields.iter().map(|(k, v)| format!("{:<width$} {v}\n", format!("{k}:"))).collect()
}

/// `k=v k2=v2`.
pub fn pairs(map: &BTreeMap<String, String>) -> String {
    map.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
}

/// `cpu=0.5 memory=1Gi`: only the resources that are set.
pub fn resources(r: &Resources) -> String {
    let quantity = |q: &Quantity| match q {
        Quantity::Number(n) => n.to_string(),
        Quantity::Text(t) => t.clone(),
    };
    let mut parts = Vec::new();
    for (name, q) in [("cpu", &r.cpu), ("memory", &r.memory), ("disk", &r.disk)] {
        if let Some(q) = q {
            parts.push(format!("{name}={}", quantity(q)));
        }
    }
    if let Some(pids) = r.pids {
        parts.push(format!("pids={pids}"));
    }
    parts.join(" ")
}

pub async fn ls(client: &Client, cmd: LsCmd) -> anyhow::Result<ExitCode> {
    let query = ListQuery { job: cmd.job, state: cmd.state, label: cmd.label };
    let sandboxes = client.list(&query).await?;
    if cmd.json {
        outln!("{}", format::json(&sandboxes)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if cmd.quiet {
        for sb in &sandboxes {
            outln!("{}", sb.id)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let now = format::now_ms();
    let rows: Vec<Vec<String>> = sandboxes
        .iter()
        .map(|sb| {
            vec![
                sb.id.clone(),
                sb.image.clone(),
                sb.state.to_string(),
                or_dash(sb.reason.map(|r| r.as_str())),
                or_dash(sb.job.as_deref()),
                age(sb.created_at_ms, now),
            ]
        })
        .collect();
    outln!("{}", table(&["ID", "IMAGE", "STATE", "REASON", "JOB", "AGE"], &rows).trim_end())?;
    Ok(ExitCode::SUCCESS)
}

/// Releases each sandbox, printing the id of each released one; one that is already gone is a
/// clean "no" (exit 1), any other failure an error (exit 2).
pub async fn rm(client: &Client, cmd: RmCmd) -> anyhow::Result<ExitCode> {
    let mut worst = 0u8;
    for id in &cmd.ids {
        match client.release(id).await {
            Ok(sandbox) => outln!("{}", sandbox.id)?,
            Err(err) => {
                let err = anyhow::Error::new(err);
                report::error(&err);
                worst = worst.max(if report::is_gone(&err) { report::NO } else { report::ERROR });
            }
        }
    }
    Ok(ExitCode::from(worst))
}

/// `sandman pause ID` (`pause`) and `sandman resume ID`.
pub async fn pause(client: &Client, cmd: IdCmd, pause: bool) -> anyhow::Result<ExitCode> {
    let sandbox = if pause { client.pause(&cmd.id).await? } else { client.resume(&cmd.id).await? };
    if cmd.json {
        outln!("{}", format::json(&sandbox)?)?;
    } else {
        outln!("{}: {}", sandbox.id, sandbox.state)?;
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn keepalive(client: &Client, cmd: IdCmd) -> anyhow::Result<ExitCode> {
    let sandbox = client.keepalive(&cmd.id).await?;
    if cmd.json {
        outln!("{}", format::json(&sandbox)?)?;
    } else {
        let lapses = match sandbox.lease_expires_at_ms {
            Some(at) => format!(", lapses in {}", format::duration(at.saturating_sub(format::now_ms()))),
            None => String::new(),
        };
        outln!("{}: lease renewed ({}s{lapses})", sandbox.id, sandbox.lease_s)?;
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn events(client: &Client, cmd: EventsCmd) -> anyhow::Result<ExitCode> {
    let query = EventsQuery { job: cmd.job, follow: cmd.follow, after: cmd.after, idempotency_key: None };
    let show = |event: &Event| -> anyhow::Result<()> {
        if cmd.json { outln!("{}", serde_json::to_string(event)?) } else { outln!("{}", event_line(event)) }
    };
    if !cmd.follow {
        for event in client.events(&query).await? {
            show(&event)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut stream = client.follow_events(&query).await?;
    while let Some(event) = stream.next().await {
        show(&event.context("the event stream broke")?)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `2023-11-14T22:13:20Z  #7  sb-1  gone (released)  job=j  message`; a queued create adds its
/// place and wait, an image being prepared shows `prepare IMAGE PHASE`.
fn event_line(e: &Event) -> String {
    let mut line = match e.kind {
        EventKind::Prepare => format!(
            "{}  #{}  prepare {}  {}",
            timestamp(e.time_ms),
            e.seq,
            e.image.as_deref().unwrap_or("-"),
            e.phase.map(|p| format!("{p:?}").to_lowercase()).unwrap_or_default()
        ),
        EventKind::Fusion => format!(
            "{}  #{}  {}  fusion call failed",
            timestamp(e.time_ms),
            e.seq,
            if e.sandbox.is_empty() { "-" } else { &e.sandbox }
        ),
        EventKind::Sandbox => format!(
            "{}  #{}  {}  {}",
            timestamp(e.time_ms),
            e.seq,
            e.sandbox,
            e.state.map(|s| s.as_str()).unwrap_or("-")
        ),
    };
    if let Some(reason) = e.reason {
        line.push_str(&format!(" ({reason})"));
    }
    if let Some(position) = e.queue_position {
        line.push_str(&format!("  position={position}"));
    }
    if let Some(wait) = e.estimated_wait_ms {
        line.push_str(&format!("  wait~{}", format::duration(wait)));
    }
    if let Some(job) = &e.job {
        line.push_str(&format!("  job={job}"));
    }
    if let Some(message) = &e.message {
        line.push_str(&format!("  {message}"));
    }
    line
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use sandman_wire::server::{Network, Profile, Reason};

    use super::*;

    fn sandbox() -> Sandbox {
        Sandbox {
            id: "sb-1".into(),
            image: "host".into(),
            provider: "process".into(),
            state: SandboxState::Gone,
            reason: Some(Reason::LeaseExpired),
            message: None,
            job: Some("j".into()),
            labels: [("team".to_owned(), "rl".to_owned())].into(),
            profile: Profile::Eval,
            network: Network::None,
            resources: Resources { cpu: Some(Quantity::Number(0.5)), ..Resources::default() },
            created_at_ms: 1_700_000_000_000,
            ready_at_ms: None,
            ended_at_ms: Some(1_700_000_060_000),
            lease_expires_at_ms: Some(1_700_000_060_000),
            idle_expires_at_ms: None,
            ttl_expires_at_ms: None,
            lease_s: 60,
            isolation: Some(sandman_wire::server::Isolation::UserNamespace),
            user: None,
            image_config: None,
            paused_at_ms: None,
            auto_resume: false,
        }
    }

    #[test]
    fn a_sandbox_described() {
        let text = describe(&sandbox(), 1_700_000_120_000);
        assert_eq!(
            text,
            "id:        sb-1\nimage:     host\nprovider:  process\nisolation: user_namespace\nstate:     gone\nreason:    lease_expired\n\
             job:       j\nlabels:    team=rl\nprofile:   eval\nnetwork:   none\nresources: cpu=0.5\n\
             created:   2023-11-14T22:13:20Z (2m ago)\nended:     2023-11-14T22:14:20Z (1m ago)\nlease:     60s\n"
        );
    }

    #[test]
    fn a_create_from_a_pool_may_leave_the_image_to_it() {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from(["sandman", "create", "--pool", "warm"]).unwrap();
        let crate::cli::Command::Create(cmd) = cli.command else { panic!("not create") };
        let req = create_request(cmd.image.as_deref().unwrap_or_default(), &cmd.sandbox, true);
        assert_eq!((req.image.as_str(), req.pool.as_deref()), ("", Some("warm")));
        let err = crate::cli::Cli::try_parse_from(["sandman", "create"]).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("<IMAGE>")));
    }

    #[test]
    fn create_flags_become_the_request() {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from([
            "sandman",
            "create",
            "img",
            "--job",
            "j",
            "--label",
            "a=b",
            "--env",
            "K=V",
            "--cpu",
            "2",
            "--network",
            "none",
            "--profile",
            "eval",
            "--no-wait",
            "--lease",
            "30",
            "--setup",
            "pip install -e .",
        ])
        .unwrap();
        let crate::cli::Command::Create(cmd) = cli.command else { panic!("not create") };
        let req = create_request(cmd.image.as_deref().unwrap_or_default(), &cmd.sandbox, !cmd.no_wait);
        let json = serde_json::to_value(&req).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "image": "img", "resources": {"cpu": 2.0}, "env": {"K": "V"}, "labels": {"a": "b"}, "job": "j",
                "profile": "eval", "network": "none", "lease_s": 30, "wait": false,
                "setup": ["pip install -e ."]
            })
        );
    }
}
