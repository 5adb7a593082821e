//! The command line, as clap types: [`Cli`] and one args struct per subcommand.

use clap::{Args, Parser, Subcommand, ValueEnum};
use sandman_wire::server::{Network, Profile, Quantity, Resources, SandboxState};

use crate::serve::ServeArgs;

/// Sandboxes for agentic RL: `sandman serve` runs the server; every other command talks to it.
#[derive(Debug, Parser)]
#[command(name = "sandman", version, max_term_width = 100)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Where the server is and how to authenticate, on every client command (not on `serve`, whose
/// token is its own); the environment is read only when these are absent.
#[derive(Debug, Args)]
pub struct Connection {
    /// The server's URL, `http://host:port` or `unix:/path` [default: $SANDMAN_URL, else the Unix
    /// socket in the server's state directory when there is one, else http://127.0.0.1:7777]
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// The server's token [default: $SANDMAN_TOKEN, else the token file in the server's state
    /// directory ($SANDMAN_STATE_DIR, $XDG_STATE_HOME/sandman or ~/.local/state/sandman)]
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,
    /// How many times a call is sent again when the server could not be reached, shed it, or (for
    /// a call safe to repeat) the connection broke; 0 for never [default: $SANDMAN_RETRIES, else 5]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=100))]
    pub retries: Option<u32>,
    /// How long after a call's first failure it may still be sent again, in seconds
    /// [default: $SANDMAN_RETRY_DEADLINE, else 30]
    #[arg(long, value_name = "SECONDS", value_parser = retry_deadline)]
    pub retry_deadline: Option<std::time::Duration>,
}

fn retry_deadline(text: &str) -> Result<std::time::Duration, String> {
    sandman_client::retry::parse_seconds(text).ok_or_else(|| format!("`{text}` is not seconds from 0 to 3600"))
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server (the control plane).
    Serve(ServeArgs),
    /// Create a sandbox and print its id.
    Create(CreateCmd),
    /// Run a command in a sandbox, streaming its output; exits with the command's code.
    Exec(ExecCmd),
    /// Create a sandbox, run one command in it, release it; exits with the command's code.
    Run(RunCmd),
    /// List sandboxes.
    Ls(LsCmd),
    /// Show one sandbox.
    Get(IdCmd),
    /// Release sandboxes.
    Rm(RmCmd),
    /// Renew a sandbox's lease.
    Keepalive(IdCmd),
    /// Freeze every process of a sandbox: it uses no CPU, keeps its memory, and its lease and
    /// idle timeout stop (its lifetime still counts).
    Pause(IdCmd),
    /// Thaw a paused sandbox.
    Resume(IdCmd),
    /// Copy files between this machine and a sandbox: `SRC DST` where one side is `ID:/abs/path`
    /// (and `-` is a tar stream on stdin or stdout).
    Cp(CpCmd),
    /// List a sandbox's background processes.
    Ps(IdCmd),
    /// Print a background process's output.
    Logs(LogsCmd),
    /// Show lifecycle events.
    Events(EventsCmd),
    /// Manage jobs: quotas, heartbeats, release-all, usage.
    #[command(subcommand)]
    Job(JobCmd),
    /// Manage warm pools: sandboxes kept ready for creates to claim (`create --pool NAME`).
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Make images ready ahead of the creates that need them, printing each as it is done.
    Prepare(PrepareCmd),
    /// The process provider's image store: list (the default), remove, prune.
    Images(ImagesCmd),
    /// Show a sandbox's signed conditions record: what was asked, what the provider applied and
    /// what the daemon observes from inside, with every difference flagged.
    Conditions(ConditionsCmd),
    /// Check a signed conditions record (`sandman conditions ID --json > FILE`): exits 0 when it
    /// is intact and signed by the server, 1 when not.
    Verify(VerifyCmd),
    /// Run a command in fresh sandboxes of one spec and report whether the results agree: exits
    /// 0 when every run gave the same exit status, stdout and stderr, 1 when not.
    Determinism(DeterminismCmd),
    /// Snapshots of sandboxes' files: create (print the id), ls, get, rm, export. A create of
    /// image `snapshot:<id>` starts from one; processes are not kept.
    Snapshot(crate::snapshots::SnapshotCmd),
    /// Snapshot a sandbox and start `-n` new sandboxes from it, printing their ids.
    Fork(crate::snapshots::ForkCmd),
}

