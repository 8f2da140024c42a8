//! `cairn-load`: load on real `cairn-coordinator` processes from simulated
//! hosts and committers over loopback gRPC; prints a JSON report
//! (`--json`) or a short table.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use cairn_load::stats::{Errors, Latency};
use cairn_load::{ClusterOptions, CommitsOptions, FleetOptions, ReplicaReport};
use clap::{Parser, Subcommand};

/// Load harness for cairn's coordinator: starts coordinators on loopback
/// (killed at the end), drives them with simulated clients over gRPC and
/// reports throughput and latencies.
#[derive(Debug, Parser)]
#[command(name = "cairn-load", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Simulated hosts heartbeat while runs are created; times each run
    /// from CreateRun to the heartbeat answer that hands it to a host.
    Fleet(FleetArgs),
    /// Concurrent workers commit checkpoints (referencing a pack each
    /// workspace uploaded once); times the commits.
    Commits(CommitsArgs),
}

#[derive(Debug, clap::Args)]
struct Common {
    /// The cairn-coordinator binary (default: the one next to cairn-load).
    #[arg(long, value_name = "PATH")]
    coordinator_bin: Option<PathBuf>,
    /// `--database` for the coordinators (default: SQLite in each one's
    /// data dir). With a postgres:// URL each invocation uses a fresh
    /// schema unless --database-schema names one.
    #[arg(long, value_name = "URL")]
    database: Option<String>,
    /// `--database-schema` for the coordinators.
    #[arg(long, value_name = "NAME", requires = "database")]
    database_schema: Option<String>,
    /// Coordinator processes on the one database (above 1 needs
    /// --database); clients are spread over them round-robin.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=cairn_load::MAX_REPLICAS))]
    replicas: u64,
    /// gRPC channels (connections) to each coordinator, shared by the
    /// simulated clients round-robin.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=cairn_load::MAX_CHANNELS))]
    channels: u64,
    /// The measured phase stops after this long and reports what it had.
    #[arg(long, value_name = "DURATION", default_value = "120s", value_parser = humantime::parse_duration)]
    duration_limit: Duration,
    /// Keep the coordinators' data directories (and logs); the report
    /// names them.
    #[arg(long)]
    keep_data: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct FleetArgs {
    /// Simulated hosts.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=cairn_load::MAX_HOSTS))]
    hosts: u64,
    /// Slots per host.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=cairn_load::MAX_SLOTS as i64))]
    slots: u32,
    /// Runs to create (at most hosts × slots: sandboxes never finish).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=cairn_load::MAX_RUNS))]
    runs: u64,
    /// The coordinators' --heartbeat-interval.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    heartbeat_interval: Duration,
    /// The coordinators' --host-lease.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    lease: Duration,
    /// CreateRun calls in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=cairn_load::MAX_CONCURRENCY))]
    create_concurrency: u64,
    /// Hosts heartbeat on their interval alone, without keeping a
    /// WatchOrders stream open (cairn-host keeps one).
    #[arg(long)]
    no_watch_orders: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Debug, clap::Args)]
struct CommitsArgs {
    /// Workspaces, each with one first checkpoint.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=cairn_load::MAX_WORKSPACES))]
    workspaces: u64,
    /// Workers committing at once (worker i takes workspaces i, i+C, …).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=cairn_load::MAX_CONCURRENCY))]
    concurrency: u64,
    /// Commits in all.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=cairn_load::MAX_COMMITS))]
    commits: u64,
    #[command(flatten)]
    common: Common,
}

impl Common {
    fn cluster(&self) -> anyhow::Result<ClusterOptions> {
        let bin = match &self.coordinator_bin {
            Some(bin) => bin.clone(),
            None => std::env::current_exe()
                .context("cannot tell where cairn-load is")?
                .with_file_name("cairn-coordinator"),
        };
        let mut options = ClusterOptions::new(bin);
        options.database = self.database.clone();
        options.database_schema = self.database_schema.clone();
        options.replicas = self.replicas as usize;
        options.channels_per_replica = self.channels as usize;
        options.keep_data = self.keep_data;
        Ok(options)
    }
}

