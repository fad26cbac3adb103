//! `tandem bench --trace FILE...`: every codec over real recorded epochs, each epoch encoded,
//! decoded on a separate mirror and verified.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tandem_codec::{decode, Codec, Config, Encoder, Plan};

use tandem_protect::stats::{mean, quantile};

#[derive(Serialize, Clone)]
pub struct CodecRow {
    pub trace: String,
    pub workload: String,
    pub codec: String,
    pub epochs: usize,
    pub bytes_per_epoch_mean: f64,
    pub bytes_per_epoch_p99: f64,
    pub ratio_to_remus_raw: f64,
    pub encode_gbps_per_core: f64,
    pub decode_gbps_per_core: f64,
    pub state_bytes: usize,
    pub roundtrip_ok: usize,
    /// Encoder time per phase (ms): pre-pass, references, pages, serialise+compress, state.
    pub encode_phase_ms: [f64; 5],
}

fn run_one(path: &Path, codec: Codec, cfg: &Config, pb: &ProgressBar) -> anyhow::Result<CodecRow> {
    let ps = tandem_codec::format::PAGE;
    let (mut enc, mut mirror): (Option<Encoder>, Vec<u8>) = (None, Vec::new());
    let (mut sizes, mut raw) = (Vec::new(), 0u64);
    let (mut enc_t, mut dec_t) = (Duration::ZERO, Duration::ZERO);
    let (mut plan, mut rec, mut state, mut phases) = (Plan::default(), Vec::new(), 0, [0u64; 5]);
    let f =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let input = std::io::BufReader::with_capacity(1 << 20, f);
    let (h, truth) = tandem_trace::replay(input, |before, e| -> anyhow::Result<()> {
        if e.data.len() != e.pfns.len() * ps {
            bail!("trace page size is not the codec's {ps}");
        }
        let enc = match enc.as_mut() {
            Some(x) => x,
            None => {
                mirror = before.to_vec();
                enc.insert(Encoder::new(codec, before, *cfg)?)
            }
        };
        rec.clear();
        let t = Instant::now();
        let st = enc.encode(e.epoch, &e.pfns, &e.data, &mut rec)?;
        enc_t += t.elapsed();
        for (p, v) in phases.iter_mut().zip(st.phase_us) {
            *p += v;
        }
        let t = Instant::now();
        decode(&rec, &mirror, &mut plan)
            .with_context(|| format!("{} epoch {}: own record rejected", codec.name(), e.epoch))?;
        plan.commit(&mut mirror);
        dec_t += t.elapsed();
        let same = e.pfns.iter().enumerate().all(|(i, &p)| {
            mirror[p as usize * ps..(p as usize + 1) * ps] == e.data[i * ps..(i + 1) * ps]
        });
        if !same {
            bail!(
                "{} epoch {}: decoded memory differs from the trace",
                codec.name(),
                e.epoch
            );
        }
        sizes.push(rec.len() as f64);
        raw += e.data.len() as u64;
        state = state.max(enc.state_bytes());
        pb.inc(1);
        Ok(())
    })?;
    if !mirror.is_empty() && mirror != truth {
        bail!(
            "{}: final decoded memory differs from the trace",
            codec.name()
        );
    }
    let gb = raw as f64 / 1e9;
    Ok(CodecRow {
        trace: path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
        workload: h.meta["workload"].as_str().unwrap_or("?").to_string(),
        codec: codec.name().into(),
        epochs: sizes.len(),
        bytes_per_epoch_mean: mean(&sizes),
        bytes_per_epoch_p99: quantile(&sizes, 0.99),
        ratio_to_remus_raw: sizes.iter().sum::<f64>() / raw.max(1) as f64,
        encode_gbps_per_core: gb / enc_t.as_secs_f64().max(1e-9) / cfg.threads as f64,
        decode_gbps_per_core: gb / dec_t.as_secs_f64().max(1e-9),
        state_bytes: state,
        roundtrip_ok: sizes.len(),
        encode_phase_ms: phases.map(|v| v as f64 / 1000.0),
    })
}

