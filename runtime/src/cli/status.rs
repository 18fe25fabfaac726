//! `devicelet status`: what a running agent serves, and who holds what.

use std::path::PathBuf;

use crate::agent::status::{self, Status};

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The running agent's state directory.
    #[arg(long, default_value = "/var/lib/devicelet")]
    pub state_dir: PathBuf,
    /// Print the raw JSON document.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let status = status::read(&args.state_dir).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render(&status));
    }
    Ok(())
}

fn render(status: &Status) -> String {
    let mut out = String::new();
    for m in &status.modules {
        let s = m.stats;
        out += &format!(
            "module {} (sha256 {}…): {} traps, {} missed deadlines, {} refused answers, {} errors, \
             {} cells abandoned, {} log lines dropped; {} allocate calls; host memory {} of {} \
             bytes\n",
            m.name,
            m.digest.get(..12).unwrap_or(&m.digest),
            s.traps,
            s.deadlines,
            s.violations,
            s.errors,
            s.abandoned_cells,
            s.log_lines_dropped,
            s.allocate_calls,
            m.host_memory,
            m.host_memory_limit
        );
        if let Some(failed) = &m.failed {
            out += &format!("  FAILED: {failed}\n");
        }
    }
    for r in &status.resources {
        let healthy = r.devices.iter().filter(|d| d.healthy).count();
        let prepared = r.devices.iter().filter(|d| d.prepared).count();
        out += &format!(
            "{} (module {}, socket {}, {} devices, {healthy} healthy, {prepared} with an Allocate \
             answer ready, registered {} time(s))\n",
            r.name,
            r.module,
            r.socket.file_name().unwrap_or_default().to_string_lossy(),
            r.devices.len(),
            r.registrations
        );
        for d in &r.devices {
            let health = if d.healthy { "Healthy" } else { "Unhealthy" };
            let holder = match (&d.holder, d.allocated) {
                (Some(h), _) => format!("{}/{} container {}", h.namespace, h.pod, h.container),
                (None, true) => "allocated, pod not yet known".into(),
                (None, false) => "free".into(),
            };
            out += &format!("  {:<24} {:<9} {holder}\n", d.id, health);
        }
    }
    let l = &status.ledger;
    out += &format!(
        "ledger: {} entries{}{}\n",
        l.entries,
        if l.written {
            ""
        } else {
            ", not yet all written"
        },
        if l.dropped > 0 {
            format!(
                ", {} dropped at the cap (is PodResources reachable?)",
                l.dropped
            )
        } else {
            String::new()
        }
    );
    for e in &status.load_errors {
        out += &format!("not served: {e}\n");
    }
    if let Some(e) = &status.reload_error {
        out += &format!("last registry edit refused: {e}\n");
    }
    out
}
