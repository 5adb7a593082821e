//! Conditions records: what a sandbox's create asked for, what the provider applied, what the
//! daemon observes from inside, and every place where the last two differ, signed with the
//! server's key (HMAC-SHA256 over the record's canonical JSON) so that a result can carry proof
//! of the conditions it ran under. `sandman verify` (through `POST /v1/verify`) checks one.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use ring::{digest, hmac};
use sandman_wire::daemon::Observed;
use sandman_wire::server::{Applied, Mismatch, SignedConditions, Verification};
use serde_json::Value;

/// The signing key's file in the state directory: 32 random bytes, made on first start (0600).
pub const KEY_FILE: &str = "conditions.key";

/// Environment an `eval` sandbox's commands always get; a create may not set these otherwise.
pub const EVAL_ENV: [(&str, &str); 3] = [("TZ", "UTC"), ("LANG", "C.UTF-8"), ("LC_ALL", "C.UTF-8")];

const SCHEME: &str = "hmac-sha256:";
/// Bytes a memory or swap limit may differ by between applied and observed: the kernel rounds
/// limits to its page size.
const PAGE: u64 = 4096;

/// Signs and checks conditions records with the server's key.
pub struct Signer {
    key: hmac::Key,
    key_id: String,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer").field("key_id", &self.key_id).finish_non_exhaustive()
    }
}

impl Signer {
    /// Reads the key from `state_dir`, making it on first start.
    pub fn open(state_dir: &Path) -> std::io::Result<Signer> {
        let path = state_dir.join(KEY_FILE);
        match std::fs::read(&path) {
            Ok(key) if key.len() >= 32 => return Ok(Signer::new(&key)),
            Ok(key) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} holds {} bytes; a signing key has 32", path.display(), key.len()),
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::create_dir_all(state_dir)?;
        let mut key = [0u8; 32];
        std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))?;
        match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path) {
            Ok(mut f) => {
                f.write_all(&key)?;
                f.sync_all()?;
                Ok(Signer::new(&key))
            }
            // Another server on this state directory made it first: use theirs.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(Signer::new(&std::fs::read(&path)?)),
            Err(e) => Err(e),
        }
    }

    pub fn new(key: &[u8]) -> Signer {
        let id = digest::digest(&digest::SHA256, key);
        Signer { key: hmac::Key::new(hmac::HMAC_SHA256, key), key_id: hex::encode(&id.as_ref()[..8]) }
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    pub fn sign(&self, record: sandman_wire::server::ConditionsRecord) -> SignedConditions {
        let value = serde_json::to_value(&record).unwrap_or(Value::Null);
        let tag = hmac::sign(&self.key, &canonical(&value));
        SignedConditions {
            record,
            signature: format!("{SCHEME}{}", hex::encode(tag.as_ref())),
            key_id: self.key_id.clone(),
        }
    }

    /// Checks a signed record as it was handed in (any JSON: fields this server does not know
    /// are part of what was signed, so adding one breaks the signature too).
    pub fn verify(&self, signed: &Value) -> Verification {
        match self.check(signed) {
            Ok(()) => Verification { valid: true, problem: None },
            Err(problem) => Verification { valid: false, problem: Some(problem) },
        }
    }

    fn check(&self, signed: &Value) -> Result<(), String> {
        let record = signed.get("record").ok_or("no `record` in it")?;
        let signature = signed.get("signature").and_then(Value::as_str).ok_or("no `signature` in it")?;
        let hex_tag = signature.strip_prefix(SCHEME).ok_or_else(|| format!("the signature is not `{SCHEME}<hex>`"))?;
        let tag = hex::decode(hex_tag).map_err(|_| "the signature is not hex".to_string())?;
        if let Some(id) = signed.get("key_id").and_then(Value::as_str)
            && id != self.key_id
        {
            return Err(format!("signed with key `{id}`, not this server's `{}`", self.key_id));
        }
        hmac::verify(&self.key, &canonical(record), &tag)
            .map_err(|_| "the signature does not match the record: it was changed after signing".to_string())
    }
}

