//! `pool put|ls|get|rm`: warm pools, the sandboxes kept ready for creates to claim.

use std::process::ExitCode;

use sandman_client::Client;
use sandman_wire::server::{Pool, PoolSpec};

use crate::cli::{PoolCmd, PoolPutCmd};
use crate::format::{self, decimal, or_dash, table};
use crate::report::{self, outln};
use crate::sandboxes;

pub async fn pool(client: &Client, cmd: PoolCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        PoolCmd::Put(put) => {
            let pool = client.put_pool(&put.name, &spec(&put)).await?;
            show(&pool, put.json)?;
        }
        PoolCmd::Ls(ls) => {
            let pools = client.pools().await?;
            if ls.json {
                outln!("{}", format::json(&pools)?)?;
            } else {
                outln!("{}", list(&pools).trim_end())?;
            }
        }
        PoolCmd::Get(get) => show(&client.pool(&get.name).await?, get.json)?,
        PoolCmd::Rm(rm) => match client.delete_pool(&rm.name).await {
            Ok(pool) if rm.json => outln!("{}", format::json(&pool)?)?,
            Ok(pool) => outln!("{}", released(&pool))?,
            // As with `sandman rm`, removing what is not there is a clean "no".
            Err(err) => {
                let err = anyhow::Error::new(err);
                if !report::is_gone(&err) {
                    return Err(err);
                }
                report::error(&err);
                return Ok(ExitCode::from(report::NO));
            }
        },
    }
    Ok(ExitCode::SUCCESS)
}

/// The pool spec of `pool put`'s flags.
pub fn spec(put: &PoolPutCmd) -> PoolSpec {
    PoolSpec {
        image: put.image.clone(),
        provider: put.provider.clone(),
        resources: put.resources.resources(),
        profile: put.profile.map(Into::into).unwrap_or_default(),
        network: put.network.map(Into::into).unwrap_or_default(),
        env: put.env.iter().cloned().collect(),
        min_ready: put.min_ready,
        max: put.max,
        setup: put.setup.clone(),
        lease_s: put.lease,
        autoscale: put.autoscale,
    }
}

fn show(pool: &Pool, json: bool) -> anyhow::Result<()> {
    if json {
        return outln!("{}", format::json(pool)?);
    }
    outln!("{}", describe(pool))
}

/// `key: value` lines for one pool: its spec, then its sizes.
fn describe(pool: &Pool) -> String {
    let spec = &pool.spec;
    let mut lines: Vec<(&str, String)> = vec![("pool", pool.name.clone()), ("image", spec.image.clone())];
    if let Some(provider) = &spec.provider {
        lines.push(("provider", provider.clone()));
    }
    lines.push(("profile", format::json_word(&spec.profile)));
    lines.push(("network", format::json_word(&spec.network)));
    let resources = sandboxes::resources(&spec.resources);
    if !resources.is_empty() {
        lines.push(("resources", resources));
    }
    if !spec.env.is_empty() {
        lines.push(("env", sandboxes::pairs(&spec.env)));
    }
    // One line per command: a command may hold any separator.
    lines.extend(spec.setup.iter().map(|command| ("setup", command.clone())));
    lines.push(("lease", spec.lease_s.map_or_else(|| "the server's default".to_owned(), |s| format!("{s}s"))));
    let max = spec.max.unwrap_or(spec.min_ready);
    lines.push(("size", format!("min ready {}, max {max}{}", spec.min_ready, auto(spec.autoscale))));
    lines.push(("target", target(pool)));
    if spec.autoscale {
        lines.push(("demand", demand(pool)));
    }
    lines.push(("ready", pool.ready.to_string()));
    lines.push(("creating", pool.creating.to_string()));
    lines.push(("claimed", pool.claimed.to_string()));
    lines.push(("claims", pool.claims.to_string()));
    if let Some(error) = &pool.last_error {
        lines.push(("error", error.clone()));
    }
    format::fields(&lines)
}

fn auto(autoscale: bool) -> &'static str {
    if autoscale { ", autoscaled" } else { "" }
}

/// How many it keeps ready now; `12 (auto)` when demand sets it.
fn target(pool: &Pool) -> String {
    if pool.spec.autoscale { format!("{} (auto)", pool.target) } else { pool.target.to_string() }
}

/// What an autoscaled pool's target comes from: `0.4 claims/s × 12s refill`, `-` for a figure
/// the server has not measured yet.
fn demand(pool: &Pool) -> String {
    let rate = pool.claim_rate.map_or_else(|| "-".to_owned(), |r| decimal(r, 2));
    let refill = pool.refill_seconds.map_or_else(|| "-".to_owned(), |s| format!("{}s", decimal(s, 1)));
    format!("{rate} claims/s × {refill} refill")
}