/// A sandbox's resources (shared by creates and pools).
#[derive(Debug, Args)]
pub struct ResourceFlags {
    /// CPU: cores, as `0.5` or `500m`.
    #[arg(long, value_name = "QUANTITY", value_parser = quantity)]
    pub cpu: Option<Quantity>,
    /// Memory: bytes, as `512Mi` or `2G`.
    #[arg(long, value_name = "QUANTITY", value_parser = quantity)]
    pub memory: Option<Quantity>,
    /// Disk: bytes, as `10Gi`.
    #[arg(long, value_name = "QUANTITY", value_parser = quantity)]
    pub disk: Option<Quantity>,
}

impl ResourceFlags {
    pub fn resources(&self) -> Resources {
        Resources { cpu: self.cpu.clone(), memory: self.memory.clone(), disk: self.disk.clone(), pids: None }
    }
}

/// How a sandbox is made (shared by `create` and `run`).
#[derive(Debug, Args)]
pub struct SandboxFlags {
    /// The job the sandbox counts against.
    #[arg(long, value_name = "JOB")]
    pub job: Option<String>,
    /// Maximum lifetime, in seconds.
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<u64>,
    /// Reclaim after this many seconds without a call, keepalive or job heartbeat.
    #[arg(long, value_name = "SECS")]
    pub lease: Option<u64>,
    /// Reclaim after this many seconds without a call on the sandbox.
    #[arg(long, value_name = "SECS")]
    pub idle_timeout: Option<u64>,
    /// A label (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub labels: Vec<(String, String)>,
    /// An environment variable of every command in the sandbox (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = key_value)]
    pub env: Vec<(String, String)>,
    #[command(flatten)]
    pub resources: ResourceFlags,
    #[arg(long, value_enum, value_name = "NETWORK")]
    pub network: Option<NetworkArg>,
    #[arg(long, value_enum, value_name = "PROFILE")]
    pub profile: Option<ProfileArg>,
    /// The provider [default: the server's]
    #[arg(long, value_name = "NAME")]
    pub provider: Option<String>,
    /// Claim from this warm pool.
    #[arg(long, value_name = "NAME")]
    pub pool: Option<String>,
    /// A shell command run in the sandbox before it is ready (repeatable, run in order); if one
    /// fails, the create fails with `setup_failed`.
    #[arg(long = "setup", value_name = "COMMAND")]
    pub setup: Vec<String>,
    /// Retrying a create with the same key answers the same sandbox.
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
    /// Give up waiting for readiness after this many seconds [default: the server's]
    #[arg(long, value_name = "SECS")]
    pub wait_timeout: Option<u64>,
    /// The user every command in the sandbox runs as unless it names one (a name or
    /// `uid[:gid]`); on the docker provider the image's USER is the default without it.
    #[arg(long, value_name = "USER")]
    pub default_user: Option<String>,
    /// A call on the sandbox while it is paused resumes it, instead of failing with `paused`.
    #[arg(long)]
    pub auto_resume: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum NetworkArg {
    /// Loopback only.
    None,
    /// The provider's default network.
    Egress,
}

impl From<NetworkArg> for Network {
    fn from(arg: NetworkArg) -> Network {
        match arg {
            NetworkArg::None => Network::None,
            NetworkArg::Egress => Network::Egress,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ProfileArg {
    Default,
    /// Controlled conditions: guaranteed resources, no network, fixed TZ and locale.
    Eval,
}

impl From<ProfileArg> for Profile {
    fn from(arg: ProfileArg) -> Profile {
        match arg {
            ProfileArg::Default => Profile::Default,
            ProfileArg::Eval => Profile::Eval,
        }
    }
}

#[derive(Debug, Args)]
pub struct CreateCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The task image (`host` for the process provider); with `--pool`, the pool's by default.
    #[arg(required_unless_present = "pool")]
    pub image: Option<String>,
    #[command(flatten)]
    pub sandbox: SandboxFlags,
    /// Answer at once instead of when the sandbox is ready.
    #[arg(long)]
    pub no_wait: bool,
    /// Print the whole sandbox as JSON.
    #[arg(long)]
    pub json: bool,
}

/// How a command runs (shared by `exec` and `run`).
#[derive(Debug, Args)]
pub struct ExecFlags {
    /// Working directory (absolute).
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// A user name or `uid[:gid]`.
    #[arg(long, short = 'u', value_name = "USER")]
    pub user: Option<String>,
    /// Kill the command's process tree after this many seconds (exit code 124).
    #[arg(long = "timeout", value_name = "SECS", value_parser = seconds)]
    pub timeout_ms: Option<u64>,
    /// Run COMMAND as one shell string (`sh -c`) instead of as argv.
    #[arg(long = "shell", short = 'c')]
    pub shell: bool,
    /// Send this command's stdin to the command (read whole before it starts).
    #[arg(long = "stdin", short = 'i')]
    pub stdin: bool,
}

#[derive(Debug, Args)]
pub struct ExecCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The sandbox.
    pub id: String,
    /// An environment variable of the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = key_value)]
    pub env: Vec<(String, String)>,
    #[command(flatten)]
    pub exec: ExecFlags,
    /// Run COMMAND on a terminal of the sandbox, sized as this one and resized with it; this
    /// terminal goes raw while it runs. With `-i`, what is typed goes to COMMAND (`-it`).
    #[arg(long = "tty", short = 't')]
    pub tty: bool,
    /// The command and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RunCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The task image (`host` for the process provider).
    pub image: String,
    #[command(flatten)]
    pub sandbox: SandboxFlags,
    #[command(flatten)]
    pub exec: ExecFlags,
    /// The command and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct LsCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// Only the sandboxes of this job.
    #[arg(long, value_name = "JOB")]
    pub job: Option<String>,
    /// Only sandboxes in this state (queued, creating, ready, releasing, gone, failed).
    #[arg(long, value_name = "STATE", value_parser = state)]
    pub state: Option<SandboxState>,
    /// Only sandboxes with this label.
    #[arg(long, value_name = "KEY=VALUE")]
    pub label: Option<String>,
    #[arg(long, conflicts_with = "quiet")]
    pub json: bool,
    /// Only the ids, one a line (for `sandman rm $(sandman ls -q)`).
    #[arg(short, long)]
    pub quiet: bool,
}

#[derive(Debug, Args)]
pub struct ConditionsCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The sandbox.
    pub id: String,
    /// Print the signed record as JSON (what `verify` checks).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct VerifyCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The signed record (JSON), or `-` for stdin.
    #[arg(value_name = "FILE")]
    pub file: String,
    /// Verify offline with the server's key file (`<state-dir>/conditions.key`) instead of
    /// asking the server.
    #[arg(long, value_name = "PATH")]
    pub key_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Args)]
