//! libvirt stays in the loop (docs/VM_DESCRIPTION.md, "libvirt"): a domain tandem adopted
//! stays defined in libvirt, marked — its autostart off, a `<tandem:vm>` element in its
//! metadata and a title saying that tandem runs it — and libvirt's `qemu` hook
//! (dist/libvirt/qemu, which runs `tandem vm libvirt-hook`) refuses to start a marked domain:
//! two QEMUs would run one guest on the same disks. `virsh list --all --title` shows every
//! adopted domain; `virsh start` of one says who runs it and how to take it back.

use roxmltree::Document;
use tandem_vm::adopt::Libvirt;

/// The namespace of tandem's element in a domain's `<metadata>`.
pub const XMLNS: &str = "https://tandem.dev/xmlns/vm/1";

/// Marking a domain failed (the guest runs under tandem regardless).
#[derive(Debug, thiserror::Error)]
#[error("marking libvirt domain {domain} as protected by tandem ({step})")]
pub struct MarkError {
    domain: String,
    step: &'static str,
    #[source]
    source: tandem_vm::qmp::QmpError,
}

/// Marks `l`'s domain as run by tandem (VM `vm`, on node `node`): autostart off, metadata,
/// title. Its persistent definition changes only; the guest already runs in tandem's QEMU.
pub fn mark_protected(l: &Libvirt, vm: &str, node: &str) -> Result<(), MarkError> {
    let err = |step| {
        move |source| MarkError {
            domain: l.domain.clone(),
            step,
            source,
        }
    };
    l.run(["autostart", "--disable", &l.domain])
        .map_err(err("turning autostart off"))?;
    let element = format!(
        "<vm name=\"{}\" node=\"{}\"/>",
        xml_escape(vm),
        xml_escape(node)
    );
    l.run([
        "metadata", &l.domain, "--config", "--uri", XMLNS, "--key", "tandem", "--set", &element,
    ])
    .map_err(err("setting its metadata"))?;
    l.run([
        "desc",
        &l.domain,
        "--config",
        "--title",
        "--new-desc",
        &format!(
            "protected by tandem (adopted on {node}; `tandem list` says where it runs; the hook refuses to start it here)"
        ),
    ])
    .map_err(err("setting its title"))?;
    Ok(())
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The bridge of libvirt network `net` (`virsh net-dumpxml`: its `<bridge name>`), asked
/// through `l`'s connection; None if libvirt does not know it or it has no bridge.
pub fn network_bridge(l: &Libvirt, net: &str) -> Option<String> {
    let xml = l.run(["net-dumpxml", net]).ok()?;
    let doc = Document::parse(&xml).ok()?;
    let b = doc
        .descendants()
        .find(|n| {
            n.tag_name().name() == "bridge"
                && n.parent_element()
                    .is_some_and(|p| p.tag_name().name() == "network")
        })?
        .attribute("name")?
        .to_string();
    Some(b)
}

/// The tandem VM a domain XML is marked with (its name and the node that adopted it).
pub fn marked(xml: &str) -> Option<(String, String)> {
    let doc = Document::parse(xml).ok()?;
    let vm = doc
        .descendants()
        .find(|n| n.tag_name().name() == "vm" && n.tag_name().namespace() == Some(XMLNS))?;
    Some((
        vm.attribute("name").unwrap_or("?").to_string(),
        vm.attribute("node").unwrap_or("?").to_string(),
    ))
}

/// libvirt's `qemu` hook (`/etc/libvirt/hooks/qemu DOMAIN OPERATION SUB-OPERATION EXTRA`,
/// the domain XML on standard input): Err with the refusal libvirt shows when a marked
/// domain is about to start.
pub fn hook(args: &[String], xml: &str) -> Result<(), String> {
    let op = args.get(1).map(String::as_str).unwrap_or("");
    let sub = args.get(2).map(String::as_str).unwrap_or("");
    if !(op == "prepare" && sub == "begin") {
        return Ok(());
    }
    match marked(xml) {
        None => Ok(()),
        Some((vm, node)) => {
            let domain = args.first().map(String::as_str).unwrap_or("?");
            Err(format!(
                "domain {domain} is protected by tandem (adopted as {vm} on {node}); its guest runs under tandem, and a second QEMU on its disks would corrupt them. \
                 `tandem list` says where it runs. To give it back to libvirt: end protection and shut the guest down where it runs (`systemctl kill -s SIGUSR1 tandem@VM`; a plain stop would hand it over to the backup instead), \
                 then remove the mark (virsh metadata {domain} --config --uri {XMLNS} --remove) and start it"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MARKED: &str = "<domain type='kvm'><name>web</name><metadata>\
        <tandem:vm xmlns:tandem='https://tandem.dev/xmlns/vm/1' name='web' node='a'/>\
        </metadata></domain>";

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_marked_domain_is_refused_at_prepare_only() {
        assert_eq!(marked(MARKED), Some(("web".into(), "a".into())));
        let e = hook(&args(&["web", "prepare", "begin", "-"]), MARKED).unwrap_err();
        assert!(
            e.contains("protected by tandem (adopted as web on a)") && e.contains("--remove"),
            "{e}"
        );
        for other in [
            ["web", "release", "end", "-"],
            ["web", "stopped", "end", "-"],
        ] {
            hook(&args(&other), MARKED).unwrap();
        }
    }

    #[test]
    fn an_unmarked_domain_starts() {
        let plain = "<domain type='kvm'><name>db</name><metadata>\
            <other:x xmlns:other='urn:x' name='db'/></metadata></domain>";
        assert_eq!(marked(plain), None);
        hook(&args(&["db", "prepare", "begin", "-"]), plain).unwrap();
        hook(&args(&["db", "prepare", "begin", "-"]), "not xml").unwrap();
    }

    #[test]
    fn names_are_escaped_in_the_mark() {
        assert_eq!(xml_escape("a\"<b>&"), "a&quot;&lt;b&gt;&amp;");
    }
}
