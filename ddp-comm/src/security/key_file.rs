//! The per-user key file: where the job's secret comes from when no launcher gave one
//! (plain torchrun, SLURM's `srun`, a program's own `Options::new`).
//!
//! A file that only this user can read holds 256 random bits in hexadecimal. Every rank of
//! a user's job reads the same file (one host, or hosts that share the home folder), and the
//! key is derived from it together with the run id (`secret.rs`). Whoever runs as another
//! user cannot read it; whoever runs as this user can read `/proc/<pid>/environ` anyway,
//! so this file protects exactly what `DDP_SECRET` does.
//!
//! The first rank to need it creates it: the digits go into a temporary file of mode 0600
//! beside it, which is then hard-linked into place. `link` fails if the name exists, so
//! when several ranks race, one wins and the others read the winner's file; nobody ever
//! reads a half-written one.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::ops::RangeInclusive;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::CommError;

/// Environment variable naming the key file, instead of the per-user default.
pub const SECRET_FILE_ENV: &str = "DDP_SECRET_FILE";

/// What to do when no key file can be made.
const INSTEAD: &str = "set DDP_SECRET on every rank instead (e.g. `export \
                       DDP_SECRET=$(openssl rand -hex 16)`), or DDP_SECRET_FILE to a file \
                       that can be made";
/// Random bytes in a file this crate creates (256 bits).
const CREATED_BYTES: usize = 32;
/// The most bytes read from a key file: 128 hexadecimal digits and some white space.
const MAX_FILE_BYTES: u64 = 1024;

/// The default key file: `$XDG_CONFIG_HOME/ddp/secret` when that is an absolute path,
/// else `$HOME/.config/ddp/secret` (the XDG base directory rule). `None` without either.
pub(crate) fn default_path(get: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let absolute = |name: &str| get(name).map(PathBuf::from).filter(|p| p.is_absolute());
    let config =
        absolute("XDG_CONFIG_HOME").or_else(|| absolute("HOME").map(|h| h.join(".config")))?;
    Some(config.join("ddp").join("secret"))
}

/// The secret bytes in `path` (their number in `accept`), creating the file (and, if
/// `make_folder`, its folder with mode 0700) when it does not exist yet. The second value
/// says whether this call made it.
pub(crate) fn read_or_create(
    path: &Path,
    make_folder: bool,
    accept: RangeInclusive<usize>,
) -> Result<(Vec<u8>, bool), CommError> {
    let error = |detail: String| CommError::SecretFile {
        path: path.to_path_buf(),
        detail,
    };
    match read(path, &accept) {
        Err(ReadError::Missing) => {}
        Err(ReadError::Bad(detail)) => return Err(error(detail)),
        Ok(bytes) => return Ok((bytes, false)),
    }
    let folder = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if make_folder {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(folder)
            .map_err(|e| error(format!("cannot create its folder ({e}); {INSTEAD}")))?;
    }
    let made =
        create(path, folder).map_err(|e| error(format!("cannot create it ({e}); {INSTEAD}")))?;
    match read(path, &accept) {
        Ok(bytes) => Ok((bytes, made)),
        Err(ReadError::Missing) => Err(error("vanished right after it was created".into())),
        Err(ReadError::Bad(detail)) => Err(error(detail)),
    }
}

enum ReadError {
    Missing,
    Bad(String),
}

