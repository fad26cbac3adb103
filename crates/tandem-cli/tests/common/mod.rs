//! Shared by the fault and fencing tests: one `tandem demo --json` run and the checks every
//! round must pass.

use std::process::Command;

/// Runs `tandem demo` with `faults` and `extra` flags; checks every round (every acknowledged
/// write read back, redis kept running, no primary frame after failover, exactly one copy,
/// nothing left behind) and returns the rounds.
pub fn demo_rounds(faults: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["demo", "--json", "--timeout-ms", "2000", "--before", "3"])
        .args(["--after", "2", "--faults", faults])
        .args(extra)
        .output()
        .expect("run tandem demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "tandem demo --faults {faults} failed:\n{stdout}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(v["ok"], true, "{v:#}");
    let rounds = v["rounds"].as_array().unwrap().clone();
    for r in &rounds {
        assert!(r["acked_keys_checked"].as_u64().unwrap() > 0, "{r:#}");
        assert_eq!(r["acked_keys_lost"], 0, "{r:#}");
        assert_eq!(r["guest_continued"], true, "{r:#}");
        assert_eq!(r["primary_frames_after_failover"], 0, "{r:#}");
        assert!(r["primary_frames_captured"].as_u64().unwrap() > 0, "{r:#}");
        assert_eq!(r["primary_copy_stopped"], true, "{r:#}");
        assert_eq!(r["leftovers"].as_array().unwrap().len(), 0, "{r:#}");
    }
    rounds
}

/// One round of [`demo_rounds`].
#[allow(dead_code)]
pub fn demo(faults: &str, extra: &[&str]) -> serde_json::Value {
    demo_rounds(faults, extra).remove(0)
}

/// What each fault of a round led to (`"partition:500: replication carried on"`).
pub fn outcomes(r: &serde_json::Value) -> Vec<String> {
    r["faults"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect()
}
