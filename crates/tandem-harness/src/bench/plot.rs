//! `tandem bench --replication --plots FILE`: one self-contained HTML page of inline SVG — the
//! client's latency CDF per row, and per row an epoch timeline (pause, dirty pages, bytes sent,
//! output held). Hand-written SVG: a few polylines need no plotting crate and its build time.

use std::fmt::Write as _;

use crate::demo::round::RoundResult;

const W: f64 = 720.0;
const H: f64 = 260.0;
const PAD: f64 = 48.0;
const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn label(r: &RoundResult) -> String {
    let mut l = format!("{} {} {} ms", r.workload, r.schedule, r.epoch_ms);
    if tandem_labguest::serves_kv(&r.workload) {
        l += &format!(", client {}", r.client);
    }
    if r.devstate == "migrate" {
        l += ", devstate migrate";
    }
    l
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Latency CDFs of every row with client latencies, on a log-scaled x axis (ms).
fn latency_cdf(rows: &[RoundResult]) -> Option<String> {
    let with: Vec<&RoundResult> = rows
        .iter()
        .filter(|r| !r.latency_samples_ms.is_empty())
        .collect();
    if with.is_empty() {
        return None;
    }
    let max = with
        .iter()
        .flat_map(|r| r.latency_samples_ms.iter().copied())
        .fold(1.0f64, f64::max);
    let (lo, hi) = (0.1f64.log10(), max.max(1.0).log10().ceil().max(0.0));
    let x = |ms: f64| PAD + (ms.max(0.1).log10() - lo) / (hi - lo) * (W - 2.0 * PAD);
    let y = |f: f64| H - PAD - f * (H - 2.0 * PAD);
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' font-family='sans-serif' font-size='11'>");
    axes(&mut s, "request latency, ms (log)", "fraction of requests");
    let mut decade = lo;
    while decade <= hi + 1e-9 {
        let v = 10f64.powf(decade);
        let _ = write!(
            s,
            "<text x='{:.1}' y='{}' text-anchor='middle'>{}</text>",
            x(v),
            H - PAD + 14.0,
            if v < 1.0 {
                format!("{v:.1}")
            } else {
                format!("{v:.0}")
            }
        );
        decade += 1.0;
    }
    for f in [0.0, 0.5, 0.99, 1.0] {
        let _ = write!(
            s,
            "<text x='{}' y='{:.1}' text-anchor='end'>{f}</text>",
            PAD - 4.0,
            y(f) + 4.0
        );
    }
    for (i, r) in with.iter().enumerate() {
        let mut v = r.latency_samples_ms.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let step = (v.len() / 400).max(1);
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .step_by(step)
            .chain(std::iter::once((v.len() - 1, &v[v.len() - 1])))
            .map(|(k, ms)| format!("{:.1},{:.1}", x(*ms), y((k + 1) as f64 / v.len() as f64)))
            .collect();
        let c = COLORS[i % COLORS.len()];
        let _ = write!(
            s,
            "<polyline fill='none' stroke='{c}' stroke-width='1.5' points='{}'/><text x='{}' y='{}' fill='{c}'>{}</text>",
            pts.join(" "),
            PAD + 8.0,
            PAD + 14.0 * i as f64,
            esc(&label(r))
        );
    }
    s.push_str("</svg>");
    Some(s)
}

fn axes(s: &mut String, xl: &str, yl: &str) {
    let _ = write!(
        s,
        "<line x1='{PAD}' y1='{b}' x2='{r}' y2='{b}' stroke='black'/><line x1='{PAD}' y1='{PAD}' x2='{PAD}' y2='{b}' stroke='black'/><text x='{cx}' y='{H}' text-anchor='middle' dy='-6'>{xl}</text><text x='12' y='{cy}' transform='rotate(-90 12 {cy})' text-anchor='middle'>{yl}</text>",
        b = H - PAD,
        r = W - PAD,
        cx = W / 2.0,
        cy = H / 2.0
    );
}

/// A row's epochs: four stacked panels sharing the epoch axis.
fn timeline(r: &RoundResult) -> Option<String> {
    let p = &r.epoch_points;
    if p.len() < 2 {
        return None;
    }
    type Series = (&'static str, fn(&crate::demo::round::EpochPoint) -> f64);
    let series: [Series; 4] = [
        ("pause + early suspend ms", |e| e.pause_ms + e.suspended_ms),
        ("dirty pages", |e| e.dirty_pages as f64),
        ("KiB sent", |e| e.sent_bytes as f64 / 1024.0),
        ("frames held", |e| e.held_frames as f64),
    ];
    let panel = 90.0;
    let height = PAD + panel * series.len() as f64 + 20.0;
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{height}' font-family='sans-serif' font-size='11'>");
    let n = p.len() as f64;
    let x = |i: usize| PAD + i as f64 / (n - 1.0) * (W - 2.0 * PAD);
    for (k, (name, f)) in series.iter().enumerate() {
        let top = 20.0 + panel * k as f64;
        let max = p.iter().map(f).fold(0.0f64, f64::max).max(1e-9);
        let y = |v: f64| top + panel - 12.0 - v / max * (panel - 24.0);
        let pts: Vec<String> = p
            .iter()
            .enumerate()
            .map(|(i, e)| format!("{:.1},{:.1}", x(i), y(f(e))))
            .collect();
        let c = COLORS[k % COLORS.len()];
        let _ = write!(
            s,
            "<line x1='{PAD}' y1='{b:.1}' x2='{r}' y2='{b:.1}' stroke='#999'/><text x='{PAD}' y='{t:.1}' fill='{c}'>{name} (max {max:.1})</text><polyline fill='none' stroke='{c}' stroke-width='1' points='{}'/>",
            pts.join(" "),
            b = top + panel - 12.0,
            r = W - PAD,
            t = top + 8.0,
        );
    }
    let _ = write!(
        s,
        "<text x='{}' y='{}' text-anchor='middle'>epochs {} to {} while replicated</text></svg>",
        W / 2.0,
        height - 4.0,
        p[0].epoch,
        p[p.len() - 1].epoch
    );
    Some(s)
}

/// The whole page for `rows`.
pub fn html(rows: &[RoundResult], command: &str) -> String {
    let mut s = String::from("<!doctype html><meta charset='utf-8'><title>tandem bench --replication</title><body style='font-family:sans-serif'>");
    let _ = write!(
        s,
        "<h1>tandem bench --replication</h1><p><code>{}</code></p>",
        esc(command)
    );
    s.push_str("<h2>Client latency while replicated (CDF)</h2>");
    match latency_cdf(rows) {
        Some(svg) => s.push_str(&svg),
        None => s.push_str("<p>No row had a latency-measuring client (kv).</p>"),
    }
    for r in rows {
        let _ = write!(
            s,
            "<h2>Epoch timeline: {}</h2><p>pause p50 {:.1} ms, {:.0} % of the time paused, {:.1} % suspended early; {} epochs</p>",
            esc(&label(r)),
            r.pause_ms_p50,
            r.pause_share * 100.0,
            r.suspend_share * 100.0,
            r.epochs_acked
        );
        if let Some(svg) = timeline(r) {
            s.push_str(&svg);
        }
    }
    s.push_str("</body>");
    s
}
