//! Issue 40's guarantee: on every workload, tandem against the better of its own v1 and the
//! plain control (xbzrle+zstd), with the workloads split like an experiment. The split is
//! fixed here (docs/CODEC.md, "Workloads: tuned on and held out"): the codec's choices were
//! tuned on [`TUNED`]; [`HELD_OUT`] must never be used to tune it.

use serde::Serialize;

use super::codec::CodecRow;

/// The workloads the codec was tuned on (its default strategies were chosen on these).
pub const TUNED: &[&str] = &[
    "idle", "compile", "sqlite", "kv", "memtouch", "disk", "pgbench",
];

/// The workloads it is only measured on.
pub const HELD_OUT: &[&str] = &["luatext", "luagc", "alloc", "awktext", "archive", "httpd"];

/// Target: tandem's bytes over the better simple path, on every workload.
pub const EVERY_MAX: f64 = 0.9;
/// Target: the same, mean over the held-out half.
pub const HELD_OUT_MEAN_MAX: f64 = 0.8;
/// Target: decode speed on every workload (GB/s per core).
pub const DECODE_MIN_GBPS: f64 = 3.0;

/// One workload's guarantee row.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Row {
    /// The workload.
    pub workload: String,
    /// `tuned`, `held-out` or `unsplit` (a workload of neither list).
    pub half: &'static str,
    /// tandem's mean bytes per epoch.
    pub tandem: f64,
    /// tandem-v1's.
    pub v1: f64,
    /// xbzrle+zstd's.
    pub control: f64,
    /// tandem / min(v1, control).
    pub ratio: f64,
    /// tandem's encode speed / tandem-v1's (≥ 1: no slower).
    pub encode_vs_v1: f64,
    /// tandem's decode speed / tandem-v1's.
    pub decode_vs_v1: f64,
    /// tandem's decode speed (GB/s per core).
    pub decode_gbps: f64,
}

/// The guarantee over every workload that has all three codecs' rows.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Guarantee {
    /// A row per workload.
    pub rows: Vec<Row>,
    /// The worst ratio and its workload.
    pub worst: Option<(String, f64)>,
    /// Mean ratio over the held-out workloads measured.
    pub held_out_mean: Option<f64>,
    /// Mean ratio over the tuned workloads measured.
    pub tuned_mean: Option<f64>,
}

fn half(workload: &str) -> &'static str {
    if TUNED.contains(&workload) {
        "tuned"
    } else if HELD_OUT.contains(&workload) {
        "held-out"
    } else {
        "unsplit"
    }
}

