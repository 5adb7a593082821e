//! `sandman serve`: the one place the server is plugged into the CLI.

use std::io::IsTerminal;

pub use sandman_server::ServeArgs;
use sandman_server::auth::TokenSource;

/// Runs the server until it is asked to stop. It builds its own runtime, so that the CLI's
/// small one is never shared with it.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| args.log.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let state_dir = args.state_dir.clone().unwrap_or_else(sandman_wire::state_dir::default_state_dir);
    let provider = args.provider.clone();
    runtime.block_on(sandman_server::run(args, sandman_server::shutdown_signal(), |started| {
        eprintln!("sandman serving on http://{} (provider {provider}, state {})", started.listen, state_dir.display());
        if let Some(socket) = &started.socket {
            eprintln!("and on unix:{} (where the CLI on this machine looks first)", socket.display());
        }
        match &started.token {
            TokenSource::Env => eprintln!("token: from SANDMAN_TOKEN"),
            TokenSource::File(p) => eprintln!("token: {} (the CLI reads it from there)", p.display()),
            TokenSource::Generated(p) => {
                eprintln!("token: generated into {} (the CLI reads it from there)", p.display())
            }
        }
        if started.recovered + started.found_dead > 0 {
            eprintln!("recovered {} sandboxes ({} found ended)", started.recovered, started.found_dead);
        }
    }))?;
    Ok(())
}
