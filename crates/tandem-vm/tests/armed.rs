//! Commands armed ahead on monitors of their own (`tandem_vm::qmp::Armed`), against stock
//! QEMU with no guest (the firmware runs): an armed command does not run until fired, runs
//! when fired, and the main monitor keeps working beside it.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::json;
use tandem_vm::qmp::{Armed, Qmp, QmpError};

struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn qemu(dir: &Path) -> (Qemu, Qmp) {
    let mut args: Vec<String> = ["-accel", "tcg", "-machine", "q35", "-m", "64"]
        .into_iter()
        .chain(["-nodefaults", "-display", "none", "-S"])
        .map(String::from)
        .collect();
    let main = dir.join("qmp.sock");
    args.extend([
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", main.display()),
    ]);
    args.extend(tandem_vm::qemu_args::armed_monitors(&main));
    let child = Command::new("qemu-system-x86_64")
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64 (./tandem setup installs it)");
    let q = Qemu(child);
    let qmp = Qmp::connect(&main, Duration::from_secs(20)).expect("main monitor");
    (q, qmp)
}

fn armed(dir: &Path, command: &'static str, args: Option<serde_json::Value>) -> Armed {
    let socket = tandem_vm::qemu_args::armed_socket(&dir.join("qmp.sock"), command);
    Armed::connect(&socket, command, args).expect("armed monitor")
}

#[test]
fn armed_commands_run_only_when_fired() {
    let dir = tempfile::tempdir().unwrap();
    let (_q, mut qmp) = qemu(dir.path());
    let mut stop = armed(dir.path(), "stop", None);
    let mut cont = armed(dir.path(), "cont", None);
    let state = dir.path().join("devstate");
    let args = json!({ "filename": state.to_string_lossy(), "live": false });
    let mut save = armed(dir.path(), "xen-save-devices-state", Some(args));
    for round in 0..3 {
        // Armed: parsed, not run.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            qmp.status().unwrap(),
            if round == 0 { "prelaunch" } else { "paused" }
        );
        cont.fire().unwrap();
        cont.reply().unwrap();
        assert!(
            cont.event_time_us("RESUME").is_some(),
            "RESUME before cont's reply"
        );
        cont.arm().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(qmp.status().unwrap(), "running");
        stop.fire().unwrap();
        stop.reply().unwrap();
        assert!(
            stop.event_time_us("STOP").is_some(),
            "STOP before stop's reply"
        );
        assert_eq!(qmp.status().unwrap(), "paused");
        let _ = std::fs::remove_file(&state);
        save.fire().unwrap();
        save.reply().unwrap();
        let saved = std::fs::read(&state).unwrap();
        assert_eq!(&saved[..4], b"QEVM", "round {round}: a device-state stream");
        // The guest stays stopped: `live: false` after a `stop`.
        assert_eq!(qmp.status().unwrap(), "paused");
        stop.arm().unwrap();
        save.arm().unwrap();
    }
    // The main monitor got every event; draining it keeps a reply read early for its
    // command.
    let sent = qmp.start("query-status", None).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    qmp.drain_events().unwrap();
    let events = qmp.take_events();
    assert!(events.iter().filter(|e| e["event"] == "STOP").count() >= 3);
    assert_eq!(qmp.reply(sent).unwrap()["status"], "paused");
}

#[test]
fn a_fired_command_left_unread_does_not_break_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let (q, mut qmp) = qemu(dir.path());
    let mut cont = armed(dir.path(), "cont", None);
    let mut stop = armed(dir.path(), "stop", None);
    cont.execute().unwrap();
    // Fired, reply never read (a pause abandoned), then fired again: the old reply is read
    // first, the command armed and run again.
    stop.fire().unwrap();
    stop.fire().unwrap();
    stop.reply().unwrap();
    assert_eq!(qmp.status().unwrap(), "paused");
    // A command QEMU refuses is an error, and the monitor stays usable.
    let mut bad = armed(
        dir.path(),
        "xen-save-devices-state",
        Some(json!({ "live": false })),
    );
    match bad.execute() {
        Err(QmpError::Command { .. }) => {}
        other => panic!("expected QEMU's refusal, got {other:?}"),
    }
    // Through its owner's slot: a refusal keeps the monitor.
    let mut slot = Some(bad);
    let refused = Armed::run_in(&mut slot, Armed::execute).unwrap();
    assert!(matches!(refused, Err(QmpError::Command { .. })));
    assert!(slot.is_some());
    cont.execute().unwrap();
    assert_eq!(qmp.status().unwrap(), "running");
    assert!(!stop.broken());
    // QEMU gone: an error, and the monitor is never used again (a late reply could be
    // taken for the next command's).
    drop(q);
    assert!(stop.execute().is_err());
    assert!(stop.broken());
    assert!(stop.fire().is_err());
    // Its owner drops a broken one: the main monitor takes the command from then on.
    let mut slot = Some(cont);
    assert!(Armed::run_in(&mut slot, Armed::execute).unwrap().is_err());
    assert!(slot.is_none());
    assert!(Armed::run_in(&mut slot, Armed::execute).is_none());
}
