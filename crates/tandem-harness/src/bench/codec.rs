//! `tandem bench --trace FILE...`: every codec over real recorded epochs, each epoch encoded,
//! decoded on a separate mirror and verified.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tandem_codec::{decode, Codec, Config, Encoder, Plan};

use tandem_types::stats::{mean, quantile};

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
    /// The encoder's working memory kept between epochs (largest seen; tandem's record
    /// buffers and staging, `Encoder::work_bytes`).
    pub work_bytes: usize,
    pub roundtrip_ok: usize,
    /// Encoder time per phase (ms): pre-pass, references, pages, serialise+compress, state.
    pub encode_phase_ms: [f64; 5],
    /// tandem: epochs whose record was compressed again without its reference prefix, to
    /// check whether the prefix pays (trial.rs, `PrefixChoice`).
    pub prefix_checks: usize,
    /// tandem: epochs that went without the reference prefix.
    pub prefix_off_epochs: usize,
}

/// What one row measures: a codec, over epochs merged `coalesce` at a time, given either the
/// dirty log's pages or (`exact`, the control row) only the pages whose content changed.
#[derive(Clone, Copy)]
pub struct Trial {
    pub codec: Codec,
    pub exact: bool,
    pub coalesce: usize,
}

/// The pages of a group of epochs: page → latest content.
type Group = std::collections::BTreeMap<u64, Vec<u8>>;

struct Runner<'a> {
    t: Trial,
    cfg: &'a Config,
    enc: Option<Encoder>,
    mirror: Vec<u8>,
    plan: Plan,
    rec: Vec<u8>,
    sizes: Vec<f64>,
    raw: u64,
    enc_t: Duration,
    dec_t: Duration,
    state: usize,
    work: usize,
    phases: [u64; 5],
    /// Prefix checks and epochs without the prefix so far.
    prefix: (usize, usize),
    epoch: u64,
}

impl Runner<'_> {
    fn flush(&mut self, group: &mut Group) -> anyhow::Result<()> {
        let ps = tandem_codec::format::PAGE;
        if group.is_empty() {
            return Ok(());
        }
        self.epoch += 1;
        let (mut pfns, mut data) = (Vec::new(), Vec::new());
        for (&p, c) in group.iter() {
            self.raw += ps as u64;
            if self.t.exact && self.mirror[p as usize * ps..(p as usize + 1) * ps] == c[..] {
                continue;
            }
            pfns.push(p);
            data.extend_from_slice(c);
        }
        let name = self.t.codec.name();
        let enc = self.enc.as_mut().context("encoder")?;
        self.rec.clear();
        let t = Instant::now();
        let st = enc.encode(self.epoch, &pfns, &data, &mut self.rec)?;
        self.enc_t += t.elapsed();
        for (p, v) in self.phases.iter_mut().zip(st.phase_us) {
            *p += v;
        }
        self.prefix.0 += usize::from(st.prefix_check.is_some());
        self.prefix.1 += usize::from(st.prefix_off);
        let t = Instant::now();
        decode(&self.rec, &self.mirror, &mut self.plan)
            .with_context(|| format!("{name} epoch {}: own record rejected", self.epoch))?;
        self.plan.commit(&mut self.mirror);
        self.dec_t += t.elapsed();
        let m = &self.mirror;
        if !group
            .iter()
            .all(|(&p, c)| m[p as usize * ps..(p as usize + 1) * ps] == c[..])
        {
            bail!(
                "{name} epoch {}: decoded memory differs from the trace",
                self.epoch
            );
        }
        self.sizes.push(self.rec.len() as f64);
        self.state = self.state.max(enc.state_bytes());
        self.work = self.work.max(enc.work_bytes());
        group.clear();
        Ok(())
    }
}

