//! The `sandmand` binary: see [`sandmand::cli`].

fn main() -> std::process::ExitCode {
    sandmand::cli::main_with(std::env::args_os().collect())
}
