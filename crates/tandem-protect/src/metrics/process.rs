//! The series every daemon adds to its own: `tandem_info`, the standard `process_*` metrics
//! of Prometheus' client libraries (read from /proc/self), and the `vm` and `node` labels
//! that tell one VM's daemons from another's on a shared host.

use std::fmt::Write as _;

/// Prometheus' label value escaping: backslash, double quote and newline.
pub(super) fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `vm="ID",node="NAME"`: the node's name in etcd, else the host name.
pub(super) fn identity_labels(vm_id: u64, node: Option<&str>) -> String {
    let host;
    let node = match node {
        Some(n) => n,
        None => {
            host = rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned();
            &host
        }
    };
    format!("vm=\"{vm_id}\",node=\"{}\"", escape(node))
}

/// Adds `base` (`a="x",b="y"`) to the labels of every sample line of `text`.
pub(super) fn with_labels(text: &str, base: &str) -> String {
    if base.is_empty() {
        return text.to_string();
    }
    let mut o = String::with_capacity(text.len() + text.lines().count() * (base.len() + 3));
    for line in text.lines() {
        if line.starts_with('#') {
            o.push_str(line);
        } else {
            match line.find(['{', ' ']) {
                Some(i) if line.as_bytes()[i] == b'{' => {
                    let (name, rest) = line.split_at(i + 1);
                    let sep = if rest.starts_with('}') { "" } else { "," };
                    let _ = write!(o, "{name}{base}{sep}{rest}");
                }
                Some(i) => {
                    let (name, rest) = line.split_at(i);
                    let _ = write!(o, "{name}{{{base}}}{rest}");
                }
                None => o.push_str(line),
            }
        }
        o.push('\n');
    }
    o
}

/// `tandem_info` and the `process_*` families (without the identity labels).
pub(super) fn render(o: &mut String, role: &str) {
    let _ = writeln!(
        o,
        "# HELP tandem_info The daemon's version and current role, always 1.\n\
         # TYPE tandem_info gauge\n\
         tandem_info{{version=\"{}\",role=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION"),
        escape(role)
    );
    let Some(p) = Process::read() else {
        return;
    };
    let rows: [(&str, &str, String, &str); 7] = [
        (
            "process_cpu_seconds_total",
            "counter",
            format!("{:.2}", p.cpu_seconds),
            "Total user and system CPU time spent in seconds.",
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            p.resident_bytes.to_string(),
            "Resident memory size in bytes.",
        ),
        (
            "process_virtual_memory_bytes",
            "gauge",
            p.virtual_bytes.to_string(),
            "Virtual memory size in bytes.",
        ),
        (
            "process_start_time_seconds",
            "gauge",
            format!("{:.2}", p.start_time),
            "Start time of the process since unix epoch in seconds.",
        ),
        (
            "process_open_fds",
            "gauge",
            p.open_fds.to_string(),
            "Number of open file descriptors.",
        ),
        (
            "process_max_fds",
            "gauge",
            p.max_fds.to_string(),
            "Maximum number of open file descriptors.",
        ),
        (
            "process_threads",
            "gauge",
            p.threads.to_string(),
            "Number of OS threads in the process.",
        ),
    ];
    for (name, kind, v, help) in rows {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    }
}

/// What /proc says about this process.
struct Process {
    cpu_seconds: f64,
    resident_bytes: u64,
    virtual_bytes: u64,
    start_time: f64,
    open_fds: u64,
    max_fds: u64,
    threads: u64,
}

impl Process {
    fn read() -> Option<Process> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // proc(5) numbers fields from 1 (pid) and 2 (comm); `f[0]` is field 3 (state).
        let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        let tick = rustix::param::clock_ticks_per_second() as f64;
        let page = rustix::param::page_size() as u64;
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok())?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        let max_fds = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        Some(Process {
            cpu_seconds: (field(14)? + field(15)?) as f64 / tick,
            threads: field(20)?,
            start_time: boot as f64 + field(22)? as f64 / tick,
            virtual_bytes: field(23)?,
            resident_bytes: field(24)? * page,
            open_fds,
            max_fds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_added_to_every_sample() {
        let text = "# HELP a x\n# TYPE a gauge\na 1\nb{le=\"0.5\"} 2\nc{} 3\n";
        assert_eq!(
            with_labels(text, "vm=\"7\",node=\"n\""),
            "# HELP a x\n# TYPE a gauge\na{vm=\"7\",node=\"n\"} 1\n\
             b{vm=\"7\",node=\"n\",le=\"0.5\"} 2\nc{vm=\"7\",node=\"n\"} 3\n"
        );
        assert_eq!(identity_labels(3, Some("a\"b")), "vm=\"3\",node=\"a\\\"b\"");
    }

    #[test]
    fn process_metrics_come_from_proc() {
        let mut o = String::new();
        render(&mut o, "backup");
        assert!(o.contains("tandem_info{version=\""), "{o}");
        let p = Process::read().expect("/proc/self readable");
        assert!(p.resident_bytes > 0 && p.virtual_bytes >= p.resident_bytes);
        assert!(p.open_fds >= 3 && p.max_fds >= p.open_fds && p.threads >= 1);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(p.start_time <= now + 1.0 && p.start_time > now - 86400.0 * 365.0);
    }
}
