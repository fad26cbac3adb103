//! VM control for tandem: start stock QEMU with guest RAM in a shared file, talk QMP, log dirty
//! pages from outside QEMU, capture and restore device state.

#![warn(missing_docs)]

pub mod adopt;
mod config;
pub mod console;
pub mod desc;
pub mod devstate;
pub mod dirty;
pub mod epoch;
pub mod extra_args;
pub mod mirror;
pub mod private;
pub mod qemu_args;
pub mod qmp;
pub mod ram;
pub mod schedule;
pub mod stale;
pub mod vcpu;
pub mod vm;

pub use desc::{Boot, DiskBus, DiskDesc, DiskFormat, NicDesc, NicNet, PciAddr};
pub use dirty::{DirtyLog, HashLog, ReplayLog, UffdWpLog};
pub use epoch::{Epoch, EpochSink, Guest};
pub use mirror::{MirrorHealth, MirrorSlice};
pub use private::{private_dir, PrivateDirError};
pub use ram::{GuestRam, MirrorFile, PAGE_SIZE};
pub use stale::{clean_stale, TMPFS};
pub use vm::{DirtyMode, LazyRam, PauseTiming, Vm, VmConfig, VmError};
