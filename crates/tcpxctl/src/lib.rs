//! tcpxd's tools, behind the `tcpxctl` binary: the client of the daemon's API and the CLI over it,
//! the benchmarks, the two-daemon demo and the plugin conformance suite.
//!
//! They use the daemon as a library (`tcpxd`): its API types and token file for the client, and
//! its data path (`tcpxd::net`, `gpu`, `unpack`) where a tool drives the plugin itself
//! (`bench raw`, `conformance`, `tcpxd-unpack-bench`). The daemon depends on nothing here.

pub mod bench;
pub mod cli;
pub mod client;
pub mod conformance;
