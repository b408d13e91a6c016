//! `gemma4 serve`: placeholder until the server crate is wired in.

use std::process::ExitCode;

use anyhow::{bail, Result};

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> Result<ExitCode> {
    bail!("serve is not available in this build")
}