/// The bytes signed: compact JSON with every object's keys sorted (serde_json's map is ordered).
pub fn canonical(value: &Value) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// Every place where what the provider applied and what the daemon observes differ; only what
/// the provider says it applied is compared.
pub fn mismatches(applied: &Applied, observed: &Observed) -> Vec<Mismatch> {
    let mut out = Vec::new();
    let mut differ = |field: &str, applied: String, observed: String| {
        out.push(Mismatch { field: field.into(), applied, observed });
    };
    let show = |v: Option<String>| v.unwrap_or_else(|| "none".into());
    if let Some(cpu) = applied.cpu {
        let seen = observed.cgroup_cpu_limit;
        if !seen.is_some_and(|o| (o - cpu).abs() <= cpu * 0.01 + 1e-3) {
            differ("cpu", cpu.to_string(), show(seen.map(|o| o.to_string())));
        }
    }
    let bytes =
        [("memory", applied.memory, observed.cgroup_memory_limit), ("swap", applied.swap, observed.cgroup_swap_limit)];
    for (field, applied, seen) in bytes {
        if let Some(a) = applied
            && seen.is_none_or(|o| o.abs_diff(a) >= PAGE)
        {
            differ(field, a.to_string(), show(seen.map(|o| o.to_string())));
        }
    }
    // A pod-wide pids limit (the kubelet's podPidsLimit) sits on the pod's cgroup, above the
    // container's own: the daemon cannot see it, so there is nothing to compare.
    let pod_scope = applied.details.get("pidsScope").and_then(Value::as_str) == Some("pod");
    if let Some(pids) = applied.pids.filter(|_| !pod_scope)
        && observed.cgroup_pids_limit != Some(pids)
    {
        differ("pids", pids.to_string(), show(observed.cgroup_pids_limit.map(|o| o.to_string())));
    }
    if applied.network.as_deref() == Some("none") && observed.network_interfaces.iter().any(|i| i != "lo") {
        differ("network", "none (loopback only)".into(), observed.network_interfaces.join(","));
    }
    if let Some(tz) = &applied.timezone
        && observed.timezone.as_ref() != Some(tz)
    {
        differ("timezone", tz.clone(), show(observed.timezone.clone()));
    }
    if let Some(locale) = &applied.locale
        && observed.locale.as_ref() != Some(locale)
    {
        differ("locale", locale.clone(), show(observed.locale.clone()));
    }
    out
}

