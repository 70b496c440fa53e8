//! The loopback cap of the `overlap` group's last rows: loopback's bandwidth held at
//! 1 Gbit/s with `tc`'s token bucket filter (root only), always removed afterwards, also on
//! an error, a panic, Ctrl-C or the death of xtask ([`LoopbackCap`]).

use std::process::{Command, Stdio};

use anyhow::{bail, Result};

use super::runner::say;

/// tc's token bucket filter that caps loopback: 1 Gbit/s.
const LOOPBACK_TBF: [&str; 7] = ["tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"];
/// Removes the cap once the process whose id is `$1` has ended (xtask killed by a signal).
const CAP_WATCHER: &str = "trap '' INT HUP TERM; while kill -0 \"$1\" 2>/dev/null; do \
                           sleep 1; done; tc qdisc del dev lo root 2>/dev/null";

/// What `tc qdisc show dev lo` says is loopback's root queueing discipline.
#[derive(Debug, PartialEq)]
enum RootQdisc {
    /// Loopback's default (`noqueue`), or none shown.
    Default,
    /// A `tbf` at 1 Gbit/s: our cap, left by a run that could not remove it.
    OurCap,
    /// Something else, someone's own: the line.
    Other(String),
}

/// Loopback's root qdisc in the output of `tc qdisc show dev lo`.
fn root_qdisc(shown: &str) -> RootQdisc {
    let Some(line) = shown
        .lines()
        .find(|l| l.split_whitespace().any(|w| w == "root"))
    else {
        return RootQdisc::Default;
    };
    match line.split_whitespace().nth(1) {
        Some("noqueue") => RootQdisc::Default,
        Some("tbf") if line.contains("rate 1Gbit ") => RootQdisc::OurCap,
        _ => RootQdisc::Other(line.trim().to_string()),
    }
}

/// Runs `tc args`; the error says why tc is not usable here.
fn tc(args: &[&str]) -> std::result::Result<String, String> {
    let out = Command::new("tc")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run tc ({e}); it is in iproute2"))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let hint = if err.contains("Operation not permitted") {
        " (changing qdiscs needs root)"
    } else if err.contains("unknown") || err.contains("No such file") {
        " (the kernel lacks the sch_tbf module)"
    } else {
        ""
    };
    Err(format!("`tc {}` failed: {err}{hint}", args.join(" ")))
}

/// Loopback capped at 1 Gbit/s while this lives: removed by [`LoopbackCap::remove`] or on
/// drop (an error, a panic, Ctrl-C while ranks run: `ddp_run::launch` turns it into an
/// error). A watcher process, in a process group of its own so that Ctrl-C at the terminal
/// does not reach it, removes the cap if xtask dies without dropping this (Ctrl-C while
/// PyTorch runs, SIGKILL). A cap left over from an earlier run is removed first.
pub(super) struct LoopbackCap {
    watcher: Option<std::process::Child>,
    removed: bool,
}

impl LoopbackCap {
    /// Caps loopback, first removing a cap an earlier run left; the error says why it
    /// cannot (no tc, not root, someone else's qdisc on lo).
    pub(super) fn install() -> std::result::Result<Self, String> {
        match root_qdisc(&tc(&["qdisc", "show", "dev", "lo"])?) {
            RootQdisc::Default => {}
            RootQdisc::OurCap => {
                say("overlap: removing a loopback cap left by an earlier run");
                tc(&["qdisc", "del", "dev", "lo", "root"])?;
            }
            RootQdisc::Other(line) => {
                return Err(format!(
                    "lo already has a root qdisc ({line}); not replacing it"
                ))
            }
        }
        let mut add = vec!["qdisc", "add", "dev", "lo", "root"];
        add.extend(LOOPBACK_TBF);
        tc(&add)?;
        let watcher = {
            use std::os::unix::process::CommandExt;
            Command::new("sh")
                .args(["-c", CAP_WATCHER, "xtask-loopback-cap"])
                .arg(std::process::id().to_string())
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()
        };
        Ok(LoopbackCap {
            watcher,
            removed: false,
        })
    }

    /// Removes the cap and checks that loopback is back to its default.
    pub(super) fn remove(mut self) -> Result<()> {
        self.removed = true;
        let deleted = tc(&["qdisc", "del", "dev", "lo", "root"]);
        let shown = tc(&["qdisc", "show", "dev", "lo"]).map_err(anyhow::Error::msg)?;
        if root_qdisc(&shown) != RootQdisc::Default {
            bail!(
                "loopback is still capped ({}; {}); remove it with `tc qdisc del dev lo root`",
                shown.trim(),
                deleted.err().unwrap_or_default()
            );
        }
        Ok(())
    }
}

impl Drop for LoopbackCap {
    fn drop(&mut self) {
        if !self.removed {
            let _ = tc(&["qdisc", "del", "dev", "lo", "root"]);
        }
        if let Some(mut watcher) = self.watcher.take() {
            let _ = watcher.kill();
            let _ = watcher.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_loopbacks_root_qdisc() {
        assert_eq!(
            root_qdisc("qdisc noqueue 0: root refcnt 2 \n"),
            RootQdisc::Default
        );
        assert_eq!(root_qdisc(""), RootQdisc::Default);
        assert_eq!(
            root_qdisc("qdisc tbf 8001: root refcnt 2 rate 1Gbit burst 262125b lat 50ms \n"),
            RootQdisc::OurCap
        );
        assert_eq!(
            root_qdisc("qdisc netem 8002: root refcnt 2 limit 1000 delay 10ms\n"),
            RootQdisc::Other("qdisc netem 8002: root refcnt 2 limit 1000 delay 10ms".into())
        );
        // Someone's own tbf at another rate is theirs.
        assert!(matches!(
            root_qdisc("qdisc tbf 8001: root refcnt 2 rate 10Gbit burst 1Mb lat 50ms"),
            RootQdisc::Other(_)
        ));
    }
}
