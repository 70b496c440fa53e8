//! [`RankEnv`]: the values of torchrun's variables ([`crate::env`]) for one rank, and the one
//! place in this workspace that writes them.

use std::process::Command;
use std::time::SystemTime;

use crate::env::*;
use crate::secret::JobSecret;

/// Everything torchrun tells one rank about its place in the job.
///
/// ```
/// let env = ddp_run::RankEnv::single_node(1, 2, 29500);
/// let vars = env.vars();
/// assert!(vars.contains(&("RANK", "1".to_string())));
/// assert!(vars.contains(&("WORLD_SIZE", "2".to_string())));
/// assert!(vars.contains(&("MASTER_ADDR", "127.0.0.1".to_string())));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// Global rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// This node's index.
    pub group_rank: usize,
    /// Number of nodes.
    pub group_world_size: usize,
    /// The workers' role name.
    pub role: String,
    /// Host of rank 0.
    pub master_addr: String,
    /// Port where the ranks meet.
    pub master_port: u16,
    /// Restarts before this attempt.
    pub restart_count: u32,
    /// The most restarts the launcher will make.
    pub max_restarts: u32,
    /// The job's id.
    pub run_id: String,
    /// `OMP_NUM_THREADS` for the rank, if the launcher sets it.
    pub omp_num_threads: Option<usize>,
    /// `TORCH_NCCL_ASYNC_ERROR_HANDLING` for the rank.
    pub nccl_async_error_handling: String,
    /// The job's secret ([`DDP_SECRET`]), the same for every rank of the job. `None`: not
    /// set (ddp-comm then takes one from the user's key file and the run id).
    pub secret: Option<JobSecret>,
    /// When the job started ([`DDP_JOB_STARTED`]), the same for every attempt: a restarted
    /// rank counts its time limit from it. `None`: not set.
    pub job_started: Option<SystemTime>,
}

impl RankEnv {
    /// Rank `rank` of `world_size` ranks on this machine, meeting at `127.0.0.1:master_port`;
    /// the other values as torchrun sets them on a first attempt, and no secret (give every
    /// rank of a job the same with [`RankEnv::secret`]).
    pub fn single_node(rank: usize, world_size: usize, master_port: u16) -> Self {
        Self {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            group_rank: 0,
            group_world_size: 1,
            role: "default".to_string(),
            master_addr: "127.0.0.1".to_string(),
            master_port,
            restart_count: 0,
            max_restarts: 0,
            run_id: format!("ddp-run-{master_port}"),
            omp_num_threads: None,
            nccl_async_error_handling: "1".to_string(),
            secret: None,
            job_started: None,
        }
    }

    /// The variables and their values, in torchrun's order; never the secret, so that
    /// they can be shown.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = vec![
            (RANK, self.rank.to_string()),
            (GROUP_RANK, self.group_rank.to_string()),
            (ROLE_RANK, self.rank.to_string()),
            (ROLE_NAME, self.role.clone()),
            (LOCAL_WORLD_SIZE, self.local_world_size.to_string()),
            (WORLD_SIZE, self.world_size.to_string()),
            (GROUP_WORLD_SIZE, self.group_world_size.to_string()),
            (ROLE_WORLD_SIZE, self.world_size.to_string()),
            (MASTER_ADDR, self.master_addr.clone()),
            (MASTER_PORT, self.master_port.to_string()),
            (TORCHELASTIC_RESTART_COUNT, self.restart_count.to_string()),
            (TORCHELASTIC_MAX_RESTARTS, self.max_restarts.to_string()),
            (TORCHELASTIC_RUN_ID, self.run_id.clone()),
            (TORCHELASTIC_USE_AGENT_STORE, "False".to_string()),
            (
                TORCH_NCCL_ASYNC_ERROR_HANDLING,
                self.nccl_async_error_handling.clone(),
            ),
            (LOCAL_RANK, self.local_rank.to_string()),
        ];
        if let Some(n) = self.omp_num_threads {
            vars.push((OMP_NUM_THREADS, n.to_string()));
        }
        if let Some(at) = self.job_started {
            vars.push((DDP_JOB_STARTED, crate::job_start::format(at)));
        }
        vars
    }

    /// Sets the variables on `cmd` (over any inherited values), and `DDP_SECRET` when
    /// there is a secret (an inherited `DDP_SECRET` stays otherwise).
    pub fn apply<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        for (name, value) in self.vars() {
            cmd.env(name, value);
        }
        if let Some(secret) = &self.secret {
            secret.apply(cmd);
        }
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_node_gets_global_ranks_after_the_first() {
        let env = RankEnv {
            rank: 5,
            local_rank: 1,
            local_world_size: 4,
            world_size: 8,
            group_rank: 1,
            group_world_size: 2,
            role: "trainer".into(),
            master_addr: "node0".into(),
            restart_count: 2,
            max_restarts: 3,
            run_id: "job7".into(),
            omp_num_threads: Some(4),
            job_started: Some(std::time::UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 5)),
            ..RankEnv::single_node(0, 1, 29400)
        };
        let got: Vec<(&str, String)> = env.vars();
        let want: Vec<(&str, &str)> = vec![
            ("RANK", "5"),
            ("GROUP_RANK", "1"),
            ("ROLE_RANK", "5"),
            ("ROLE_NAME", "trainer"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("WORLD_SIZE", "8"),
            ("GROUP_WORLD_SIZE", "2"),
            ("ROLE_WORLD_SIZE", "8"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("LOCAL_RANK", "1"),
            ("OMP_NUM_THREADS", "4"),
            ("DDP_JOB_STARTED", "1700000000.000000005"),
        ];
        let got: Vec<(&str, &str)> = got.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn apply_sets_every_variable_on_the_command() {
        let mut cmd = Command::new("true");
        RankEnv::single_node(1, 3, 20001).apply(&mut cmd);
        let set: Vec<(String, String)> = cmd
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.unwrap().to_string_lossy().into_owned(),
                )
            })
            .collect();
        assert_eq!(set.len(), 16, "{set:?}");
        assert!(set.contains(&("LOCAL_RANK".into(), "1".into())));
        assert!(set.contains(&("MASTER_PORT".into(), "20001".into())));
        assert!(!set
            .iter()
            .any(|(k, _)| k == "OMP_NUM_THREADS" || k == "DDP_SECRET"));
    }

    #[test]
    fn the_secret_is_applied_but_never_listed_nor_shown() {
        let secret = JobSecret::from_hex("00112233445566778899aabbccddeeff").unwrap();
        let env = RankEnv {
            secret: Some(secret),
            ..RankEnv::single_node(0, 2, 20001)
        };
        assert!(!env.vars().iter().any(|(k, _)| *k == DDP_SECRET));
        assert!(!format!("{env:?}").contains("0011"), "{env:?}");
        let mut cmd = Command::new("true");
        env.apply(&mut cmd);
        let value = cmd
            .get_envs()
            .find(|(k, _)| *k == DDP_SECRET)
            .and_then(|(_, v)| v);
        assert_eq!(
            value.and_then(|v| v.to_str()),
            Some("00112233445566778899aabbccddeeff")
        );
        assert_eq!(cmd.get_args().count(), 0);
    }
}
