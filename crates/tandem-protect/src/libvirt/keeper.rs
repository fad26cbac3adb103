//! The adopted domain stays known to libvirt on both hosts (docs/VM_DESCRIPTION.md,
//! "libvirt"). The node that adopted it records its marked definition in etcd, next to the
//! VM's ownership record (`PREFIX/vm/ID/libvirt`, [`Recorded`]); every node serving as the
//! backup defines it in its own libvirt — marked, so the hook refuses to start it there too —
//! with its disks pointed at that node's copy of them (slices of `guest-disks.raw`, libvirt's
//! `<slices>`), the disks the guest runs from after a failover to it. `virsh list --all` then
//! shows the domain on both hosts, and once protection has ended (the guest stopped where it
//! ran) the host holding the newest disks can give the domain back to libvirt with `virsh
//! start` after removing the mark.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Weak;
use std::time::Duration;

use roxmltree::Document;
use tandem_vm::adopt::Libvirt;

use crate::disk_copy;
use crate::Status;

/// How often a node that has not defined the domain yet tries again.
const EVERY: Duration = Duration::from_secs(5);

/// A recorded definition larger than this is not one of ours.
const DOC_LIMIT: usize = 1 << 20;

/// The file in the copy's directory that the definition given to libvirt is written to (kept:
/// it is what this host's libvirt was told).
pub const FILE: &str = "libvirt-domain.xml";

/// What the adopting node records in etcd.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recorded {
    /// The domain's name.
    pub domain: String,
    /// The node that adopted it.
    pub node: String,
    /// When (Unix milliseconds).
    pub at_unix_ms: u64,
    /// Its persistent definition once marked (`virsh dumpxml --inactive`).
    pub xml: String,
}

impl Recorded {
    /// Reads what etcd holds (`key`, for the error).
    pub fn parse(key: &str, v: &[u8]) -> Result<Recorded, KeepError> {
        if v.len() > DOC_LIMIT {
            return Err(KeepError::TooLarge(key.to_string()));
        }
        serde_json::from_slice(v).map_err(|e| KeepError::Corrupt(key.to_string(), e))
    }
}

