//! A host-side PostgreSQL load for recording a trace of the Debian test VM: pgbench's
//! TPC-B-like script against the guest's PostgreSQL, reached through the port its VM
//! description forwards (`tcp:127.0.0.1:5432-:5432`, written by `tandem setup --debian`).

use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Load, StartLoad};
use tandem_vm::VmConfig;

use crate::demo::{pgbench_init, PgAt};

/// Host port the Debian VM description forwards to the guest's PostgreSQL.
pub const PG_PORT: u16 = 5432;

/// Once the guest is ready: waits for PostgreSQL, initialises pgbench's tables at `scale`
/// (before the recording starts), then runs `clients` clients for `secs` seconds.
pub fn pgbench_load(clients: u32, scale: u32, secs: u64) -> StartLoad {
    Arc::new(move |_cfg: &VmConfig| {
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", PG_PORT)).is_err() {
            if t.elapsed() > Duration::from_secs(120) {
                return Err(format!(
                    "nothing answers on 127.0.0.1:{PG_PORT} (is this the Debian VM's description?)"
                ));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let at = PgAt::Port(PG_PORT);
        pgbench_init(at, scale).map_err(|e| format!("{e:#}"))?;
        let child = at
            .pgbench()
            .args(["-n", "-c", &clients.to_string(), "-T", &secs.to_string()])
            .arg("postgres")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("running pgbench: {e}"))?;
        Ok(Some(Box::new(Pgbench(child)) as Box<dyn Load>))
    })
}

struct Pgbench(Child);

impl Load for Pgbench {
    /// Waits a little for pgbench to finish its run (it was started for the recording's
    /// length), else stops it; returns the transactions it reported.
    fn stop(mut self: Box<Self>) -> Result<u64, String> {
        let t = Instant::now();
        while self.0.try_wait().map_err(|e| e.to_string())?.is_none() {
            if t.elapsed() > Duration::from_secs(15) {
                // Killed mid-run: it prints no summary.
                let _ = self.0.kill();
                let _ = self.0.wait();
                return Ok(0);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let out = self.0.wait_with_output().map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(format!("pgbench failed: {}", err.trim()));
        }
        Ok(transactions(&text).unwrap_or(0))
    }
}

/// The transaction count in pgbench's summary.
fn transactions(summary: &str) -> Option<u64> {
    summary
        .lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed:"))
        .and_then(|v| v.split_whitespace().next())
        // "N" with -T, "N/M" with -t.
        .and_then(|v| v.split('/').next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_transaction_count_is_read_from_the_summary() {
        let s = "transaction type: <builtin: TPC-B (sort of)>\nnumber of clients: 4\n\
                 number of transactions actually processed: 4886\n\
                 number of failed transactions: 0 (0.000%)\n";
        assert_eq!(super::transactions(s), Some(4886));
        let t = "number of transactions actually processed: 800/800\n";
        assert_eq!(super::transactions(t), Some(800));
        assert_eq!(super::transactions("pgbench: error"), None);
    }
}