pub struct DeterminismCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The task image (`host` for the process provider).
    pub image: String,
    #[command(flatten)]
    pub sandbox: SandboxFlags,
    #[command(flatten)]
    pub exec: ExecFlags,
    /// How many fresh sandboxes run the command.
    #[arg(long, short = 'n', default_value_t = 5, value_name = "N")]
    pub runs: usize,
    /// How many runs at once (1: one after the other).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub parallel: usize,
    /// Print the verdict and every run as JSON.
    #[arg(long)]
    pub json: bool,
    /// The command and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct IdCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The sandbox.
    pub id: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RmCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The sandboxes to release.
    #[arg(required = true, value_name = "ID")]
    pub ids: Vec<String>,
}

#[derive(Debug, Args)]
pub struct CpCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// A local path, `ID:/abs/path`, or `-` (a tar stream on stdin).
    pub src: String,
    /// A local path, `ID:/abs/path`, or `-` (a tar stream on stdout).
    pub dst: String,
    /// Into a sandbox: make what is written durable (fsync) before answering. Writes are atomic
    /// without it; this costs a disk flush.
    #[arg(long)]
    pub fsync: bool,
}

#[derive(Debug, Args)]
pub struct LogsCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The sandbox.
    pub id: String,
    /// The process: its id or tag.
    pub process: String,
    /// Keep printing output as it comes, until the process exits.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Print stderr instead of stdout.
    #[arg(long)]
    pub stderr: bool,
}

