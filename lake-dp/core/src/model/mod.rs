//! The core model of DESIGN §3: who may share a block ([`namespace`]), what a
//! block is called ([`key`]), what its bytes look like ([`layout`]) and where
//! a copy of it lives ([`replica`]).

pub mod key;
pub mod layout;
pub mod namespace;
pub mod replica;
