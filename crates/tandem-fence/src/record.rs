//! The ownership record of one VM and its transitions, as pure functions (no I/O): which node
//! runs the guest, in which generation, and whether a backup may take it over.
//!
//! ```text
//! <prefix>/vm/<id>/owner = {"gen":7,"state":"protected","node":"primary@a","session":"00…2a",
//!                            "op":"9f…","at_ms":1764150000000}
//!
//!            boot                      protect(S)                   takeover(S) by B
//!  absent ─────────► unprotected{A,g} ◄──────────► protected{A,g,S} ─────────────────►
//!  stopped ──────────►      │            unprotect                    unprotected{B,g+1}
//!                           └─ stop ─► stopped{A,g} ◄── stop ──┘
//!  any state ── operator override naming g ──► stopped{operator,g}
//! ```
//!
//! Every transition is a compare-and-swap on the record's etcd mod revision (see
//! [`crate::owner`]); the functions here decide, from the record read, whether a transition is
//! allowed and what it writes. Each write carries a random `op` so that a writer whose reply
//! was lost recognises its own write when it reads the record back.

use serde::{Deserialize, Serialize};

/// What the record says about the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Shut down on purpose (or released by an operator): a fresh boot may claim the VM.
    Stopped,
    /// `node` runs the only copy; its output passes without a backup's acknowledgement, so no
    /// backup may take over.
    Unprotected,
    /// `node` runs the guest and releases output only on acknowledgements of the backup that
    /// received replication session `session`; that backup may take over.
    Protected,
}

/// The ownership record of one VM.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Record {
    /// Generation: +1 each time another copy of the guest starts (a boot or a takeover).
    pub gen: u64,
    /// What it says.
    pub state: State,
    /// The node running the guest (for `stopped`: who stopped it).
    pub node: String,
    /// The replication session whose backup may take over (`protected` only; 16 hex digits).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "hex_opt")]
    pub session: Option<u64>,
    /// Random id of the write (16 hex digits): a writer recognises its own write by it.
    #[serde(with = "hex")]
    pub op: u64,
    /// When it was written (Unix ms, for operators).
    #[serde(default)]
    pub at_ms: u64,
}

/// Largest stored record accepted (a record is about 150 bytes).
pub const MAX_RECORD: usize = 4096;

impl Record {
    /// The stored value (JSON).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a stored value; `None` if it is not a record.
    pub fn parse(v: &[u8]) -> Option<Record> {
        if v.len() > MAX_RECORD {
            return None;
        }
        serde_json::from_slice(v).ok()
    }

    /// One line for operators: `protected by session 00…2a on "primary@a" (generation 7)`.
    pub fn describe(&self) -> String {
        match self.state {
            State::Stopped => format!(
                "stopped by {:?} (generation {}): a fresh boot may claim it",
                self.node, self.gen
            ),
            State::Unprotected => format!(
                "running on {:?} WITHOUT a replica (generation {}): that node holds the only copy",
                self.node, self.gen
            ),
            State::Protected => format!(
                "running on {:?} protected by replication session {:016x} (generation {})",
                self.node,
                self.session.unwrap_or(0),
                self.gen
            ),
        }
    }
}

/// A change of the record someone asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// `node` boots a fresh guest: only a new VM (no record) or one stopped on purpose.
    Boot {
        /// The booting node.
        node: String,
    },
    /// The backup that received session `session` resumes the guest on `node`.
    Takeover {
        /// The backup's node.
        node: String,
        /// Its replication session.
        session: u64,
    },
    /// The owner records the session whose backup may take over, before that session's
    /// epochs count.
    Protect {
        /// The owner.
        node: String,
        /// Its generation.
        gen: u64,
        /// The new session.
        session: u64,
    },
    /// The owner lets output pass without acknowledgements: no backup may take over.
    Unprotect {
        /// The owner.
        node: String,
        /// Its generation.
        gen: u64,
    },
    /// The owner shut the guest down on purpose.
    Stop {
        /// The owner.
        node: String,
        /// Its generation.
        gen: u64,
    },
    /// An operator declares generation `gen`'s copy gone (throwing away what it did), so that
    /// a fresh boot may claim the VM.
    Override {
        /// The generation the operator names.
        gen: u64,
    },
}

