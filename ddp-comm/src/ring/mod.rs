//! The CPU ring: the backend that carries CPU tensors (and every byte-level collective), and
//! the links between ring neighbours, shared memory on one host and TCP between hosts.
//!
//! - `cpu.rs`: the backend, which runs ring schedules over the rank's two links.
//! - `header.rs`: the header each collective starts with, and its description in words.
//! - `schedule.rs`: ring schedules (which byte ranges move at each step) and the ring order.
//! - `link.rs`: a link's two ends, TCP or shared memory, behind one non-blocking interface.
//! - `connect.rs`: connecting the two links once rendezvous has decided what carries each.
//! - `shm.rs`: shared-memory rings, one direction of a link between two ranks of one host.

pub(crate) mod connect;
pub(crate) mod cpu;
pub(crate) mod header;
pub(crate) mod link;
pub(crate) mod schedule;
pub(crate) mod shm;