/// Giving this host's libvirt the domain failed (retried; the guest is not affected).
#[derive(Debug, thiserror::Error)]
pub enum KeepError {
    /// etcd could not be read.
    #[error("reading the recorded domain from etcd")]
    Etcd(#[from] tandem_fence::FenceError),
    /// The key holds something else.
    #[error("{0} holds something that is not a libvirt domain recorded by tandem; inspect it with `etcdctl get {0}`")]
    Corrupt(String, #[source] serde_json::Error),
    /// The key holds far too much.
    #[error("{0} holds more than {DOC_LIMIT} bytes: not a libvirt domain recorded by tandem")]
    TooLarge(String),
    /// The recorded domain is another one.
    #[error("etcd records libvirt domain {recorded:?} for this VM, but this node was told --libvirt {given:?}: give the adopted domain's name")]
    OtherDomain {
        /// What etcd holds.
        recorded: String,
        /// What this node was given.
        given: String,
    },
    /// The recorded XML does not parse.
    #[error("the recorded domain's XML does not parse")]
    Xml(#[from] roxmltree::Error),
    /// The disk copy's record could not be read.
    #[error("reading this node's disk copy record")]
    Copy(#[from] disk_copy::CopyError),
    /// libvirt refused or could not be reached.
    #[error("asking this host's libvirt")]
    Virsh(#[from] tandem_vm::qmp::QmpError),
    /// The definition could not be written for virsh.
    #[error("writing {0}")]
    Io(PathBuf, #[source] std::io::Error),
}

/// One writable disk of the description and where this node keeps its copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskAt {
    /// The disk's file or device in the description (and in the adopted domain).
    pub original: PathBuf,
    /// The file holding this node's copy.
    pub file: PathBuf,
    /// Where the disk starts in it.
    pub offset: u64,
    /// Its size.
    pub size: u64,
}

fn xml_attr(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('\'', "&apos;")
        .replace('"', "&quot;")
}

/// `xml` with every `<disk>` whose source is one of `at`'s originals pointed at its slice of
/// the copy (`type='file'`, a raw `<driver>`, `<source file><slices>`, no backing chain);
/// how many disks it changed.
pub fn point_disks_at_copy(xml: &str, at: &[DiskAt]) -> Result<(String, usize), roxmltree::Error> {
    let doc = Document::parse(xml)?;
    let mut edits: Vec<(Range<usize>, String)> = Vec::new();
    let mut changed = 0;
    let disks = doc.descendants().filter(|n| {
        n.has_tag_name("disk")
            && n.parent_element()
                .is_some_and(|p| p.has_tag_name("devices"))
    });
    for disk in disks {
        let Some(src) = disk.children().find(|c| c.has_tag_name("source")) else {
            continue;
        };
        let Some(from) = src.attribute("file").or_else(|| src.attribute("dev")) else {
            continue;
        };
        let Some(d) = at.iter().find(|d| d.original.as_os_str() == from) else {
            continue;
        };
        if let Some(t) = disk.attributes().find(|a| a.name() == "type") {
            if t.value() != "file" {
                edits.push((t.range_value(), "file".into()));
            }
        }
        match disk.children().find(|c| c.has_tag_name("driver")) {
            Some(drv) => match drv.attributes().find(|a| a.name() == "type") {
                Some(t) => edits.push((t.range_value(), "raw".into())),
                None => {
                    let at = drv.range().start + "<driver".len();
                    edits.push((at..at, " type='raw'".into()));
                }
            },
            None => {
                let at = src.range().start;
                edits.push((at..at, "<driver name='qemu' type='raw'/>".into()));
            }
        }
        edits.push((
            src.range(),
            format!(
                "<source file='{}'><slices><slice type='storage' offset='{}' size='{}'/></slices></source>",
                xml_attr(&d.file.to_string_lossy()),
                d.offset,
                d.size
            ),
        ));
        for b in disk.children().filter(|c| c.has_tag_name("backingStore")) {
            edits.push((b.range(), String::new()));
        }
        changed += 1;
    }
    // From the end, so earlier ranges stay valid; an insertion before a replacement at the
    // same place goes in after it.
    edits.sort_by_key(|(r, _)| (r.start, r.end));
    let mut out = xml.to_string();
    for (r, text) in edits.into_iter().rev() {
        out.replace_range(r, &text);
    }
    Ok((out, changed))
}

/// What one attempt did.
#[derive(Debug, PartialEq, Eq)]
pub enum Kept {
    /// Not yet: what is missing.
    Waiting(&'static str),
    /// libvirt here has the domain as it should (what was done).
    Done(String),
    /// libvirt here has an unmarked domain of that name: left alone.
    Unmarked,
}

/// One attempt: the recorded domain defined in `l`'s libvirt, its disks on this node's copy
/// in `dir` (`disks`: the description's disks by index).
pub fn keep_once(
    fence: &tandem_fence::Fence,
    l: &Libvirt,
    disks: &[PathBuf],
    dir: &Path,
) -> Result<Kept, KeepError> {
    let Some(raw) = fence.libvirt()? else {
        return Ok(Kept::Waiting(
            "the adopting node has not recorded the domain in etcd yet",
        ));
    };
    let rec = Recorded::parse(&fence.config().libvirt_key(), &raw)?;
    if rec.domain != l.domain {
        return Err(KeepError::OtherDomain {
            recorded: rec.domain,
            given: l.domain.clone(),
        });
    }
    let Some(copy) = disk_copy::read(dir)? else {
        return Ok(Kept::Waiting("this node has no copy of the disks yet"));
    };
    let at: Vec<DiskAt> = copy
        .slices
        .iter()
        .filter_map(|s| {
            disks.get(s.disk).map(|p| DiskAt {
                original: p.clone(),
                file: disk_copy::path(dir),
                offset: s.offset,
                size: s.size,
            })
        })
        .collect();
    let verb = match l.run(["dumpxml", "--inactive", &l.domain]) {
        Ok(here) if super::inloop::marked(&here).is_none() => return Ok(Kept::Unmarked),
        // Its disks name no original any more: it is defined on this node's copy already.
        Ok(here) if point_disks_at_copy(&here, &at)?.1 == 0 => {
            return Ok(Kept::Done(
                "already defined here on this node's copy".into(),
            ))
        }
        Ok(_) => "redefined",
        Err(e) if not_found(&e) => "defined",
        Err(e) => return Err(e.into()),
    };
    let (xml, n) = point_disks_at_copy(&rec.xml, &at)?;
    let file = dir.join(FILE);
    std::fs::write(&file, xml).map_err(|e| KeepError::Io(file.clone(), e))?;
    l.run([std::ffi::OsStr::new("define"), file.as_os_str()])?;
    Ok(Kept::Done(format!(
        "{verb} from its adopting node's definition ({} on {}), marked, {n} disk(s) on this node's copy {}",
        rec.domain,
        rec.node,
        disk_copy::path(dir).display()
    )))
}

fn not_found(e: &tandem_vm::qmp::QmpError) -> bool {
    let s = e.to_string();
    s.contains("failed to get domain") || s.contains("Domain not found")
}

/// Keeps trying [`keep_once`] every few seconds, in a thread, until it is done or `alive` is
/// dropped; says what it did (or, once per kind of failure, why not yet) through `status`.
pub(crate) fn spawn(
    cfg: tandem_fence::FenceConfig,
    l: Libvirt,
    disks: Vec<PathBuf>,
    dir: PathBuf,
    status: Status,
    alive: Weak<()>,
) {
    let fence = match tandem_fence::Fence::connect(cfg) {
        Ok(f) => f,
        Err(e) => {
            status.warn(format!(
                "libvirt domain {}: not defined on this host ({})",
                l.domain,
                crate::chain(&e)
            ));
            return;
        }
    };
    let _ = std::thread::Builder::new()
        .name("libvirt-keeper".into())
        .spawn(move || {
            let mut said = String::new();
            while alive.upgrade().is_some() {
                let why = match keep_once(&fence, &l, &disks, &dir) {
                    Ok(Kept::Done(what)) => {
                        status.info(format!("libvirt domain {}: {what}", l.domain));
                        return;
                    }
                    Ok(Kept::Unmarked) => {
                        status.warn(format!(
                            "libvirt domain {} exists on this host unmarked: left alone (not tandem's definition; the hook cannot guard it)",
                            l.domain
                        ));
                        return;
                    }
                    Ok(Kept::Waiting(why)) => why.to_string(),
                    Err(e) => crate::chain(&e),
                };
                if why != said {
                    status.info(format!(
                        "libvirt domain {}: not defined on this host yet: {why}; trying again every {} s",
                        l.domain,
                        EVERY.as_secs()
                    ));
                    said = why;
                }
                let t = std::time::Instant::now();
                while t.elapsed() < EVERY && alive.upgrade().is_some() {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    const XML: &str = "<domain type='kvm'>\n  <name>web</name>\n  <devices>\n\
        <disk type='file' device='disk'>\n<driver name='qemu' type='qcow2' cache='writeback'/>\n\
        <source file='/var/lib/libvirt/images/web.qcow2'/>\n<backingStore/>\n\
        <target dev='vda' bus='virtio'/>\n<address type='pci' domain='0x0000' bus='0x04' slot='0x00' function='0x0'/>\n</disk>\n\
        <disk type='block' device='disk'>\n<driver name='qemu'/>\n<source dev='/dev/vg/data'/>\n<target dev='vdb' bus='virtio'/>\n</disk>\n\
        <disk type='file' device='cdrom'>\n<source file='/iso/x.iso'/>\n<target dev='sda' bus='sata'/>\n<readonly/>\n</disk>\n\
        </devices>\n</domain>\n";

    fn at() -> Vec<DiskAt> {
        let f = PathBuf::from("/var/lib/tandem/web/guest-disks.raw");
        vec![
            DiskAt {
                original: "/var/lib/libvirt/images/web.qcow2".into(),
                file: f.clone(),
                offset: 0,
                size: 4 << 30,
            },
            DiskAt {
                original: "/dev/vg/data".into(),
                file: f,
                offset: 4 << 30,
                size: 1 << 30,
            },
        ]
    }

    #[test]
    fn disks_point_at_their_slices_of_the_copy() {
        let (out, n) = point_disks_at_copy(XML, &at()).unwrap();
        assert_eq!(n, 2);
        let doc = Document::parse(&out).unwrap();
        let disks: Vec<_> = doc
            .descendants()
            .filter(|n| n.has_tag_name("disk"))
            .collect();
        for (d, off) in disks[..2].iter().zip([0u64, 4 << 30]) {
            assert_eq!(d.attribute("type"), Some("file"), "{out}");
            let drv = d.children().find(|c| c.has_tag_name("driver")).unwrap();
            assert_eq!(drv.attribute("type"), Some("raw"));
            assert_eq!(drv.attribute("name"), Some("qemu"));
            let src = d.children().find(|c| c.has_tag_name("source")).unwrap();
            assert_eq!(
                src.attribute("file"),
                Some("/var/lib/tandem/web/guest-disks.raw")
            );
            let slice = src.descendants().find(|c| c.has_tag_name("slice")).unwrap();
            assert_eq!(slice.attribute("type"), Some("storage"));
            assert_eq!(slice.attribute("offset"), Some(off.to_string().as_str()));
            assert!(!d.children().any(|c| c.has_tag_name("backingStore")));
            // The rest of the disk is kept.
            assert!(d.children().any(|c| c.has_tag_name("target")));
        }
        assert_eq!(
            disks[0]
                .children()
                .find(|c| c.has_tag_name("driver"))
                .unwrap()
                .attribute("cache"),
            Some("writeback")
        );
        assert!(disks[0].children().any(|c| c.has_tag_name("address")));
        // The CD-ROM is not one of the copy's disks.
        assert!(out.contains("<source file='/iso/x.iso'/>"));
        // Once pointed at the copy, nothing is left to change.
        assert_eq!(point_disks_at_copy(&out, &at()).unwrap().1, 0);
    }

    #[test]
    fn a_disk_without_a_driver_gets_a_raw_one() {
        let xml = "<domain><devices><disk type='file' device='disk'><source file='/a b&amp;c'/>\
            <target dev='vda'/></disk></devices></domain>";
        let at = [DiskAt {
            original: "/a b&c".into(),
            file: "/copy/it's.raw".into(),
            offset: 1 << 20,
            size: 1 << 20,
        }];
        let (out, n) = point_disks_at_copy(xml, &at).unwrap();
        assert_eq!(n, 1);
        let doc = Document::parse(&out).unwrap();
        let src = doc
            .descendants()
            .find(|c| c.has_tag_name("source"))
            .unwrap();
        assert_eq!(src.attribute("file"), Some("/copy/it's.raw"));
        let drv = doc
            .descendants()
            .find(|c| c.has_tag_name("driver"))
            .unwrap();
        assert_eq!(drv.attribute("type"), Some("raw"));
    }

    #[test]
    fn a_recorded_domain_round_trips_and_garbage_is_named() {
        let r = Recorded {
            domain: "web".into(),
            node: "a".into(),
            at_unix_ms: 1,
            xml: XML.into(),
        };
        let v = serde_json::to_vec(&r).unwrap();
        assert_eq!(Recorded::parse("k", &v).unwrap(), r);
        let e = Recorded::parse("/tandem/vm/1/libvirt", b"nope").unwrap_err();
        assert!(
            e.to_string().contains("etcdctl get /tandem/vm/1/libvirt"),
            "{e}"
        );
        let big = vec![b' '; DOC_LIMIT + 1];
        assert!(matches!(
            Recorded::parse("k", &big),
            Err(KeepError::TooLarge(_))
        ));
    }
}
