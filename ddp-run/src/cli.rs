//! What the `ddp-run` binary is made of, for launchers built on this crate, so that every
//! launcher spells its flags and tells its user alike: torchrun's flags as clap argument
//! groups ([`NodeArgs`], for `#[command(flatten)]`), and [`launch_and_report`], a job run
//! with the binary's messages and exit status.
//!
//! Each flag takes torchrun's spellings (`--node-rank` and `--node_rank`) and, as torchrun,
//! its `PET_*` environment variable (`PET_NODE_RANK`) when the flag is absent.

mod report;

pub use report::{error_message, join_causes, launch_and_report};

use crate::LaunchConfig;

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
