//! The tests that count lanes, or build peer messages from the lanes a pairing uses, again on
//! routed pairings, in CI. Each runs in a child process of this binary whose daemons (in
//! process, and the peer processes it starts) see two stand-in GPUs (tools/realplugin/cudastub
//! as `libcuda.so.1`: `tcpxd_testkit::cudastub`), so every pairing is routed, as on Google's
//! plugin under `tools/realplugin/run.sh` (which gives its daemons the same stand-in). Routed,
//! their lanes are the lane catalogue's (`routes.rs`), not the layout's: the tests check what
//! each lane carries, not where it sits. `TCPXD_TEST_EXPECT_ROUTED=1` makes the child's tests
//! check that their pairings really were routed (`daemons::assert_routed_as_expected`).

use crate::common::daemons::test_plugin_file;

/// Set in the children: they run the test itself.
const CHILD_ENV: &str = "TCPXD_TEST_ROUTED_CHILD";

/// Runs `test` (its full name in this binary) in a child with two stand-in GPUs.
fn on_routed_pairings(test: &str) {
    if std::env::var_os(CHILD_ENV).is_some() || test_plugin_file().is_some() {
        // A child, or the real plugin's run, whose daemons have GPUs already.
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .envs(tcpxd_testkit::cudastub::child_env(2))
        .env(CHILD_ENV, "1")
        .env("TCPXD_TEST_EXPECT_ROUTED", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{test} on routed pairings: {text}");
    assert!(text.contains("1 passed"), "{test}: the child ran no test: {text}");
}

#[test]
fn auto_small_and_large_transfers() {
    on_routed_pairings(
        "daemon_auto::small_and_large_transfers_at_once_in_both_directions_each_take_their_protocol",
    );
}

#[test]
fn auto_pairs_with_eager_and_rendezvous_nodes() {
    on_routed_pairings("daemon_auto::an_auto_node_pairs_with_eager_and_rendezvous_nodes_both_ways");
}

#[test]
fn first_use() {
    on_routed_pairings("daemon_first_use::a_descriptor_is_all_a_client_needs");
}

#[test]
fn eager_write_refused() {
    on_routed_pairings("daemon_eager::a_write_refused_after_its_data_left_changes_no_destination_byte");
}

#[test]
fn eager_mixed_pairings() {
    on_routed_pairings("daemon_eager::mixed_pairings_follow_each_receivers_mode_both_ways");
}

#[test]
fn eager_cancel_and_deadlines() {
    on_routed_pairings("daemon_eager::cancel_and_deadlines_give_every_credit_and_slot_back_on_both_sides");
}

#[test]
fn eager_hostile_headers() {
    on_routed_pairings("daemon_eager::hostile::hostile_headers_are_refused_and_change_nothing");
}

#[test]
fn hostile_peer_messages() {
    on_routed_pairings("daemon_hostile::peer::hostile_peer_messages_are_refused_and_change_nothing");
}

#[test]
fn cancel_read_and_deadlines() {
    on_routed_pairings("daemon_cancel::cancelling_a_read_and_missing_a_deadline_drain_too");
}
