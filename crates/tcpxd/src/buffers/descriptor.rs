//! A buffer's descriptor: what another node needs to address it and reach its daemon.

use crate::engine::EngineError;

/// What another node needs to address a buffer and reach its daemon:
/// `tcpxd1:<node>:<buffer id>:<size>:<key hex>[@<peer address>[,<peer address>…]]`. The
/// addresses (the daemon's `peer.advertise`) let a daemon that never met this node pair with it on
/// first use; a descriptor without them (from an older daemon) still parses.
#[derive(Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub node_id: String,
    pub buffer_id: u64,
    pub size: u64,
    pub key: [u8; 16],
    /// Where the node's peer service can be dialled (host:port each); may be empty.
    pub addresses: Vec<String>,
}

impl std::fmt::Debug for Descriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Descriptor({}:{}, {} bytes, at {:?})",
            self.node_id, self.buffer_id, self.size, self.addresses
        )
    }
}

const DESCRIPTOR_PREFIX: &str = "tcpxd1";
/// The longest descriptor accepted (5 fixed fields and 8 longest addresses fit).
pub const MAX_DESCRIPTOR_BYTES: usize = 2560;

impl Descriptor {
    pub fn encode(&self) -> String {
        let mut s = format!(
            "{DESCRIPTOR_PREFIX}:{}:{}:{}:{}",
            self.node_id,
            self.buffer_id,
            self.size,
            hex::encode(self.key)
        );
        if !self.addresses.is_empty() {
            s.push('@');
            s.push_str(&self.addresses.join(","));
        }
        s
    }

    /// Parses a descriptor; the error names what is malformed (never echoing the key).
    pub fn parse(field: &str, s: &str) -> Result<Descriptor, EngineError> {
        Descriptor::read(s).map_err(|fault| fault.named(field))
    }

    /// Parses a descriptor without naming its field: the field is named only when it is
    /// malformed ([`DescriptorFault::named`]), so a request's checks parse each descriptor once
    /// and format nothing on the way when it is well formed. One allocation for the node id,
    /// one per peer address, none else.
    pub fn read(s: &str) -> Result<Descriptor, DescriptorFault> {
        let bad = |why: &'static str| DescriptorFault::Malformed(why.into());
        if s.len() > MAX_DESCRIPTOR_BYTES {
            return Err(DescriptorFault::TooLong(s.len()));
        }
        let (head, addresses) = match s.split_once('@') {
            Some((head, tail)) => (head, Some(tail)),
            None => (s, None),
        };
        let mut split = head.split(':');
        let mut parts = [""; 5];
        let mut five = true;
        for p in &mut parts {
            match split.next() {
                Some(x) => *p = x,
                None => five = false,
            }
        }
        if !five || split.next().is_some() || parts[0] != DESCRIPTOR_PREFIX {
            return Err(bad(
                "expected tcpxd1:<node>:<buffer id>:<size>:<32 hex digits>[@<host:port>,…]",
            ));
        }
        if crate::config::check_node_id(parts[1]).is_err() {
            return Err(bad("invalid node id"));
        }
        let buffer_id = parts[2].parse().map_err(|_| bad("buffer id is not a number"))?;
        let size = parts[3].parse().map_err(|_| bad("size is not a number"))?;
        // As `hex::decode` then a length check: an odd length or a non-hex digit is "not hex",
        // an even count of hex digits other than 32 "not 16 bytes".
        let digits = parts[4];
        if digits.len() % 2 != 0 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("access key is not hex"));
        }
        let mut key = [0u8; 16];
        if digits.len() != 2 * key.len() {
            return Err(bad("access key is not 16 bytes"));
        }
        hex::decode_to_slice(digits, &mut key).map_err(|_| bad("access key is not hex"))?;
        let addresses: Vec<String> = match addresses {
            None => Vec::new(),
            Some(tail) => tail.split(',').map(str::to_string).collect(),
        };
        crate::advertise::check_peer_addresses("peer address", &addresses)
            .map_err(|why| DescriptorFault::Malformed(why.into()))?;
        Ok(Descriptor {
            node_id: parts[1].to_string(),
            buffer_id,
            size,
            key,
            addresses,
        })
    }
}

/// Why a descriptor did not parse, before its field is named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DescriptorFault {
    /// Longer than [`MAX_DESCRIPTOR_BYTES`] (its length).
    TooLong(usize),
    /// Malformed: why.
    Malformed(std::borrow::Cow<'static, str>),
}

