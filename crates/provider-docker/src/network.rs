//! Where `network: egress` sandboxes sit: a bridge network of sandman's own ([`Egress::network`],
//! made at start when missing, inter-container communication off, its bridge interface named
//! [`Egress::bridge`]) instead of the engine's default bridge, which reaches the host's services,
//! other containers and the cloud's metadata service. On it, unless told otherwise
//! ([`Filter::Unfiltered`]), the host firewall of [`firewall`] refuses what a sandbox sends to
//! the host itself and to the private, loopback, link-local, shared and multicast ranges (other
//! containers included), lets its resolvers answer on port 53, and drops its IPv6: the same
//! refusals as the process provider's sandboxes. Docker masquerades the bridge's traffic itself,
//! and its own iptables rules accept the bridge's forwarded traffic (`-i <bridge> ! -o <bridge>
//! -j ACCEPT` and the conntrack rule back), so the table only refuses (a start finds out and
//! warns when they do not). Start at [`Egress::prepare`].
//!
//! The table can only be installed by root on the engine's own host; elsewhere the provider
//! refuses to start, naming `--docker-egress unfiltered`, and never runs unfiltered unless told.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::Path;

use bollard::Docker;
use bollard::errors::Error as BollardError;
use bollard::models::NetworkCreateRequest;
use sandman_provider::ProviderError;
use sandman_provider::firewall::{self, Cidr, Policy, Sandboxes};

use crate::container::{MANAGED_BY, MANAGED_BY_VALUE, OWNER_LABEL};

/// The network egress sandboxes join when not told (`--docker-network`).
pub const DEFAULT_NETWORK: &str = "sandman";
/// Its bridge interface when not told (`--docker-bridge`).
pub const DEFAULT_BRIDGE: &str = "smd0";
/// The engine's option that names a bridge network's interface.
const BRIDGE_NAME: &str = "com.docker.network.bridge.name";
/// The engine's option that lets containers of a bridge network reach each other.
const ENABLE_ICC: &str = "com.docker.network.bridge.enable_icc";

/// Whether the host firewall holds egress sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Refused the host and the private ranges (the default): needs root on the engine's host.
    Filtered,
    /// Nothing refused: egress sandboxes reach the host's services and the private ranges
    /// (other containers excepted: inter-container communication stays off). Only when told.
    Unfiltered,
}

/// How `network: egress` sandboxes reach out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Egress {
    /// The engine's network they join.
    pub network: String,
    /// Its bridge interface on the host, which the firewall names (at most 15 bytes).
    pub bridge: String,
    pub filter: Filter,
    /// Networks they may reach although the firewall refuses them (`--egress-allow`).
    pub allow: Vec<Cidr>,
    /// Their resolvers: given to their containers, and reachable on port 53 wherever they are
    /// (`--dns`); `None`: the engine's (the host's resolv.conf), which the firewall lets through.
    pub dns: Option<Vec<Ipv4Addr>>,
}

impl Default for Egress {
    fn default() -> Self {
        Egress {
            network: DEFAULT_NETWORK.into(),
            bridge: DEFAULT_BRIDGE.into(),
            filter: Filter::Filtered,
            allow: Vec::new(),
            dns: None,
        }
    }
}

impl Egress {
    /// Makes the network when it is missing (or checks the one there is sandman's kind), then
    /// installs this server's firewall table; at start. `owner` is the provider's host
    /// directory (`<state_dir>/docker`), which names the table and the network's maker.
    pub async fn prepare(&self, docker: &Docker, owner: &Path) -> Result<(), ProviderError> {
        if self.filter == Filter::Filtered {
            let policy = self.policy(owner);
            let marker = owner.to_path_buf();
            tokio::task::spawn_blocking(move || install(&policy, &marker))
                .await
                .map_err(|e| ProviderError::Backend(format!("the firewall's installation failed: {e}")))??;
        } else {
            tracing::warn!(
                network = %self.network,
                "--docker-egress unfiltered: egress sandboxes reach the host's services and private networks"
            );
        }
        self.ensure_network(docker, owner).await?;
        let bridge = self.bridge.clone();
        let listed = tokio::task::spawn_blocking(|| {
            std::process::Command::new("iptables").args(["-w", "-S", "FORWARD"]).output()
        })
        .await;
        if let Ok(Ok(out)) = listed
            && out.status.success()
            && !engine_forwards(&String::from_utf8_lossy(&out.stdout), &bridge)
        {
            tracing::warn!(
                %bridge,
                "iptables' FORWARD chain drops by default and has no rule of the engine's accepting what the bridge \
                 forwards out (is dockerd running with --iptables=false?): egress sandboxes will reach nothing"
            );
        }
        Ok(())
    }

