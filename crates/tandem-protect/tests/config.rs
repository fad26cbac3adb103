//! The daemons' configurations are plain data: written as TOML and read back unchanged, and
//! an operator's file with humantime durations reads as meant.

use std::time::Duration;

use tandem_protect::backup::BackupConfig;
use tandem_protect::checkpoint::SaveConfig;
use tandem_protect::node::NodeConfig;
use tandem_protect::primary::PrimaryConfig;
use tandem_protect::VmSpec;

fn round_trip<T: serde::Serialize + serde::de::DeserializeOwned>(c: &T) {
    let text = toml::to_string(c).unwrap();
    let back: T = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(
        serde_json::to_value(c).unwrap(),
        serde_json::to_value(&back).unwrap(),
        "{text}"
    );
}

#[test]
fn every_config_reads_back_what_it_wrote() {
    let mut vm = VmSpec::described("/etc/tandem/db.toml");
    vm.mem = 512;
    let mut p = PrimaryConfig::new("10.0.0.2:7001", vm);
    p.adaptive = Some(Default::default());
    p.stall = Some(Duration::from_millis(2500));
    p.fence = Some(tandem_fence::FenceConfig::new(
        vec!["http://10.0.0.9:2379".into()],
        1,
        "primary@a",
    ));
    round_trip(&p);
    let mut b = BackupConfig::new("0.0.0.0:7001", "/dev/shm/tandem-vm1", VmSpec::default());
    b.consolidate = Some(Default::default());
    round_trip(&b);
    round_trip(&NodeConfig::new(p, b));
    round_trip(&SaveConfig::new(
        "/var/lib/tandem/store",
        VmSpec::described("/etc/tandem/vm.toml"),
    ));
}

#[test]
fn an_operators_file_reads_as_meant() {
    let b: BackupConfig = toml::from_str(
        r#"
        listen = "10.0.0.2:7002"
        dir = "/dev/shm/tandem-vm2"
        vm_id = 2
        timeout = "250ms"
        [vm]
        vm_config = "/etc/tandem/web.toml"
        [fence]
        endpoints = ["https://10.0.0.9:2379"]
        vm_id = 2
        node = "backup@b"
        watch_every = "1s"
        [tls]
        ca = "/etc/tandem/ca.pem"
        cert = "/etc/tandem/backup.pem"
        key = "/etc/tandem/backup.key"
        "#,
    )
    .unwrap();
    assert_eq!(b.timeout, Duration::from_millis(250));
    assert_eq!(b.vm_id, 2);
    let f = b.fence.unwrap();
    assert_eq!(
        (f.watch_every, f.request_timeout),
        (Duration::from_secs(1), Duration::from_millis(300))
    );
    assert_eq!(
        b.tls.unwrap().key,
        std::path::PathBuf::from("/etc/tandem/backup.key")
    );
    // A misspelt key is an error that names it, not a silently ignored setting.
    let e = toml::from_str::<BackupConfig>("listen = \"a:1\"\ndir = \"/x\"\ntimeout_ms = 5\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("timeout_ms"), "{e}");
    let e = toml::from_str::<BackupConfig>("timeout = \"5 parsecs\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("timeout") || e.contains("parsecs"), "{e}");
}
