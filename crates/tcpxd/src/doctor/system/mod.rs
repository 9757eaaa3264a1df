//! The host checks: mounts, TCPX settings, NICs, the kernel log, RxDM, GPUs, memlock and ports.
//!
//! One file per check (or pair of checks on one subject): `mounts` (`plugin.noexec`), `env`
//! (`env.chunk_size`, `env.tcpx`), `nics` (`nics`, `nics.data_split`), `kernel` (`kernel.devmem`),
//! `rxdm` (`rxdm.sockets`), `gpus`, `memlock`, `ports`.

mod env;
mod gpus;
mod kernel;
mod memlock;
mod mounts;
mod nics;
mod ports;
mod rxdm;

pub use env::{check_chunk_size, check_tcpx_env, parse_recommended_env};
pub use gpus::{check_gpus, proc_gpus};
pub use kernel::check_kernel_log;
pub use memlock::check_memlock;
pub use mounts::check_noexec;
pub use nics::{check_data_split, check_nics};
pub use ports::check_ports;
pub use rxdm::check_rxdm;
