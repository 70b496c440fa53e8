//! What a group is told before it starts: this rank's place in the job and the settings the
//! environment can give, and what only code chooses.
//!
//! - `env.rs`: [`EnvConfig`](crate::EnvConfig), read from torchrun's, SLURM's or `ddp-run`'s
//!   variables (the crate's one reader of torchrun's variables), or given in code.
//! - `options.rs`: [`Options`](crate::Options) and [`Backend`](crate::Backend), what
//!   `ProcessGroup::new` takes.

pub(crate) mod env;
pub(crate) mod options;