    /// Refuses, before anything is made or asked of the engine, what cannot be honoured: a
    /// bridge name no interface may have, and a firewall for an engine elsewhere (its containers'
    /// traffic does not go through this host).
    pub fn check(&self, docker_host: &str) -> Result<(), ProviderError> {
        check_bridge_name(&self.bridge)?;
        if self.filter == Filter::Filtered && !is_local(docker_host) {
            return Err(ProviderError::Unsupported(format!(
                "the engine at `{docker_host}` is not on this host, and the firewall that keeps egress sandboxes \
                 from the host and private networks is installed on the engine's host; run the server as root \
                 beside the engine, or pass --docker-egress unfiltered to let them reach everything"
            )));
        }
        Ok(())
    }

    /// The table of this server (`sandman_docker_<hash of owner>`): refusals only, no masquerade.
    pub fn policy(&self, owner: &Path) -> Policy {
        Policy {
            table: table_of(owner),
            sandboxes: Sandboxes::Interface(self.bridge.clone()),
            masquerade: None,
            allow: self.allow.clone(),
            dns: self.dns.clone().unwrap_or_else(firewall::host_resolvers),
        }
    }

    async fn ensure_network(&self, docker: &Docker, owner: &Path) -> Result<(), ProviderError> {
        match docker.inspect_network(&self.network, None).await {
            Ok(found) => return self.check_found(&found),
            Err(BollardError::DockerResponseServerError { status_code: 404, .. }) => {}
            Err(e) => return Err(engine(&format!("cannot inspect the docker network `{}`", self.network), e)),
        }
        let request = NetworkCreateRequest {
            name: self.network.clone(),
            driver: Some("bridge".into()),
            options: Some(HashMap::from([
                (BRIDGE_NAME.to_string(), self.bridge.clone()),
                (ENABLE_ICC.to_string(), "false".to_string()),
            ])),
            labels: Some(HashMap::from([
                (MANAGED_BY.to_string(), MANAGED_BY_VALUE.to_string()),
                (OWNER_LABEL.to_string(), owner.display().to_string()),
            ])),
            ..Default::default()
        };
        match docker.create_network(request).await {
            Ok(_) => {
                tracing::info!(network = %self.network, bridge = %self.bridge, "made the docker network of egress sandboxes");
                Ok(())
            }
            // Another server made it meanwhile: it must be the same kind.
            Err(BollardError::DockerResponseServerError { status_code: 409, .. }) => {
                let found = docker
                    .inspect_network(&self.network, None)
                    .await
                    .map_err(|e| engine(&format!("cannot inspect the docker network `{}`", self.network), e))?;
                self.check_found(&found)
            }
            Err(e) => Err(engine(&format!("cannot make the docker network `{}`", self.network), e)),
        }
    }

    /// A network of that name that is not a bridge with this interface and no inter-container
    /// communication is not taken for sandman's.
    fn check_found(&self, found: &bollard::models::NetworkInspect) -> Result<(), ProviderError> {
        let options = found.options.clone().unwrap_or_default();
        let mut wrong = Vec::new();
        if found.driver.as_deref() != Some("bridge") {
            wrong.push(format!("its driver is `{}`, not `bridge`", found.driver.as_deref().unwrap_or("none")));
        }
        if options.get(BRIDGE_NAME) != Some(&self.bridge) {
            wrong.push(format!(
                "its bridge is `{}`, not `{}`",
                options.get(BRIDGE_NAME).map_or("unnamed", String::as_str),
                self.bridge
            ));
        }
        if options.get(ENABLE_ICC).map(String::as_str) != Some("false") {
            wrong.push("its containers reach each other (enable_icc is not false)".into());
        }
        if wrong.is_empty() {
            return Ok(());
        }
        Err(ProviderError::Unsupported(format!(
            "the docker network `{}` is not one sandman made for egress sandboxes: {}; remove it (docker network rm {}) \
             or name another with --docker-network and --docker-bridge",
            self.network,
            wrong.join(", "),
            self.network
        )))
    }
}

/// Whether iptables' `FORWARD` rules (`iptables -S FORWARD`) let what `bridge` forwards out
/// through: no drop policy, or the engine's own accept rule for its bridge.
fn engine_forwards(rules: &str, bridge: &str) -> bool {
    let accept = format!("-A FORWARD -i {bridge} ! -o {bridge} -j ACCEPT");
    !rules.lines().any(|l| l.trim() == "-P FORWARD DROP") || rules.lines().any(|l| l.trim() == accept)
}

