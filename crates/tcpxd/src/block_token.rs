//! Block-list tokens: what another node needs to name a list of this node's blocks and reach its
//! daemon, as a descriptor does for a buffer:
//! `tcpxd1b:<node>:<list id>:<blocks>:<block length, 0 when they differ>:<key hex>[@<peer address>,…]`.
//!
//! The key is the list's buffer's access key, so a rekey of the buffer makes every token of its
//! lists stale. The block length lets a sender check each pair's lengths before anything is sent
//! when the list's blocks are all of one size (docs/BLOCKS.md).

use crate::buffers::MAX_DESCRIPTOR_BYTES;
use crate::engine::EngineError;

const TOKEN_PREFIX: &str = "tcpxd1b";

#[derive(Clone, PartialEq, Eq)]
pub struct BlockToken {
    pub node_id: String,
    pub list_id: u64,
    /// Blocks in the list.
    pub blocks: u32,
    /// The length of every block, or 0 when they differ.
    pub block_len: u32,
    pub key: [u8; 16],
    /// Where the node's peer service can be dialled (host:port each); may be empty.
    pub addresses: Vec<String>,
}

impl std::fmt::Debug for BlockToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BlockToken({}:{}, {} blocks of {}, at {:?})",
            self.node_id, self.list_id, self.blocks, self.block_len, self.addresses
        )
    }
}

impl BlockToken {
    pub fn encode(&self) -> String {
        let mut s = format!(
            "{TOKEN_PREFIX}:{}:{}:{}:{}:{}",
            self.node_id,
            self.list_id,
            self.blocks,
            self.block_len,
            hex::encode(self.key)
        );
        if !self.addresses.is_empty() {
            s.push('@');
            s.push_str(&self.addresses.join(","));
        }
        s
    }

    /// Parses a token; the error names the field and what is malformed (never echoing the key).
    pub fn parse(field: &str, s: &str) -> Result<BlockToken, EngineError> {
        let bad = |why: &str| EngineError::invalid(format!("{field}: malformed block-list token: {why}"));
        if s.len() > MAX_DESCRIPTOR_BYTES {
            return Err(EngineError::invalid(format!(
                "{field}: {} bytes, over the limit of {MAX_DESCRIPTOR_BYTES} for a token",
                s.len()
            )));
        }
        let (head, addresses) = match s.split_once('@') {
            Some((head, tail)) => (head, Some(tail)),
            None => (s, None),
        };
        let parts: Vec<&str> = head.split(':').collect();
        if parts.len() != 6 || parts[0] != TOKEN_PREFIX {
            return Err(bad(
                "expected tcpxd1b:<node>:<list id>:<blocks>:<block length>:<32 hex digits>[@<host:port>,…]",
            ));
        }
        if crate::config::check_node_id(parts[1]).is_err() {
            return Err(bad("invalid node id"));
        }
        let list_id = parts[2].parse().map_err(|_| bad("list id is not a number"))?;
        let blocks = parts[3]
            .parse()
            .map_err(|_| bad("block count is not a 32-bit number"))?;
        let block_len = parts[4]
            .parse()
            .map_err(|_| bad("block length is not a 32-bit number"))?;
        if blocks == 0 {
            return Err(bad("a list has at least one block"));
        }
        let raw = hex::decode(parts[5]).map_err(|_| bad("access key is not hex"))?;
        let key: [u8; 16] = raw.try_into().map_err(|_| bad("access key is not 16 bytes"))?;
        let addresses: Vec<String> = match addresses {
            None => Vec::new(),
            Some(tail) => tail.split(',').map(str::to_string).collect(),
        };
        crate::advertise::check_peer_addresses("peer address", &addresses).map_err(|why| bad(&why))?;
        Ok(BlockToken {
            node_id: parts[1].to_string(),
            list_id,
            blocks,
            block_len,
            key,
            addresses,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_malformed_ones_are_named() {
        let t = BlockToken {
            node_id: "node-a.1".into(),
            list_id: 7,
            blocks: 1 << 20,
            block_len: 16384,
            key: [0xCD; 16],
            addresses: vec!["10.0.0.2:50052".into(), "[fd00::2]:50052".into()],
        };
        let s = t.encode();
        assert_eq!(
            s,
            format!(
                "tcpxd1b:node-a.1:7:1048576:16384:{}@10.0.0.2:50052,[fd00::2]:50052",
                "cd".repeat(16)
            )
        );
        assert_eq!(BlockToken::parse("remote_token", &s).unwrap(), t);
        let bare = BlockToken {
            addresses: Vec::new(),
            block_len: 0,
            ..t.clone()
        };
        assert_eq!(BlockToken::parse("remote_token", &bare.encode()).unwrap(), bare);
        let key = "ab".repeat(16);
        for (bad, why) in [
            (String::new(), "expected tcpxd1b:"),
            (format!("tcpxd1:a:1:2:{key}"), "expected tcpxd1b:"),
            (format!("tcpxd1b:a:1:2:3:{key}:x"), "expected tcpxd1b:"),
            (format!("tcpxd1b:a b:1:2:3:{key}"), "invalid node id"),
            (format!("tcpxd1b:a:x:2:3:{key}"), "list id"),
            (format!("tcpxd1b:a:1:4294967296:3:{key}"), "block count"),
            (format!("tcpxd1b:a:1:0:3:{key}"), "at least one block"),
            (format!("tcpxd1b:a:1:2:-3:{key}"), "block length"),
            ("tcpxd1b:a:1:2:3:zz".to_string(), "not hex"),
            ("tcpxd1b:a:1:2:3:abab".to_string(), "not 16 bytes"),
            (format!("tcpxd1b:a:1:2:3:{key}@"), "malformed"),
            (format!("tcpxd1b:a:1:2:3:{key}@10.0.0.2"), "malformed"),
        ] {
            let e = BlockToken::parse("remote_token", &bad).unwrap_err();
            assert!(
                e.message.starts_with("remote_token: malformed block-list token") && e.message.contains(why),
                "{bad:?}: {}",
                e.message
            );
            assert!(!e.message.contains(&key), "the key is never echoed");
        }
        let long = format!("tcpxd1b:a:1:2:3:{key}@{}", "h:1,".repeat(700));
        assert!(
            BlockToken::parse("remote_token", &long)
                .unwrap_err()
                .message
                .contains("over the limit")
        );
    }
}