/// Why a transition is not allowed on the record as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A fresh boot over a VM that runs (or ran) somewhere.
    #[error("the VM is {}", .0.describe())]
    Owned(Record),
    /// A takeover by a backup whose session is not the recorded one.
    #[error("the record names no backup of this session: the VM is {}", .0.as_ref().map_or("not recorded".into(), Record::describe))]
    NotEligible(Option<Record>),
    /// The asker no longer owns the VM.
    #[error("this node no longer owns the VM: it is {}", .0.as_ref().map_or("not recorded".into(), Record::describe))]
    Fenced(Option<Record>),
    /// An override naming another generation.
    #[error("the override names generation {named}, the record is at {}", .current.as_ref().map_or("nothing".into(), Record::describe))]
    Generation {
        /// The generation named.
        named: u64,
        /// The record.
        current: Option<Record>,
    },
}

/// Whether `r` is owned by `node` in generation `gen` (and not stopped).
pub fn owned_by(r: Option<&Record>, node: &str, gen: u64) -> bool {
    r.is_some_and(|r| r.node == node && r.gen == gen && r.state != State::Stopped)
}

/// What `t` writes over `current` (`Ok(None)`: nothing to write, the record already says it).
/// `op` and `at_ms` go into the written record.
pub fn plan(
    current: Option<&Record>,
    t: &Transition,
    op: u64,
    at_ms: u64,
) -> Result<Option<Record>, Refusal> {
    let gen = current.map_or(0, |r| r.gen);
    let rec = |gen: u64, state: State, node: &str, session: Option<u64>| Record {
        gen,
        state,
        node: node.to_string(),
        session,
        op,
        at_ms,
    };
    let mine = |node: &str, g: u64| {
        if owned_by(current, node, g) {
            Ok(())
        } else {
            Err(Refusal::Fenced(current.cloned()))
        }
    };
    match t {
        Transition::Boot { node } => match current {
            None => Ok(Some(rec(1, State::Unprotected, node, None))),
            Some(r) if r.state == State::Stopped => {
                Ok(Some(rec(gen + 1, State::Unprotected, node, None)))
            }
            Some(r) => Err(Refusal::Owned(r.clone())),
        },
        Transition::Takeover { node, session } => match current {
            Some(r) if r.state == State::Protected && r.session == Some(*session) => {
                Ok(Some(rec(gen + 1, State::Unprotected, node, None)))
            }
            _ => Err(Refusal::NotEligible(current.cloned())),
        },
        Transition::Protect {
            node,
            gen: g,
            session,
        } => {
            mine(node, *g)?;
            if current.is_some_and(|r| r.session == Some(*session)) {
                return Ok(None);
            }
            Ok(Some(rec(*g, State::Protected, node, Some(*session))))
        }
        Transition::Unprotect { node, gen: g } => {
            mine(node, *g)?;
            if current.is_some_and(|r| r.state == State::Unprotected) {
                return Ok(None);
            }
            Ok(Some(rec(*g, State::Unprotected, node, None)))
        }
        Transition::Stop { node, gen: g } => {
            if current.is_some_and(|r| r.state == State::Stopped && r.node == *node && r.gen == *g)
            {
                return Ok(None);
            }
            mine(node, *g)?;
            Ok(Some(rec(*g, State::Stopped, node, None)))
        }
        Transition::Override { gen: g } => match current {
            Some(r) if r.gen == *g && r.state == State::Stopped => Ok(None),
            Some(r) if r.gen == *g => Ok(Some(rec(*g, State::Stopped, "operator", None))),
            _ => Err(Refusal::Generation {
                named: *g,
                current: current.cloned(),
            }),
        },
    }
}

mod hex {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:016x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        u64::from_str_radix(&s, 16).map_err(serde::de::Error::custom)
    }
}