#[derive(Debug, Args)]
pub struct EventsCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// Only the events of this job.
    #[arg(long, value_name = "JOB")]
    pub job: Option<String>,
    /// Keep printing events as they happen.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Only events after this sequence number.
    #[arg(long, value_name = "SEQ")]
    pub after: Option<u64>,
    /// One JSON event per line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum JobCmd {
    /// Create a job or change its quota.
    Put(JobPutCmd),
    /// Show a job's quota and usage.
    Get(JobNameCmd),
    /// Release every sandbox of a job and forget it.
    Rm(JobNameCmd),
    /// Renew the lease of every sandbox of a job.
    Heartbeat(JobNameCmd),
    /// Show what a job's sandboxes used: counts by how they ended, sandbox-, CPU-seconds, memory.
    Usage(JobNameCmd),
    /// Print the job's SandboxFusion URL (made when it has none), for clients that send no
    /// credentials: verl's `sandbox_fusion.url` is it with `/run_code` appended.
    FusionUrl(JobFusionUrlCmd),
}

impl JobCmd {
    pub fn conn(&self) -> &Connection {
        match self {
            JobCmd::Put(cmd) => &cmd.conn,
            JobCmd::Get(cmd) | JobCmd::Rm(cmd) | JobCmd::Heartbeat(cmd) | JobCmd::Usage(cmd) => &cmd.conn,
            JobCmd::FusionUrl(cmd) => &cmd.conn,
        }
    }
}

#[derive(Debug, Args)]
pub struct JobFusionUrlCmd {
    #[command(flatten)]
    pub conn: Connection,
    pub name: String,
    /// Revoke the URL instead: calls through it are refused from now on.
    #[arg(long)]
    pub revoke: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct JobPutCmd {
    #[command(flatten)]
    pub conn: Connection,
    pub name: String,
    /// Most sandboxes alive at once.
    #[arg(long, value_name = "N")]
    pub max_sandboxes: Option<u64>,
    /// Most creates per second.
    #[arg(long, value_name = "PER_SEC")]
    pub create_rate: Option<f64>,
    /// Share of the create rate when jobs queue, and of the nodes' room while creates wait for
    /// capacity (kubernetes) [default: 1]
    #[arg(long, value_name = "W")]
    pub weight: Option<f64>,
    /// Default lease of the job's sandboxes, in seconds.
    #[arg(long, value_name = "SECS")]
    pub lease: Option<u64>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum PoolCmd {
    /// Create a warm pool or change it, then show it.
    Put(Box<PoolPutCmd>),
    /// List warm pools with their sizes.
    Ls(PoolLsCmd),
    /// Show one warm pool.
    Get(PoolNameCmd),
    /// Forget a warm pool and release its unclaimed sandboxes (claimed ones live on).
    Rm(PoolNameCmd),
}

impl PoolCmd {
    pub fn conn(&self) -> &Connection {
        match self {
            PoolCmd::Put(cmd) => &cmd.conn,
            PoolCmd::Ls(cmd) => &cmd.conn,
            PoolCmd::Get(cmd) | PoolCmd::Rm(cmd) => &cmd.conn,
        }
    }
}

#[derive(Debug, Args)]
pub struct ImagesCmd {
    #[command(flatten)]
    pub conn: Connection,
    #[command(subcommand)]
    pub action: Option<ImagesAction>,
    /// Print JSON.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ImagesAction {
    /// List the images, most recently used first, with the sandboxes that run each.
    Ls,
    /// Remove images no sandbox runs, by reference or id (a reference other references share
    /// the image with is only untagged).
    Rm {
        #[arg(required = true, value_name = "IMAGE")]
        images: Vec<String>,
    },
    /// Remove every image no sandbox runs, and the layers no image keeps.
    Prune,
}

#[derive(Debug, Args)]
pub struct PoolPutCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The pool.
    pub name: String,
    /// The image of the pool's sandboxes (`host` for the process provider).
    pub image: String,
    /// Sandboxes kept ready, unclaimed (with `--autoscale`, the least kept ready).
    #[arg(long, value_name = "N")]
    pub min_ready: u64,
    /// Most unclaimed sandboxes (ready or being created) at once [default: --min-ready]
    #[arg(long, value_name = "M")]
    pub max: Option<u64>,
    /// Size the pool from demand (claims a second × how long a refill takes), between
    /// `--min-ready` and `--max`.
    #[arg(long)]
    pub autoscale: bool,
    #[command(flatten)]
    pub resources: ResourceFlags,
    #[arg(long, value_enum, value_name = "PROFILE")]
    pub profile: Option<ProfileArg>,
    #[arg(long, value_enum, value_name = "NETWORK")]
    pub network: Option<NetworkArg>,
    /// An environment variable the pool's sandboxes start with (repeatable); a claim adds its own.
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = key_value)]
    pub env: Vec<(String, String)>,
    /// A shell command run in each sandbox before it joins the pool as ready (repeatable, in
    /// order).
    #[arg(long = "setup", value_name = "COMMAND")]
    pub setup: Vec<String>,
    /// The longest lease a claim may ask for, in seconds [default: the server's]; a create
    /// asking for more is created cold.
    #[arg(long, value_name = "SECS")]
    pub lease: Option<u64>,
    /// The provider [default: the server's]
    #[arg(long, value_name = "NAME")]
    pub provider: Option<String>,
    /// Print the pool as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PoolLsCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// Print a JSON array of pools.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PoolNameCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The pool.
    pub name: String,
    /// Print the pool as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PrepareCmd {
    #[command(flatten)]
    pub conn: Connection,
    /// The images.
    #[arg(required = true, value_name = "IMAGE")]
    pub images: Vec<String>,
    /// The job the images are for (it tags the server's progress events).
    #[arg(long, value_name = "JOB")]
    pub job: Option<String>,
    /// Hold the job's creates of these images until this fraction of nodes has them (0 < F <= 1).
    #[arg(long, value_name = "F", requires = "job")]
    pub hold_until: Option<f64>,
    /// Print the results as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct JobNameCmd {
    #[command(flatten)]
    pub conn: Connection,
    pub name: String,
    #[arg(long)]
    pub json: bool,
}

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("`{text}` is not KEY=VALUE")),
    }
}