/// Refuses an `eval` create whose environment sets what eval fixes.
pub fn check_eval_env(env: &std::collections::BTreeMap<String, String>) -> Result<(), String> {
    let clashes: Vec<String> = EVAL_ENV
        .iter()
        .filter_map(|(k, v)| {
            env.get(*k).filter(|have| have != v).map(|have| format!("{k}={have} (eval fixes {k}={v})"))
        })
        .collect();
    if clashes.is_empty() {
        Ok(())
    } else {
        Err(format!("the eval profile fixes the environment it runs in; the request sets {}", clashes.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandman_wire::server::{Asked, ConditionsRecord, Network, Profile, Resources};

    fn record() -> ConditionsRecord {
        ConditionsRecord {
            sandbox: "sb-1".into(),
            job: Some("j".into()),
            provider: "process".into(),
            isolation: None,
            server_version: "0.1.0".into(),
            recorded_ms: 1,
            asked: Asked {
                image: "host".into(),
                resources: Resources::default(),
                profile: Profile::Eval,
                network: Network::None,
            },
            applied: Applied { cpu: Some(1.0), memory: Some(1 << 28), ..Default::default() },
            observed: Observed {
                cgroup_cpu_limit: Some(1.0),
                cgroup_memory_limit: Some(1 << 28),
                ..Default::default()
            },
            mismatches: Vec::new(),
        }
    }

    #[test]
    fn a_signed_record_verifies_and_any_change_breaks_it() {
        let signer = Signer::new(&[7u8; 32]);
        let signed = serde_json::to_value(signer.sign(record())).unwrap_or_default();
        assert_eq!(signer.verify(&signed), Verification { valid: true, problem: None });
        // Through text and back, as a file a result carries.
        let text = serde_json::to_string_pretty(&signed).unwrap_or_default();
        let reread: Value = serde_json::from_str(&text).unwrap_or_default();
        assert!(signer.verify(&reread).valid);

        let mut tampered = signed.clone();
        tampered["record"]["applied"]["memory"] = Value::from(1u64 << 30);
        let v = signer.verify(&tampered);
        assert!(!v.valid && v.problem.as_deref().is_some_and(|p| p.contains("changed after signing")), "{v:?}");
        let mut added = signed.clone();
        added["record"]["note"] = Value::from("looks fine");
        assert!(!signer.verify(&added).valid);
        let other = Signer::new(&[8u8; 32]);
        let v = other.verify(&signed);
        assert!(!v.valid && v.problem.as_deref().is_some_and(|p| p.contains("not this server's")), "{v:?}");
        let mut unsigned = signed.clone();
        unsigned["signature"] = Value::from("md5:00");
        assert!(!signer.verify(&unsigned).valid);
    }

    #[test]
    fn the_key_is_made_once_and_kept_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let a = Signer::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let b = Signer::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.key_id(), b.key_id());
        let mode = std::fs::metadata(dir.path().join(KEY_FILE)).map(|m| m.permissions().mode()).unwrap_or(0);
        assert_eq!(mode & 0o777, 0o600);
        let signed = serde_json::to_value(a.sign(record())).unwrap_or_default();
        assert!(b.verify(&signed).valid);
    }

    #[test]
    fn differences_between_applied_and_observed_are_flagged() {
        let applied = Applied {
            cpu: Some(0.5),
            memory: Some(512 << 20),
            swap: Some(0),
            pids: Some(256),
            network: Some("none".into()),
            timezone: Some("UTC".into()),
            locale: Some("C.UTF-8".into()),
            ..Default::default()
        };
        let same = Observed {
            cgroup_cpu_limit: Some(0.5),
            cgroup_memory_limit: Some(512 << 20),
            cgroup_swap_limit: Some(0),
            cgroup_pids_limit: Some(256),
            network_interfaces: vec!["lo".into()],
            timezone: Some("UTC".into()),
            locale: Some("C.UTF-8".into()),
            ..Default::default()
        };
        assert_eq!(mismatches(&applied, &same), []);
        let off = Observed {
            cgroup_cpu_limit: None,
            cgroup_memory_limit: Some(1 << 30),
            cgroup_swap_limit: None,
            cgroup_pids_limit: Some(255),
            network_interfaces: vec!["eth0".into(), "lo".into()],
            timezone: Some("Europe/Paris".into()),
            locale: None,
            ..Default::default()
        };
        let fields: Vec<String> = mismatches(&applied, &off).into_iter().map(|m| m.field).collect();
        assert_eq!(fields, ["cpu", "memory", "swap", "pids", "network", "timezone", "locale"]);
        // Nothing applied, nothing compared.
        assert_eq!(mismatches(&Applied::default(), &off), []);
        // A pod-wide pids limit is not visible from inside: not compared.
        let pod = Applied {
            pids: Some(256),
            details: [("pidsScope".to_string(), Value::from("pod"))].into_iter().collect(),
            ..Default::default()
        };
        assert_eq!(mismatches(&pod, &Observed::default()), []);
    }

    #[test]
    fn eval_refuses_an_environment_that_changes_what_it_fixes() {
        let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert!(check_eval_env(&env(&[("TZ", "UTC"), ("FOO", "1")])).is_ok());
        let e = check_eval_env(&env(&[("TZ", "Asia/Tokyo"), ("LC_ALL", "fr_FR.UTF-8")])).err().unwrap_or_default();
        assert!(e.contains("TZ=Asia/Tokyo") && e.contains("LC_ALL=fr_FR.UTF-8"), "{e}");
    }
}
