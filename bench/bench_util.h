// Small helpers the expert-bench subcommands share: sizes on the command line, percentiles, and a
// description of the machine a result was measured on.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace expertd::bench {

// "4GiB", "512MiB", "1.5G", "64k", "1000000": K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024,
// KB/MB/ GB/TB powers of 1000, no suffix (or B) is bytes. nullopt for anything else.
std::optional<uint64_t> parse_bytes(std::string_view text);
// 1536 MiB -> "1.50 GiB", 512 KiB -> "512 KiB".
std::string format_bytes(uint64_t bytes);

// The nearest-rank percentile (p in [0, 100]) of `values`; 0 for none. Sorts a copy.
uint64_t percentile(std::span<const uint64_t> values, double p);

struct MachineInfo {
  std::string host;
  std::string date;  // local time, ISO 8601 with the UTC offset
  uint32_t cpus = 0;
  uint64_t ram_bytes = 0;
  std::string kernel;
  std::string disk;  // the block device under `path`: name, model, queue settings (best effort)
};
MachineInfo describe_machine(const std::string& path);

}  // namespace expertd::bench
