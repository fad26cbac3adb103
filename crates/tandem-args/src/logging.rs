//! Logging set-up shared by both binaries: human-readable lines on stderr, coloured only on a
//! terminal, and with syslog priority prefixes (`<3>` … `<7>`, sd-daemon(3)) when stderr is
//! connected to the journal, so that `journalctl -p warning` finds tandem's warnings and no
//! escape sequences land in the journal.

use std::io::IsTerminal;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::registry::LookupSpan;

/// Where stderr goes, which decides the format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sink {
    /// A terminal: colour.
    Terminal,
    /// systemd's journal (`JOURNAL_STREAM` names stderr): priority prefixes, no colour, no
    /// timestamp (the journal has its own).
    Journal,
    /// Anything else (a file, a pipe): plain lines.
    Plain,
}

/// What stderr is connected to.
pub fn sink() -> Sink {
    if journal_stream() {
        Sink::Journal
    } else if std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none() {
        Sink::Terminal
    } else {
        Sink::Plain
    }
}

/// systemd sets `JOURNAL_STREAM=DEV:INODE` for a service whose stdout or stderr is the
/// journal; it is ours only if stderr is that very stream (a child with redirected stderr
/// inherits the variable).
fn journal_stream() -> bool {
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.to_str().and_then(|v| v.split_once(':')) else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    match rustix::fs::fstat(std::io::stderr()) {
        Ok(st) => st.st_dev == dev && st.st_ino == ino,
        Err(_) => false,
    }
}

/// The sd-daemon(3) priority of a level: err, warning, info, debug.
pub fn priority(level: Level) -> u8 {
    match level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// Prefixes every event with its priority for the journal.
struct Prioritised<F>(F);

impl<S, N, F> FormatEvent<S, N> for Prioritised<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        write!(writer, "<{}>", priority(*event.metadata().level()))?;
        self.0.format_event(ctx, writer, event)
    }
}

/// Installs the global subscriber: `filter` is an `EnvFilter` directive (RUST_LOG wins).
pub fn init(filter: &str) {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| filter.to_string());
    let filter = tracing_subscriber::EnvFilter::new(filter);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match sink() {
        Sink::Terminal => builder.init(),
        Sink::Plain => builder.with_ansi(false).init(),
        Sink::Journal => builder
            .with_ansi(false)
            .event_format(Prioritised(format::format().without_time()))
            .init(),
    }
}

/// Prints the error that ends the process, with the journal's `err` priority when stderr is
/// the journal.
pub fn report_error(e: &dyn std::fmt::Display) {
    let prefix = if sink() == Sink::Journal { "<3>" } else { "" };
    eprintln!("{prefix}error: {e}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_follow_syslog() {
        assert_eq!(priority(Level::ERROR), 3);
        assert_eq!(priority(Level::WARN), 4);
        assert_eq!(priority(Level::INFO), 6);
        assert_eq!(priority(Level::DEBUG), 7);
        assert_eq!(priority(Level::TRACE), 7);
    }
}
