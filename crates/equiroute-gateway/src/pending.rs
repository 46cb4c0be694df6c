//! The contexts of answered requests waiting for quality feedback.
//!
//! Every answered request leaves one here, on the request path, so the store is built to take
//! it without allocating once warm: a ring of `cap` slots reused oldest first (each keeps its
//! feature buffer), ids of the gateway's own form (`req-` and 32 hex digits, 128 random bits)
//! kept as the number they spell, indexed by its two halves folded into 64 bits; interfaces
//! and owners (the labels of the keys that made the requests) as indexes into short lists of
//! names. Before, each insert made four allocations and each eviction freed four, often made
//! by another event loop.
//!
//! Each context is bound to its owner: [`PendingFeedback::owner`] travels with it in snapshots
//! and the shared journal, and the feedback route checks it (`server::auth::Caller::may_score`).
//! Contexts saved before owners existed load unbound (`None`).

use equiroute_core::features::Fnv64;
use equiroute_core::hash::KeyHasher;
use equiroute_core::{Millis, Timestamp};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

/// The context of an answered request, kept until its quality score arrives. This is the
/// form it takes in snapshots and in the shared journal; the store keeps it in its slots.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PendingFeedback {
    pub interface: String,
    pub candidate: usize,
    /// The request's features, in single precision (half the memory; the quality update
    /// that uses them is insensitive to the rounding).
    pub features: Vec<f32>,
    pub latency: Millis,
    pub at: Timestamp,
    pub consumed: bool,
    /// The label of the key that made the request; `None`: unbound (made without a key, or
    /// saved before requests were bound to their keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

impl PendingFeedback {
    /// The features in the precision the policies take.
    #[must_use]
    pub fn features_f64(&self) -> Vec<f64> {
        self.features.iter().map(|&v| f64::from(v)).collect()
    }
}

/// What a context is made of, borrowed: the request path hands these over without building
/// a [`PendingFeedback`] first.
#[derive(Clone, Copy, Debug)]
pub struct PendingContext<'a> {
    pub interface: &'a str,
    pub candidate: usize,
    pub features: Features<'a>,
    pub latency: Millis,
    pub at: Timestamp,
    /// The label of the key that made the request, if a key did.
    pub owner: Option<&'a str>,
}

impl PendingContext<'_> {
    /// The owned form (as snapshots and the shared journal carry it), not yet consumed.
    #[must_use]
    pub fn to_feedback(&self) -> PendingFeedback {
        PendingFeedback {
            interface: self.interface.to_owned(),
            candidate: self.candidate,
            features: {
                let mut f = Vec::new();
                self.features.copy_into(&mut f);
                f
            },
            latency: self.latency,
            at: self.at,
            consumed: false,
            owner: self.owner.map(str::to_owned),
        }
    }
}

/// Features as the request path has them (double precision) or as a snapshot has them.
#[derive(Clone, Copy, Debug)]
pub enum Features<'a> {
    F64(&'a [f64]),
    F32(&'a [f32]),
}

impl Features<'_> {
    /// Replaces the contents of `out` with these features in single precision (reusing its
    /// buffer).
    fn copy_into(self, out: &mut Vec<f32>) {
        out.clear();
        match self {
            Features::F64(x) => out.extend(x.iter().map(|&v| v as f32)),
            Features::F32(x) => out.extend_from_slice(x),
        }
    }
}

/// The digits of a gateway-made id after `req-`.
const OWN_DIGITS: usize = 32;

/// An id as a slot holds it: the number of a gateway-made id, else the text.
#[derive(Debug)]
enum SlotId {
    Own(u128),
    Foreign(Box<str>),
}

impl Default for SlotId {
    fn default() -> Self {
        SlotId::Own(0)
    }
}

/// The number of `OWN_DIGITS` lowercase hex digits, in one pass (the ledger reads one per
/// request; `u128::from_str_radix` after a check took five times as long); `None` for any
/// other text.
fn own_number(hex: &str) -> Option<u128> {
    if hex.len() != OWN_DIGITS {
        return None;
    }
    hex.bytes().try_fold(0u128, |n, b| {
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => return None,
        };
        Some(n << 4 | u128::from(digit))
    })
}