fn main() -> ExitCode {
    cairn_utils::program::run(async {
        let cli = Cli::parse();
        // The coordinators started here inherit the raised limit.
        cairn_load::raise_nofile_limit().context("cannot raise the open-file limit")?;
        tokio::select! {
            done = run(cli) => done,
            // Dropping `run` stops the coordinators it started.
            _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted"),
        }
    })
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Fleet(args) => {
            let options = FleetOptions {
                cluster: args.common.cluster()?,
                hosts: args.hosts as usize,
                slots: args.slots,
                runs: args.runs as usize,
                heartbeat_interval: args.heartbeat_interval,
                lease: args.lease,
                create_concurrency: args.create_concurrency as usize,
                watch_orders: !args.no_watch_orders,
                duration_limit: args.common.duration_limit,
            };
            let report = cairn_load::fleet(options).await?;
            if args.common.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_fleet(&report);
            }
        }
        Command::Commits(args) => {
            let options = CommitsOptions {
                cluster: args.common.cluster()?,
                workspaces: args.workspaces as usize,
                concurrency: args.concurrency as usize,
                commits: args.commits,
                duration_limit: args.common.duration_limit,
            };
            let report = cairn_load::commits(options).await?;
            if args.common.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_commits(&report);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn latency(l: &Latency) -> String {
    format!(
        "p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms  ({} calls)",
        l.p50_ms, l.p99_ms, l.max_ms, l.count
    )
}

fn errors(e: &Errors) -> String {
    if e.total == 0 {
        return "no errors".into();
    }
    let codes: Vec<String> = e
        .by_code
        .iter()
        .map(|(code, n)| format!("{code} {n} (\"{}\")", e.first_message[code]))
        .collect();
    format!("{} errors: {}", e.total, codes.join(", "))
}

fn cpu(seconds: Option<f64>) -> String {
    seconds.map_or_else(|| "?".into(), |s| format!("{s:.1} s"))
}

fn print_coordinators(
    coordinators: &[ReplicaReport],
    schema: Option<&cairn_load::SchemaReport>,
    harness_cpu_seconds: Option<f64>,
) {
    if let Some(schema) = schema {
        match &schema.left_because {
            None => println!("  database schema     {} (dropped)", schema.name),
            Some(why) => println!("  database schema     {} (left: {why})", schema.name),
        }
    }
    println!("  harness CPU         {}", cpu(harness_cpu_seconds));
    for (i, c) in coordinators.iter().enumerate() {
        println!(
            "  coordinator {i}       {}{}; CPU {}; log: {} warnings, {} errors",
            if c.alive_at_end { "" } else { "DIED EARLY, " },
            c.exit,
            cpu(c.cpu_seconds),
            c.log_warnings,
            c.log_errors
        );
        for (what, served) in [
            ("Heartbeat", &c.served_heartbeats),
            ("CommitCheckpoint", &c.served_commits),
        ] {
            if let Some(s) = served {
                println!(
                    "      {what:<18}  p50 {:.1} ms  p99 {:.1} ms  ({} calls, as it timed them)",
                    s.p50_ms, s.p99_ms, s.count
                );
            }
        }
        if let Some(why) = &c.metrics_error {
            println!("      metrics unread: {why}");
        }
        for line in &c.log_excerpt {
            println!("      {line}");
        }
        if let Some(dir) = &c.data_dir {
            println!("      data dir kept: {}", dir.display());
        }
    }
}

fn print_fleet(r: &cairn_load::FleetReport) {
    println!(
        "fleet: {} of {} hosts × {} slots, {} runs, {} coordinator(s), heartbeat {} ms, lease {} ms",
        r.hosts_registered,
        r.hosts,
        r.slots_per_host,
        r.runs_requested,
        r.replicas,
        r.heartbeat_interval_ms,
        r.lease_ms
    );
    println!("  RegisterHost        {}", latency(&r.register));
    println!(
        "  runs created        {} ({})",
        r.runs_created,
        errors(&r.create_errors)
    );
    println!("  CreateRun           {}", latency(&r.create));
    println!(
        "  runs assigned       {} ({} more than once, {} unassigned)",
        r.runs_assigned, r.runs_assigned_more_than_once, r.runs_unassigned
    );
    println!("  assignments/s       {:.1}", r.assignments_per_second);
    println!("  create→assign       {}", latency(&r.create_to_assign));
    println!("  Heartbeat           {}", latency(&r.heartbeats));
    println!("  heartbeat errors    {}", errors(&r.heartbeat_errors));
    if r.watch_orders {
        println!(
            "  order notices       {} ({})",
            r.order_notices,
            errors(&r.watch_errors)
        );
    } else {
        println!("  order notices       not watched (--no-watch-orders)");
    }
    println!(
        "  anomalies           {} destroy orders, {} lost answers, {} over capacity",
        r.destroy_orders, r.lost_answers, r.over_capacity
    );
    println!(
        "  phase               {:.1} s{}",
        r.seconds,
        if r.timed_out {
            ", CUT OFF at the duration limit"
        } else {
            ""
        }
    );
    print_coordinators(
        &r.coordinators,
        r.database_schema.as_ref(),
        r.harness_cpu_seconds,
    );
}

fn print_commits(r: &cairn_load::CommitsReport) {
    println!(
        "commits: {} workspaces, {} workers, {} commits, {} coordinator(s)",
        r.workspaces, r.workers, r.commits_requested, r.replicas
    );
    println!("  set-up              {:.1} s", r.setup_seconds);
    println!(
        "  commits             {} ok ({})",
        r.commits_ok,
        errors(&r.errors)
    );
    println!("  commits/s           {:.1}", r.commits_per_second);
    println!("  CommitCheckpoint    {}", latency(&r.commit));
    println!(
        "  sequences           {} out of step, highest {}",
        r.sequence_errors, r.max_sequence
    );
    println!(
        "  phase               {:.1} s{}",
        r.seconds,
        if r.timed_out {
            ", CUT OFF at the duration limit"
        } else {
            ""
        }
    );
    print_coordinators(
        &r.coordinators,
        r.database_schema.as_ref(),
        r.harness_cpu_seconds,
    );
}
