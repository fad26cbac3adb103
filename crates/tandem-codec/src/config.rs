//! The codecs and the encoder's configuration.

use crate::strategies::Budget;

/// The codecs: tandem's default and every baseline / paper technique alone. In configuration
/// files a codec is its command-line name ([`Codec::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Codec {
    /// Remus: every dirty page raw.
    Remus,
    /// QEMU XBZRLE: 64 MiB direct-mapped cache, XOR + zero/non-zero runs, zero pages.
    Xbzrle,
    /// Attribution control: XBZRLE's runs followed by one zstd pass over the whole record at
    /// tandem's level (without its reference prefix), which shows how much comes from the
    /// generic compressor alone.
    XbzrleZstd,
    /// zstd level 1 over the whole dirty pages.
    Zstd,
    /// LZ4 over the whole dirty pages.
    Lz4,
    /// FITDOC: 8-byte-word delta against an LRU buffer of previous versions.
    Fitdoc,
    /// FGBI: 64-byte block hashes, block sharing, hybrid compression.
    Fgbi,
    /// Gerofi et al.: popcount similarity of 512-byte areas over recently dirtied pages.
    Gerofi,
    /// Gerofi et al. searching all of the VM's memory, as in the paper (a full mirror).
    GerofiFull,
    /// Difference Engine: sharing, HashSimilarityDetector(2,1) patching, compression.
    De,
    /// Difference Engine over all of the VM's memory, as in the paper (a full mirror).
    DeFull,
    /// tandem's default: combines the techniques within a CPU budget.
    Tandem,
    /// tandem's previous default (no reference prefix), kept to compare in the same run.
    TandemV1,
}

impl Codec {
    /// All codecs, baselines first.
    pub const ALL: [Codec; 13] = [
        Codec::Remus,
        Codec::Xbzrle,
        Codec::XbzrleZstd,
        Codec::Zstd,
        Codec::Lz4,
        Codec::Fitdoc,
        Codec::Fgbi,
        Codec::Gerofi,
        Codec::GerofiFull,
        Codec::De,
        Codec::DeFull,
        Codec::TandemV1,
        Codec::Tandem,
    ];

    /// Name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Remus => "remus",
            Codec::Xbzrle => "xbzrle",
            Codec::XbzrleZstd => "xbzrle+zstd",
            Codec::Zstd => "zstd1",
            Codec::Lz4 => "lz4",
            Codec::Fitdoc => "fitdoc",
            Codec::Fgbi => "fgbi",
            Codec::Gerofi => "gerofi",
            Codec::GerofiFull => "gerofi-full",
            Codec::De => "de",
            Codec::DeFull => "de-full",
            Codec::Tandem => "tandem",
            Codec::TandemV1 => "tandem-v1",
        }
    }

    /// The paper technique this codec runs (the `-full` variants run their paper's).
    pub(crate) fn strategy(self) -> Codec {
        match self {
            Codec::XbzrleZstd => Codec::Xbzrle,
            Codec::GerofiFull => Codec::Gerofi,
            Codec::DeFull => Codec::De,
            c => c,
        }
    }

    /// Whether the codec keeps every page's previous version regardless of `Config`.
    pub(crate) fn full(self) -> bool {
        matches!(self, Codec::GerofiFull | Codec::DeFull)
    }
}

impl TryFrom<String> for Codec {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Codec> for String {
    fn from(c: Codec) -> String {
        c.name().to_string()
    }
}

impl std::str::FromStr for Codec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Codec::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown codec {s:?}; known: {}",
                    Codec::ALL.map(|c| c.name()).join(", ")
                )
            })
    }
}

/// Encoder configuration.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Worker threads (output does not depend on it).
    pub threads: usize,
    /// Fewest pages per worker thread before an epoch is split across threads.
    pub min_pages_per_thread: usize,
    /// Bound of the previous-version store (XBZRLE cache, FITDOC buffer, DE and tandem store).
    pub cache_bytes: usize,
    /// Gerofi's recently-dirtied-pages cache, in pages.
    pub rdp_pages: usize,
    /// Bits of the similarity tables (Gerofi's content table, DE's two detector tables): 18 as
    /// in both papers.
    pub index_bits: u32,
    /// Keep every page's previous version (memory = guest size) instead of a bounded store.
    pub full_mirror: bool,
    /// tandem strategy knobs.
    pub budget: Budget,
    /// zstd level for data sections.
    pub zstd_level: i32,
    /// tandem: prefix and payload bytes per zstd frame. A larger record is cut, at entry
    /// boundaries, into frames of about this size, each with the prefix pages of its own
    /// entries, which `threads` compress in parallel. Depends on the input only, so the output
    /// does not depend on the thread count. Frames cannot reference each other's prefix:
    /// 4 MiB frames cost 48 % more bytes on 500 ms `sqlite` epochs, so the default keeps
    /// ordinary epochs in one frame and bounds only very large ones.
    pub frame_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            threads: 1,
            min_pages_per_thread: 512,
            cache_bytes: 64 << 20,
            rdp_pages: 5120,
            index_bits: 18,
            full_mirror: false,
            budget: Budget::default(),
            zstd_level: 1,
            frame_bytes: 32 << 20,
        }
    }
}