/// An id as the store looks it up: its index key, and the number of a gateway-made id
/// (`req-` and 32 lowercase hex digits), else `None` (the slot then keeps the text to tell
/// ids with the same key apart).
fn key_of(id: &str) -> (u64, Option<u128>) {
    if let Some(n) = id.strip_prefix("req-").and_then(own_number) {
        // Random bits: folding the halves keeps them well spread.
        return ((n as u64) ^ ((n >> 64) as u64), Some(n));
    }
    // A foreign id only needs spreading, not flood resistance: ids are not chosen by
    // clients (they come from this or another instance of the gateway).
    let mut h = Fnv64::new();
    h.write(id.as_bytes());
    (h.finish(), None)
}

/// The most distinct owners a store names; the contexts of further owners are kept bound to
/// an owner no caller has ([`NO_ONE`]). Owners are the labels of configured keys, so only a
/// journal from instances configured otherwise could come near it.
const MAX_OWNERS: usize = 4096;
/// The owner index of an unbound context.
const UNBOUND: u16 = 0;
/// The owner index of a context whose owner did not fit in the list: no key's label.
const NO_ONE: u16 = u16::MAX;

/// The index of `name` in `names`, added when it is not there yet and `names` holds fewer than
/// `most`; `None` when it is not there and there is no room.
fn intern(names: &mut Vec<Box<str>>, name: &str, most: usize) -> Option<usize> {
    if let Some(i) = names.iter().position(|n| &**n == name) {
        return Some(i);
    }
    if names.len() >= most {
        return None;
    }
    names.push(name.into());
    Some(names.len() - 1)
}

type Index = HashMap<u64, u32, BuildHasherDefault<KeyHasher>>;

#[derive(Debug, Default)]
struct Slot {
    key: u64,
    id: SlotId,
    interface: u16,
    /// [`UNBOUND`], [`NO_ONE`], or 1 + an index into the store's owners.
    owner: u16,
    candidate: usize,
    features: Vec<f32>,
    latency: Millis,
    at: Timestamp,
    consumed: bool,
}

impl Slot {
    fn id(&self) -> String {
        match &self.id {
            SlotId::Own(n) => format!("req-{n:032x}"),
            SlotId::Foreign(id) => id.to_string(),
        }
    }

    /// Whether this slot holds `id`, whose number (for a gateway-made id) is `own`.
    fn is(&self, id: &str, own: Option<u128>) -> bool {
        match (&self.id, own) {
            (SlotId::Own(n), Some(m)) => *n == m,
            (SlotId::Foreign(f), None) => **f == *id,
            _ => false,
        }
    }
}

/// The contexts of answered requests waiting for feedback: at most `cap` of them, the oldest
/// evicted first, so memory stays bounded whatever the request rate and the feedback window.
#[derive(Debug)]
pub struct PendingStore {
    index: Index,
    /// A ring in insertion order: `len` slots from `head` (the oldest) on, wrapping at `cap`.
    slots: Vec<Slot>,
    head: usize,
    len: usize,
    cap: usize,
    interfaces: Vec<Box<str>>,
    owners: Vec<Box<str>>,
    evicted: u64,
}

impl PendingStore {
    /// An empty store holding at most `cap` contexts.
    #[must_use]
    pub fn new(cap: usize) -> PendingStore {
        let cap = cap.clamp(1, u32::MAX as usize);
        // Sized up front (at most 64k entries): growing a large map rehashes it, and growing
        // the ring copies it, under the lock while other requests wait. The memory is only
        // reserved: pages are touched as slots are first used.
        let initial = cap.min(65_536);
        PendingStore {
            index: Index::with_capacity_and_hasher(initial, BuildHasherDefault::default()),
            slots: Vec::with_capacity(initial),
            head: 0,
            len: 0,
            cap,
            interfaces: Vec::new(),
            owners: Vec::new(),
            evicted: 0,
        }
    }

    /// Keeps `entry` for `id` unless `id` is kept already; evicts the oldest beyond the cap.
    pub fn insert(&mut self, id: &str, entry: &PendingFeedback) {
        let ctx = PendingContext {
            interface: &entry.interface,
            candidate: entry.candidate,
            features: Features::F32(&entry.features),
            latency: entry.latency,
            at: entry.at,
            owner: entry.owner.as_deref(),
        };
        self.put(id, ctx, entry.consumed);
    }

