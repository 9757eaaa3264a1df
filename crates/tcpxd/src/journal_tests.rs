//! The journal's unit tests (a temporary state directory each).

use super::*;

struct TempDir(PathBuf);
impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("tcpxd-journal-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn buffer(key: &str) -> Record {
    Record::Buffer {
        kind: "host_shared".into(),
        size: 4096,
        key: key.into(),
        label: String::new(),
        owner: None,
        device: None,
        lists: Vec::new(),
    }
}

#[test]
fn ids_are_never_reused_and_registrations_come_back_pending() {
    let dir = TempDir::new("ids");
    let j = Journal::open(dir.path(), "a").unwrap();
    assert_eq!(j.first_id(Space::Buffer), 1);
    j.record(Space::Buffer, 1, &buffer("00")).unwrap();
    j.record(Space::Buffer, 2, &buffer("11")).unwrap();
    j.record(Space::List, 7, &Record::List { buffer: 1 }).unwrap();
    j.forget(Space::Buffer, 2);
    drop(j);
    // A restart: ids start past everything reserved, the live ones wait for their clients.
    let j = Journal::open(dir.path(), "a").unwrap();
    assert!(j.first_id(Space::Buffer) > 2, "{}", j.first_id(Space::Buffer));
    assert!(j.first_id(Space::List) > 7);
    assert_eq!(j.pending(), 2);
    let e = j
        .claim("reattach_id", Space::Buffer, 1, |r| match r {
            Record::Buffer { key, .. } if key == "ff" => Ok(()),
            _ => Err("the key differs".into()),
        })
        .unwrap_err();
    assert_eq!(e.code, Code::FailedPrecondition);
    assert!(
        e.message
            .contains("buffer 1 cannot be re-attached: the key differs"),
        "{e}"
    );
    // A re-attach that fails after its claim puts it back.
    let r = j.claim("reattach_id", Space::Buffer, 1, |_| Ok(())).unwrap();
    j.unclaim(Space::Buffer, 1, r);
    j.claim("reattach_id", Space::Buffer, 1, |_| Ok(())).unwrap();
    let e = j.claim("reattach_id", Space::Buffer, 1, |_| Ok(())).unwrap_err();
    assert!(e.message.contains("not waiting to be re-attached"), "{e}");
    assert!(
        j.claim("f", Space::Buffer, 2, |_| Ok(())).is_err(),
        "released before: gone"
    );
    // The list nobody re-attached goes when the grace period ends.
    assert_eq!(j.expire(), 1);
    assert!(!dir.path().join("regs/l7").exists());
    // A third instance: still no reuse, though nothing of 1 was recorded again.
    let first = j.first_id(Space::Buffer);
    drop(j);
    let j = Journal::open(dir.path(), "a").unwrap();
    assert!(j.first_id(Space::Buffer) >= first);
}

#[test]
fn a_batch_is_recorded_with_one_reservation_and_comes_back_whole() {
    let dir = TempDir::new("batch");
    let j = Journal::open(dir.path(), "a").unwrap();
    let floors = || std::fs::read_to_string(dir.path().join("floors")).unwrap();
    let before = floors();
    let records = vec![
        (Space::Buffer, 1, buffer("00")),
        (Space::List, 1, Record::List { buffer: 1 }),
        (Space::List, 2, Record::List { buffer: 1 }),
        (Space::Buffer, 2, buffer("11")),
    ];
    assert!(j.record_many(&records).iter().all(Result::is_ok));
    assert_eq!(
        floors(),
        before,
        "ids within the reservation: the floors stay as they were"
    );
    // Past the reservation: the floors move once, above the batch's highest id.
    let far = RESERVE + 10;
    let got = j.record_many(&[
        (Space::Buffer, far, buffer("22")),
        (Space::Buffer, far - 1, buffer("33")),
    ]);
    assert!(got.iter().all(Result::is_ok));
    let reserved: u64 = floors().split_whitespace().next().unwrap().parse().unwrap();
    assert!(reserved > far, "{reserved}");
    // Released with its buffer: the lists go too.
    j.forget(Space::Buffer, 1);
    assert!(!dir.path().join("regs/l1").exists() && !dir.path().join("regs/l2").exists());
    drop(j);
    let j = Journal::open(dir.path(), "a").unwrap();
    assert_eq!(
        j.pending(),
        3,
        "buffers 2, far and far - 1 wait for their clients"
    );
    assert!(j.first_id(Space::Buffer) > far);
}

