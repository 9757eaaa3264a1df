//! The peer addresses a daemon advertises: what its descriptors carry and `DescribeNode` reports,
//! so that a descriptor is all another node needs to reach it (`peer.advertise`, else derived from
//! the address the peer service is bound to).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};

/// At most this many advertised addresses (in a descriptor, or in `peer.advertise`).
pub const MAX_PEER_ADDRESSES: usize = 8;
/// The longest address: a 253-byte DNS name, ':' and a 5-digit port (a bracketed IPv6 is shorter).
pub const MAX_PEER_ADDRESS_BYTES: usize = 259;

/// Checks one dialable peer address: `host:port` with a DNS name, an IPv4 address or a bracketed
/// IPv6 address, a nonzero port, and no wildcard (`0.0.0.0`, `[::]`), which no other node can dial.
/// The error says what is wrong (the caller adds the field's name).
pub fn check_peer_address(a: &str) -> Result<(), String> {
    let shown = || {
        let s: String = a.chars().take(64).collect();
        format!("{:?}{}", s, if a.chars().count() > 64 { "…" } else { "" })
    };
    if a.is_empty() {
        return Err("empty address (expected host:port)".into());
    }
    if a.len() > MAX_PEER_ADDRESS_BYTES {
        return Err(format!(
            "{} is {} bytes, over the limit of {MAX_PEER_ADDRESS_BYTES}",
            shown(),
            a.len()
        ));
    }
    let Some((host, port)) = a.rsplit_once(':') else {
        return Err(format!("{} has no port (expected host:port)", shown()));
    };
    match port.parse::<u16>() {
        Ok(0) => return Err(format!("{}: port 0 cannot be dialled", shown())),
        Ok(_) if port.bytes().all(|b| b.is_ascii_digit()) => {}
        _ => return Err(format!("{}: port {port:?} is not a number in 1..=65535", shown())),
    }
    let ip = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        let ip: Ipv6Addr = inner
            .parse()
            .map_err(|_| format!("{}: {inner:?} is not an IPv6 address", shown()))?;
        Some(IpAddr::V6(ip))
    } else if let Ok(ip) = host.parse::<Ipv4Addr>() {
        Some(IpAddr::V4(ip))
    } else {
        check_dns_name(host).map_err(|why| format!("{}: {why}", shown()))?;
        None
    };
    if ip.is_some_and(|ip| ip.is_unspecified()) {
        return Err(format!(
            "{}: a wildcard address names no host another node can dial",
            shown()
        ));
    }
    Ok(())
}

fn check_dns_name(host: &str) -> Result<(), String> {
    if host.is_empty() || host.len() > 253 {
        return Err(format!("host name of {} bytes (1 to 253 allowed)", host.len()));
    }
    for label in host.split('.') {
        let ok = (1..=63).contains(&label.len())
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(format!(
                "{:?} is not a host name, an IPv4 address or a bracketed IPv6 address",
                host.chars().take(64).collect::<String>()
            ));
        }
    }
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!("{host:?} is not a valid IPv4 address"));
    }
    Ok(())
}

/// Checks a list of advertised addresses (`what` names the setting or field in errors).
pub fn check_peer_addresses(what: &str, list: &[String]) -> Result<(), String> {
    if list.len() > MAX_PEER_ADDRESSES {
        return Err(format!(
            "{what}: {} addresses, at most {MAX_PEER_ADDRESSES} allowed",
            list.len()
        ));
    }
    for (i, a) in list.iter().enumerate() {
        check_peer_address(a).map_err(|why| format!("{what}[{i}]: {why}"))?;
    }
    Ok(())
}

/// `ip:port` as a dialable address (IPv6 bracketed).
pub fn format_socket_addr(a: SocketAddr) -> String {
    match a {
        SocketAddr::V4(v4) => format!("{}:{}", v4.ip(), v4.port()),
        SocketAddr::V6(v6) => format!("[{}]:{}", v6.ip(), v6.port()),
    }
}