    /// Keeps the context of `id` unless `id` is kept already (then returns false); evicts the
    /// oldest when full. Allocates only while the store is still filling up, for an id not of
    /// the gateway's form, or for an interface it has not seen.
    pub fn remember(&mut self, id: &str, ctx: PendingContext<'_>) -> bool {
        self.put(id, ctx, false)
    }

    fn put(&mut self, id: &str, ctx: PendingContext<'_>, consumed: bool) -> bool {
        let (key, own) = key_of(id);
        if self.find_key(id, key, own).is_some() {
            return false;
        }
        if self.len == self.cap {
            self.pop_oldest();
            self.evicted += 1;
        }
        let interface = self.interface_index(ctx.interface);
        let owner = self.owner_index(ctx.owner);
        let at = (self.head + self.len) % self.cap;
        if at == self.slots.len() {
            self.slots.push(Slot::default());
        }
        let slot = &mut self.slots[at];
        slot.key = key;
        slot.id = match own {
            Some(n) => SlotId::Own(n),
            None => SlotId::Foreign(id.into()),
        };
        slot.interface = interface;
        slot.owner = owner;
        slot.candidate = ctx.candidate;
        ctx.features.copy_into(&mut slot.features);
        slot.latency = ctx.latency;
        slot.at = ctx.at;
        slot.consumed = consumed;
        // A foreign id whose hash collides with a kept key is simply not indexed: it is
        // evicted in turn like the others, and its feedback is answered "unknown".
        self.index.entry(key).or_insert(at as u32);
        self.len += 1;
        true
    }

    fn interface_index(&mut self, name: &str) -> u16 {
        intern(&mut self.interfaces, name, usize::MAX)
            .map_or(u16::MAX, |i| u16::try_from(i).unwrap_or(u16::MAX))
    }

    /// The owner index of `owner` (allocates only for an owner not seen before).
    fn owner_index(&mut self, owner: Option<&str>) -> u16 {
        let Some(name) = owner else {
            return UNBOUND;
        };
        intern(&mut self.owners, name, MAX_OWNERS).map_or(NO_ONE, |i| (i + 1) as u16)
    }

    /// The owner of a slot, as [`PendingFeedback::owner`] has it.
    fn owner_of(&self, slot: &Slot) -> Option<&str> {
        match slot.owner {
            UNBOUND => None,
            // Not a label any key can have (labels are letters, digits, `_`, `-`, `.`).
            NO_ONE => Some("(unknown owner)"),
            i => self.owners.get(usize::from(i) - 1).map(|o| &**o),
        }
    }

    fn find(&self, id: &str) -> Option<usize> {
        let (key, own) = key_of(id);
        self.find_key(id, key, own)
    }

    /// The slot of `id`, whose key (and number) `key_of` gave.
    fn find_key(&self, id: &str, key: u64, own: Option<u128>) -> Option<usize> {
        let at = *self.index.get(&key)? as usize;
        self.slots[at].is(id, own).then_some(at)
    }

    fn pop_oldest(&mut self) {
        let slot = &self.slots[self.head];
        if self.index.get(&slot.key) == Some(&(self.head as u32)) {
            self.index.remove(&slot.key);
        }
        self.head = (self.head + 1) % self.cap;
        self.len -= 1;
    }

    fn feedback(&self, at: usize) -> PendingFeedback {
        let s = &self.slots[at];
        PendingFeedback {
            interface: self
                .interfaces
                .get(usize::from(s.interface))
                .map(ToString::to_string)
                .unwrap_or_default(),
            candidate: s.candidate,
            features: s.features.clone(),
            latency: s.latency,
            at: s.at,
            consumed: s.consumed,
            owner: self.owner_of(s).map(str::to_owned),
        }
    }

    /// The context kept for `id`, copied out.
    #[must_use]
    pub fn get(&self, id: &str) -> Option<PendingFeedback> {
        self.find(id).map(|at| self.feedback(at))
    }

    /// The context kept for `id` when `may_see` accepts its owner (checked before anything is
    /// copied, so a refused context costs what a missing one does).
    #[must_use]
    pub fn get_if(
        &self,
        id: &str,
        may_see: impl FnOnce(Option<&str>) -> bool,
    ) -> Option<PendingFeedback> {
        let at = self.find(id)?;
        may_see(self.owner_of(&self.slots[at])).then(|| self.feedback(at))
    }

