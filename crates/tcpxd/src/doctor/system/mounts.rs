//! `plugin.noexec`: the mount holding the plugin, from the kernel's mount tables.

use std::path::{Path, PathBuf};

use crate::doctor::{Check, Host};

/// One mount: where, and its per-mount options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub point: PathBuf,
    pub options: Vec<String>,
    pub fstype: String,
}

/// Undoes the octal escapes (`\040` for a space) the kernel writes in mount tables.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v =
                u16::from(b[i + 1] - b'0') * 64 + u16::from(b[i + 2] - b'0') * 8 + u16::from(b[i + 3] - b'0');
            out.push(v as u8);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses `/proc/self/mountinfo` (mount point in field 5, per-mount options in field 6, the
/// filesystem type after the `-` separator).
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            Some(Mount {
                point: PathBuf::from(unescape(f.get(4)?)),
                options: f.get(5)?.split(',').map(String::from).collect(),
                fstype: f.get(sep + 1).map(|s| s.to_string()).unwrap_or_default(),
            })
        })
        .collect()
}

/// Parses `/proc/mounts` (device, mount point, type, options).
pub fn parse_proc_mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(Mount {
                point: PathBuf::from(unescape(f.get(1)?)),
                options: f.get(3)?.split(',').map(String::from).collect(),
                fstype: f.get(2)?.to_string(),
            })
        })
        .collect()
}

/// The mount holding `path`: the longest mount point that is a prefix of it (the last one listed
/// wins among equals, as later mounts hide earlier ones).
pub fn mount_of<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    mounts
        .iter()
        .enumerate()
        .filter(|(_, m)| path.starts_with(&m.point))
        .max_by_key(|(i, m)| (m.point.components().count(), *i))
        .map(|(_, m)| m)
}

/// `plugin.noexec`: the plugin's directory must not be mounted noexec (dlopen would fail).
pub fn check_noexec(host: &Host, plugin: &Path) -> Check {
    const NAME: &str = "plugin.noexec";
    let mounts = match std::fs::read_to_string(host.path("/proc/self/mountinfo")) {
        Ok(t) => parse_mountinfo(&t),
        Err(_) => match std::fs::read_to_string(host.path("/proc/mounts")) {
            Ok(t) => parse_proc_mounts(&t),
            Err(e) => {
                return Check::warn(
                    NAME,
                    format!("cannot read the mount table (/proc/self/mountinfo, /proc/mounts): {e}"),
                    "run the doctor where /proc is mounted",
                );
            }
        },
    };
    let dir = plugin.parent().unwrap_or(Path::new("/"));
    // On the real root, resolve symlinks so the match is against the mount that really holds it.
    let dir = if host.root == Path::new("/") {
        std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
    } else {
        dir.to_path_buf()
    };
    match mount_of(&mounts, &dir) {
        None => Check::warn(
            NAME,
            format!("no mount in the table holds {}", dir.display()),
            "check the plugin path is absolute",
        ),
        Some(m) if m.options.iter().any(|o| o == "noexec") => Check::fail(
            NAME,
            format!(
                "{} is on {} ({}) mounted noexec: the plugin cannot be loaded from there",
                dir.display(),
                m.point.display(),
                m.fstype
            ),
            "copy libnccl-net.so to an executable directory (e.g. /usr/local/tcpx/lib64) and point --plugin there",
        ),
        Some(m) => Check::ok(
            NAME,
            format!(
                "{} is on {} ({}), not noexec",
                dir.display(),
                m.point.display(),
                m.fstype
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::{TempRoot, simple_host};

    #[test]
    fn mount_tables_and_longest_prefix() {
        let mi = "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                  30 22 0:25 / /var/lib/tcpx rw,nosuid,nodev,noexec shared:9 - ext4 /dev/sdb rw\n\
                  31 22 0:26 / /var/lib/tcpx\\040x rw shared:10 - tmpfs tmpfs rw\n";
        let m = parse_mountinfo(mi);
        assert_eq!(m.len(), 3);
        assert_eq!(m[2].point, PathBuf::from("/var/lib/tcpx x"));
        let hit = mount_of(&m, Path::new("/var/lib/tcpx/lib64")).unwrap();
        assert_eq!(hit.point, PathBuf::from("/var/lib/tcpx"));
        // A prefix match is by components: /var/lib/tcpxfoo is not under /var/lib/tcpx.
        assert_eq!(
            mount_of(&m, Path::new("/var/lib/tcpxfoo")).unwrap().point,
            PathBuf::from("/")
        );
        let pm = parse_proc_mounts("/dev/sda1 / ext4 rw 0 0\ntmpfs /run tmpfs rw,noexec 0 0\n");
        assert_eq!(
            mount_of(&pm, Path::new("/run/x")).unwrap().options,
            vec!["rw", "noexec"]
        );
    }

    #[test]
    fn noexec_ok_warn_fail() {
        let root = TempRoot::new("noexec");
        let h = simple_host(&root, &[]);
        // Unreadable mount table: warn.
        let c = check_noexec(&h, Path::new("/usr/local/tcpx/lib64/libnccl-net.so"));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        root.write(
            "/proc/self/mountinfo",
            "22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n\
             30 22 0:25 / /var/lib/tcpx rw,nosuid,noexec - ext4 /dev/sdb rw\n",
        );
        let c = check_noexec(&h, Path::new("/usr/local/tcpx/lib64/libnccl-net.so"));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        let c = check_noexec(&h, Path::new("/var/lib/tcpx/lib64/libnccl-net.so"));
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("noexec") && c.fix.contains("/usr/local/tcpx/lib64"));
        // /proc/mounts is the fallback.
        std::fs::remove_file(root.0.join("proc/self/mountinfo")).unwrap();
        root.write(
            "/proc/mounts",
            "/dev/sda1 / ext4 rw 0 0\ntmpfs /opt tmpfs rw,noexec 0 0\n",
        );
        assert_eq!(check_noexec(&h, Path::new("/opt/p.so")).level, Level::Fail);
    }
}