#[test]
fn lists_named_in_their_buffers_record_come_back_pending_and_go_with_it() {
    let dir = TempDir::new("carried");
    let j = Journal::open(dir.path(), "a").unwrap();
    let with = |named: Vec<u64>| {
        let mut r = buffer("00");
        if let Record::Buffer { lists, .. } = &mut r {
            *lists = named;
        }
        r
    };
    let got = j.record_many(&[
        (Space::Buffer, 1, with(vec![7, 8])),
        (Space::Buffer, 2, with(vec![9])),
    ]);
    assert!(got.iter().all(Result::is_ok));
    let files = || std::fs::read_dir(dir.path().join("regs")).unwrap().count();
    assert_eq!(files(), 2, "one file a buffer, its lists in it");
    j.record(Space::Buffer, 1, &buffer("11")).unwrap(); // re-keyed: its lists stay named
    j.forget(Space::List, 8); // released alone: its buffer's record written without it
    j.forget(Space::Buffer, 2);
    drop(j);
    let j = Journal::open(dir.path(), "a").unwrap();
    assert!(j.first_id(Space::List) > 9);
    assert_eq!(j.pending(), 2, "buffer 1 and its list 7");
    let of_1 = |r: &Record| match r {
        Record::List { buffer: 1 } => Ok(()),
        _ => Err("another buffer's".into()),
    };
    assert!(j.claim("reattach_id", Space::List, 8, of_1).is_err());
    let r = j.claim("reattach_id", Space::Buffer, 1, |_| Ok(())).unwrap();
    assert!(matches!(r, Record::Buffer { ref key, ref lists, .. } if key == "11" && *lists == [7]));
    // Re-attached without its list yet: still named, until the list expires unclaimed.
    j.record(Space::Buffer, 1, &buffer("11")).unwrap();
    assert_eq!(j.expire(), 1);
    let record = std::fs::read(dir.path().join("regs/b1")).unwrap();
    assert_eq!(serde_json::from_slice::<Record>(&record).unwrap(), buffer("11"));
}

#[test]
fn another_nodes_state_is_set_aside() {
    let dir = TempDir::new("aside");
    let j = Journal::open(dir.path(), "a").unwrap();
    j.record(Space::Buffer, 1, &buffer("00")).unwrap();
    drop(j);
    let j = Journal::open(dir.path(), "b").unwrap();
    assert_eq!(j.pending(), 0);
    assert!(dir.path().join("previous-node-a/regs/b1").exists());
}

/// What a daemon before session 20 reads of a registration's file: the same tags, no `lists`
/// (serde ignores the field it does not know).
#[derive(Debug, PartialEq, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
enum Session19Record {
    Buffer { kind: String, size: u64, key: String },
    List { buffer: u64 },
    Prepared,
}

fn session19_regs(dir: &Path) -> Vec<(String, Session19Record)> {
    let mut v: Vec<(String, Session19Record)> = std::fs::read_dir(dir.join("regs"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let r = serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap();
            (name, r)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn lists_named_in_buffer_records_get_records_of_their_own_at_a_clean_stop() {
    let dir = TempDir::new("downgrade");
    let j = Journal::open(dir.path(), "a").unwrap();
    let mut named = buffer("00");
    if let Record::Buffer { lists, .. } = &mut named {
        *lists = vec![7, 8];
    }
    assert!(
        j.record_many(&[(Space::Buffer, 1, named)])
            .iter()
            .all(Result::is_ok)
    );
    j.record(Space::List, 9, &Record::List { buffer: 1 }).unwrap();
    // While it runs: one file for the buffer and its granule lists (one write a region).
    let names = |dir: &Path| -> Vec<String> { session19_regs(dir).into_iter().map(|(n, _)| n).collect() };
    assert_eq!(names(dir.path()), ["b1", "l9"]);
    // A clean stop: each named list gets its own record, as older daemons wrote and read them.
    assert_eq!(j.write_list_records(), 2);
    drop(j);
    assert_eq!(
        session19_regs(dir.path()),
        [
            (
                "b1".to_string(),
                Session19Record::Buffer {
                    kind: "host_shared".into(),
                    size: 4096,
                    key: "00".into()
                }
            ),
            ("l7".to_string(), Session19Record::List { buffer: 1 }),
            ("l8".to_string(), Session19Record::List { buffer: 1 }),
            ("l9".to_string(), Session19Record::List { buffer: 1 }),
        ]
    );
    // This daemon again: every registration pending once, and a list released goes in both forms.
    let j = Journal::open(dir.path(), "a").unwrap();
    assert_eq!(j.pending(), 4, "b1, l7, l8, l9");
    let got = j.claim("list_id", Space::List, 7, |_| Ok(())).unwrap();
    assert_eq!(got, Record::List { buffer: 1 });
    j.forget(Space::List, 7);
    assert_eq!(names(dir.path()), ["b1", "l8", "l9"]);
    assert_eq!(j.expire(), 3);
    assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));
}

#[test]
fn a_directory_of_a_newer_format_is_refused_and_left_as_it_was() {
    let dir = TempDir::new("format");
    let j = Journal::open(dir.path(), "a").unwrap();
    j.record(Space::Buffer, 1, &buffer("00")).unwrap();
    drop(j);
    let format = dir.path().join("format");
    assert_eq!(std::fs::read_to_string(&format).unwrap(), format!("{FORMAT}\n"));
    for newer in [format!("{}\n", FORMAT + 1), "not a number\n".to_string()] {
        std::fs::write(&format, &newer).unwrap();
        let e = Journal::open(dir.path(), "a").expect_err("a newer format is refused");
        let msg = e.to_string();
        assert!(matches!(e, JournalError::Newer { known: FORMAT, .. }), "{msg}");
        assert!(
            msg.contains("newer tcpxd") && msg.contains("move the directory aside"),
            "{msg}"
        );
        // Nothing was changed: the registration and the format are as they were.
        assert_eq!(std::fs::read_to_string(&format).unwrap(), newer);
        assert!(dir.path().join("regs/b1").exists());
    }
    // A directory of an older daemon (no `format` file) is read, and gets this one's format.
    std::fs::remove_file(&format).unwrap();
    let j = Journal::open(dir.path(), "a").unwrap();
    assert_eq!(j.pending(), 1);
    assert_eq!(std::fs::read_to_string(&format).unwrap(), format!("{FORMAT}\n"));
}
