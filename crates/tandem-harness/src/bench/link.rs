//! `tandem bench --link`: what mutual TLS costs on the replication link, measured side by side
//! with plain TCP in the same run, over loopback (no rate limit): bulk throughput of epoch-sized
//! writes (what a checkpoint's transfer takes) and the round trip of a small frame (what an
//! acknowledgement adds to output latency). Both go through the daemons' own `Conn` (the TLS
//! pump included), so the figure is the daemons' cost, not rustls' alone.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tandem_protect::conn::Conn;
use tandem_protect::tls;

#[derive(Serialize)]
struct LinkRow {
    link: &'static str,
    /// MiB/s of 1 MiB writes, median of the runs.
    bulk_mib_s: f64,
    /// Round trip of a 64-byte message and its 16-byte reply, median (µs).
    rtt_us_p50: f64,
    rtt_us_p99: f64,
    /// CPU time of the whole process per MiB moved (both ends and the pumps), ms.
    cpu_ms_per_mib: f64,
}

fn cpu_ms() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage writes a full rusage into the pointer it is given.
    let r = unsafe { libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr()) };
    if r != 0 {
        return 0.0;
    }
    // SAFETY: initialised by the successful call above.
    let u = unsafe { u.assume_init() };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(u.ru_utime) + ms(u.ru_stime)
}

struct Pair {
    client: Conn,
    server: Conn,
}

fn pair(keys: Option<&std::path::Path>) -> anyhow::Result<Pair> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?.to_string();
    let cfgs = match keys {
        Some(k) => Some((
            tls::server_config(&tls::TlsFiles::in_dir(k, "backup"))?,
            tls::client_config(&tls::TlsFiles::in_dir(k, "primary"))?,
        )),
        None => None,
    };
    let server_cfg = cfgs.as_ref().map(|c| c.0.clone());
    let srv = std::thread::spawn(move || -> anyhow::Result<Conn> {
        let (s, _) = l.accept()?;
        s.set_nodelay(true)?;
        Ok(match server_cfg {
            Some(c) => tls::accept(s, &c, Duration::from_secs(5))?,
            None => Conn::plain(s)?,
        })
    });
    let tcp = TcpStream::connect(&addr)?;
    tcp.set_nodelay(true)?;
    let client = match &cfgs {
        Some((_, c)) => tls::connect(
            tcp,
            c,
            tls::server_name(&addr, None)?,
            Duration::from_secs(5),
        )?,
        None => Conn::plain(tcp)?,
    };
    let server = srv.join().map_err(|_| anyhow::anyhow!("server thread"))??;
    Ok(Pair { client, server })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measure(
    name: &'static str,
    keys: Option<&std::path::Path>,
    mib: usize,
) -> anyhow::Result<LinkRow> {
    let mut rates = Vec::new();
    let mut cpu = Vec::new();
    for _ in 0..5 {
        let Pair { mut client, server } = pair(keys)?;
        let mut server = server;
        let sink = std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            let mut n = 0u64;
            while let Ok(k) = server.read(&mut buf) {
                if k == 0 {
                    break;
                }
                n += k as u64;
            }
            n
        });
        let chunk: Vec<u8> = (0..1 << 20).map(|i| (i * 31 % 253) as u8).collect();
        let (t, c) = (Instant::now(), cpu_ms());
        for _ in 0..mib {
            client.write_all(&chunk)?;
        }
        client.shutdown_write();
        let got = sink.join().map_err(|_| anyhow::anyhow!("sink thread"))?;
        let secs = t.elapsed().as_secs_f64();
        anyhow::ensure!(got == (mib << 20) as u64, "{name}: {got} bytes arrived");
        rates.push(mib as f64 / secs);
        cpu.push((cpu_ms() - c) / mib as f64);
    }
    let Pair {
        mut client,
        mut server,
    } = pair(keys)?;
    let echo = std::thread::spawn(move || {
        let mut m = [0u8; 64];
        while server.read_exact(&mut m).is_ok() {
            if server
                .write_all(&m[..16])
                .and_then(|()| server.flush())
                .is_err()
            {
                break;
            }
        }
    });
    let mut rtt = Vec::with_capacity(2000);
    let (m, mut r) = ([7u8; 64], [0u8; 16]);
    for _ in 0..2000 {
        let t = Instant::now();
        client.write_all(&m)?;
        client.read_exact(&mut r)?;
        rtt.push(t.elapsed().as_secs_f64() * 1e6);
    }
    client.shutdown();
    let _ = echo.join();
    rtt.sort_by(f64::total_cmp);
    Ok(LinkRow {
        link: name,
        bulk_mib_s: median(&mut rates),
        rtt_us_p50: rtt[rtt.len() / 2],
        rtt_us_p99: rtt[rtt.len() * 99 / 100],
        cpu_ms_per_mib: median(&mut cpu),
    })
}

/// Runs the link benchmark.
pub fn run(json: bool, mib: usize) -> anyhow::Result<()> {
    let keys = tempfile::tempdir().context("a directory for the lab keys")?;
    tls::generate(keys.path(), &["127.0.0.1".into()], None)?;
    let rows = vec![
        measure("plain TCP", None, mib)?,
        measure(
            "mutual TLS (rustls, TLS 1.3, AES-GCM via ring)",
            Some(keys.path()),
            mib,
        )?,
    ];
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "replication link over loopback, {mib} MiB in 1 MiB writes (median of 5) and 2000 round trips of 64 B"
    );
    for r in &rows {
        println!(
            "  {:<48} {:>8.0} MiB/s  {:>6.2} ms CPU/MiB  round trip p50 {:>6.1} µs p99 {:>6.1} µs",
            r.link, r.bulk_mib_s, r.cpu_ms_per_mib, r.rtt_us_p50, r.rtt_us_p99
        );
    }
    let (p, t) = (&rows[0], &rows[1]);
    println!(
        "  TLS / plain: throughput {:.2}x, CPU per MiB {:.1}x, round trip +{:.0} µs",
        t.bulk_mib_s / p.bulk_mib_s,
        t.cpu_ms_per_mib / p.cpu_ms_per_mib,
        t.rtt_us_p50 - p.rtt_us_p50
    );
    Ok(())
}
