//! What the `ddp-run` binary is made of, for launchers built on this crate, so that every
//! launcher spells its flags and tells its user alike: torchrun's flags as clap argument
//! groups ([`NodeArgs`], for `#[command(flatten)]`), and [`launch_and_report`], a job run
//! with the binary's messages and exit status.
//!
//! Each flag takes torchrun's spellings (`--node-rank` and `--node_rank`) and, as torchrun,
//! its `PET_*` environment variable (`PET_NODE_RANK`) when the flag is absent;
//! [`try_parse_from`] names that variable when its value is refused.

mod report;

pub use report::{
    die_of_interruption, eprint_line, error_message, exit_status, failure_lines,
    interruption_lines, launch_and_report, launch_and_report_outcome, launch_and_report_with,
    print_line, shell_command, Wording,
};

use std::ffi::OsString;

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{ArgMatches, Command, Parser};

use crate::LaunchConfig;

/// Parses `argv` (the program's name first) as `T::try_parse_from` does, and returns the
/// matches too, so that a caller can tell a value typed on the command line from one a
/// `PET_*` variable gave ([`ArgMatches::value_source`]). A variable's value that its flag
/// refuses is named by the variable (`PET_NNODES=abc`), not by a flag never typed.
pub fn try_parse_from<T: Parser>(
    argv: impl IntoIterator<Item = impl Into<OsString>>,
) -> Result<(T, ArgMatches), clap::Error> {
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let mut cmd = T::command();
    let matches = match cmd.try_get_matches_from_mut(&argv) {
        Ok(matches) => matches,
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::InvalidValue | ErrorKind::ValueValidation
            ) =>
        {
            return Err(variable_error(&mut cmd, &argv).unwrap_or(e));
        }
        Err(e) => return Err(e),
    };
    let parsed = T::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))?;
    Ok((parsed, matches))
}

/// Where the command line alone is valid, the error of the first flag whose variable holds
/// a value the flag refuses, naming the variable; `None` otherwise (the error is the
/// command line's own).
fn variable_error(cmd: &mut Command, argv: &[OsString]) -> Option<clap::Error> {
    let typed_only = cmd.clone().mut_args(|a| a.env(None));
    let typed = typed_only.clone().try_get_matches_from(argv).ok()?;
    let bound: Vec<(OsString, String)> = cmd
        .get_arguments()
        .filter(|a| a.get_action().takes_values())
        .filter(|a| typed.value_source(a.get_id().as_str()) != Some(ValueSource::CommandLine))
        .filter_map(|a| Some((a.get_env()?.to_owned(), a.get_long()?.to_string())))
        .collect();
    for (var, long) in bound {
        let Some(value) = std::env::var_os(&var) else {
            continue;
        };
        // The variable's value as if typed, in front of the (valid) command line.
        let mut flag = OsString::from(format!("--{long}="));
        flag.push(&value);
        let mut with_flag = argv.to_vec();
        with_flag.insert(argv.len().min(1), flag);
        let Err(e) = typed_only.clone().try_get_matches_from(with_flag) else {
            continue;
        };
        if !matches!(
            e.kind(),
            ErrorKind::InvalidValue | ErrorKind::ValueValidation
        ) {
            continue;
        }
        let why = std::error::Error::source(&e)
            .map_or_else(|| format!("not a value --{long} takes"), |s| s.to_string());
        let (var, value) = (var.to_string_lossy(), value.to_string_lossy());
        return Some(cmd.error(
            e.kind(),
            format!(
                "invalid value '{value}' of the environment variable {var} (read as --{long}): \
                 {why}; unset {var} or give --{long}"
            ),
        ));
    }
    None
}

