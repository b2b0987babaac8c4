# expertd's control plane: Cap'n Proto RPC over the daemon's Unix socket.
#
# APPEND-ONLY from version 1 on: never renumber, retype or remove a field, method or
# parameter; add new ones at the end with the next ordinal. Old clients and daemons must keep
# talking to new ones. The data plane (acquire / release / prefetch / cursor) is not here: it runs
# over shared-memory rings (client/include/expertd/protocol.h) that attach() hands out.
#
# Every C++ type of these structs (client/include/expertd/control_types.h) is declared from this
# file: at build time client/gen_fields.cmake lists each struct's plain fields (numbers and Text)
# in expertd/stats_fields.h, with a field's trailing comment as its description (expertctl stats
# prints it). A new counter is a line here and the line in the scheduler that counts it.
#
# Errors: a failed call carries the daemon's one-line message as the exception's description
# ("model 'x' is not served by this daemon (models: a, b)").

@0xe70fb0b0d0d4b887;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("expertd::rpc");

# A file descriptor passed with the message (SCM_RIGHTS): the server side overrides getFd(), the
# receiving side reads it with Capability::Client::getFd() (and dup()s it to keep it).
interface Fd {}

struct ModelLayout {
  name @0 :Text;
  architecture @1 :Text;
  blockCount @2 :UInt32;
  expertCount @3 :UInt32;
  topK @4 :UInt32;
  alignment @5 :UInt32;   # DIO alignment the slots were laid out with
  slotBytes @6 :UInt64;
  slotCount @7 :UInt32;
  slices @8 :List(Slice);

  # Expert 0's slice of one kind in one MoE layer; expert e is at offset + e * stride. Within a
  # layer, slices are listed in the order their bytes are placed in a slot.
  struct Slice {
    layer @0 :UInt32;
    kind @1 :Text;        # gate, up, down, gate_up
    shard @2 :UInt32;
    offset @3 :UInt64;
    stride @4 :UInt64;
    bytes @5 :UInt64;
    type @6 :Text;        # ggml type name
    ne0 @7 :UInt64;
    ne1 @8 :UInt64;
  }
}

struct SchedulerStats {
  acquires @0 :UInt64;           # acquires of an expert
  hits @1 :UInt64;               # acquires that found the expert READY
  coalesced @2 :UInt64;          # acquires that joined a load in progress
  misses @3 :UInt64;             # acquires that started a load
  busy @4 :UInt64;               # acquires refused at once (EBUSY): the session at its slot bound, or the wait queue full
  prefetchHints @5 :UInt64;      # prefetch hints received (resident experts included)
  prefetchLoads @6 :UInt64;      # loads the hints started
  prefetchDropped @7 :UInt64;    # hints passed by the cursor or pushed out of a full queue
  prefetchCancelled @8 :UInt64;  # prefetch loads passed by the cursor while reading
  prefetchUseful @9 :UInt64;     # prefetched experts later acquired
  loadsDone @10 :UInt64;         # loads that completed
  loadsFailed @11 :UInt64;       # loads that ended in an error
  stagedLoads @12 :UInt64;       # loads that went to the staging ring
  evictions @13 :UInt64;         # READY experts dropped: to make room, by a limit or on request
  bytesRead @14 :UInt64;         # bytes the backend delivered (widened reads included)
  reads @15 :UInt64;             # reads submitted (resubmissions included)
  shortReads @16 :UInt64;        # reads that returned fewer bytes than asked
  eagainRetries @17 :UInt64;     # reads resubmitted after EAGAIN
  bufferedRequeues @18 :UInt64;  # unaligned remainders read through the buffered fd
  demandBytes @19 :UInt64;       # bytes read for loads an acquire started (not prefetches)
  prefetchStaged @20 :UInt64;    # prefetch loads streamed through the staging ring
  prefetchRefused @21 :UInt64;   # prefetches refused a cache slot that needed an eviction
  prefetchSkipped @22 :UInt64;   # hints not read: calibrated probability below break-even
  acquireTimeouts @23 :UInt64;   # acquires that found no slot within the acquire deadline (ETIMEDOUT)
  readRetries @24 :UInt64;       # reads resubmitted after EIO or an early end of file, with backoff
  checksumMismatches @25 :UInt64;  # loads whose bytes did not match the checksum manifest
  readsTimedOut @26 :UInt64;     # reads not back within read_timeout_ms: their loads failed (ETIME)
  exactHints @27 :UInt64;        # hints flagged exact (the session will acquire the expert: a prefill's routing), read at any depth
  exactLoads @28 :UInt64;        # loads exact hints started (also in prefetchLoads; in no depth's counts)
  exactWasted @29 :UInt64;       # loads of exact hints evicted, cancelled or failed before their acquire
}

# Prefetch telemetry for one lookahead depth: how many layers ahead of the session's cursor a hint
# was (a hint for the cursor's layer or an earlier one is for the next token). docs/CACHE.md
# defines precision = useful / (useful + wasted) and recall = hintedAcquires / acquires.
struct PrefetchDepthStats {
  depth @0 :UInt32;           # 1..8; 8 also counts every deeper hint
  hints @1 :UInt64;           # hints received at this depth
  loads @2 :UInt64;           # prefetch loads they started
  useful @3 :UInt64;          # loads acquired before their expert left the cache
  wasted @4 :UInt64;          # loads evicted, cancelled or dropped before any acquire
  usefulBytes @5 :UInt64;     # bytes the useful loads read
  wastedBytes @6 :UInt64;     # bytes the wasted loads read
  hintedAcquires @7 :UInt64;  # acquires of an expert hinted at this depth for that token
}

