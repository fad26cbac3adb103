//! `tandem run` (the unit tandem@VM) on two "hosts" of 127.0.0.1 with a real 3-member etcd
//! cluster: the role comes from the ownership record, and stopping and starting a node's
//! daemon in each role — what `systemctl restart` does — never loses the VM and never boots a
//! second copy: the node running a protected guest hands it over and comes back as its backup;
//! a backup comes back as a backup; the node running the guest without a backup shuts it down,
//! records it stopped, and boots it again when it comes back.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{free_port, spawn, wait_event, wait_line, Proc};
use tandem_harness::etcd_cluster::Cluster;

fn cluster(dir: &std::path::Path) -> Cluster {
    common::local_etcd(dir)
}

/// The node's configuration file: the same keys on both nodes but for its directories (both
/// "hosts" share this machine).
fn config(dir: &Path, node: &str, nodes: &[(&str, String)], eps: &str, vm: &str) -> String {
    let nodes: String = nodes
        .iter()
        .map(|(n, a)| format!("{n} = \"{a}\"\n"))
        .collect();
    let etcd: Vec<String> = eps.split(',').map(|e| format!("\"{e}\"")).collect();
    let text = format!(
        "vm_id = 7\nprimary = \"a\"\nvm_config = \"{vm}\"\n[nodes]\n{nodes}\
         [paths]\nmirror_dir = \"{d}/{node}-mirror\"\nstate_dir = \"{d}/{node}-state\"\n\
         [fencing]\netcd = [{}]\n[replication]\ntimeout_ms = 500\nepoch_ms = 50\n",
        etcd.join(", "),
        d = dir.display()
    );
    let path = dir.join(format!("{node}.toml"));
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn run(cfg: &str, node: &str) -> (Proc, std::sync::mpsc::Receiver<String>) {
    spawn(&["run", "--config", cfg, "--node", node, "--json-events"])
}

/// SIGTERM (systemctl stop) and the exit status.
fn stop(p: &mut Proc) -> std::process::ExitStatus {
    // SAFETY: kill(2) on our child's pid.
    unsafe { libc::kill(p.id() as i32, libc::SIGTERM) };
    p.wait().unwrap()
}

fn record(eps: &str) -> serde_json::Value {
    let out = std::process::Command::new(tandem_harness::product_exe().unwrap())
        .args(["fence", "show", "--etcd", eps, "--vm-id", "7", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["record"].clone()
}

#[test]
fn restarting_either_node_in_any_role_never_loses_the_vm() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let etcd = cluster(dir.path());
    let eps = etcd.endpoints().join(",");
    let vm = common::lab_vm("idle", 0);
    let nodes = [
        ("a", format!("127.0.0.1:{}", free_port())),
        ("b", format!("127.0.0.1:{}", free_port())),
    ];
    let cfg_a = config(dir.path(), "a", &nodes, &eps, &vm);
    let cfg_b = config(dir.path(), "b", &nodes, &eps, &vm);
    let long = Duration::from_secs(120);

    // A new VM: a (primary = "a") boots it, b serves as its backup.
    let (mut b, brx) = run(&cfg_b, "b");
    wait_line(&brx, "serves as the backup (a new VM)", long);
    let (mut a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "runs the guest (a new VM)", long);
    wait_event(&arx, "guest_running", long, |_| true);
    wait_event(&arx, "protected", long, |_| true);

    // Restart the node running the protected guest: it hands the guest over to b (no fresh
    // boot anywhere), and comes back as b's backup; b protects the guest onto it.
    assert!(stop(&mut a).success(), "a's daemon ends cleanly on SIGTERM");
    let taken = wait_event(&brx, "failed_over", long, |_| true);
    assert!(taken["epoch"].as_u64() > Some(0), "{taken}");
    let (mut a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "serves as the backup", long);
    wait_event(&brx, "protected", long, |_| true);
    assert_eq!(record(&eps)["node"], "b");
    assert_eq!(record(&eps)["state"], "protected");

    // Restart the backup: it comes back as the backup; the guest stays on b, protected again.
    assert!(stop(&mut a).success());
    let (mut a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "serves as the backup", long);
    wait_event(&brx, "protected", long, |_| true);

    // Stop the backup for good: b runs the guest without a replica (recorded in etcd). Then
    // stop b: no backup to hand over to, the guest is shut down and recorded stopped by b
    // (its disks are the newest); b, started again, boots it.
    assert!(stop(&mut a).success());
    wait_event(&brx, "unreplicated", long, |v| v["on"] == true);
    assert!(stop(&mut b).success());
    let r = record(&eps);
    assert_eq!(
        (r["state"].as_str(), r["node"].as_str()),
        (Some("stopped"), Some("b")),
        "{r}"
    );
    let (_b, brx) = run(&cfg_b, "b");
    wait_line(&brx, "runs the guest", long);
    wait_event(&brx, "guest_running", long, |_| true);
    // And a, started again, is its backup.
    let (_a, arx) = run(&cfg_a, "a");
    wait_line(&arx, "serves as the backup", long);
    wait_event(&brx, "protected", long, |_| true);
}
