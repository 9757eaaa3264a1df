use super::*;

/// A3's eight GPUs (ordinal order = PCI order), each under the switch of its NIC's pair, when
/// `placed`; without sysfs places otherwise.
fn a3_gpus(placed: bool) -> Vec<GpuInfo> {
    A3VM.iter()
        .flat_map(|n| n.gpus)
        .enumerate()
        .map(|(i, bus)| GpuInfo {
            ordinal: i as u32,
            pci_bus_id: bus.to_string(),
            place: placed.then(|| a3_place(bus)),
        })
        .collect()
}

/// GPUs 04/05 and NIC 06 under one switch of root complex 00, 0a/0b/0c under another, 84.. and
/// 8a.. under root complex 80.
fn a3_place(bus: &str) -> Vec<String> {
    let b = u8::from_str_radix(&bus[5..7], 16).unwrap();
    let (root, switch) = match b {
        0x04..=0x06 => ("pci0000:00", "0000:00:01.0"),
        0x0a..=0x0c => ("pci0000:00", "0000:00:02.0"),
        0x84..=0x86 => ("pci0000:80", "0000:80:01.0"),
        _ => ("pci0000:80", "0000:80:02.0"),
    };
    vec![root.into(), switch.into(), bus.into()]
}

fn a3_nics(names: [&str; 4], placed: bool) -> Vec<NicInfo> {
    A3VM.iter()
        .zip(names)
        .enumerate()
        .map(|(i, (n, name))| {
            let path = format!("/sys/devices/{}", a3_place(n.pci).join("/"));
            NicInfo {
                device: i as i32,
                name: name.into(),
                place: placed.then(|| place_of(&path).unwrap()),
                pci_path: placed.then_some(path),
            }
        })
        .collect()
}

const ETH: [&str; 4] = ["eth1", "eth2", "eth3", "eth4"];

fn pairs(t: &Topology) -> Vec<(u32, Vec<&str>)> {
    t.gpus
        .iter()
        .zip(&t.bindings)
        .map(|(g, b)| {
            (
                g.ordinal,
                b.nics.iter().map(|&n| t.nics[n].name.as_str()).collect(),
            )
        })
        .collect()
}

fn a3vm_pairs() -> Vec<(u32, Vec<&'static str>)> {
    (0..8).map(|g| (g, vec![ETH[g as usize / 2]])).collect()
}

#[test]
fn pci_distance_on_a3_is_rxdms_map() {
    let t = Topology::build(a3_gpus(true), a3_nics(ETH, true), &MapSpec::Pci).unwrap();
    assert_eq!(t.source, "pci");
    assert_eq!(pairs(&t), a3vm_pairs());
    assert!(t.bindings.iter().all(|b| b.relation == "same PCIe switch"));
    assert!(t.contradictions(&served_a3vm()).is_empty());
    assert_eq!(t.gpus_served(2), [4, 5]);
    assert_eq!(t.listen_gpu(3), Some(6));
}

#[test]
fn without_pci_places_gpus_are_spread_evenly() {
    let t = Topology::build(a3_gpus(false), a3_nics(ETH, false), &MapSpec::Pci).unwrap();
    assert_eq!(pairs(&t), a3vm_pairs());
    assert!(
        t.bindings
            .iter()
            .all(|b| b.relation == "even spread (no PCI place)")
    );
    // Two GPUs over four NICs: NICs 0 and 2; NICs 1 and 3 serve none.
    let two: Vec<GpuInfo> = a3_gpus(false).into_iter().take(2).collect();
    let t = Topology::build(two, a3_nics(ETH, false), &MapSpec::Pci).unwrap();
    assert_eq!(pairs(&t), [(0, vec!["eth1"]), (1, vec!["eth3"])]);
    // NICs 1 and 3 serve none: opened under GPU ⌈(j + 1) × 2 / 4⌉ − 1, as the emulation's map.
    assert_eq!((t.listen_gpu(1), t.listen_gpu(3)), (Some(0), Some(1)));
    assert!(t.gpus_served(1).is_empty());
    // Five GPUs over two NICs: 0,1,2 -> NIC 0; 3,4 -> NIC 1.
    let five: Vec<GpuInfo> = a3_gpus(false).into_iter().take(5).collect();
    let nics: Vec<NicInfo> = a3_nics(ETH, false).into_iter().take(2).collect();
    let t = Topology::build(five, nics, &MapSpec::Pci).unwrap();
    let firsts: Vec<usize> = t.bindings.iter().map(|b| b.nics[0]).collect();
    assert_eq!(firsts, [0, 0, 0, 1, 1]);
}