struct ModelStats {
  name @0 :Text;
  scheduler @1 :SchedulerStats;
  cacheSlots @2 :UInt32;
  cacheReady @3 :UInt32;
  stagingSlots @4 :UInt32;
  slotBytes @5 :UInt64;
  layerHits @6 :List(UInt64);    # per block layer: acquires served READY
  layerMisses @7 :List(UInt64);  # per block layer: acquires that waited for a read
  readsInFlight @8 :UInt32;
  cacheLimit @9 :UInt32;         # slots the cache may use now (setCacheLimit), <= cacheSlots
  prefetchDepths @10 :List(PrefetchDepthStats);  # depths 1..8
  prefetchDepthNow @11 :UInt32;  # layers ahead prefetches may cover now (auto: the depth chosen)
  # The running estimate of hint precision per depth 1..8 (docs/CACHE.md "Prefetch admission and
  # automatic depth"): the calibrated probability the admission rule uses.
  hintPrecision @12 :List(Float64);
  reservedSlots @13 :UInt32;     # slots the attached sessions reserve (top-k each)
  diskBusy @14 :Float64;          # fraction of active time reads were in flight at depth 0; -1 unmeasured
  prefetchAutoNeed @15 :Float64;  # the hint precision auto mode asks of a depth now
  shardLoadsFailed @16 :List(UInt64);  # per shard (model file): loads that ended in a read error
  shardReadRetries @17 :List(UInt64);  # per shard: reads retried after EIO or an early end of file
  # Empty while the model is served; else why it is not (its file changed under the daemon:
  # docs/STORAGE.md "Files changed under the daemon").
  fileChanged @18 :Text;
  # Nanoseconds spent with exactly i reads in flight, i = 0 .. the most there have been since the
  # daemon started (up to this call): the difference of two calls gives a window's disk-busy
  # fraction (time at i >= 1 over the window), mean queue depth and peak (expert-run --json).
  readDepthNs @19 :List(UInt64);
}

struct SessionStats {
  session @0 :UInt32;
  model @1 :Text;
  client @2 :Text;
  pid @3 :Int32;
  uid @4 :UInt32;
  acquires @5 :UInt64;
  prefetches @6 :UInt64;
  releases @7 :UInt64;
  holds @8 :UInt32;
  prefetchDepths @9 :List(PrefetchDepthStats);   # depths 1..8, this session's hints
}

struct Stats {
  backend @0 :Text;
  backendDetail @1 :Text;
  uptimeMs @2 :UInt64;
  reactorLoops @3 :UInt64;
  queueDepth @4 :UInt32;
  chunkBytes @5 :UInt64;
  prefetchDepth @6 :UInt32;
  policy @7 :Text;
  bytesRead @8 :UInt64;
  models @9 :List(ModelStats);
  sessions @10 :List(SessionStats);
  sessionsClosedHostile @11 :UInt64;
  prefetchDepthAuto @12 :Bool;   # the depth is chosen from the hints' precision (prefetchDepth: max)
}

# One file of a model (a shard of a split model), passed read-only so that a client needs only the
# socket and the model's name to read its dense weights.
struct ModelFile {
  shard @0 :UInt32;  # 0-based shard index
  name @1 :Text;     # the file's name without its directory (for messages)
  path @2 :Text;     # where the daemon opened it (for messages; the client reads the fd)
  bytes @3 :UInt64;  # the file's size
  file @4 :Fd;       # opened O_RDONLY by the daemon: the same file it serves the experts from
}

# One attached client of one model. Dropping this capability (or the connection) detaches the
# session: the daemon releases every slot it still holds.
interface Session {
  stats @0 () -> (stats :SessionStats);
  detach @1 () -> ();
}

# The bootstrap capability.
interface Expertd {
  info @0 () -> (version :Text, protocolVersion :UInt32, backend :Text, backendDetail :Text,
                 models :List(Text));
  openModel @1 (name :Text) -> (layout :ModelLayout);
  attach @2 (model :Text, clientName :Text)
      -> (session :Session, sessionId :UInt32, arenaBytes :UInt64, slotTableBytes :UInt64,
          sessionBytes :UInt64, requestCapacity :UInt32, completionCapacity :UInt32,
          arena :Fd, slotTable :Fd, sessionRegion :Fd, requestDoorbell :Fd,
          completionDoorbell :Fd, acquireTimeoutMs :UInt32, readTimeoutMs :UInt32);
  stats @3 () -> (stats :Stats);
  # depth 0xFFFFFFFF: auto (chosen per model from the measured hint precision).
  setPrefetchDepth @4 (depth :UInt32) -> ();
  setQueueDepth @5 (depth :UInt32) -> ();
  setPolicy @6 (name :Text) -> ();
  pin @7 (model :Text, layer :UInt32, expert :UInt32) -> ();
  unpin @8 (model :Text, layer :UInt32, expert :UInt32) -> ();
  evict @9 (model :Text, layer :UInt32, expert :UInt32) -> ();
  ping @10 () -> ();
  # Caps a model's cache at `slots` slots (0: the whole arena's cache), evicting down to it.
  setCacheLimit @11 (model :Text, slots :UInt32) -> ();
  # Drops every cached and staged expert of a model that nobody holds or pinned, and restarts its
  # policy's history.
  evictAll @12 (model :Text) -> (evicted :UInt32);
  # The model's GGUF files, shards in order, each with a read-only fd. A reply carries at most 8
  # (one message's fds): the files from `first` on; call again from `first + files.size()` until
  # `shardCount`.
  modelFiles @13 (model :Text, first :UInt32) -> (shardCount :UInt32, files :List(ModelFile));
}