mod hex_opt {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_str(&format!("{v:016x}")),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let s = Option::<String>::deserialize(d)?;
        s.map(|s| u64::from_str_radix(&s, 16).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boot(n: &str) -> Transition {
        Transition::Boot { node: n.into() }
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let r = Record {
            gen: 7,
            state: State::Protected,
            node: "primary@a".into(),
            session: Some(0x2a),
            op: u64::MAX,
            at_ms: 5,
        };
        assert_eq!(Record::parse(&r.encode()), Some(r.clone()));
        let text = String::from_utf8(r.encode()).unwrap();
        assert!(text.contains("\"session\":\"000000000000002a\""), "{text}");
        for bad in [
            &b""[..],
            b"none",
            b"{}",
            b"{\"gen\":1}",
            &[b' '; MAX_RECORD + 1][..],
        ] {
            assert_eq!(Record::parse(bad), None);
        }
    }

    #[test]
    fn a_fresh_boot_needs_a_new_or_stopped_vm() {
        let r = plan(None, &boot("a"), 1, 0).unwrap().unwrap();
        assert_eq!((r.gen, r.state), (1, State::Unprotected));
        assert!(matches!(
            plan(Some(&r), &boot("b"), 2, 0),
            Err(Refusal::Owned(_))
        ));
        // Not even the same node: its earlier copy may hold the only current state.
        assert!(matches!(
            plan(Some(&r), &boot("a"), 2, 0),
            Err(Refusal::Owned(_))
        ));
        let s = plan(
            Some(&r),
            &Transition::Stop {
                node: "a".into(),
                gen: 1,
            },
            3,
            0,
        )
        .unwrap()
        .unwrap();
        let again = plan(Some(&s), &boot("b"), 4, 0).unwrap().unwrap();
        assert_eq!((again.gen, again.node.as_str()), (2, "b"));
    }

    #[test]
    fn only_the_recorded_session_takes_over_and_the_old_owner_is_fenced() {
        let a = plan(None, &boot("a"), 1, 0).unwrap().unwrap();
        let p = Transition::Protect {
            node: "a".into(),
            gen: 1,
            session: 9,
        };
        let prot = plan(Some(&a), &p, 2, 0).unwrap().unwrap();
        let take = |s| Transition::Takeover {
            node: "b".into(),
            session: s,
        };
        assert!(matches!(
            plan(Some(&prot), &take(8), 3, 0),
            Err(Refusal::NotEligible(_))
        ));
        // Unprotected: no backup may take over.
        assert!(matches!(
            plan(Some(&a), &take(9), 3, 0),
            Err(Refusal::NotEligible(_))
        ));
        let b = plan(Some(&prot), &take(9), 3, 0).unwrap().unwrap();
        assert_eq!(
            (b.gen, b.state, b.node.as_str()),
            (2, State::Unprotected, "b")
        );
        for t in [
            p.clone(),
            Transition::Unprotect {
                node: "a".into(),
                gen: 1,
            },
            Transition::Stop {
                node: "a".into(),
                gen: 1,
            },
        ] {
            assert!(
                matches!(plan(Some(&b), &t, 4, 0), Err(Refusal::Fenced(_))),
                "{t:?}"
            );
        }
        // A second takeover by the same session (its own write, read back) is not allowed by
        // planning: recognising one's own write is the op id's job.
        assert!(plan(Some(&b), &take(9), 5, 0).is_err());
    }

    #[test]
    fn repeated_transitions_write_nothing() {
        let a = plan(None, &boot("a"), 1, 0).unwrap().unwrap();
        let u = Transition::Unprotect {
            node: "a".into(),
            gen: 1,
        };
        assert_eq!(plan(Some(&a), &u, 2, 0), Ok(None));
        let p = Transition::Protect {
            node: "a".into(),
            gen: 1,
            session: 3,
        };
        let prot = plan(Some(&a), &p, 2, 0).unwrap().unwrap();
        assert_eq!(plan(Some(&prot), &p, 3, 0), Ok(None));
        let st = Transition::Stop {
            node: "a".into(),
            gen: 1,
        };
        let s = plan(Some(&prot), &st, 4, 0).unwrap().unwrap();
        assert_eq!(plan(Some(&s), &st, 5, 0), Ok(None));
    }

    #[test]
    fn an_override_must_name_the_current_generation() {
        let a = plan(None, &boot("a"), 1, 0).unwrap().unwrap();
        assert!(matches!(
            plan(Some(&a), &Transition::Override { gen: 2 }, 2, 0),
            Err(Refusal::Generation { named: 2, .. })
        ));
        let s = plan(Some(&a), &Transition::Override { gen: 1 }, 2, 0)
            .unwrap()
            .unwrap();
        assert_eq!((s.state, s.gen), (State::Stopped, 1));
        assert!(plan(Some(&s), &boot("c"), 3, 0).is_ok());
        assert!(matches!(
            plan(None, &Transition::Override { gen: 1 }, 2, 0),
            Err(Refusal::Generation { .. })
        ));
    }
}