/// Reads and checks an existing key file: a regular file of this user, readable by no one
/// else, holding hexadecimal digits for a number of bytes in `accept`. Errors never quote
/// the contents.
fn read(path: &Path, accept: &RangeInclusive<usize>) -> Result<Vec<u8>, ReadError> {
    // Without blocking: opening a FIFO for reading waits for a writer, and a terminal could
    // become the controlling one. A regular file reads the same either way; anything else
    // is refused below, before a byte is read.
    let opened = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path);
    let mut file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ReadError::Missing),
        Err(e) => return Err(ReadError::Bad(format!("cannot open it ({e}); {INSTEAD}"))),
    };
    let meta = file
        .metadata()
        .map_err(|e| ReadError::Bad(format!("cannot read its metadata: {e}")))?;
    let me = rustix::process::geteuid().as_raw();
    if !meta.is_file() {
        return Err(ReadError::Bad("is not a regular file".into()));
    }
    if meta.uid() != me {
        return Err(ReadError::Bad(format!(
            "belongs to uid {}, not to this user (uid {me}): use your own key file, or set \
             DDP_SECRET",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(ReadError::Bad(format!(
            "can be read or written by other users (mode {:04o}): run `chmod 600 {}`",
            meta.mode() & 0o7777,
            path.display()
        )));
    }
    let mut text = Vec::new();
    (&mut file)
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(|e| ReadError::Bad(format!("cannot read it: {e}")))?;
    let digits_wanted = format!("{} to {}", accept.start() * 2, accept.end() * 2);
    let hidden = |what: &str| {
        ReadError::Bad(format!(
            "does not hold {digits_wanted} hexadecimal digits (<hidden: {} bytes, {what}>); \
             delete it to have a new one made",
            text.len()
        ))
    };
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(hidden("too long"));
    }
    let digits = std::str::from_utf8(&text)
        .map_err(|_| hidden("not text"))?
        .trim();
    let bytes = decode_hex(digits).ok_or_else(|| hidden("not all hexadecimal digits"))?;
    if !accept.contains(&bytes.len()) {
        return Err(hidden("another number of hexadecimal digits"));
    }
    Ok(bytes)
}

/// Writes fresh digits beside `path` and links them into place. `Ok(false)`: another
/// process linked its own first (its file stands).
fn create(path: &Path, folder: &Path) -> io::Result<bool> {
    // The secret, then a tag that makes the temporary name unique.
    let mut random = [0u8; CREATED_BYTES + 8];
    getrandom::fill(&mut random).map_err(|e| io::Error::other(format!("no random bytes: {e}")))?;
    let (secret, tag) = random.split_at(CREATED_BYTES);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let temp = folder.join(format!(".{name}.{}.{}", std::process::id(), hex(tag)));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&temp)?;
    let written = file
        .write_all(format!("{}\n", hex(secret)).as_bytes())
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::hard_link(&temp, path));
    // The temporary name goes whatever happened; the linked name keeps the file.
    let _ = std::fs::remove_file(&temp);
    match written {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// The bytes of hexadecimal text (either case); `None` unless it is all pairs of digits.
pub(crate) fn decode_hex(text: &str) -> Option<Vec<u8>> {
    let digits = text.as_bytes();
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    let value = |d: u8| (d as char).to_digit(16).map(|v| v as u8);
    digits
        .chunks_exact(2)
        .map(|pair| Some((value(pair[0])? << 4) | value(pair[1])?))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const ACCEPT: RangeInclusive<usize> = 16..=64;

    fn detail(err: CommError) -> String {
        match err {
            CommError::SecretFile { detail, .. } => detail,
            other => panic!("expected SecretFile, got {other:?}"),
        }
    }

    #[test]
    fn the_default_follows_the_xdg_rule() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        assert_eq!(
            default_path(env(&[("HOME", "/home/a"), ("XDG_CONFIG_HOME", "/cfg")])),
            Some(PathBuf::from("/cfg/ddp/secret"))
        );
        // A relative XDG_CONFIG_HOME is to be ignored, as the specification says.
        assert_eq!(
            default_path(env(&[("HOME", "/home/a"), ("XDG_CONFIG_HOME", "cfg")])),
            Some(PathBuf::from("/home/a/.config/ddp/secret"))
        );
        assert_eq!(default_path(env(&[("HOME", "")])), None);
        assert_eq!(default_path(env(&[])), None);
    }

    #[test]
    fn a_missing_file_is_made_private_and_then_reused() {
        let tmp = ddp_testkit::temp_dir("key-file-make");
        let dir = tmp.path();
        let path = dir.join("nested/ddp/secret");
        let (first, made) = read_or_create(&path, true, ACCEPT).unwrap();
        assert!(made);
        assert_eq!(first.len(), CREATED_BYTES);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, format!("{}\n", hex(&first)));
        assert_eq!(read_or_create(&path, true, ACCEPT).unwrap(), (first, false));
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["secret"]);
    }

    #[test]
    fn racing_ranks_all_read_the_one_file_that_won() {
        let tmp = ddp_testkit::temp_dir("key-file-race");
        let dir = tmp.path();
        let path = dir.join("secret");
        let got: Vec<(Vec<u8>, bool)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| read_or_create(&path, false, ACCEPT).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|(bytes, _)| *bytes == got[0].0));
        assert_eq!(got.iter().filter(|(_, made)| *made).count(), 1);
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 1);
    }

    #[test]
    fn a_file_others_can_read_is_refused_with_the_fix() {
        let tmp = ddp_testkit::temp_dir("key-file-mode");
        let dir = tmp.path();
        let path = dir.join("secret");
        read_or_create(&path, false, ACCEPT).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let why = detail(read_or_create(&path, false, ACCEPT).unwrap_err());
        assert_eq!(
            why,
            format!(
                "can be read or written by other users (mode 0644): run `chmod 600 {}`",
                path.display()
            )
        );
    }

    #[test]
    fn bad_contents_are_refused_without_quoting_them() {
        let tmp = ddp_testkit::temp_dir("key-file-contents");
        let dir = tmp.path();
        let path = dir.join("secret");
        let write = |bytes: &[u8]| {
            std::fs::write(&path, bytes).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        };
        for (bytes, what) in [
            (
                &b"0123456789abcdef"[..],
                "16 bytes, another number of hexadecimal digits",
            ),
            (
                &b"zz112233445566778899aabbccddeeff"[..],
                "32 bytes, not all hexadecimal digits",
            ),
            (&[0xff; 40][..], "not text"),
            (&[b'a'; 2000][..], "too long"),
        ] {
            write(bytes);
            let why = detail(read_or_create(&path, false, ACCEPT).unwrap_err());
            assert!(
                why.starts_with("does not hold 32 to 128 hexadecimal digits"),
                "{why}"
            );
            assert!(why.contains(what), "{why}");
            assert!(
                !why.contains("0123456789") && !why.contains("zz11"),
                "{why}"
            );
        }
        // White space around the digits is fine, and upper case is the same key.
        write(b"  00112233445566778899AABBCCDDEEFF\n\n");
        assert_eq!(
            read_or_create(&path, false, ACCEPT).unwrap().0,
            decode_hex("00112233445566778899aabbccddeeff").unwrap()
        );
    }

    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let tmp = ddp_testkit::temp_dir("key-file-fifo");
        // A FIFO at the key's path is refused without waiting for a writer (an open for
        // reading would block until one comes); the read runs on a thread so that a
        // blocked open fails the test instead of hanging it.
        let fifo = tmp.path().join("secret");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(read_or_create(&fifo, false, ACCEPT));
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("reading a FIFO as the key file blocked");
        assert_eq!(detail(got.unwrap_err()), "is not a regular file");
    }

    #[test]
    fn a_folder_or_another_users_file_is_refused() {
        let tmp = ddp_testkit::temp_dir("key-file-kind");
        let dir = tmp.path();
        let folder = dir.join("secret");
        std::fs::create_dir(&folder).unwrap();
        assert_eq!(
            detail(read_or_create(&folder, false, ACCEPT).unwrap_err()),
            "is not a regular file"
        );
        let path = dir.join("theirs");
        read_or_create(&path, false, ACCEPT).unwrap();
        // Only root can give a file away; elsewhere this half is not checkable.
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
            let why = detail(read_or_create(&path, false, ACCEPT).unwrap_err());
            assert!(
                why.starts_with("belongs to uid 65534, not to this user (uid 0)"),
                "{why}"
            );
        }
        // A path through a file: the error says what to do.
        let plain = dir.join("plain");
        std::fs::write(&plain, b"").unwrap();
        let why = detail(read_or_create(&plain.join("ddp/secret"), true, ACCEPT).unwrap_err());
        assert!(
            why.starts_with("cannot open it (Not a directory") && why.contains("set DDP_SECRET"),
            "{why}"
        );
        // A folder that cannot be made (not even root makes one in /proc).
        let why = detail(
            read_or_create(Path::new("/proc/ddp-comm-test/ddp/secret"), true, ACCEPT).unwrap_err(),
        );
        assert!(
            why.starts_with("cannot create its folder (") && why.contains("set DDP_SECRET"),
            "{why}"
        );
        // Without the folder, nothing is created and the error says what to do.
        let why = detail(read_or_create(&dir.join("none/secret"), false, ACCEPT).unwrap_err());
        assert!(
            why.starts_with("cannot create it (") && why.contains("DDP_SECRET"),
            "{why}"
        );
    }
}