    /// Marks `id`'s context as used by a score; false when `id` is not kept.
    pub fn consume(&mut self, id: &str) -> bool {
        match self.find(id) {
            Some(at) => {
                self.slots[at].consumed = true;
                true
            }
            None => false,
        }
    }

    /// Every kept context with its id, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (String, PendingFeedback)> + '_ {
        (0..self.len).map(move |i| {
            let at = (self.head + i) % self.cap;
            (self.slots[at].id(), self.feedback(at))
        })
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most contexts kept.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Contexts evicted because the store was full.
    #[must_use]
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Moves the contexts of `interface` to its new runtime after a reload: each one's
    /// candidate becomes `to(candidate)`; one whose provider is gone (`None`) is marked used,
    /// so that its score is answered as a duplicate and teaches nothing.
    pub fn retarget(&mut self, interface: &str, to: &dyn Fn(usize) -> Option<usize>) {
        let Some(at) = self.interfaces.iter().position(|n| &**n == interface) else {
            return;
        };
        for i in 0..self.len {
            let slot = &mut self.slots[(self.head + i) % self.cap];
            if usize::from(slot.interface) != at {
                continue;
            }
            match to(slot.candidate) {
                Some(j) => slot.candidate = j,
                None => slot.consumed = true,
            }
        }
    }