fn run_one(path: &Path, t: Trial, cfg: &Config, pb: &ProgressBar) -> anyhow::Result<CodecRow> {
    let ps = tandem_codec::format::PAGE;
    let mut r = Runner {
        t,
        cfg,
        enc: None,
        mirror: Vec::new(),
        plan: Plan::default(),
        rec: Vec::new(),
        sizes: Vec::new(),
        raw: 0,
        enc_t: Duration::ZERO,
        dec_t: Duration::ZERO,
        state: 0,
        work: 0,
        phases: [0; 5],
        prefix: (0, 0),
        epoch: 0,
    };
    let mut group = Group::new();
    let mut n = 0usize;
    let f =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let input = std::io::BufReader::with_capacity(1 << 20, f);
    let (h, truth) = tandem_trace::replay(input, |before, e| -> anyhow::Result<()> {
        if e.data.len() != e.pfns.len() * ps {
            bail!("trace page size is not the codec's {ps}");
        }
        if r.enc.is_none() {
            r.mirror = before.to_vec();
            r.enc = Some(Encoder::new(t.codec, before, *r.cfg)?);
        }
        for (i, &p) in e.pfns.iter().enumerate() {
            group.insert(p, e.data[i * ps..(i + 1) * ps].to_vec());
        }
        n += 1;
        if n.is_multiple_of(t.coalesce.max(1)) {
            r.flush(&mut group)?;
        }
        pb.inc(1);
        Ok(())
    })?;
    r.flush(&mut group)?;
    let name = t.codec.name();
    if !r.mirror.is_empty() && r.mirror != truth {
        bail!("{name}: final decoded memory differs from the trace");
    }
    let gb = r.raw as f64 / 1e9;
    let trace = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    // A trace of a VM description has no lab workload: name it by its file (`pgbench-…`).
    let workload = match h.meta["workload"].as_str().unwrap_or("?") {
        "custom" => trace.split('-').next().unwrap_or("custom").to_string(),
        w => w.to_string(),
    };
    Ok(CodecRow {
        trace,
        workload,
        codec: if t.exact {
            format!("{name} (exact)")
        } else {
            name.into()
        },
        epochs: r.sizes.len(),
        bytes_per_epoch_mean: mean(&r.sizes),
        bytes_per_epoch_p99: quantile(&r.sizes, 0.99),
        ratio_to_remus_raw: r.sizes.iter().sum::<f64>() / r.raw.max(1) as f64,
        encode_gbps_per_core: gb / r.enc_t.as_secs_f64().max(1e-9) / cfg.threads as f64,
        decode_gbps_per_core: gb / r.dec_t.as_secs_f64().max(1e-9),
        state_bytes: r.state,
        work_bytes: r.work,
        roundtrip_ok: r.sizes.len(),
        encode_phase_ms: r.phases.map(|v| v as f64 / 1000.0),
        prefix_checks: r.prefix.0,
        prefix_off_epochs: r.prefix.1,
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
            "run_gap" => cfg.budget.run_gap = num(v)?,
            "similar_above" => cfg.budget.similar_above = num(v)?,
            "similarity" => cfg.budget.similarity = flag(v)?,
            "prefix" => cfg.budget.prefix = flag(v)?,
            "anchors" => cfg.budget.anchors = flag(v)?,
            "blocks" => cfg.budget.blocks = flag(v)?,
            "word_runs" => cfg.budget.word_runs = flag(v)?,
            "admission" => cfg.budget.admission = flag(v)?,
            "cold" => cfg.budget.cold = flag(v)?,
            "trial" => cfg.budget.trial = flag(v)?,
            "words" => cfg.budget.words = flag(v)?,
            "regular_up_to" => cfg.budget.regular_up_to = num(v)?,
            "held_anchors" if v == "off" => cfg.budget.held_anchors = usize::MAX,
            "held_anchors" => cfg.budget.held_anchors = num(v)?,
            _ => bail!("--budget: unknown knob {k:?} (good_enough, regular_up_to, run_gap, prefix, anchors, held_anchors, similar_above, similarity, blocks, word_runs, admission, cold, trial, words)"),
        }
    }
    Ok(())
}

#[derive(Serialize)]
pub struct Summary {
    pub rows: Vec<CodecRow>,
    pub tandem_vs_remus_mean: Option<f64>,
    pub tandem_vs_best_baseline: Vec<(String, String, f64)>,
    /// Issue 40's guarantee (workloads with tandem, tandem-v1 and xbzrle+zstd rows).
    pub guarantee: super::guarantee::Guarantee,
}

pub fn run(traces: &[PathBuf], trials: &[Trial], cfg: &Config, json: bool) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for path in traces {
        for &t in trials {
            let c = t.codec;
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
            let row = run_one(path, t, cfg, &pb)?;
            pb.finish_and_clear();
            rows.push(row);
        }
    }
    // Targets: tandem vs Remus raw (mean over traces) and vs the best other codec per trace:
    // the papers' techniques, and separately the attribution control (XBZRLE runs + one zstd
    // pass over the whole record at tandem's level), which shows what the generic compressor
    // alone gives.
    let mut vs_remus = Vec::new();
    let mut vs_best = Vec::new();
    for t in rows.iter().filter(|r| r.codec == "tandem") {
        vs_remus.push(t.ratio_to_remus_raw);
        for control in [false, true] {
            let best = rows
                .iter()
                .filter(|r| r.trace == t.trace && !r.codec.starts_with("tandem"))
                .filter(|r| !r.codec.ends_with("(exact)"))
                .filter(|r| (r.codec == "xbzrle+zstd") == control)
                .min_by(|a, b| a.bytes_per_epoch_mean.total_cmp(&b.bytes_per_epoch_mean));
            if let Some(b) = best {
                vs_best.push((
                    t.workload.clone(),
                    b.codec.clone(),
                    t.bytes_per_epoch_mean / b.bytes_per_epoch_mean.max(1.0),
                ));
            }
        }
    }
    let rows_for_guarantee = rows.clone();
    let s = Summary {
        rows,
        tandem_vs_remus_mean: (!vs_remus.is_empty()).then(|| mean(&vs_remus)),
        tandem_vs_best_baseline: vs_best,
        guarantee: super::guarantee::of(&rows_for_guarantee),
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
        println!("\ntandem / Remus raw bytes, mean over traces: {m:.4}");
    }
    for (w, b, x) in &s.tandem_vs_best_baseline {
        let what = if b == "xbzrle+zstd" {
            "the attribution control"
        } else {
            "the best paper codec"
        };
        println!("tandem / {what} on {w} ({b}): {x:.3} (target ≤ 0.7)");
    }
    for t in s.rows.iter().filter(|r| r.codec == "tandem") {
        if let Some(v1) = s
            .rows
            .iter()
            .find(|r| r.trace == t.trace && r.codec == "tandem-v1")
        {
            println!(
                "tandem / tandem-v1 on {}: {:.3}",
                t.workload,
                t.bytes_per_epoch_mean / v1.bytes_per_epoch_mean.max(1.0)
            );
        }
    }
    super::guarantee::print(&s.guarantee);
    Ok(())
}