fn quantity(text: &str) -> Result<Quantity, String> {
    let quantity = match text.parse::<f64>() {
        Ok(n) => Quantity::Number(n),
        Err(_) => Quantity::Text(text.to_owned()),
    };
    quantity.value().map(|_| quantity.clone())
}

fn state(text: &str) -> Result<SandboxState, String> {
    SandboxState::ALL.into_iter().find(|s| s.as_str() == text).ok_or_else(|| {
        let names: Vec<&str> = SandboxState::ALL.iter().map(|s| s.as_str()).collect();
        format!("`{text}` is not a state ({})", names.join(", "))
    })
}

/// Seconds, whole or not, as milliseconds.
fn seconds(text: &str) -> Result<u64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok((s * 1000.0).round() as u64),
        _ => Err(format!("`{text}` is not a positive number of seconds")),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn exec_takes_argv_after_its_flags() {
        let cli = Cli::try_parse_from(["sandman", "exec", "sb-1", "--cwd", "/w", "--", "ls", "-la"]).unwrap();
        let Command::Exec(exec) = cli.command else { panic!("not exec") };
        assert_eq!(exec.command, ["ls", "-la"]);
        assert_eq!(exec.exec.cwd.as_deref(), Some("/w"));
        let cli = Cli::try_parse_from(["sandman", "run", "host", "--timeout", "1.5", "echo", "--x"]).unwrap();
        let Command::Run(run) = cli.command else { panic!("not run") };
        assert_eq!(
            (run.image.as_str(), run.command.as_slice()),
            ("host", ["echo".to_owned(), "--x".to_owned()].as_slice())
        );
        assert_eq!(run.exec.timeout_ms, Some(1500));
    }

    #[test]
    fn values_are_checked_when_parsed() {
        assert_eq!(key_value("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert!(key_value("=x").is_err());
        assert_eq!(quantity("0.5").unwrap(), Quantity::Number(0.5));
        assert_eq!(quantity("512Mi").unwrap(), Quantity::Text("512Mi".into()));
        assert!(quantity("lots").is_err());
        assert_eq!(state("gone").unwrap(), SandboxState::Gone);
        assert!(state("dead").unwrap_err().contains("queued, creating"));
        assert!(seconds("0").is_err());
    }
}