impl DescriptorFault {
    /// The error naming the field the descriptor came in (never echoing the key).
    pub fn named(&self, field: &str) -> EngineError {
        match self {
            DescriptorFault::TooLong(len) => EngineError::invalid(format!(
                "{field}: {len} bytes, over the limit of {MAX_DESCRIPTOR_BYTES} for a descriptor"
            )),
            DescriptorFault::Malformed(why) => {
                EngineError::invalid(format!("{field}: malformed descriptor: {why}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Code;

    #[test]
    fn descriptors_round_trip_and_malformed_ones_are_named() {
        let d = Descriptor {
            node_id: "node-a.1".into(),
            buffer_id: 42,
            size: 1 << 30,
            key: [0xAB; 16],
            addresses: Vec::new(),
        };
        let s = d.encode();
        assert_eq!(Descriptor::parse("remote_descriptor", &s).unwrap(), d);
        // With peer addresses: they round-trip, and the old form above still parses.
        let with = Descriptor {
            addresses: vec![
                "10.0.0.2:50052".into(),
                "[fd00::2]:50052".into(),
                "node-a:7".into(),
            ],
            ..d.clone()
        };
        let w = with.encode();
        assert!(
            w.starts_with(&s) && w.ends_with("@10.0.0.2:50052,[fd00::2]:50052,node-a:7"),
            "{w}"
        );
        assert_eq!(Descriptor::parse("remote_descriptor", &w).unwrap(), with);
        for bad in [
            "",
            "tcpxd2:a:1:2:abababababababababababababababab",
            "tcpxd1:a:x:2:abababababababababababababababab",
            "tcpxd1:a:1:-2:abababababababababababababababab",
            "tcpxd1:a:1:2:zz",
            "tcpxd1:a:1:2:abab",
            "tcpxd1:a b:1:2:abababababababababababababababab",
            "tcpxd1:a:1:2:abababababababababababababababab:extra",
            "tcpxd1:a:1:2:abababababababababababababababab@",
            "tcpxd1:a:1:2:abababababababababababababababab@10.0.0.2",
            "tcpxd1:a:1:2:abababababababababababababababab@10.0.0.2:0",
            "tcpxd1:a:1:2:abababababababababababababababab@0.0.0.0:5",
            "tcpxd1:a:1:2:abababababababababababababababab@h:1,,h:2",
            "tcpxd1:a:1:2:abababababababababababababababab@h:1@h:2",
            "tcpxd1:a:1:2:abababababababababababababababab@h:1,h:2,h:3,h:4,h:5,h:6,h:7,h:8,h:9",
        ] {
            let e = Descriptor::parse("remote_descriptor", bad).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(
                e.message.starts_with("remote_descriptor: malformed descriptor"),
                "{e}"
            );
            assert!(!e.message.contains("abababab"), "the key never appears in errors");
        }
        assert!(!format!("{d:?}").contains("ab"), "Debug hides the key");
        let long = format!("{s}@{}:1", "a".repeat(4000));
        let e = Descriptor::parse("entries[3].remote_descriptor", &long).unwrap_err();
        assert!(
            e.message.starts_with("entries[3].remote_descriptor: ") && e.message.contains("limit of 2560"),
            "{e}"
        );
        let e = Descriptor::parse("f", &format!("{s}@h:1,x y:2")).unwrap_err();
        assert!(e.message.contains("peer address[1]"), "{e}");
    }

    #[test]
    fn malformed_keys_are_worded_as_before() {
        // `read` checks the key in place; the words are those of `hex::decode` then a length
        // check, which it replaced.
        for (key, why) in [
            ("zz", "access key is not hex"),
            ("abc", "access key is not hex"),
            ("abababababababababababababababag", "access key is not hex"),
            ("", "access key is not 16 bytes"),
            ("abab", "access key is not 16 bytes"),
            ("abababababababababababababababab00", "access key is not 16 bytes"),
        ] {
            let e = Descriptor::parse("f", &format!("tcpxd1:a:1:2:{key}")).unwrap_err();
            assert_eq!(e.message, format!("f: malformed descriptor: {why}"));
        }
        for short in ["tcpxd1", "tcpxd1:a:1:2"] {
            let e = Descriptor::parse("f", short).unwrap_err();
            assert!(
                e.message.starts_with("f: malformed descriptor: expected tcpxd1:"),
                "{e}"
            );
        }
        let d = Descriptor::read("tcpxd1:a:1:2:000102030405060708090a0b0c0d0e0F@h:1").unwrap();
        assert_eq!(d.key, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);
        assert_eq!(
            (d.buffer_id, d.size, d.addresses),
            (1, 2, vec!["h:1".to_string()])
        );
        assert_eq!(
            Descriptor::read(&"x".repeat(3000)),
            Err(DescriptorFault::TooLong(3000))
        );
    }
}