#[test]
fn distance_ties_spread_over_nics() {
    // Both GPUs and both NICs under one switch: one NIC each.
    let gpu = |o: u32, bus: &str| GpuInfo {
        ordinal: o,
        pci_bus_id: bus.into(),
        place: place_of(&format!("/sys/devices/pci0/s1/{bus}")),
    };
    let nic = |d: i32, name: &str| NicInfo {
        device: d,
        name: name.into(),
        pci_path: None,
        place: place_of(&format!("/sys/devices/pci0/s1/n{d}")),
    };
    let t = Topology::build(
        vec![gpu(0, "0000:01:00.0"), gpu(1, "0000:02:00.0")],
        vec![nic(0, "a"), nic(1, "b")],
        &MapSpec::Pci,
    )
    .unwrap();
    assert_eq!(pairs(&t), [(0, vec!["a"]), (1, vec!["b"])]);
}

#[test]
fn a3vm_finds_nics_by_name_or_pci_address() {
    let t = Topology::build(a3_gpus(false), a3_nics(ETH, false), &MapSpec::A3vm).unwrap();
    assert_eq!(t.source, "a3vm");
    assert_eq!(pairs(&t), a3vm_pairs());
    // Named otherwise (the emulation's default names) but at A3's PCI addresses.
    let t = Topology::build(
        a3_gpus(false),
        a3_nics(["d0", "d1", "d2", "d3"], true),
        &MapSpec::A3vm,
    )
    .unwrap();
    assert_eq!(
        pairs(&t).iter().map(|p| p.1[0]).collect::<Vec<_>>(),
        ["d0", "d0", "d1", "d1", "d2", "d2", "d3", "d3"]
    );
    // Neither: the error names the GPU, the NIC it needs and the devices there are.
    let e = Topology::build(
        a3_gpus(false),
        a3_nics(["d0", "d1", "d2", "d3"], false),
        &MapSpec::A3vm,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("GPU 0 (0000:04:00.0) is served by eth1 (PCI 0000:06:00.0)"),
        "{e}"
    );
    assert!(e.contains("0 d0, 1 d1"), "{e}");
    // A GPU the preset does not know.
    let mut gpus = a3_gpus(false);
    gpus[3].pci_bus_id = "0000:07:00.0".into();
    let e = Topology::build(gpus, a3_nics(ETH, false), &MapSpec::A3vm)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("GPU 3 (0000:07:00.0) is not one of the preset's eight"),
        "{e}"
    );
}

