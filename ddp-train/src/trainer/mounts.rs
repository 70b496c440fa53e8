//! Whether the run directory's lock reaches other nodes: some mounts take `flock` locks
//! that only the node holding them sees, and so refuse a second job only where its rank 0
//! runs on the same node.

use std::path::{Path, PathBuf};

/// Where the mount holding `out` takes `flock` locks local to this node, that mount and why
/// (`/scratch (nfs, mounted local_lock=all)`), by `/proc/self/mountinfo`. `None` where its
/// locks are shared, or where `out` or the mount table cannot be read.
pub(super) fn node_local_locks(out: &Path) -> Option<String> {
    let path = out.canonicalize().ok()?;
    let table = std::fs::read("/proc/self/mountinfo").ok()?;
    node_local_in(&String::from_utf8_lossy(&table), &path)
}

/// [`node_local_locks`] of the canonical `path`, by `mountinfo` (the text of
/// `/proc/self/mountinfo`): its mount is the one whose mount point is the longest prefix of
/// `path`, the last listed where mounts are stacked on one point. Local to the node: NFS
/// mounted `nolock` or `local_lock=flock` or `all` (in the file system's options), Lustre
/// mounted `localflock`, and BeeGFS, whose client keeps `flock` on its node unless its
/// configuration sets `tuneUseGlobalFileLocks` (which the mount table does not show).
fn node_local_in(mountinfo: &str, path: &Path) -> Option<String> {
    let mut found: Option<(PathBuf, &str, &str)> = None;
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        // id parent major:minor root point options [optional...] - fstype source super-options
        let Some(dash) = fields.iter().skip(6).position(|f| *f == "-") else {
            continue;
        };
        let (Some(point), Some(fstype)) = (fields.get(4), fields.get(6 + dash + 1)) else {
            continue;
        };
        let point = unescape(point);
        let longer = found
            .as_ref()
            .is_none_or(|(best, ..)| point.as_os_str().len() >= best.as_os_str().len());
        if path.starts_with(&point) && longer {
            let options = fields.get(6 + dash + 3).copied().unwrap_or("");
            found = Some((point, fstype, options));
        }
    }
    let (point, fstype, options) = found?;
    let mounted = |local: &[&str]| {
        let option = options.split(',').find(|o| local.contains(o))?;
        Some(format!("{} ({fstype}, mounted {option})", point.display()))
    };
    match fstype {
        "nfs" | "nfs4" => mounted(&["nolock", "local_lock=flock", "local_lock=all"]),
        "lustre" => mounted(&["localflock"]),
        "beegfs" => Some(format!(
            "{} (beegfs, whose flock is local to a node unless its clients set \
             tuneUseGlobalFileLocks)",
            point.display()
        )),
        _ => None,
    }
}

/// A mount point as the mount table writes it, with a space, tab, newline or backslash as
/// an octal escape (`\040`), decoded.
fn unescape(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| {
            bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)) && d[0] <= b'3'
        });
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as a Linux client writes them: the root, a home on ext4, an NFSv4 share with
    /// server-side locks, an NFSv3 scratch with node-local ones, and under the share a
    /// nested mount whose point has a space.
    const TABLE: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
29 22 259:3 / /home rw,relatime shared:2 - ext4 /dev/nvme0n1p3 rw
412 22 0:52 / /shared rw,relatime shared:220 - nfs4 fs1:/export rw,vers=4.2,rsize=1048576,\
wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.5,\
local_lock=none,addr=10.0.0.1
413 22 0:53 / /scratch rw,relatime shared:221 - nfs fs2:/scratch rw,vers=3,rsize=1048576,\
wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,mountaddr=10.0.0.2,\
mountvers=3,mountport=20048,mountproto=udp,local_lock=all,addr=10.0.0.2
414 412 0:54 / /shared/local\\040runs rw,relatime shared:222 - nfs fs3:/runs rw,vers=3,\
hard,proto=tcp,timeo=600,retrans=2,sec=sys,local_lock=flock,addr=10.0.0.3
";

    fn local(table: &str, path: &str) -> Option<String> {
        node_local_in(table, Path::new(path))
    }

    #[test]
    fn nfs_locks_are_node_local_where_mounted_so() {
        assert_eq!(local(TABLE, "/shared/runs/a"), None);
        assert_eq!(
            local(TABLE, "/scratch/runs/a").as_deref(),
            Some("/scratch (nfs, mounted local_lock=all)")
        );
        let nolock = "415 22 0:55 / /data rw,relatime - nfs fs4:/data rw,vers=3,hard,nolock,\
                      proto=tcp,sec=sys,local_lock=all,addr=10.0.0.4\n";
        assert_eq!(
            local(nolock, "/data/run").as_deref(),
            Some("/data (nfs, mounted nolock)")
        );
        // Only flock's own option counts: fcntl's locks local (`posix`) leave flock shared.
        let posix = "416 22 0:56 / /data rw - nfs4 fs4:/data rw,vers=4.1,local_lock=posix\n";
        assert_eq!(local(posix, "/data/run"), None);
    }

    #[test]
    fn a_path_under_a_nested_mount_takes_that_mount() {
        assert_eq!(
            local(TABLE, "/shared/local runs/job-7").as_deref(),
            Some("/shared/local runs (nfs, mounted local_lock=flock)")
        );
        // A name that only starts like the mount point is not under it.
        assert_eq!(local(TABLE, "/shared/local runs2/job-7"), None);
        assert_eq!(local(TABLE, "/home/me/run"), None);
        assert_eq!(local(TABLE, "/tmp/run"), None);
        // Mounts stacked on one point: the last listed is the one seen.
        let stacked = format!("{TABLE}420 22 0:57 / /scratch rw - ext4 /dev/sdb1 rw\n");
        assert_eq!(local(&stacked, "/scratch/runs/a"), None);
    }

    #[test]
    fn lustre_localflock_and_beegfs_are_node_local() {
        let lustre = |opts: &str| {
            format!(
                "520 22 0:60 / /lustre rw,relatime shared:300 - lustre 10.0.0.3@o2ib:/fs1 {opts}\n"
            )
        };
        assert_eq!(
            local(&lustre("rw,localflock,lazystatfs"), "/lustre/me/run").as_deref(),
            Some("/lustre (lustre, mounted localflock)")
        );
        assert_eq!(
            local(&lustre("rw,flock,lazystatfs"), "/lustre/me/run"),
            None
        );
        let beegfs = "530 22 0:61 / /mnt/beegfs rw,relatime shared:310 - beegfs beegfs_nodev \
                      rw,cfgFile=/etc/beegfs/beegfs-client.conf\n";
        assert_eq!(
            local(beegfs, "/mnt/beegfs/run").as_deref(),
            Some(
                "/mnt/beegfs (beegfs, whose flock is local to a node unless its clients set \
                 tuneUseGlobalFileLocks)"
            )
        );
    }

    #[test]
    fn mount_points_are_unescaped() {
        assert_eq!(
            unescape(r"/a\040b\011c\134d\012"),
            PathBuf::from("/a b\tc\\d\n")
        );
        // Not an escape: left as written.
        assert_eq!(unescape(r"/a\09x\4"), PathBuf::from(r"/a\09x\4"));
    }
}
