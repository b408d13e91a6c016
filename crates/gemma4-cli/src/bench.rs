//! `gemma4 bench`: placeholder until the bench crate is wired in.

use std::process::ExitCode;

use anyhow::{bail, Result};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Run a concurrency sweep against a server.
    Serve,
}

pub fn run(_c: Command) -> Result<ExitCode> {
    bail!("bench is not available in this build")
}
