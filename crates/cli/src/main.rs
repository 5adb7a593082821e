//! `sandman`: parses the command line, runs `serve` or one client command, and turns the outcome
//! into an exit code. Start at [`cli::Command`].

// The CLI's job is printing: data goes to stdout (through `outln!`), diagnostics to stderr.
#![allow(clippy::print_stdout)]

mod cli;
mod cp;
mod eval;
mod exec;
mod format;
mod images;
mod jobs;
mod pools;
mod prepare;
mod procs;
mod report;
mod sandboxes;
mod serve;
mod snapshots;
mod tty;

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use sandman_client::{Client, env};

use crate::cli::{Cli, Command, Connection};

/// The hidden first argument that makes this binary the sandbox daemon, so that the process
/// provider needs no second binary (see `sandman_server::build_provider`).
pub const DAEMON_ARG: &str = sandman_server::EMBEDDED_DAEMON_ARG;

fn main() -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == DAEMON_ARG) {
        argv.remove(1);
        return sandmand::cli::main_with(argv);
    }
    let cli = Cli::parse_from(argv);
    let outcome = match cli.command {
        Command::Serve(args) => serve::serve(args).map(|()| ExitCode::SUCCESS),
        command => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("could not start the async runtime")
            .and_then(|runtime| runtime.block_on(run(command))),
    };
    report::exit_code(outcome)
}

/// Runs one client command against the server.
async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Serve(_) => anyhow::bail!("`serve` runs outside the CLI's runtime"),
        Command::Create(cmd) => sandboxes::create(&connect(&cmd.conn)?, cmd).await,
        Command::Exec(cmd) => exec::exec(&connect(&cmd.conn)?, cmd).await,
        Command::Run(cmd) => exec::run(&connect(&cmd.conn)?, cmd).await,
        Command::Ls(cmd) => sandboxes::ls(&connect(&cmd.conn)?, cmd).await,
        Command::Get(cmd) => sandboxes::get(&connect(&cmd.conn)?, cmd).await,
        Command::Rm(cmd) => sandboxes::rm(&connect(&cmd.conn)?, cmd).await,
        Command::Keepalive(cmd) => sandboxes::keepalive(&connect(&cmd.conn)?, cmd).await,
        Command::Pause(cmd) => sandboxes::pause(&connect(&cmd.conn)?, cmd, true).await,
        Command::Resume(cmd) => sandboxes::pause(&connect(&cmd.conn)?, cmd, false).await,
        Command::Events(cmd) => sandboxes::events(&connect(&cmd.conn)?, cmd).await,
        Command::Cp(cmd) => cp::cp(&connect(&cmd.conn)?, cmd).await,
        Command::Ps(cmd) => procs::ps(&connect(&cmd.conn)?, cmd).await,
        Command::Logs(cmd) => procs::logs(&connect(&cmd.conn)?, cmd).await,
        Command::Job(cmd) => jobs::job(&connect(cmd.conn())?, cmd).await,
        Command::Pool(cmd) => pools::pool(&connect(cmd.conn())?, cmd).await,
        Command::Prepare(cmd) => prepare::prepare(&connect(&cmd.conn)?, cmd).await,
        Command::Images(cmd) => images::images(&connect(&cmd.conn)?, cmd).await,
        Command::Conditions(cmd) => eval::conditions(&connect(&cmd.conn)?, cmd).await,
        Command::Verify(cmd) => eval::verify(cmd).await,
        Command::Determinism(cmd) => eval::determinism(&connect(&cmd.conn)?, cmd).await,
        Command::Snapshot(cmd) => snapshots::snapshot(&connect(&cmd.conn)?, cmd).await,
        Command::Fork(cmd) => snapshots::fork(&connect(&cmd.conn)?, cmd).await,
    }
}

/// The client: `--url` and `--token` where given, the environment otherwise.
pub(crate) fn connect(conn: &Connection) -> anyhow::Result<Client> {
    let url = conn.url.clone().unwrap_or_else(env::url_from_env);
    let token = match &conn.token {
        Some(token) => token.clone(),
        None => env::token_from_env()?,
    };
    let mut retry = sandman_client::RetryPolicy::from_env()?;
    retry.retries = conn.retries.unwrap_or(retry.retries);
    retry.deadline = conn.retry_deadline.unwrap_or(retry.deadline);
    Ok(Client::new(&url, &token)?.with_retry(retry))
}
