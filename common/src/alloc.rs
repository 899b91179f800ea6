//! The services' global allocator: mimalloc (glibc malloc's free-list consolidation was a
//! tenth of the dispatcher's CPU at full load). Each service binary declares
//! `#[global_allocator] static ALLOCATOR: Allocator = ALLOCATOR;`.
//!
//! With the cargo feature `count-allocations` (benchmarks only) it is wrapped in
//! [`CountingAllocator`], which counts heap allocations process-wide (`realloc` counts as one:
//! it may move the block) and publishes them as the Prometheus counters
//! `process_heap_allocations_total` and `process_heap_allocated_bytes_total`
//! ([`publish_every`]). Normal builds pay nothing for counting.
//!
//! Every service turns transparent huge pages off for its whole process
//! ([`disable_huge_pages`], called when its runtime is built). mimalloc asks for huge pages on
//! its segments, and the kernel then zeroes 2 MiB at the first touch of one: a scheduler trace
//! showed such 3-5 ms faults in puller-svc's reads, on the path of an ACK's p99. Off, the
//! half-load ACK → DURABLE p99 was lower in most A/Bs and every service's RSS a third to a half
//! smaller (docs/BENCHMARKS.md, DECISIONS.md); a service's memory is a few tens of MiB, where
//! huge pages save little TLB.
// `GlobalAlloc` is an unsafe trait; every method only adds to a counter and forwards to the
// inner allocator with the caller's own arguments.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);

/// The allocator behind every service.
type Inner = mimalloc::MiMalloc;
const INNER: Inner = mimalloc::MiMalloc;

/// The services' allocator.
#[cfg(not(feature = "count-allocations"))]
pub type Allocator = Inner;
/// The services' allocator.
#[cfg(not(feature = "count-allocations"))]
pub const ALLOCATOR: Allocator = INNER;
/// The services' allocator, counting.
#[cfg(feature = "count-allocations")]
pub type Allocator = CountingAllocator;
/// The services' allocator, counting.
#[cfg(feature = "count-allocations")]
pub const ALLOCATOR: Allocator = CountingAllocator;

/// The services' allocator, counting.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAllocator;

fn count(bytes: usize) {
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    ALLOCATED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
}

// SAFETY: forwards every call unchanged to the inner allocator, which upholds the GlobalAlloc
// contract.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed through unchanged.
        unsafe { INNER.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as above.
        unsafe { INNER.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: as above.
        unsafe { INNER.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { INNER.dealloc(ptr, layout) }
    }
}

/// Heap allocations (and reallocations) made by this process so far.
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Bytes requested by those allocations.
pub fn allocated_bytes() -> u64 {
    ALLOCATED_BYTES.load(Ordering::Relaxed)
}

/// Turns transparent huge pages off for this process and its future children (module doc):
/// `prctl(PR_SET_THP_DISABLE)`. Memory already mapped is covered too: the kernel checks the flag
/// at every fault and in khugepaged.
pub fn disable_huge_pages() -> io::Result<()> {
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and changes a flag of the calling
    // process; no memory is passed.
    let status = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    if status == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether transparent huge pages are off for this process (`prctl(PR_GET_THP_DISABLE)`).
pub fn huge_pages_disabled() -> bool {
    // SAFETY: PR_GET_THP_DISABLE takes no pointer; it returns the flag (or -1).
    unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1 }
}

/// Sets the counters on the installed metrics recorder every `interval` (spawned on the
/// current tokio runtime; runs until the process ends).
pub fn publish_every(interval: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        loop {
            tick.tick().await;
            metrics::counter!("process_heap_allocations_total").absolute(allocations());
            metrics::counter!("process_heap_allocated_bytes_total").absolute(allocated_bytes());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_it_forwards() {
        let layout = Layout::from_size_align(64, 8).unwrap_or(Layout::new::<u64>());
        let before = allocations();
        let bytes_before = allocated_bytes();
        // SAFETY: a non-zero-sized layout, freed with the same layout.
        unsafe {
            let block = CountingAllocator.alloc(layout);
            assert!(!block.is_null());
            CountingAllocator.dealloc(block, layout);
        }
        assert!(allocations() > before);
        assert!(allocated_bytes() >= bytes_before + 64);
    }

    #[test]
    fn huge_pages_are_turned_off_for_the_process() {
        disable_huge_pages().unwrap_or_else(|error| panic!("prctl: {error}"));
        assert!(huge_pages_disabled());
        // The kernel's own view of the process, not only prctl's answer.
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        assert!(
            status
                .lines()
                .any(|line| line.split_whitespace().eq(["THP_enabled:", "0"])),
            "{status}"
        );
    }
}