#[test]
fn an_explicit_map_names_every_gpu_with_known_nics() {
    let spec = MapSpec::parse("0=eth1;1=eth1;2=eth2;3=eth2;4=eth3;5=eth3;6=eth4;0000:8b:00.0=3").unwrap();
    let t = Topology::build(a3_gpus(false), a3_nics(ETH, false), &spec).unwrap();
    assert_eq!((t.source, pairs(&t)), ("config", a3vm_pairs()));
    let two = MapSpec::parse("0=eth1+eth2;1=eth2").unwrap();
    let gpus: Vec<GpuInfo> = a3_gpus(false).into_iter().take(2).collect();
    let t = Topology::build(gpus.clone(), a3_nics(ETH, false), &two).unwrap();
    assert_eq!(pairs(&t), [(0, vec!["eth1", "eth2"]), (1, vec!["eth2"])]);
    for (text, says) in [
        ("0=eth1", "GPU 1 (0000:05:00.0) has no NIC"),
        (
            "0=eth1;1=eth9",
            "NIC eth9 is not one of the plugin devices in use (0 eth1, 1 eth2",
        ),
        (
            "0=eth1;7=eth1",
            "GPU 7 is not on this node (GPUs: 0 0000:04:00.0, 1 0000:05:00.0)",
        ),
        ("0=eth1;0000:04:00.0=eth2", "GPU 0 (0000:04:00.0) is named twice"),
    ] {
        let e = Topology::build(gpus.clone(), a3_nics(ETH, false), &MapSpec::parse(text).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{text}: {e}");
        assert!(e.starts_with("topology.map: "), "{e}");
    }
}

#[test]
fn no_gpus_means_no_map_and_no_nics_is_refused() {
    let t = Topology::build(Vec::new(), a3_nics(ETH, false), &MapSpec::A3vm).unwrap();
    assert_eq!(t.source, "none");
    assert!(t.bindings.is_empty());
    assert_eq!(t.listen_gpu(0), None);
    assert_eq!(
        Topology::build(a3_gpus(false), Vec::new(), &MapSpec::Pci),
        Err(TopologyError::NoNics)
    );
}

fn served_a3vm() -> Vec<(&'static str, &'static str)> {
    A3VM.iter().flat_map(|n| n.gpus.map(|g| (g, n.name))).collect()
}

#[test]
fn a_map_against_rxdm_names_each_gpu_it_contradicts() {
    let spec = MapSpec::parse("0=eth1;1=eth2;2=eth2;3=eth2;4=eth3;5=eth3;6=eth4;7=eth4+eth1").unwrap();
    let t = Topology::build(a3_gpus(false), a3_nics(ETH, false), &spec).unwrap();
    let c = t.contradictions(&served_a3vm());
    assert_eq!(c.len(), 2);
    assert_eq!(
        (c[0].gpu, c[0].ours.clone(), c[0].rxdm.as_str()),
        (1, vec!["eth2".to_string()], "eth1")
    );
    assert_eq!(c[1].gpu, 7);
    assert_eq!(c[1].ours, ["eth4", "eth1"]);
}

#[test]
fn routes_follow_the_gpus_nics() {
    let a = Topology::build(a3_gpus(false), a3_nics(ETH, false), &MapSpec::Pci).unwrap();
    let b = a.clone();
    let ep = |nic, gpu| Endpoint { nic, gpu };
    // GPU 5 on a to GPU 2 on b: eth3 (under GPU 5) -> b's eth2 under GPU 2, nothing else.
    assert_eq!(
        routes(&a, &b, Memory::Gpu(5), Memory::Gpu(2)),
        [Route {
            send: ep(2, Some(5)),
            recv: ep(1, Some(2))
        }]
    );
    // Host to host: every NIC, NIC i to NIC i, each under the first GPU it serves.
    let hh = routes(&a, &b, Memory::Host, Memory::Host);
    assert_eq!(hh.len(), 4);
    for (i, r) in hh.iter().enumerate() {
        assert_eq!(
            *r,
            Route {
                send: ep(i, Some(2 * i as u32)),
                recv: ep(i, Some(2 * i as u32))
            }
        );
    }
    // Host to GPU 7: every sending NIC, all into b's eth4 under GPU 7.
    let hg = routes(&a, &b, Memory::Host, Memory::Gpu(7));
    assert_eq!(hg.len(), 4);
    assert!(hg.iter().all(|r| r.recv == ep(3, Some(7))));
    // GPU 0 to host: a's eth1 under GPU 0, to each of b's NICs.
    let gh = routes(&a, &b, Memory::Gpu(0), Memory::Host);
    assert_eq!(gh.iter().map(|r| r.recv.nic).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert!(gh.iter().all(|r| r.send == ep(0, Some(0))));
    // A GPU the node lacks: no lanes at all.
    assert!(routes(&a, &b, Memory::Gpu(8), Memory::Host).is_empty());
    // No GPUs (today's default: one NIC, host memory): one lane, nothing made current.
    let plain = Topology::build(Vec::new(), a3_nics(ETH, false)[..1].to_vec(), &MapSpec::Pci).unwrap();
    assert_eq!(
        routes(&plain, &plain, Memory::Host, Memory::Host),
        [Route {
            send: ep(0, None),
            recv: ep(0, None)
        }]
    );
}

#[test]
fn a_gpu_pairs_lanes_are_the_same_computed_from_either_side() {
    let a = Topology::build(a3_gpus(false), a3_nics(ETH, false), &MapSpec::Pci).unwrap();
    let b = Topology::build(
        a3_gpus(false)[..4].to_vec(),
        a3_nics(ETH, false)[..2].to_vec(),
        &MapSpec::parse("0=eth1+eth2;1=eth1;2=eth2;3=eth2").unwrap(),
    )
    .unwrap();
    // The sender plans with (own, peer's); the receiver with (peer's, own): same inputs.
    for s in (0..8).map(Memory::Gpu).chain([Memory::Host]) {
        for d in (0..4).map(Memory::Gpu).chain([Memory::Host]) {
            let r = routes(&a, &b, s, d);
            assert!(!r.is_empty());
            for lane in &r {
                if let Memory::Gpu(g) = s {
                    assert!(a.nics_of(g).contains(&lane.send.nic));
                    assert_eq!(lane.send.gpu, Some(g));
                }
                if let Memory::Gpu(g) = d {
                    assert!(b.nics_of(g).contains(&lane.recv.nic));
                    assert_eq!(lane.recv.gpu, Some(g));
                }
                // Every comm is opened under a GPU its NIC serves.
                assert!(a.gpus_served(lane.send.nic).contains(&lane.send.gpu.unwrap()));
                assert!(b.gpus_served(lane.recv.nic).contains(&lane.recv.gpu.unwrap()));
            }
        }
    }
    // GPU 0 on b has two NICs: a GPU with one NIC sending to it takes both of them.
    assert_eq!(routes(&a, &b, Memory::Gpu(0), Memory::Gpu(0)).len(), 2);
}

#[test]
fn places_come_from_sysfs_paths() {
    assert_eq!(
        place_of("/sys/devices/pci0000:00/0000:00:01.0/0000:06:00.0").unwrap(),
        ["pci0000:00", "0000:00:01.0", "0000:06:00.0"]
    );
    assert_eq!(place_of("/sys/class/net/eth1"), None);
    assert_eq!(place_of("/sys/devices/"), None);
}

fn a3(map: &str) -> Topology {
    Topology::build(a3_gpus(false), a3_nics(ETH, false), &MapSpec::parse(map).unwrap()).unwrap()
}

#[test]
fn a_summary_round_trips_what_routes_read() {
    let a = a3("a3vm");
    let back = Topology::from_summary(&a.summary()).unwrap();
    assert_eq!(back.nics.len(), 4);
    for g in 0..8 {
        assert_eq!(back.nics_of(g), a.nics_of(g));
    }
    for n in 0..4 {
        assert_eq!(back.listen_gpu(n), a.listen_gpu(n));
    }
    // Without GPUs: NICs only.
    let plain = Topology::build(Vec::new(), a3_nics(ETH, false)[..1].to_vec(), &MapSpec::Pci).unwrap();
    let back = Topology::from_summary(&plain.summary()).unwrap();
    assert_eq!(
        (back.nics.len(), back.gpus.len(), back.listen_gpu(0)),
        (1, 0, None)
    );
}

#[test]
fn a_bad_summary_is_refused_naming_the_field() {
    let mut s = a3("a3vm").summary();
    s.gpus[3].nics = vec![4];
    let e = Topology::from_summary(&s).unwrap_err();
    assert!(e.contains("topology.gpus[3].nics") && e.contains("NIC 4"), "{e}");
    let mut s = a3("a3vm").summary();
    s.gpus[2].ordinal = 0;
    assert!(Topology::from_summary(&s).unwrap_err().contains("GPU 0 twice"));
    let mut s = a3("a3vm").summary();
    s.nics.clear();
    assert!(
        Topology::from_summary(&s)
            .unwrap_err()
            .contains("topology.nics: 0 NICs")
    );
    let mut s = a3("a3vm").summary();
    s.gpus[0].nics.clear();
    assert!(
        Topology::from_summary(&s)
            .unwrap_err()
            .contains("topology.gpus[0].nics: 0")
    );
}

#[test]
fn both_sides_build_the_same_catalogue_from_the_exchanged_summaries() {
    let a = a3("a3vm");
    let b = Topology::build(
        a3_gpus(false)[..4].to_vec(),
        a3_nics(ETH, false)[..2].to_vec(),
        &MapSpec::parse("0=eth1+eth2;1=eth1;2=eth2;3=eth2").unwrap(),
    )
    .unwrap();
    // a sends to b: a builds (own, b's summary), b builds (a's summary, own).
    let at_a = LaneCatalogue::build(&a, &Topology::from_summary(&b.summary()).unwrap(), 2, 1);
    let at_b = LaneCatalogue::build(&Topology::from_summary(&a.summary()).unwrap(), &b, 2, 1);
    assert_eq!(at_a.lanes(), at_b.lanes());
    assert_eq!(at_a.groups(), at_b.groups());
    for lane in 0..at_a.lanes() {
        assert_eq!(at_a.route(lane), at_b.route(lane));
        assert_eq!(at_a.group_of(lane), at_b.group_of(lane));
    }
    // 9 sources × 5 destinations, lanes consecutive and every lane in exactly one group.
    assert_eq!(at_a.groups().len(), 45);
    let mut next = 0;
    for g in at_a.groups() {
        assert_eq!(g.rendezvous.start, next);
        assert_eq!(g.rendezvous.len(), 2 * g.routes.len());
        assert_eq!(g.eager.start, g.rendezvous.end);
        assert_eq!(g.eager.len(), g.routes.len(), "one eager lane per route");
        next = g.eager.end;
        // Each lane of the group takes one of the group's routes, in turn.
        for (k, lane) in g.rendezvous.clone().chain(g.eager.clone()).enumerate() {
            assert_eq!(at_a.route(lane), Some(g.routes[k % g.routes.len()]));
        }
    }
    assert_eq!(next, at_a.lanes());
}

#[test]
fn a_gpu_pairs_group_uses_only_their_nics_under_their_gpus() {
    let a = a3("a3vm");
    let cat = LaneCatalogue::build(&a, &a, 2, 1);
    for s in 0..8u32 {
        for d in 0..8u32 {
            let g = cat.group(Memory::Gpu(s), Memory::Gpu(d)).unwrap();
            assert_eq!(g.rendezvous.len(), 2, "one route, two lanes");
            assert_eq!(g.eager.len(), 1, "one route, one eager lane");
            for lane in g.rendezvous.clone().chain(g.eager.clone()) {
                assert_eq!(cat.is_eager(lane), g.eager.contains(&lane));
                let r = cat.route(lane).unwrap();
                assert_eq!((r.send.nic, r.send.gpu), (s as usize / 2, Some(s)));
                assert_eq!((r.recv.nic, r.recv.gpu), (d as usize / 2, Some(d)));
            }
        }
    }
    // Host to host: every NIC, NIC i to NIC i, rotating over them lane by lane.
    let hh = cat.group(Memory::Host, Memory::Host).unwrap();
    let nics: Vec<usize> = hh
        .rendezvous
        .clone()
        .map(|l| cat.route(l).unwrap().send.nic)
        .collect();
    assert_eq!(nics, [0, 1, 2, 3, 0, 1, 2, 3]);
    assert_eq!(hh.eager.len(), 4);
}

#[test]
fn a_gpu_either_side_lacks_is_an_error_naming_it() {
    let a = a3("a3vm");
    let four = Topology::build(
        a3_gpus(false)[..4].to_vec(),
        a3_nics(ETH, false)[..2].to_vec(),
        &MapSpec::Pci,
    )
    .unwrap();
    let cat = LaneCatalogue::build(&a, &four, 2, 0);
    let e = cat.group(Memory::Host, Memory::Gpu(6)).unwrap_err().to_string();
    assert_eq!(e, "GPU 6 is not one of the receiver's GPUs (0, 1, 2, 3)");
    let e = cat.group(Memory::Gpu(9), Memory::Host).unwrap_err().to_string();
    assert_eq!(
        e,
        "GPU 9 is not one of the sender's GPUs (0, 1, 2, 3, 4, 5, 6, 7)"
    );
    let plain = Topology::build(Vec::new(), a3_nics(ETH, false)[..1].to_vec(), &MapSpec::Pci).unwrap();
    let cat = LaneCatalogue::build(&a, &plain, 2, 0);
    let e = cat.group(Memory::Gpu(1), Memory::Gpu(0)).unwrap_err().to_string();
    assert_eq!(e, "GPU 0 is not one of the receiver's GPUs (it has none)");
}

#[test]
fn nodes_without_gpus_keep_todays_layout() {
    let plain = Topology::build(Vec::new(), a3_nics(ETH, false)[..2].to_vec(), &MapSpec::Pci).unwrap();
    let cat = LaneCatalogue::build(&plain, &plain, 2, 1);
    assert_eq!(cat.groups().len(), 1);
    let g = cat.group(Memory::Host, Memory::Host).unwrap();
    assert_eq!((g.rendezvous.clone(), g.eager.clone()), (0..4, 4..6));
    // Lane i on NIC i % 2, nothing made current: LaneLayout's devices.
    let nics: Vec<(usize, Option<u32>)> = (0..6)
        .map(|l| {
            let r = cat.route(l).unwrap();
            (r.send.nic, r.send.gpu)
        })
        .collect();
    assert_eq!(
        nics,
        [(0, None), (1, None), (0, None), (1, None), (0, None), (1, None)]
    );
}

#[test]
fn a_synthetic_node_spreads_its_gpus_evenly() {
    let t = Topology::synthetic(8, 4).unwrap();
    for g in 0..8u32 {
        assert_eq!(t.nics_of(g), &[g as usize / 2], "GPU {g}");
    }
    assert_eq!(t.gpus_served(3), vec![6, 7]);
    assert!(matches!(Topology::synthetic(2, 0), Err(TopologyError::NoNics)));
}