/// The `pool ls` table; DEMAND only when a pool autoscales, ERROR only when a pool's refills fail.
fn list(pools: &[Pool]) -> String {
    let autoscaled = pools.iter().any(|p| p.spec.autoscale);
    let failing = pools.iter().any(|p| p.last_error.is_some());
    let mut header = vec!["NAME", "IMAGE", "READY", "CREATING", "CLAIMED", "TARGET", "CLAIMS"];
    if autoscaled {
        header.push("DEMAND");
    }
    if failing {
        header.push("ERROR");
    }
    let rows: Vec<Vec<String>> = pools
        .iter()
        .map(|p| {
            let mut row = vec![
                p.name.clone(),
                p.spec.image.clone(),
                p.ready.to_string(),
                p.creating.to_string(),
                p.claimed.to_string(),
                target(p),
                p.claims.to_string(),
            ];
            if autoscaled {
                row.push(if p.spec.autoscale { demand(p) } else { "-".to_owned() });
            }
            if failing {
                row.push(or_dash(p.last_error.as_deref()));
            }
            row
        })
        .collect();
    table(&header, &rows)
}

/// What `pool rm` released: the pool's unclaimed sandboxes; claimed ones stay their claimers'.
fn released(pool: &Pool) -> String {
    let plural = |n: u64| if n == 1 { "" } else { "es" };
    let unclaimed = pool.ready + pool.creating;
    let mut text = format!(
        "pool `{}`: released {unclaimed} unclaimed sandbox{} ({} ready, {} creating)",
        pool.name,
        plural(unclaimed),
        pool.ready,
        pool.creating
    );
    if pool.claimed > 0 {
        text.push_str(&format!("; {} claimed sandbox{} left to their claimers", pool.claimed, plural(pool.claimed)));
    }
    text
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::Parser;
    use sandman_wire::server::{Network, Profile, Quantity};

    use super::*;

    fn pool() -> Pool {
        Pool {
            name: "warm".into(),
            spec: PoolSpec { image: "host".into(), min_ready: 2, ..PoolSpec::default() },
            ready: 2,
            creating: 1,
            claimed: 1,
            claims: 9,
            target: 2,
            claim_rate: None,
            refill_seconds: None,
            last_error: None,
        }
    }

    #[test]
    fn put_flags_become_the_spec() {
        let cli = crate::cli::Cli::try_parse_from([
            "sandman",
            "pool",
            "put",
            "warm",
            "py:3",
            "--min-ready",
            "2",
            "--max",
            "8",
            "--autoscale",
            "--cpu",
            "1",
            "--memory",
            "1Gi",
            "--profile",
            "eval",
            "--network",
            "none",
            "-e",
            "K=V",
            "--setup",
            "pip install x",
            "--lease",
            "300",
        ])
        .unwrap();
        let crate::cli::Command::Pool(PoolCmd::Put(put)) = cli.command else { panic!("not pool put") };
        let spec = spec(&put);
        assert_eq!(spec.resources.cpu, Some(Quantity::Number(1.0)));
        assert_eq!(spec.resources.memory, Some(Quantity::Text("1Gi".into())));
        assert_eq!((spec.profile, spec.network), (Profile::Eval, Network::None));
        assert_eq!((spec.min_ready, spec.max, spec.autoscale, spec.lease_s), (2, Some(8), true, Some(300)));
        assert_eq!(spec.env.get("K").map(String::as_str), Some("V"));
        assert_eq!(spec.setup, ["pip install x"]);
    }

    #[test]
    fn min_ready_is_required() {
        let err = crate::cli::Cli::try_parse_from(["sandman", "pool", "put", "warm", "host"]).unwrap_err();
        assert!(err.to_string().contains("--min-ready"), "{err}");
    }

    #[test]
    fn a_pool_described() {
        assert_eq!(
            describe(&pool()),
            "pool:     warm\nimage:    host\nprofile:  default\nnetwork:  egress\nlease:    the server's default\n\
             size:     min ready 2, max 2\ntarget:   2\nready:    2\ncreating: 1\nclaimed:  1\nclaims:   9"
        );
    }

    #[test]
    fn an_autoscaled_pool_shows_its_demand_before_it_is_measured() {
        let mut p = pool();
        p.spec.autoscale = true;
        assert_eq!(demand(&p), "- claims/s × - refill");
        p.claim_rate = Some(0.4);
        p.refill_seconds = Some(12.26);
        assert_eq!(demand(&p), "0.4 claims/s × 12.3s refill");
    }

    #[test]
    fn rm_says_what_it_released() {
        assert_eq!(
            released(&pool()),
            "pool `warm`: released 3 unclaimed sandboxes (2 ready, 1 creating); 1 claimed sandbox left to their \
             claimers"
        );
        let empty = Pool { ready: 0, creating: 1, claimed: 0, ..pool() };
        assert_eq!(released(&empty), "pool `warm`: released 1 unclaimed sandbox (0 ready, 1 creating)");
    }
}
