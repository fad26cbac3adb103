//! `tandem-lab`: what exercises tandem rather than being it — the demo, the benchmarks, the
//! namespace lab, trace recording and the set-up of the lab's guest images. It drives the
//! product, the `tandem` binary next to it, as real processes. `./tandem demo` and
//! `./tandem test` run it.

mod prng;
mod record;
mod setup;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tandem-lab",
    version,
    about = "tandem's lab: the demo, benchmarks, the namespace lab, traces and guest images"
)]
struct Cli {
    /// Log level filter (e.g. info, debug, tandem_vm=trace); also RUST_LOG.
    #[arg(long, global = true, default_value = "warn")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install missing Debian packages and build the lab's guest images (idempotent).
    Setup(setup::Args),
    /// The main job: replicate a redis guest to a backup, kill the primary, fail over, verify.
    Demo(tandem_harness::demo::Args),
    /// Measure: --lab, --replication, --trace (codecs), --faults, --failover, --store, ...
    Bench(Box<tandem_harness::bench::Args>),
    /// Record a memory trace of a real guest run.
    Record(record::RecordArgs),
    /// Record traces of lab workloads into the cache (default: idle, compile, sqlite, kv).
    Traces(record::TracesArgs),
    /// Inspect traces.
    #[command(subcommand)]
    Trace(record::TraceCmd),
    /// Create or remove the network lab (clients' bridge, primary and backup hosts).
    #[command(subcommand)]
    Lab(tandem_harness::lab::Cmd),
}

fn main() {
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::Trace(_)) {
        // SAFETY: called in main before any other thread exists; SIG_DFL is valid.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    tandem_args::logging::init(&cli.log);
    if !matches!(cli.cmd, Cmd::Trace(_) | Cmd::Setup(_)) {
        tandem_vm::clean_stale();
    }
    let result = match cli.cmd {
        Cmd::Setup(a) => setup::run(a),
        Cmd::Demo(a) => tandem_harness::demo::run(a),
        Cmd::Bench(a) => tandem_harness::bench::run(*a),
        Cmd::Record(a) => record::record(a),
        Cmd::Traces(a) => record::traces(a),
        Cmd::Trace(c) => record::trace_cmd(c),
        Cmd::Lab(c) => tandem_harness::lab::run(c),
    };
    if let Err(e) = result {
        tandem_args::logging::report_error(&format_args!("{e:#}"));
        std::process::exit(1);
    }
}
