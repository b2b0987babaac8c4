// The shared-memory ABI between expertd and its clients. Both sides compile this header; every
// layout is fixed by static_asserts and the version below changes with any incompatible change.
//
// Shared regions (all memfds sealed against grow/shrink):
//  - the arena: `slot_count` slots of `slot_bytes` each, holding expert bytes (client: read-only);
//  - the slot table: a SlotTableHeader followed by `slot_count` SlotEntry records, written only by
//    the daemon, describing which expert each slot holds (client: read-only);
//  - one session region per client: a SessionHeader, then the request ring (client → daemon),
//    then the completion ring (daemon → client). Both sides map it read-write; the daemon copies
//    every request entry once and validates the copy, so nothing a client writes there can harm
//    the daemon or another session.
//
// Rings are single-producer/single-consumer with free-running u32 head (consumer) and tail
// (producer) indices on their own cache lines; capacity is a power of two and an index is masked
// on use. The producer writes the entry, then stores tail with release order; the consumer loads
// tail with acquire order, reads entries, then stores head with release order. Sleeping: a
// consumer about to sleep stores `waiting = 1`, issues a seq_cst fence, re-checks the ring, then
// blocks on its eventfd; a producer, after publishing, issues a seq_cst fence and writes the
// consumer's eventfd only if `waiting` is set. The busy side makes no syscall.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace expertd::abi {

inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr uint32_t kSlotTableMagic = 0x54535845;  // "EXST"

// Slot states as clients see them. The daemon's state machine (cache/cache.h) has more detail;
// a client only ever uses a slot it holds, which is Ready for as long as it holds it.
enum SlotState : uint32_t {
  kSlotFree = 0,
  kSlotLoading = 1,
  kSlotReady = 2,
};

struct alignas(64) SlotTableHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t slot_count;
  uint32_t reserved0;
  uint64_t slot_bytes;
  uint64_t arena_bytes;
  uint8_t reserved[32];
};
static_assert(sizeof(SlotTableHeader) == 64);

// One slot. `generation` increases every time the slot is given a new expert, so a completion
// carrying (slot, generation) can be checked against the table. Writers publish layer/expert
// before storing state with release order; readers load state with acquire order.
struct SlotEntry {
  std::atomic<uint32_t> state;
  uint32_t generation;
  uint32_t layer;
  uint32_t expert;
};
static_assert(sizeof(SlotEntry) == 16);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

inline constexpr size_t slot_table_bytes(uint32_t slot_count) {
  return sizeof(SlotTableHeader) + static_cast<size_t>(slot_count) * sizeof(SlotEntry);
}

// --- Session rings ---------------------------------------------------------------------------

inline constexpr uint32_t kSessionMagic = 0x53535845;  // "EXSS"

enum RequestOp : uint32_t {
  kOpAcquire = 1,   // layer, expert, tag: completes with a held slot or -errno
  kOpPrefetch = 2,  // layer, expert, score in [0, 1]: no completion
  kOpRelease = 3,   // slot, flags: drops one hold taken by an acquire; no completion
  kOpCursor = 4,    // token (arg), layer: the engine's position; no completion
  // layer, expert: the client no longer keeps its own copy (its VRAM tier evicted it), so the
  // daemon's copy, if it still has one, is an ordinary slot again, not a first victim; no
  // completion. Only to a daemon whose SessionHeader::max_op says it takes it.
  kOpUnkeep = 5,
};

// Request::flags of kOpRelease. A daemon that predates a flag ignores it (it was reserved, 0).
// kReleaseClientCopy: the client keeps a copy of its own (the GPU engine's VRAM tier), so the
// daemon's copy is worth little to it: the cache makes the slot its first victim while no one
// holds it, until an acquire (by any session) wants it from host memory again.
inline constexpr uint32_t kReleaseClientCopy = 1;

// Request::flags of kOpPrefetch. A daemon that predates a flag ignores it (it was reserved, 0).
// kPrefetchExact: the client will acquire this expert at its cursor's token before the cursor
// passes the layer (a prefill chunk's routing: known, not predicted). The hint is for the
// cursor's token even when its layer is the cursor's own, is read whatever the automatic depth
// (a fixed depth of 0 still reads nothing), and stays out of the precision estimate.
inline constexpr uint32_t kPrefetchExact = 1;

struct Request {
  uint32_t op;
  uint32_t layer;
  uint32_t expert;
  uint32_t arg;    // kOpRelease: slot; kOpCursor: token
  uint64_t tag;    // kOpAcquire: echoed in the completion
  float score;     // kOpPrefetch
  uint32_t flags;  // kOpRelease: kRelease*; kOpPrefetch: kPrefetch*; 0 otherwise
};
static_assert(sizeof(Request) == 32);
static_assert(offsetof(Request, tag) == 16);

struct CompletionEntry {
  uint64_t tag;
  int32_t result;       // slot (>= 0) or -errno
  uint32_t generation;  // the slot's generation when it became READY for this acquire
  uint32_t layer;
  uint32_t expert;
};
static_assert(sizeof(CompletionEntry) == 24);

struct alignas(64) RingIndex {
  std::atomic<uint32_t> value;
  uint8_t pad[60];
};
static_assert(sizeof(RingIndex) == 64);

struct alignas(64) RingHeader {
  uint32_t capacity;  // entries, a power of two
  uint32_t entry_bytes;
  uint8_t pad0[56];
  RingIndex head;     // consumer: next entry to read
  RingIndex tail;     // producer: next entry to write
  RingIndex waiting;  // consumer sleeps (needs a wakeup) when 1
};
static_assert(sizeof(RingHeader) == 256);

struct alignas(64) SessionHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t session_id;
  // The highest RequestOp this daemon takes: kOpUnkeep; 0 from a daemon older than it (ops
  // kOpAcquire..kOpCursor), which closes a session that sends another.
  uint32_t max_op;
  uint64_t request_ring_offset;     // from the start of the region
  uint64_t completion_ring_offset;  // from the start of the region
  uint64_t region_bytes;
  // Set by the daemon when it closes the session (a hostile entry, shutdown): the reason code
  // (-errno); the client stops using the rings.
  std::atomic<int32_t> closed;
  uint8_t pad[20];
};
static_assert(sizeof(SessionHeader) == 64);

// Layout of a session region with the given ring capacities.
struct SessionLayout {
  uint64_t request_ring_offset;
  uint64_t completion_ring_offset;
  uint64_t bytes;
};
inline constexpr SessionLayout session_layout(uint32_t request_capacity,
                                              uint32_t completion_capacity) {
  auto align64 = [](uint64_t x) { return (x + 63) / 64 * 64; };
  const uint64_t req = sizeof(SessionHeader);
  const uint64_t comp =
      align64(req + sizeof(RingHeader) + uint64_t{request_capacity} * sizeof(Request));
  const uint64_t end =
      align64(comp + sizeof(RingHeader) + uint64_t{completion_capacity} * sizeof(CompletionEntry));
  return SessionLayout{req, comp, end};
}

}  // namespace expertd::abi
