//! The lane layout: how many lanes a node opens towards each peer, on which device each one
//! is, and which of its receive lanes keep eager credits. Computed once, here, from the
//! [`EngineConfig`]; the daemon checks it against the handshake's limit, the poller opens its
//! listening comms from it and the engine splits each peer's receive lanes by it.

use crate::{EngineConfig, Protocol};

/// A node's lanes towards each peer: `lanes_per_device` lanes per device (rendezvous, or
/// every kind under a pure protocol), then under `auto` `eager_per_device` eager lanes per
/// device after those, devices taken in turn (lane `i` is on device `i % devices`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneLayout {
    /// Devices the node's lanes use.
    pub devices: u32,
    /// Lanes per device besides the eager ones.
    pub lanes_per_device: u32,
    /// Eager lanes per device (nonzero only under `auto`).
    pub eager_per_device: u32,
}

impl LaneLayout {
    /// The layout a configuration asks for.
    pub fn of(cfg: &EngineConfig) -> LaneLayout {
        LaneLayout {
            devices: cfg.devices,
            lanes_per_device: cfg.lanes_per_device,
            eager_per_device: match cfg.protocol {
                Protocol::Auto => cfg.eager_lanes,
                Protocol::Rendezvous | Protocol::Eager => 0,
            },
        }
    }

    /// Lanes per device, of every kind.
    pub fn per_device(&self) -> u32 {
        self.lanes_per_device + self.eager_per_device
    }

    /// Lanes towards each peer (in each direction).
    pub fn lanes(&self) -> u32 {
        self.devices * self.per_device()
    }

    /// The eager lanes of a peer under `auto`: the last ones (0 otherwise).
    pub fn eager_lanes(&self) -> u32 {
        self.devices * self.eager_per_device
    }

    /// The position in the node's device list of a lane's device.
    pub fn device_index(&self, lane: u32) -> usize {
        (lane % self.devices.max(1)) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(protocol: Protocol, devices: u32, per_device: u32, eager: u32) -> EngineConfig {
        EngineConfig {
            protocol,
            devices,
            lanes_per_device: per_device,
            eager_lanes: eager,
            ..EngineConfig::default()
        }
    }

    #[test]
    fn auto_adds_its_eager_lanes_per_device_after_the_others() {
        let l = LaneLayout::of(&cfg(Protocol::Auto, 2, 3, 1));
        assert_eq!(l.per_device(), 4);
        assert_eq!(l.lanes(), 8);
        assert_eq!(l.eager_lanes(), 2);
        let devices: Vec<usize> = (0..l.lanes()).map(|i| l.device_index(i)).collect();
        assert_eq!(devices, [0, 1, 0, 1, 0, 1, 0, 1]);
    }

    #[test]
    fn the_pure_protocols_have_no_eager_lanes_of_their_own() {
        for p in [Protocol::Rendezvous, Protocol::Eager] {
            let l = LaneLayout::of(&cfg(p, 4, 2, 3));
            assert_eq!((l.per_device(), l.lanes(), l.eager_lanes()), (2, 8, 0));
        }
    }
}
