//! `ps` and `logs`: a sandbox's background processes and their output.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use sandman_client::Client;
use sandman_wire::daemon::{ExitStatus, OutputEvent, OutputQuery, ProcessInfo, ProcessState, StreamName};

use crate::cli::{IdCmd, LogsCmd};
use crate::format::{self, age, or_dash, table};
use crate::report::{self, outln};

pub async fn ps(client: &Client, cmd: IdCmd) -> anyhow::Result<ExitCode> {
    let processes = client.list_processes(&cmd.id).await?;
    if cmd.json {
        outln!("{}", format::json(&processes)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = format::now_ms();
    let rows: Vec<Vec<String>> = processes.iter().map(|p| row(p, now)).collect();
    outln!("{}", table(&["ID", "TAG", "PID", "STATE", "EXIT", "AGE", "COMMAND"], &rows).trim_end())?;
    Ok(ExitCode::SUCCESS)
}

fn row(p: &ProcessInfo, now: u64) -> Vec<String> {
    let state = match p.state {
        ProcessState::Running => "running",
        ProcessState::Exited => "exited",
    };
    vec![
        p.id.clone(),
        or_dash(p.tag.as_deref()),
        p.pid.to_string(),
        state.to_owned(),
        p.exit.as_ref().map(exit).unwrap_or_else(|| "-".to_owned()),
        age(p.started_at_ms, now),
        p.argv.join(" "),
    ]
}

/// How a process ended, in a word or two.
fn exit(status: &ExitStatus) -> String {
    match (status.timed_out, status.exit_code, status.signal) {
        (true, _, _) => "timeout".to_owned(),
        (false, Some(code), _) => code.to_string(),
        (false, None, Some(signal)) => format!("signal {signal}"),
        (false, None, None) => "?".to_owned(),
    }
}

pub async fn logs(client: &Client, cmd: LogsCmd) -> anyhow::Result<ExitCode> {
    let stream = if cmd.stderr { StreamName::Stderr } else { StreamName::Stdout };
    let mut query = OutputQuery { offset: 0, stream, follow: cmd.follow, max_bytes: None };
    let mut stdout = std::io::stdout();
    let mut write = |data: &str| -> anyhow::Result<()> {
        stdout.write_all(data.as_bytes()).and_then(|()| stdout.flush()).map_err(report::StdoutClosed::from_io)
    };
    if cmd.follow {
        // A broken connection is reopened where the last event ended (see `OutputFollow`).
        let mut events = client.follow_output_resuming(&cmd.id, &cmd.process, &query);
        while let Some(event) = events.next().await {
            match event.context("the output stream broke")? {
                OutputEvent::Data { data, .. } => write(&data)?,
                OutputEvent::Dropped { offset, bytes } => dropped(bytes, offset),
                OutputEvent::Exit { .. } => break,
                OutputEvent::Keepalive => {}
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    loop {
        let chunk = client.process_output(&cmd.id, &cmd.process, &query).await?;
        if chunk.dropped > 0 {
            dropped(chunk.dropped, query.offset);
        }
        write(&chunk.data)?;
        if chunk.eof || chunk.next_offset <= query.offset {
            return Ok(ExitCode::SUCCESS);
        }
        query.offset = chunk.next_offset;
    }
}

fn dropped(bytes: u64, offset: u64) {
    report::warning(&format!("{bytes} bytes of output from offset {offset} were dropped by retention"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_in_a_word() {
        let status =
            |exit_code, signal, timed_out| ExitStatus { exit_code, signal, timed_out, ..ExitStatus::default() };
        assert_eq!(exit(&status(Some(0), None, false)), "0");
        assert_eq!(exit(&status(None, Some(9), false)), "signal 9");
        assert_eq!(exit(&status(None, Some(9), true)), "timeout");
    }
}