    /// Drops, from the oldest, the contexts answered more than `horizon` ms before `now`.
    pub fn prune(&mut self, now: Timestamp, horizon: f64) {
        while self.len > 0 && now.0 - self.slots[self.head].at.0 > horizon {
            self.pop_oldest();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(at: f64) -> PendingFeedback {
        PendingFeedback {
            interface: "chat".into(),
            candidate: 0,
            features: vec![1.0; 4],
            latency: Millis(1.0),
            at: Timestamp(at),
            consumed: false,
            owner: None,
        }
    }

    #[test]
    fn pending_contexts_are_bounded_oldest_first_and_pruned_by_age() {
        let mut p = PendingStore::new(3);
        for i in 0..5 {
            p.insert(&format!("r{i}"), &ctx(f64::from(i) * 100.0));
        }
        assert_eq!(p.len(), 3);
        assert_eq!(p.evicted(), 2);
        assert!(p.get("r0").is_none() && p.get("r1").is_none());
        assert!(p.get("r4").is_some());
        // A second insert of a kept id changes nothing.
        p.insert("r4", &ctx(0.0));
        assert_eq!(p.get("r4").map(|e| e.at), Some(Timestamp(400.0)));
        // At t = 550 with a 260 ms horizon, r2 (350 ms old) goes, r3 (250) and r4 (150) stay.
        p.prune(Timestamp(550.0), 260.0);
        assert_eq!(p.len(), 2);
        assert!(p.get("r2").is_none() && p.get("r3").is_some());
        let ids: Vec<String> = p.iter().map(|(id, _)| id).collect();
        assert_eq!(ids, ["r3", "r4"], "oldest first");
    }

    #[test]
    fn gateway_ids_round_trip_and_slots_are_reused_with_their_contexts() {
        let mut p = PendingStore::new(2);
        let id = |n: u64| {
            format!(
                "req-{:032x}",
                u128::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)
            )
        };
        for n in 0..7u32 {
            let features = [f64::from(n), 0.5];
            assert!(p.remember(
                &id(u64::from(n)),
                PendingContext {
                    interface: if n % 2 == 0 { "chat" } else { "web_search" },
                    candidate: n as usize,
                    features: Features::F64(&features),
                    latency: Millis(f64::from(n)),
                    at: Timestamp(f64::from(n)),
                    owner: (n % 3 != 0).then_some(if n % 3 == 1 { "TEAM_A" } else { "TEAM_B" }),
                }
            ));
        }
        assert_eq!((p.len(), p.evicted()), (2, 5));
        let kept: Vec<(String, PendingFeedback)> = p.iter().collect();
        assert_eq!(kept[0].0, id(5));
        assert_eq!(kept[1].0, id(6));
        assert_eq!(kept[0].1.interface, "web_search");
        assert_eq!(kept[1].1.interface, "chat");
        assert_eq!(kept[1].1.features, vec![6.0, 0.5]);
        assert_eq!(kept[1].1.candidate, 6);
        // 5 % 3 = 2, 6 % 3 = 0: each context keeps its owner, or none.
        assert_eq!(kept[0].1.owner.as_deref(), Some("TEAM_B"));
        assert_eq!(kept[1].1.owner, None);
        // Upper-case hex is not the gateway's form: a different id, not found.
        assert!(p.get(&id(6).to_uppercase().replace("REQ", "req")).is_none());
        assert!(p.consume(&id(6)) && !p.consume(&id(4)));
        assert!(p.get(&id(6)).is_some_and(|e| e.consumed));
        assert!(p.get(&id(5)).is_some_and(|e| !e.consumed));
    }

    #[test]
    fn own_numbers_are_read_as_u128_reads_them_and_other_text_is_refused() {
        for hex in [
            "0123456789abcdeffedcba9876543210",
            "ffffffffffffffffffffffffffffffff",
            "00000000000000000000000000000000",
        ] {
            assert_eq!(own_number(hex), u128::from_str_radix(hex, 16).ok(), "{hex}");
        }
        for bad in [
            "0123456789ABCDEFfedcba9876543210",
            "+123456789abcdeffedcba9876543210",
            "0123456789abcdeffedcba987654321g",
            "0123456789abcdeffedcba987654321",
            "0123456789abcdeffedcba98765432100",
            "",
        ] {
            assert_eq!(own_number(bad), None, "{bad}");
        }
    }

    #[test]
    fn ids_of_the_old_form_and_near_misses_are_kept_apart_from_gateway_ids() {
        let mut p = PendingStore::new(8);
        let own = "req-0123456789abcdeffedcba9876543210";
        // The 16-digit form of earlier releases (from an old snapshot) is kept by its text.
        let old = "req-0123456789abcdef";
        // The halves swapped: the same folded index key, another id.
        let other = "req-fedcba98765432100123456789abcdef";
        assert_eq!(key_of(own).0, key_of(other).0);
        let mut owned = ctx(1.0);
        owned.owner = Some("TEAM_A".into());
        p.insert(own, &owned);
        p.insert(old, &ctx(2.0));
        assert!(p.get(other).is_none());
        assert_eq!(p.get(own).and_then(|e| e.owner).as_deref(), Some("TEAM_A"));
        assert!(p.get_if(own, |o| o == Some("TEAM_A")).is_some());
        assert!(p.get_if(own, |o| o == Some("TEAM_B")).is_none());
        assert!(p.get(old).is_some_and(|e| e.owner.is_none()));
        let ids: Vec<String> = p.iter().map(|(id, _)| id).collect();
        assert_eq!(ids, [own, old]);
    }

    #[test]
    fn a_consumed_context_stays_consumed_through_a_snapshot() {
        let mut p = PendingStore::new(4);
        let mut used = ctx(1.0);
        used.consumed = true;
        p.insert("elsewhere-1", &used);
        p.insert("elsewhere-2", &ctx(2.0));
        let mut q = PendingStore::new(4);
        for (id, e) in p.iter() {
            q.insert(&id, &e);
        }
        assert!(q.get("elsewhere-1").is_some_and(|e| e.consumed));
        assert!(q.get("elsewhere-2").is_some_and(|e| !e.consumed));
    }

    #[test]
    fn a_reload_moves_an_interfaces_contexts_to_its_new_indices() {
        let mut p = PendingStore::new(8);
        for (id, candidate) in [("r0", 0), ("r1", 1), ("r2", 2)] {
            p.insert(
                id,
                &PendingFeedback {
                    candidate,
                    ..ctx(1.0)
                },
            );
        }
        let other = PendingFeedback {
            interface: "search".into(),
            candidate: 1,
            ..ctx(1.0)
        };
        p.insert("s1", &other);
        // Providers [a, b, c] become [c, a]: `b` is gone.
        p.retarget("chat", &|i| [Some(1), None, Some(0)][i]);
        let at = |p: &PendingStore, id: &str| p.get(id).map(|e| (e.candidate, e.consumed));
        assert_eq!(at(&p, "r0"), Some((1, false)));
        assert_eq!(
            at(&p, "r1"),
            Some((1, true)),
            "used: its score teaches nothing"
        );
        assert_eq!(at(&p, "r2"), Some((0, false)));
        assert_eq!(
            at(&p, "s1"),
            Some((1, false)),
            "another interface's, untouched"
        );
        p.retarget("gone", &|_| None);
        assert_eq!(at(&p, "r0"), Some((1, false)));
    }
}
