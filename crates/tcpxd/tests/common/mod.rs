#![allow(dead_code)] // each test binary uses a different part of the shared helpers

//! Shared by the daemon's integration tests: daemons in process and as processes, the framed
//! local session, metrics scrapes (where the build put the plugin and the tools: `tcpxd-testkit`).

pub mod batches;
pub mod daemons;
pub mod framed;
pub mod procs;
pub mod scrape;
