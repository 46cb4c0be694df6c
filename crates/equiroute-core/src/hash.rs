//! Hashing for maps keyed by numbers the router computes itself.

use std::hash::Hasher;

/// A multiplicative hash for keys we compute ourselves (small integers, counters): maps on
/// the request path are probed several times per decision, and the default hasher's flood
/// resistance buys nothing when clients do not choose the keys.
#[derive(Default, Clone, Copy, Debug)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}