/// Where this node's ranks stand among the nodes, and how often the group may restart.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct NodeArgs {
    /// Number of nodes; run the same command on each, with its own --node-rank. torchrun's
    /// MIN:MAX is accepted only with MIN = MAX (no elastic membership).
    #[arg(long, default_value = "1", value_parser = parse_nnodes, env = "PET_NNODES")]
    pub nnodes: usize,
    /// This node's index, from 0.
    #[arg(
        long = "node-rank",
        visible_alias = "node_rank",
        default_value_t = 0,
        env = "PET_NODE_RANK"
    )]
    pub node_rank: usize,
    /// Host of rank 0 (node 0).
    #[arg(
        long = "master-addr",
        visible_alias = "master_addr",
        default_value = "127.0.0.1",
        env = "PET_MASTER_ADDR"
    )]
    pub master_addr: String,
    /// Port where the ranks meet [default: a free port on a single node, 29500 on several].
    #[arg(
        long = "master-port",
        visible_alias = "master_port",
        env = "PET_MASTER_PORT"
    )]
    pub master_port: Option<u16>,
    /// Restart the whole group after a failure, up to K times; each restart runs the same
    /// command with TORCHELASTIC_RESTART_COUNT raised by one.
    #[arg(
        long = "max-restarts",
        visible_alias = "max_restarts",
        value_name = "K",
        default_value_t = 0,
        env = "PET_MAX_RESTARTS"
    )]
    pub max_restarts: u32,
}

impl Default for NodeArgs {
    /// One node, master at 127.0.0.1 on a free port, no restarts.
    fn default() -> Self {
        Self {
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_string(),
            master_port: None,
            max_restarts: 0,
        }
    }
}

impl NodeArgs {
    /// Copies these settings into `config`.
    pub fn apply(&self, config: &mut LaunchConfig) {
        config.nnodes = self.nnodes;
        config.node_rank = self.node_rank;
        config.master_addr.clone_from(&self.master_addr);
        config.master_port = self.master_port;
        config.max_restarts = self.max_restarts;
    }
}

/// `--nnodes N` or `N:N`.
pub fn parse_nnodes(value: &str) -> Result<usize, String> {
    let number = |s: &str| {
        s.trim()
            .parse::<usize>()
            .map_err(|_| format!("'{value}' is not a number of nodes"))
    };
    match value.split_once(':') {
        None => number(value),
        Some((min, max)) => {
            let (min, max) = (number(min)?, number(max)?);
            if min == max {
                Ok(min)
            } else if min > max {
                Err(format!(
                    "'{value}' is not a range of nodes: MIN:MAX with MIN at most MAX"
                ))
            } else {
                Err(format!(
                    "'{value}': a range of nodes needs elastic membership, which ddp-run does \
                     not have; give a fixed number of nodes (torchrun's elastic agent runs \
                     ddp-train on a range: docs/preemption.md)"
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        node: NodeArgs,
    }

    #[test]
    fn torchruns_spellings_are_accepted() {
        let cli = Cli::try_parse_from([
            "x",
            "--nnodes=2:2",
            "--node_rank",
            "1",
            "--master-addr",
            "node0",
            "--master_port=29400",
            "--max_restarts",
            "3",
        ])
        .unwrap();
        assert_eq!(
            cli.node,
            NodeArgs {
                nnodes: 2,
                node_rank: 1,
                master_addr: "node0".into(),
                master_port: Some(29400),
                max_restarts: 3,
            }
        );
        assert_eq!(
            Cli::try_parse_from(["x"]).unwrap().node,
            NodeArgs::default()
        );
    }

    #[test]
    fn elastic_node_ranges_are_refused() {
        assert_eq!(parse_nnodes("3"), Ok(3));
        assert_eq!(parse_nnodes("2:2"), Ok(2));
        assert_eq!(
            parse_nnodes("1:4"),
            Err(
                "'1:4': a range of nodes needs elastic membership, which ddp-run does not \
                 have; give a fixed number of nodes (torchrun's elastic agent runs ddp-train \
                 on a range: docs/preemption.md)"
                    .to_string()
            )
        );
        assert_eq!(
            parse_nnodes("3:2"),
            Err("'3:2' is not a range of nodes: MIN:MAX with MIN at most MAX".to_string())
        );
        assert_eq!(
            parse_nnodes("two"),
            Err("'two' is not a number of nodes".to_string())
        );
    }
}