/// Installs `policy` and records it under `marker`, after sweeping the tables of servers that
/// are gone. Blocking.
fn install(policy: &Policy, marker: &Path) -> Result<(), ProviderError> {
    let tables = Path::new(firewall::TABLES_DIR);
    firewall::sweep(tables, marker);
    firewall::apply(policy).map_err(|e| {
        ProviderError::Unsupported(format!(
            "cannot install the firewall of egress sandboxes (the nftables table `{}`): {e}; it needs root on the \
             engine's host: run the server as root there, or pass --docker-egress unfiltered to let egress sandboxes \
             reach the host and private networks",
            policy.table
        ))
    })?;
    firewall::record(tables, &policy.table, marker).map_err(|e| {
        ProviderError::io(format!("cannot record the table `{}` in `{}`", policy.table, firewall::TABLES_DIR), e)
    })?;
    tracing::info!(table = %policy.table, bridge = ?policy.sandboxes, resolvers = ?policy.dns, "egress sandboxes: the host and private ranges refused");
    Ok(())
}

/// The table of the server whose docker host directory is `owner`: FNV-1a of the path (stable
/// across builds and runs, unlike std's hasher).
pub fn table_of(owner: &Path) -> String {
    let hash = owner
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193));
    format!("sandman_docker_{hash:08x}")
}

/// Whether the engine is on this host: a Unix socket (its bind mounts name this host's paths).
fn is_local(docker_host: &str) -> bool {
    docker_host.starts_with("unix://") || docker_host.starts_with('/')
}

/// A Linux interface name: 1 to 15 bytes, none of them `/`, whitespace or `:`.
fn check_bridge_name(name: &str) -> Result<(), ProviderError> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(ProviderError::Unsupported(format!(
            "`{name}` is not an interface name for the egress bridge: 1 to 15 letters, digits, `-`, `_` or `.`"
        )))
    }
}

fn engine(what: &str, e: BollardError) -> ProviderError {
    ProviderError::Backend(format!("{what}: {}", crate::engine_message(&e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_refuses_only_and_is_named_for_its_server() {
        let egress = Egress { bridge: "smd0".into(), ..Egress::default() };
        let policy = egress.policy(Path::new("/var/lib/sandman/docker"));
        assert_eq!(policy.masquerade, None, "docker masquerades its bridge itself");
        assert_eq!(policy.sandboxes, Sandboxes::Interface("smd0".into()));
        assert!(policy.table.starts_with("sandman_docker_") && policy.table.len() == "sandman_docker_".len() + 8);
        assert_ne!(policy.table, egress.policy(Path::new("/root/.local/state/sandman/docker")).table);
        let told = Egress { dns: Some(vec![Ipv4Addr::new(10, 0, 0, 53)]), ..egress };
        assert_eq!(told.policy(Path::new("/x")).dns, [Ipv4Addr::new(10, 0, 0, 53)]);
    }

    #[test]
    fn bridge_names_are_interface_names_and_engines_are_local_only_on_a_socket() {
        for ok in ["smd0", "smt1a2b3c4d", "br-sandman_1"] {
            assert!(check_bridge_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a-name-longer-than-15", "sm d0", "a/b"] {
            assert!(check_bridge_name(bad).is_err(), "{bad}");
        }
        assert!(is_local("unix:///var/run/docker.sock") && is_local("/var/run/docker.sock"));
        assert!(!is_local("tcp://10.0.0.2:2375") && !is_local("ssh://host"));
    }

    /// What engine 20.10 lists once it has made a bridge network: its FORWARD policy drops, and
    /// its own rule accepts what the bridge forwards out, so no rule of ours is needed.
    #[test]
    fn the_engines_own_rules_forward_its_bridge() {
        let listed = "-P FORWARD DROP\n-A FORWARD -j DOCKER-USER\n-A FORWARD -j DOCKER-ISOLATION-STAGE-1\n\
                      -A FORWARD -o smd0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
                      -A FORWARD -o smd0 -j DOCKER\n-A FORWARD -i smd0 ! -o smd0 -j ACCEPT\n\
                      -A FORWARD -i smd0 -o smd0 -j DROP\n";
        assert!(engine_forwards(listed, "smd0"));
        assert!(!engine_forwards(listed, "smd1"), "another bridge has no rule of the engine's");
        assert!(engine_forwards("-P FORWARD ACCEPT\n", "smd1"));
    }

    #[test]
    fn a_network_of_another_kind_is_refused_naming_what_differs() {
        let egress = Egress::default();
        let ours = bollard::models::NetworkInspect {
            driver: Some("bridge".into()),
            options: Some(HashMap::from([
                (BRIDGE_NAME.to_string(), "smd0".to_string()),
                (ENABLE_ICC.to_string(), "false".to_string()),
            ])),
            ..Default::default()
        };
        assert!(egress.check_found(&ours).is_ok());
        let theirs = bollard::models::NetworkInspect { driver: Some("bridge".into()), ..Default::default() };
        let e = egress.check_found(&theirs).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            e.contains("its bridge is `unnamed`") && e.contains("enable_icc") && e.contains("docker network rm"),
            "{e}"
        );
    }
}
