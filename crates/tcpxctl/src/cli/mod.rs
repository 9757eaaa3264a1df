//! tcpxctl's client side: subcommand definitions, their implementations, the two-daemon demo,
//! output formatting and transfer following. The binary (`src/main.rs`) only parses and
//! dispatches, so integration tests can drive the same code (notably [`demo::run_demo`]).

pub mod args;
pub mod bench;
pub mod commands;
pub mod demo;
pub mod error;
pub mod node;
pub mod output;
pub mod transfer;
