//! `tcpxctl peer ...`: connecting to a peer daemon and listing the peers.

use serde_json::json;

use crate::cli::args::PeerCommand;
use crate::cli::error::{CliError, print_json, rpc};
use crate::cli::output::{peer_json, peers_table};
use crate::client::ApiClient;
use tcpxd::api::proto::v1::{ConnectPeerRequest, ListPeersRequest};

pub(super) async fn peer(client: &mut ApiClient, json: bool, cmd: PeerCommand) -> Result<(), CliError> {
    match cmd {
        PeerCommand::Connect(args) => {
            let peer = client
                .connect_peer(ConnectPeerRequest {
                    address: args.address.clone(),
                })
                .await
                .map_err(rpc(format!("connecting to peer {}", args.address)))?
                .into_inner();
            if json {
                print_json(&peer_json(&peer))?;
            } else {
                out!("{}", peers_table(std::slice::from_ref(&peer)));
            }
            Ok(())
        }
        PeerCommand::List => {
            let peers = client
                .list_peers(ListPeersRequest {})
                .await
                .map_err(rpc("listing peers"))?
                .into_inner()
                .peers;
            if json {
                print_json(&json!(peers.iter().map(peer_json).collect::<Vec<_>>()))?;
            } else if peers.is_empty() {
                outln!("no peers");
            } else {
                out!("{}", peers_table(&peers));
            }
            Ok(())
        }
    }
}