/// Parses `key=value,...` budget overrides onto `cfg`.
pub fn parse_budget(spec: &str, cfg: &mut Config) -> anyhow::Result<()> {
    for kv in spec.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--budget: {kv:?} is not key=value"))?;
        let flag = |v: &str| match v {
            "on" | "true" | "1" => Ok(true),
            "off" | "false" | "0" => Ok(false),
            _ => bail!("--budget {k}: expected on or off, got {v:?}"),
        };
        let num = |v: &str| {
            v.parse::<usize>()
                .with_context(|| format!("--budget {k}: {v:?} is not a number"))
        };
        match k {
            "good_enough" => cfg.budget.good_enough = num(v)?,
            "similar_above" => cfg.budget.similar_above = num(v)?,
            "similarity" => cfg.budget.similarity = flag(v)?,
            "prefix" => cfg.budget.prefix = flag(v)?,
            "blocks" => cfg.budget.blocks = flag(v)?,
            "word_runs" => cfg.budget.word_runs = flag(v)?,
            _ => bail!("--budget: unknown knob {k:?} (good_enough, prefix, similar_above, similarity, blocks, word_runs)"),
        }
    }
    Ok(())
}

#[derive(Serialize)]
pub struct Summary {
    pub rows: Vec<CodecRow>,
    pub tandem_vs_remus_mean: Option<f64>,
    pub tandem_vs_best_baseline: Vec<(String, String, f64)>,
}

pub fn run(traces: &[PathBuf], codecs: &[Codec], cfg: &Config, json: bool) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for path in traces {
        for &c in codecs {
            let pb = ProgressBar::no_length();
            pb.set_style(
                ProgressStyle::with_template("{spinner} {msg:40} {pos} epochs [{elapsed}]")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            pb.set_message(format!(
                "{} / {}",
                path.file_name().unwrap_or_default().to_string_lossy(),
                c.name()
            ));
            let row = run_one(path, c, cfg, &pb)?;
            pb.finish_and_clear();
            rows.push(row);
        }
    }
    // Targets: tandem vs Remus raw (mean over traces) and vs the best other codec per trace.
    let mut vs_remus = Vec::new();
    let mut vs_best = Vec::new();
    for t in rows.iter().filter(|r| r.codec == "tandem") {
        vs_remus.push(t.ratio_to_remus_raw);
        if let Some(b) = rows
            .iter()
            .filter(|r| r.trace == t.trace && r.codec != "tandem")
            .min_by(|a, b| a.bytes_per_epoch_mean.total_cmp(&b.bytes_per_epoch_mean))
        {
            vs_best.push((
                t.workload.clone(),
                b.codec.clone(),
                t.bytes_per_epoch_mean / b.bytes_per_epoch_mean.max(1.0),
            ));
        }
    }
    let s = Summary {
        rows,
        tandem_vs_remus_mean: (!vs_remus.is_empty()).then(|| mean(&vs_remus)),
        tandem_vs_best_baseline: vs_best,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!("| workload | codec | epochs | bytes/epoch mean | p99 | ratio to Remus raw | encode GB/s/core | decode GB/s/core | state MiB | round trips |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &s.rows {
        println!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.4} | {:.2} | {:.2} | {:.1} | {}/{} |",
            r.workload,
            r.codec,
            r.epochs,
            r.bytes_per_epoch_mean,
            r.bytes_per_epoch_p99,
            r.ratio_to_remus_raw,
            r.encode_gbps_per_core,
            r.decode_gbps_per_core,
            r.state_bytes as f64 / (1 << 20) as f64,
            r.roundtrip_ok,
            r.epochs
        );
    }
    if let Some(m) = s.tandem_vs_remus_mean {
        println!("\ntandem / Remus raw bytes, mean over traces: {m:.4} (target ≤ 0.2)");
    }
    for (w, b, x) in &s.tandem_vs_best_baseline {
        println!("tandem / best other codec on {w} ({b}): {x:.3} (target ≤ 0.8)");
    }
    Ok(())
}
