// The control plane's data between its C++ types (expertd/control_types.h) and the schema's
// builders and readers (expertd.capnp): what the daemon's RPC server sends and the client reads.
// Plain fields go through the generated field lists; lists and nested structs are written once
// here. Private to the client layer and the daemon (the schema is not installed with the client).
#pragma once

#include "client/expertd.capnp.h"
#include "expertd/control_types.h"

namespace expertd::wire {

void fill(const client::ModelLayout& from, rpc::ModelLayout::Builder to);
void fill(const client::SessionStats& from, rpc::SessionStats::Builder to);
void fill(const client::Stats& from, rpc::Stats::Builder to);

client::ModelLayout read(rpc::ModelLayout::Reader from);
client::SessionStats read(rpc::SessionStats::Reader from);
client::Stats read(rpc::Stats::Reader from);

}  // namespace expertd::wire