/// The addresses a daemon whose peer service is bound to `bound` advertises: `configured` when
/// set; else `bound` itself; for a wildcard bind, the addresses `hostname` resolves to that other
/// nodes can dial (not loopback). A wildcard bind whose hostname resolves to none of those is an
/// error saying to set `peer.advertise`.
pub fn advertised(configured: &[String], bound: SocketAddr, hostname: &str) -> Result<Vec<String>, String> {
    if !configured.is_empty() {
        return Ok(configured.to_vec());
    }
    if !bound.ip().is_unspecified() {
        return Ok(vec![format_socket_addr(bound)]);
    }
    let resolved: Vec<SocketAddr> = (hostname, bound.port())
        .to_socket_addrs()
        .map(|it| it.collect())
        .unwrap_or_default();
    let mut usable: Vec<String> = Vec::new();
    for a in &resolved {
        let ip = a.ip();
        if ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() {
            continue;
        }
        // A link-local IPv6 address needs a zone to be dialled: not advertisable.
        if let IpAddr::V6(v6) = ip
            && (v6.segments()[0] & 0xffc0) == 0xfe80
        {
            continue;
        }
        let s = format_socket_addr(*a);
        if !usable.contains(&s) && usable.len() < MAX_PEER_ADDRESSES {
            usable.push(s);
        }
    }
    if usable.is_empty() {
        let found = if resolved.is_empty() {
            "to no address".to_string()
        } else {
            format!(
                "only to {}",
                resolved
                    .iter()
                    .map(|a| a.ip().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        return Err(format!(
            "peer.advertise: the peer service listens on {bound} (every interface) and the hostname {hostname:?} resolves {found}, which other nodes cannot dial; \
             set peer.advertise (TCPXD_PEER_ADVERTISE, --peer-advertise) to the host:port other nodes reach this one at, or bind peer.listen to that address"
        ));
    }
    Ok(usable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_addresses_pass() {
        for a in [
            "10.0.0.2:50052",
            "node-a.cluster.local:1",
            "[fd00::2]:50052",
            "localhost:65535",
            "a_b:7",
        ] {
            check_peer_address(a).unwrap_or_else(|e| panic!("{a}: {e}"));
        }
    }

    #[test]
    fn bad_addresses_say_why() {
        for (a, words) in [
            ("", "empty"),
            ("10.0.0.2", "no port"),
            ("10.0.0.2:0", "port 0"),
            ("10.0.0.2:65536", "not a number"),
            ("10.0.0.2:+5", "not a number"),
            ("0.0.0.0:50052", "wildcard"),
            ("[::]:50052", "wildcard"),
            ("[zz]:1", "not an IPv6"),
            ("fd00::2:50052", "not a host name"),
            ("a b:1", "not a host name"),
            ("-a:1", "not a host name"),
            ("a..b:1", "not a host name"),
            ("300.1.1.1:5", "not a valid IPv4"),
            ("x,y:1", "not a host name"),
        ] {
            let e = check_peer_address(a).unwrap_err();
            assert!(e.contains(words), "{a:?}: {e}");
        }
        let long = format!("{}:1", "a".repeat(300));
        assert!(check_peer_address(&long).unwrap_err().contains("over the limit"));
        let many: Vec<String> = (0..9).map(|i| format!("h{i}:1")).collect();
        assert!(
            check_peer_addresses("peer.advertise", &many)
                .unwrap_err()
                .contains("at most 8")
        );
        let e = check_peer_addresses("peer.advertise", &["ok:1".into(), "bad".into()]).unwrap_err();
        assert!(e.starts_with("peer.advertise[1]: "), "{e}");
    }

    #[test]
    fn advertised_addresses_derive_from_the_bind() {
        let bound: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        assert_eq!(advertised(&[], bound, "x").unwrap(), ["127.0.0.1:5000"]);
        let v6: SocketAddr = "[fd00::1]:5000".parse().unwrap();
        assert_eq!(advertised(&[], v6, "x").unwrap(), ["[fd00::1]:5000"]);
        let set = vec!["n1:7".to_string()];
        assert_eq!(advertised(&set, bound, "x").unwrap(), set);
        // A wildcard bind with a hostname that resolves to loopback only: refused, saying why.
        let any: SocketAddr = "0.0.0.0:5000".parse().unwrap();
        let e = advertised(&[], any, "localhost").unwrap_err();
        assert!(
            e.contains("peer.advertise") && e.contains("every interface"),
            "{e}"
        );
        let e = advertised(&[], any, "no-such-host.invalid").unwrap_err();
        assert!(e.contains("to no address"), "{e}");
    }
}
