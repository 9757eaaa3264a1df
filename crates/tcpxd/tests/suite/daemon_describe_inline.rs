//! DescribeNode reports the node's inline settings (`transfer.inline_max_bytes`,
//! `inline_window_bytes`, `inline_gpu`, `inline_gpu_in_flight`; fields 740-743) as the daemon
//! resolved them: the defaults, a config file's values, flags over the file, and 0 when inline
//! transfers are off.

use crate::common::daemons::*;
use tcpxd::api::proto::v1 as pb;
use tcpxd::config::inline::InlineSettings;

async fn describe(c: &mut Client) -> pb::NodeDescription {
    c.describe_node(pb::DescribeNodeRequest {})
        .await
        .expect("describe")
        .into_inner()
}

/// The four inline fields of a description, in the config's shape.
fn reported(n: &pb::NodeDescription) -> InlineSettings {
    InlineSettings {
        max_bytes: n.inline_max_bytes,
        window_bytes: n.inline_window_bytes,
        gpu: n.inline_gpu,
        gpu_in_flight: u64::from(n.inline_gpu_in_flight),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_node_reports_the_inline_settings_the_daemon_runs_with() {
    tcpxd::logging::init("warn");
    // Defaults.
    let mut a = start("describe-inline-default", |_| {}).await;
    let n = describe(&mut a.client).await;
    assert_eq!(reported(&n), InlineSettings::default(), "{n:?}");
    assert!(n.inline_max_bytes > 0 && n.inline_window_bytes > 0, "{n:?}");
    assert!(
        n.features.iter().any(|f| f == "inline_small_transfers"),
        "{:?}",
        n.features
    );
    a.stop().await;

    // A config file's [transfer] keys.
    let dir = std::env::temp_dir().join(format!("tcpxd-test-describe-inline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tcpxd.toml");
    std::fs::write(
        &file,
        "[transfer]\ninline_max_bytes = 4096\ninline_window_bytes = 16384\ninline_gpu = \"on\"\n\
         inline_gpu_in_flight = 3\n",
    )
    .unwrap();
    let f = file.clone();
    let mut b = start("describe-inline-file", move |a| a.config = Some(f)).await;
    let from_file = InlineSettings {
        max_bytes: 4096,
        window_bytes: 16384,
        gpu: true,
        gpu_in_flight: 3,
    };
    assert_eq!(reported(&describe(&mut b.client).await), from_file);
    b.stop().await;

    // Flags over the file's keys; inline off.
    let f = file.clone();
    let mut c = start("describe-inline-flags", move |a| {
        a.config = Some(f);
        a.inline.inline_max_bytes = Some(0);
        a.inline.inline_window_bytes = Some(8192);
        a.inline.inline_gpu = Some("off".into());
        a.inline.inline_gpu_in_flight = Some(0);
    })
    .await;
    let off = InlineSettings {
        max_bytes: 0,
        window_bytes: 8192,
        gpu: false,
        gpu_in_flight: 0,
    };
    assert_eq!(reported(&describe(&mut c.client).await), off);
    c.stop().await;
    std::fs::remove_dir_all(&dir).ok();
}
