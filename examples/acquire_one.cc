// acquire_one: the smallest complete client of expertd.
//
//   acquire_one SOCKET MODEL GGUF [GGUF...]
//
// Connects to the expertd listening on SOCKET, attaches a session to MODEL, acquires one expert
// (the last expert of the first layer that has experts), checks each of its bytes against the
// model's GGUF file, and releases it. GGUF is the file the daemon serves MODEL from; a model split
// into shards takes every shard's path, in order.
//
// Prints one line; exits 0 when the bytes match and 1 on any error or mismatch.
//
// Build it against an installed libexpertd-client: examples/CMakeLists.txt (find_package) or
// examples/Makefile (pkg-config).
#include <expertd/client.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "acquire_one: %s\n", message.c_str());
  return 1;
}

// Reads `bytes` bytes at `offset` of `fd` into `out` (pread may return fewer than asked).
bool read_exactly(int fd, uint64_t offset, uint64_t bytes, std::vector<uint8_t>& out) {
  out.resize(bytes);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, out.data() + done, bytes - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<uint64_t>(n);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: acquire_one SOCKET MODEL GGUF [GGUF...]\n");
    return 2;
  }
  const std::string socket = argv[1];
  const std::string model = argv[2];
  std::vector<std::string> shards(argv + 3, argv + argc);

  // 1. Connect (the control plane: Cap'n Proto RPC on the daemon's Unix socket).
  auto client = expertd::client::Client::connect(socket);
  if (!client) return fail(client.error().message);

  // 2. Attach a session to the model: this maps the daemon's expert cache read-only and sets up
  //    the shared-memory rings of the data plane. The session carries the model's layout.
  auto session = (*client)->attach(model, "acquire_one");
  if (!session) return fail(session.error().message);
  const expertd::client::ModelLayout& layout = (*session)->layout();

  uint32_t layer = 0;
  while (layer < layout.block_count && !layout.has_experts(layer)) ++layer;
  if (layer == layout.block_count) return fail("model '" + model + "' has no routed experts");
  const uint32_t expert = layout.expert_count - 1;

  // 3. Acquire the expert. Its bytes are in the shared cache while we hold it: no copy.
  const uint32_t experts[] = {expert};
  auto views = (*session)->acquire(layer, experts);
  if (!views) return fail(views.error().message);
  const expertd::client::SlotView& view = views->front();

  // 4. Check it. Each slice (gate, up, down) of expert e lies in its shard's GGUF file at
  //    offset + e * stride, `bytes` long; the view points at the same bytes in the cache.
  std::vector<int> fds;
  for (const std::string& path : shards) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail(path + ": " + std::strerror(errno));
    fds.push_back(fd);
  }
  std::string error;
  uint64_t checked = 0;
  std::vector<uint8_t> file_bytes;
  for (uint32_t i = 0; i < view.slice_count && error.empty(); ++i) {
    const expertd::client::SliceView& slice = view.slices[i];
    const expertd::client::ModelLayout::Slice& info = *slice.info;
    const std::string what =
        "layer " + std::to_string(layer) + " expert " + std::to_string(expert) + " " + info.kind;
    if (info.shard >= fds.size()) {
      error = what + " is in shard " + std::to_string(info.shard) + ", give every shard's path";
      break;
    }
    const uint64_t offset = info.offset + uint64_t{expert} * info.stride;
    if (!read_exactly(fds[info.shard], offset, slice.bytes, file_bytes)) {
      error = shards[info.shard] + ": cannot read " + std::to_string(slice.bytes) +
              " bytes at offset " + std::to_string(offset);
      break;
    }
    for (uint64_t b = 0; b < slice.bytes; ++b) {
      if (slice.data[b] != file_bytes[b]) {
        error = what + ": byte " + std::to_string(b) + " differs from " + shards[info.shard] +
                " at offset " + std::to_string(offset + b);
        break;
      }
    }
    checked += slice.bytes;
  }
  for (const int fd : fds) ::close(fd);
  if (error.empty() && checked == 0) error = "the expert has no bytes";

  // 5. Release it, so the daemon may evict it again (destroying the session would, too).
  auto released = (*session)->release(view.slot);
  if (!released) return fail(released.error().message);

  if (!error.empty()) return fail(error);
  std::printf("acquire_one: model %s layer %u expert %u: %u slices, %llu bytes match %s\n",
              model.c_str(), layer, expert, view.slice_count,
              static_cast<unsigned long long>(checked), shards[0].c_str());
  return 0;
}