/// The guarantee of `rows` (a bench run's rows; workloads without the three codecs are left
/// out).
pub fn of(rows: &[CodecRow]) -> Guarantee {
    let find = |trace: &str, codec: &str| {
        rows.iter()
            .find(|r| r.trace == trace && r.codec == codec)
            .cloned()
    };
    let mut out = Vec::new();
    for t in rows.iter().filter(|r| r.codec == "tandem") {
        let (Some(v1), Some(c)) = (find(&t.trace, "tandem-v1"), find(&t.trace, "xbzrle+zstd"))
        else {
            continue;
        };
        let better = v1.bytes_per_epoch_mean.min(c.bytes_per_epoch_mean).max(1.0);
        out.push(Row {
            workload: t.workload.clone(),
            half: half(&t.workload),
            tandem: t.bytes_per_epoch_mean,
            v1: v1.bytes_per_epoch_mean,
            control: c.bytes_per_epoch_mean,
            ratio: t.bytes_per_epoch_mean / better,
            encode_vs_v1: t.encode_gbps_per_core / v1.encode_gbps_per_core.max(1e-9),
            decode_vs_v1: t.decode_gbps_per_core / v1.decode_gbps_per_core.max(1e-9),
            decode_gbps: t.decode_gbps_per_core,
        });
    }
    let mean_of = |h: &str| {
        let v: Vec<f64> = out
            .iter()
            .filter(|r| r.half == h)
            .map(|r| r.ratio)
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    Guarantee {
        worst: out
            .iter()
            .max_by(|a, b| a.ratio.total_cmp(&b.ratio))
            .map(|r| (r.workload.clone(), r.ratio)),
        held_out_mean: mean_of("held-out"),
        tuned_mean: mean_of("tuned"),
        rows: out,
    }
}

/// Prints the guarantee as a Markdown table with the verdict on each target.
pub fn print(g: &Guarantee) {
    if g.rows.is_empty() {
        return;
    }
    println!("\nIssue 40's guarantee: tandem against the better of tandem-v1 and xbzrle+zstd (bytes), and its speed against tandem-v1");
    println!("| workload | half | tandem B/epoch | tandem-v1 | xbzrle+zstd | tandem / better (≤ {EVERY_MAX}) | encode / v1 (≥ 1) | decode / v1 (≥ 1) | decode GB/s (≥ {DECODE_MIN_GBPS}) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mark = |ok: bool| if ok { "" } else { " **missed**" };
    for r in &g.rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.3}{} | {:.2}{} | {:.2}{} | {:.2}{} |",
            r.workload,
            r.half,
            r.tandem,
            r.v1,
            r.control,
            r.ratio,
            mark(r.ratio <= EVERY_MAX),
            r.encode_vs_v1,
            mark(r.encode_vs_v1 >= 1.0),
            r.decode_vs_v1,
            mark(r.decode_vs_v1 >= 1.0),
            r.decode_gbps,
            mark(r.decode_gbps >= DECODE_MIN_GBPS)
        );
    }
    if let Some((w, x)) = &g.worst {
        println!(
            "worst tandem / better over all workloads: {x:.3} ({w}; target ≤ {EVERY_MAX}){}",
            mark(*x <= EVERY_MAX)
        );
    }
    if let Some(m) = g.held_out_mean {
        println!(
            "held-out mean: {m:.3} (target ≤ {HELD_OUT_MEAN_MAX}){}",
            mark(m <= HELD_OUT_MEAN_MAX)
        );
    }
    if let Some(m) = g.tuned_mean {
        println!("tuned mean: {m:.3}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(workload: &str, codec: &str, bytes: f64, enc: f64, dec: f64) -> CodecRow {
        CodecRow {
            trace: format!("{workload}.trace"),
            workload: workload.into(),
            codec: codec.into(),
            epochs: 10,
            bytes_per_epoch_mean: bytes,
            bytes_per_epoch_p99: bytes,
            ratio_to_remus_raw: 0.1,
            encode_gbps_per_core: enc,
            decode_gbps_per_core: dec,
            state_bytes: 0,
            work_bytes: 0,
            roundtrip_ok: 10,
            encode_phase_ms: [0.0; 5],
            prefix_checks: 0,
            prefix_off_epochs: 0,
        }
    }

    #[test]
    fn the_worst_ratio_is_against_the_better_simple_path() {
        let rows = vec![
            row("kv", "tandem", 80.0, 1.0, 4.0),
            row("kv", "tandem-v1", 100.0, 1.0, 4.0),
            row("kv", "xbzrle+zstd", 90.0, 2.0, 4.0),
            row("luatext", "tandem", 120.0, 0.5, 3.0),
            row("luatext", "tandem-v1", 100.0, 1.0, 3.5),
            row("luatext", "xbzrle+zstd", 110.0, 1.0, 3.5),
            // No control row: left out.
            row("idle", "tandem", 1.0, 1.0, 1.0),
        ];
        let g = of(&rows);
        assert_eq!(g.rows.len(), 2);
        assert!((g.rows[0].ratio - 80.0 / 90.0).abs() < 1e-9);
        assert_eq!(g.rows[0].half, "tuned");
        assert_eq!(g.rows[1].half, "held-out");
        assert!((g.rows[1].encode_vs_v1 - 0.5).abs() < 1e-9);
        assert_eq!(g.worst.as_ref().map(|w| w.0.as_str()), Some("luatext"));
        assert!((g.held_out_mean.unwrap() - 1.2).abs() < 1e-9);
    }

    #[test]
    fn the_halves_do_not_overlap_and_name_lab_workloads() {
        for w in HELD_OUT {
            assert!(!TUNED.contains(w), "{w} is in both halves");
        }
        for w in TUNED.iter().chain(HELD_OUT).filter(|w| **w != "pgbench") {
            tandem_labguest::check_workload(w).unwrap();
        }
        assert!(TUNED.len() + HELD_OUT.len() >= 12);
    }
}
