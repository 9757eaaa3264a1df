//! The gRPC layer: generated code, the client service and the peer service; and the framed
//! local session on the API unix socket (`local`).

pub mod batch_ranges;
pub mod blocks;
pub mod delivery;
pub mod dial;
pub mod finished_tags;
pub mod host_memory;
pub mod local;
pub mod node;
pub mod peer_service;
pub mod prepared;
pub mod proto;
pub mod reattach;
pub mod register_batch;
pub mod same_node;
pub mod same_node_registry;
pub mod service;
pub mod session;
pub mod state;
pub mod stats;
pub mod transfer_index;
pub mod transfers;
