//! 20,000 random 1–4-byte mutations (seed 20260909) of a 2-attribute, 32-byte frame only ever
//! decode or return an error: no panic, and — measured with a counting allocator — no
//! allocation larger than the input could justify. Both outcomes must occur.
//!
//! Its own test binary, so the global allocator sees only this test.

#![allow(clippy::unwrap_used)] // tests and benches: a failed unwrap is a failed run
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Tracking;

static TRACKING: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call unchanged to the system allocator; only records sizes.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if TRACKING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        // SAFETY: same layout contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: ptr came from System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

#[test]
fn random_mutations_decode_or_fail_cleanly() {
    let mut frame = Frame::event();
    frame.set_attribute("a", "x");
    frame.set_attribute("b", "y");
    frame.data = Bytes::from_static(b"ok");
    let limits = FrameLimits::DEFAULT;
    let original = frame.encode(&limits).unwrap();
    assert_eq!(original.len(), 32, "the reference's 32-byte frame");

    let mut rng = StdRng::seed_from_u64(20_260_909);
    let (mut decoded, mut rejected) = (0, 0);
    TRACKING.store(true, Ordering::Relaxed);
    for _ in 0..20_000 {
        let mut bytes = original.to_vec();
        for _ in 0..rng.random_range(1..=4) {
            let at = rng.random_range(0..bytes.len());
            bytes[at] = rng.random();
        }
        match Frame::decode(&Bytes::from(bytes), &limits) {
            Ok(_) => decoded += 1,
            Err(_) => rejected += 1,
        }
    }
    TRACKING.store(false, Ordering::Relaxed);
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        decoded > 0 && rejected > 0,
        "decoded {decoded}, rejected {rejected}"
    );
    // Attribute vector (≤ 64 entries of 48 bytes) is the largest thing decode may allocate.
    assert!(
        largest <= 64 * 48,
        "largest allocation while decoding was {largest} bytes"
    );
}
